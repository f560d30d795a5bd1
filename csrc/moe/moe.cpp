// The MoE driver: packing, routing metadata, kernel dispatch, threading. Compiled at the
// baseline flags; only calls into an ISA translation unit after runtime dispatch.
//
// One forward = two parallel regions on the library's pool:
//   1. gate/up + activation: every thread owns a contiguous range of I panels and runs it for
//      every active expert, so each thread streams its own slice of each expert's weights;
//   2. down + routing weight + scatter-add + output conversion: every thread owns a range of H
//      panels of the fp32 accumulator, so no two threads ever add into the same element and the
//      sum over experts runs in ascending expert order (deterministic for any thread count).
// By default (MoeParams::static_split false) both regions are split dynamically instead:
// threads claim work items from a shared counter (region 1: (active expert, chunk of I
// panels), expert-major; region 2: chunks of H panels, each run over all experts in ascending
// order), so a thread that runs slower (memory contention, a vCPU taken by another process,
// torch's OpenMP workers still spinning on its core) ends up with less of the work instead of
// holding everyone up. Every output element is still produced by one item in one fixed order:
// results do not depend on the split (tested bit-identical).
// An item's chunk is sized in bytes, not panels: each expert's piece of it is about
// kItemBytes of contiguous panels, at most 1 / (2 x threads) of the region's panels (a quarter
// at 2 threads, an eighth at 4), so that every thread has items to take and to share. A thread
// streams its item's pieces one after the other, and the hardware prefetchers ramp up again at
// each piece. The old cap of 8 panels made int4's down pieces 64 KiB (8 KiB panels) and its
// q/k/v and o_proj pieces 128 KiB: on an AMD Zen 5 whole OLMoE int4 decode steps took 4-7 %
// less time with 1 MiB pieces (int8 2-4 %, lossless12 1-2 %), under a competing process too,
// and 35 % more with 32 KiB ones (benchmarks/log/, 2026-12-04, 12f9408).
#include <cmath>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "hina_moe/experts.h"
#include "hina_moe/thread_pool.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"
#include "moe/quant_panel.h"
#include "moe/step_trace.h"

namespace hina {

using namespace detail;

namespace detail::pf {
namespace {
// HINA_MOE_PREFETCH_BYTES when it holds a multiple of 64 in [0, 65536], else -1.
int env_prefetch_bytes() {
  if (const char* env = std::getenv("HINA_MOE_PREFETCH_BYTES")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v >= 0 && v <= 65536 && v % 64 == 0) return static_cast<int>(v);
  }
  return -1;
}
bool amd() { return std::strcmp(cpu_features().vendor, "AuthenticAMD") == 0; }
}  // namespace

int load_prefetch_distance() {
  static const int bytes = [] {
    const int env = env_prefetch_bytes();
    return env >= 0 ? env : amd() ? 1024 : 4096;
  }();
  return bytes;
}
int load_rows_prefetch(bool many) {
  static const int few = [] {
    const int env = env_prefetch_bytes();
    return env >= 0 ? env : amd() ? 0 : load_prefetch_distance();
  }();
  static const int lots = [] {
    const int env = env_prefetch_bytes();
    return env >= 0 ? env : amd() ? 16384 : load_prefetch_distance();
  }();
  return many ? lots : few;
}
bool load_l12_prefetch() {
  return std::getenv("HINA_MOE_PREFETCH_BYTES") != nullptr || !amd();
}
}  // namespace detail::pf

bool l12_prefetch() { return detail::pf::l12_prefetch(); }

namespace {
// The dynamic split's piece of one expert (header comment); a build with HINA_PREFETCH_TUNING
// reads HINA_ITEM_BYTES at every forward instead, for benchmarks to compare sizes (0: pieces of
// 8 panels whatever their bytes, the rule before, for A/B in one process).
constexpr int64_t kItemBytes = 1 << 20;
int64_t dynamic_item_bytes() {
#ifdef HINA_PREFETCH_TUNING
  if (const char* b = std::getenv("HINA_ITEM_BYTES")) return std::max<int64_t>(0, std::atoll(b));
#endif
  return kItemBytes;
}
}  // namespace

int prefetch_distance() { return detail::pf::bytes(); }
int rows_prefetch_distance(int64_t rows) { return detail::pf::ahead(rows); }

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
  }
  return "unknown";
}
const char* dtype_short(DType dt) {
  switch (dt) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "unknown";
}
size_t dtype_size(DType dt) { return dt == DType::kF32 ? 4 : 2; }

const char* act_name(Act act) {
  switch (act) {
    case Act::kSilu: return "silu";
    case Act::kGelu: return "gelu";
    case Act::kGeluTanh: return "gelu_tanh";
    case Act::kRelu: return "relu";
    case Act::kRelu2: return "relu2";
    case Act::kSigmoidAlpha: return "sigmoid_alpha";
    case Act::kIdentity: return "identity";
  }
  return "unknown";
}
bool act_from_name(const char* name, Act* out) {
  for (Act a : {Act::kSilu, Act::kGelu, Act::kGeluTanh, Act::kRelu, Act::kRelu2,
                Act::kSigmoidAlpha, Act::kIdentity}) {
    if (std::strcmp(name, act_name(a)) == 0) {
      *out = a;
      return true;
    }
  }
  return false;
}
const char* wformat_name(WFormat f) {
  switch (f) {
    case WFormat::kLossless: return "lossless";
    case WFormat::kInt8: return "int8";
    case WFormat::kInt4: return "int4";
    case WFormat::kLossless12: return "lossless12";
  }
  return "unknown";
}
bool wformat_from_name(const char* name, WFormat* out) {
  for (WFormat f : {WFormat::kLossless, WFormat::kInt8, WFormat::kInt4, WFormat::kLossless12}) {
    if (std::strcmp(name, wformat_name(f)) == 0) {
      *out = f;
      return true;
    }
  }
  return false;
}
const char* path_name(MoePath path) {
  switch (path) {
    case MoePath::kAuto: return "auto";
    case MoePath::kDecode: return "decode";
    case MoePath::kPrefill: return "prefill";
  }
  return "unknown";
}

const char* qdot_name(QDot q) {
  switch (q) {
    case QDot::kAuto: return "auto";
    case QDot::kInt: return "int";
    case QDot::kExpand: return "expand";
  }
  return "unknown";
}
bool qdot_from_name(const char* name, QDot* out) {
  for (QDot q : {QDot::kAuto, QDot::kInt, QDot::kExpand}) {
    if (std::strcmp(name, qdot_name(q)) == 0) {
      *out = q;
      return true;
    }
  }
  return false;
}

namespace detail {

// The activation quantisation of the integer-dot kernels (experts.h): the portable build of
// moe/quant_panel.h's lane-wise code here (no FMA contraction in moe.cpp), the AVX-512 / AVX2
// builds where the CPU has them (same bytes: tested).
void quant_act_row_portable(const float* x, int64_t Kp, uint8_t* row) { qp::quant_act_row<4>(x, Kp, row); }

void quant_act_row(const float* x, int64_t Kp, uint8_t* row) {
#if defined(HINA_HAVE_X86_KERNELS)
  static const int best = isa_supported(cpu_features(), Isa::kAvx512) ? 2 : isa_supported(cpu_features(), Isa::kAvx2) ? 1 : 0;
  if (best == 2) {
    quant_act_row_avx512(x, Kp, row);
    return;
  }
  if (best == 1) {
    quant_act_row_avx2(x, Kp, row);
    return;
  }
#endif
  quant_act_row_portable(x, Kp, row);
}

int64_t l12_compress_panel(const uint16_t* plain, int64_t plain_bytes, uint8_t* panel) {
  const L12Geometry g = l12_geometry(plain_bytes);
  std::memset(panel, 0, static_cast<size_t>(g.bytes));
  int64_t count[256] = {};
  for (int64_t i = 0; i < plain_bytes / 2; ++i) ++count[plain[i] >> 8];
  int order[256];
  for (int i = 0; i < 256; ++i) order[i] = i;
  std::stable_sort(order, order + 256, [&](int a, int b) { return count[a] > count[b]; });  // ties: lower byte first
  int code[256];
  std::fill(code, code + 256, -1);
  for (int i = 0; i < 16; ++i) {
    code[order[i]] = i;
    for (int r = 0; r < 4; ++r) panel[16 * r + i] = static_cast<uint8_t>(order[i]);
  }
  uint8_t* flags = panel + kL12Table;
  int64_t spilled = 0;
  for (int64_t b = 0; b < g.nb; ++b) {
    const uint16_t* v = plain + b * 64;  // the block's two plain vectors
    uint8_t* slot = panel + g.slots + b * kL12Slot;
    uint8_t hi[64];
    bool spill = false;
    for (int i = 0; i < 64; ++i) {  // L byte order: what unpacklo/hi_epi8 interleave back
      const int j = i / 16, q = i % 16;
      const uint16_t word = v[q < 8 ? 8 * j + q : 32 + 8 * j + q - 8];
      slot[i] = static_cast<uint8_t>(word & 0xff);
      hi[i] = static_cast<uint8_t>(word >> 8);
      spill = spill || code[hi[i]] < 0;
    }
    if (!spill) {
      for (int i = 0; i < 32; ++i) slot[64 + i] = static_cast<uint8_t>(code[hi[i]] | code[hi[i + 32]] << 4);
      continue;
    }
    flags[b / 8] = static_cast<uint8_t>(flags[b / 8] | 1u << (b % 8));
    std::memcpy(slot + 64, hi, 32);
    if (spilled < g.cap) std::memcpy(panel + g.spill + spilled * kL12SpillSlot, hi + 32, 32);
    ++spilled;
  }
  return spilled;
}

void l12_decompress_panel_portable(const uint8_t* panel, int64_t plain_bytes, uint16_t* plain) {
  const L12Geometry g = l12_geometry(plain_bytes);
  const uint8_t* flags = panel + kL12Table;
  int64_t spilled = 0;
  for (int64_t b = 0; b < g.nb; ++b) {
    const uint8_t* slot = panel + g.slots + b * kL12Slot;
    uint8_t hi[64];
    if (flags[b / 8] >> (b % 8) & 1) {
      std::memcpy(hi, slot + 64, 32);
      std::memcpy(hi + 32, panel + g.spill + std::min(spilled++, g.cap - 1) * kL12SpillSlot, 32);
    } else {
      for (int i = 0; i < 32; ++i) {
        hi[i] = panel[slot[64 + i] & 15];
        hi[i + 32] = panel[slot[64 + i] >> 4];
      }
    }
    uint16_t* v = plain + b * 64;
    for (int i = 0; i < 64; ++i) {
      const int j = i / 16, q = i % 16;
      v[q < 8 ? 8 * j + q : 32 + 8 * j + q - 8] = static_cast<uint16_t>(slot[i] | hi[i] << 8);
    }
  }
}

}  // namespace detail

namespace {

std::string cpu_summary() {
  const CpuFeatures& f = cpu_features();
  std::string s = "best tier here: '";
  Isa best = best_isa(f);
  s += isa_name(best == Isa::kNeon ? Isa::kGeneric : best);
  s += "'; cpu: avx2=" + std::to_string(f.avx2) + " fma=" + std::to_string(f.fma) +
       " f16c=" + std::to_string(f.f16c) + " avx512f=" + std::to_string(f.avx512f) +
       " avx512bw=" + std::to_string(f.avx512bw) + " avx512vl=" + std::to_string(f.avx512vl) +
       " amx_tile=" + std::to_string(f.amx_tile) + " amx_bf16=" + std::to_string(f.amx_bf16) +
       "; os: avx=" + std::to_string(f.os_avx) + " avx512=" + std::to_string(f.os_avx512) +
       " amx=" + std::to_string(f.os_amx) + " amx_permission=" + std::to_string(f.amx_permission);
  return s;
}

// Which kernels run for (tier, dtype, concrete path, format, qdot), and under which name.
// `kernel` is the <kernel> part of the name: an Isa (0..3), one of the integer-dot kinds, or the
// bf16 dot-product prefill (avx512bf16).
enum KernelKind : int {
  kKindGenericDot = 4, kKindAvx2Dot = 5, kKindAvx512Vnni = 6, kKindAvxVnni = 7, kKindAvx512Bf16 = 8, kNumKinds = 9
};
const char* kind_name(int kind) {
  switch (kind) {
    case kKindGenericDot: return "genericdot";
    case kKindAvx2Dot: return "avx2dot";
    case kKindAvx512Vnni: return "avx512vnni";
    case kKindAvxVnni: return "avxvnni";
    case kKindAvx512Bf16: return "avx512bf16";
    default: return isa_name(static_cast<Isa>(kind));
  }
}

struct Selected {
  KernelImpl k;
  int kind;
};

// The prefill of bf16 weights on the avx512 tier of a CPU with AVX512-BF16 (and so no AMX tier,
// or the amx tier forced down): vdpbf16ps on bf16 x and h rows, the AMX kernels' contract.
// Tuning builds (HINA_PREFETCH_TUNING) read HINA_BF16DOT=0 at every call to turn it off, so a
// benchmark can compare it with the fp32 kernel in one process; release builds cannot.
bool bf16dot_prefill(Isa tier, MoePath path) {
  if (tier != Isa::kAvx512 || path != MoePath::kPrefill || !cpu_features().avx512bf16) return false;
#ifdef HINA_PREFETCH_TUNING
  if (const char* v = std::getenv("HINA_BF16DOT"); v && std::atoi(v) == 0) return false;
#endif
  return true;
}

// The integer-dot kernels for this tier (false: the tier has no SIMD integer-dot kernel).
bool select_qdot(Isa tier, WFormat wf, Selected* s) {
  const bool x86 = tier == Isa::kAvx2 || tier == Isa::kAvx512 || tier == Isa::kAmx;
  if ((tier == Isa::kAvx512 || tier == Isa::kAmx) && cpu_features().avx512vnni &&
      get_qdot_kernels_avx512vnni(wf, &s->k)) {
    s->kind = kKindAvx512Vnni;
    return true;
  }
  if (x86 && cpu_features().avx_vnni && get_qdot_kernels_avxvnni(wf, &s->k)) {
    s->kind = kKindAvxVnni;
    return true;
  }
  if (x86 && get_qdot_kernels_avx2(wf, &s->k)) {
    s->kind = kKindAvx2Dot;
    return true;
  }
  return false;
}

// ---- lossless12 on every tier and path: the tier's plain bf16 kernels on decompressed panels ----
// Per job, its panels are decompressed a few at a time into a per-thread buffer, and the plain
// kernel runs on that buffer as a job of its own: panels [0, n) there, with the output columns
// (h, biases, acc rows, and the I / H limits of the column masks) shifted to the chunk's first
// column. The plain kernel reads the same words as it would from a lossless block, so the
// outputs are its bits.
enum class Plain : int { kGeneric, kAvx2, kAvx512, kAvx512Bf16, kAmx };

// The amx tier's kernels: the hardware build, or in the C++ tests' build while
// use_amx_software_tiles(true) the same code on software tiles (moe_amx_sw.cpp).
bool amx_kernels(DType dt, KernelImpl* k) {
#ifdef HINA_AMX_SOFTWARE_TILES_BUILT
  if (amx_software_tiles()) return get_kernels_amx_sw(dt, k);
#endif
  return get_kernels_amx(dt, k);
}
bool amx_qkernels(WFormat wf, KernelImpl* k) {
#ifdef HINA_AMX_SOFTWARE_TILES_BUILT
  if (amx_software_tiles()) return get_qkernels_amx_sw(wf, k);
#endif
  return get_qkernels_amx(wf, k);
}

bool get_plain_bf16(Plain pl, KernelImpl* k) {
  switch (pl) {
    case Plain::kGeneric: return get_kernels_generic(DType::kBF16, false, k);
    case Plain::kAvx2: return get_kernels_avx2(DType::kBF16, k);
    case Plain::kAvx512: return get_kernels_avx512(DType::kBF16, k);
    case Plain::kAvx512Bf16: return get_kernels_avx512bf16(DType::kBF16, k);
    case Plain::kAmx: return amx_kernels(DType::kBF16, k);
  }
  return false;
}

template <Plain P>
const KernelImpl& plain_bf16() {
  static const KernelImpl k = [] {
    KernelImpl r;
    get_plain_bf16(P, &r);  // select_l12 checked that it exists
    return r;
  }();
  return k;
}

// Even, so that the AMX down kernel, which takes panels in pairs, pairs them as in a plain job;
// small, so that the buffer (4 x 128 KiB for a 2048-long gate/up panel) stays in L2.
constexpr int64_t kL12ChunkPanels = 4;
thread_local AlignedBuf tls_l12_plain;
thread_local std::vector<float*> tls_l12_acc;

// Stored panels [c0, c1) of an expert at w (stored bytes each) as plain panels in the buffer.
template <Plain P>
const uint8_t* l12_chunk(const void* w, int64_t c0, int64_t c1, int64_t stored, int64_t plain) {
  uint8_t* buf = static_cast<uint8_t*>(tls_l12_plain.get(static_cast<size_t>(plain * kL12ChunkPanels)));
  for (int64_t p = c0; p < c1; ++p) {
    const uint8_t* src = static_cast<const uint8_t*>(w) + p * stored;
    uint16_t* dst = reinterpret_cast<uint16_t*>(buf + (p - c0) * plain);
#if defined(HINA_HAVE_X86_KERNELS)
    if constexpr (P == Plain::kAvx512 || P == Plain::kAvx512Bf16 || P == Plain::kAmx) {
      l12_decompress_panel_avx512(src, plain, dst);
      continue;
    }
#endif
    l12_decompress_panel_portable(src, plain, dst);
  }
  return buf;
}

// Runs `job`'s stored panels [p0, p1) as plain jobs of <= kL12ChunkPanels panels each: `shift`
// points a copy's outputs (and L's column limit) at the chunk's first column, then `run` runs it.
template <Plain P, typename Job, typename Shift, typename Run>
void l12_chunks(const Job& j, int64_t stored, int64_t plain, Layout& L, Shift shift, Run run) {
  for (int64_t c0 = j.p0; c0 < j.p1; c0 += kL12ChunkPanels) {
    const int64_t c1 = std::min(j.p1, c0 + kL12ChunkPanels);
    Job s = j;
    s.w = l12_chunk<P>(j.w, c0, c1, stored, plain);
    s.p0 = 0;
    s.p1 = c1 - c0;
    shift(s, c0 * kPanelN);
    s.L = &L;
    // a prefetch hint only (AMX): the stored panels the next chunk or job decompresses first
    s.w_next = c1 < j.p1 ? static_cast<const uint8_t*>(j.w) + c1 * stored : j.w_next;
    run(s);
  }
}

template <Plain P>
void gateup_l12_wrapped(const GateUpJob& j) {
  const KernelImpl& k = plain_bf16<P>();
  Layout L = *j.L;
  L.wfmt = WFormat::kLossless;
  const size_t hesz = k.h_bf16 ? 2 : 4;
  l12_chunks<P>(j, gu_panel_bytes(*j.L), gu_panel_bytes(L), L, [&](GateUpJob& s, int64_t col) {
    if (s.bias_g) s.bias_g += col;
    if (s.bias_u) s.bias_u += col;
    s.h = static_cast<uint8_t*>(j.h) + hesz * static_cast<size_t>(col);
    L.I = j.L->I - col;  // > 0: every panel holds a column < I
  }, k.gateup);
}

template <Plain P>
void down_l12_wrapped(const DownJob& j) {
  const KernelImpl& k = plain_bf16<P>();
  Layout L = *j.L;
  L.wfmt = WFormat::kLossless;
  std::vector<float*>& acc = tls_l12_acc;
  acc.resize(static_cast<size_t>(j.nt));
  l12_chunks<P>(j, down_panel_bytes(*j.L), down_panel_bytes(L), L, [&](DownJob& s, int64_t col) {
    if (s.bias) s.bias += col;
    for (int64_t r = 0; r < j.nt; ++r) acc[static_cast<size_t>(r)] = j.acc[r] + col;
    s.acc = acc.data();
    L.H = j.L->H - col;  // > 0 likewise
  }, k.down);
}

template <Plain P>
bool wrapped_l12(KernelImpl* k) {
  if (!get_plain_bf16(P, k)) return false;
  k->gateup = &gateup_l12_wrapped<P>;
  k->down = &down_l12_wrapped<P>;
  return true;
}

// lossless12 (bf16 only): the fused AVX-512 kernels for decode on the avx512 and amx tiers, the
// wrapped plain kernels of the tier and path everywhere else.
Selected select_l12(Isa tier, MoePath path) {
  Selected s{};
  const bool avx512 = tier == Isa::kAvx512 || tier == Isa::kAmx;
  if (tier == Isa::kAmx && path == MoePath::kPrefill && wrapped_l12<Plain::kAmx>(&s.k)) {
    s.kind = static_cast<int>(Isa::kAmx);
  } else if (bf16dot_prefill(tier, path) && wrapped_l12<Plain::kAvx512Bf16>(&s.k)) {
    s.kind = kKindAvx512Bf16;
  } else if (avx512 && path == MoePath::kDecode &&
             ((cpu_features().avx512vbmi && get_l12_kernels_avx512vbmi(&s.k)) || get_l12_kernels_avx512(&s.k))) {
    s.kind = static_cast<int>(Isa::kAvx512);  // either build: the same bytes, the same name
  } else if (avx512 && wrapped_l12<Plain::kAvx512>(&s.k)) {
    s.kind = static_cast<int>(Isa::kAvx512);
  } else if (tier == Isa::kAvx2 && wrapped_l12<Plain::kAvx2>(&s.k)) {
    s.kind = static_cast<int>(Isa::kAvx2);
  } else {
    wrapped_l12<Plain::kGeneric>(&s.k);
    s.kind = static_cast<int>(Isa::kGeneric);
  }
  return s;
}

Selected select_kernels(Isa tier, DType dt, MoePath path, WFormat wf, QDot qd) {
  if (wf == WFormat::kLossless12) return select_l12(tier, path);
  Selected s{};
  bool ok = false;
  const bool q = wf != WFormat::kLossless;
  const bool amx_prefill = tier == Isa::kAmx && path == MoePath::kPrefill && dt == DType::kBF16;
  if (q && (qd == QDot::kInt || (qd == QDot::kAuto && !amx_prefill))) {
    if (select_qdot(tier, wf, &s)) return s;
    if (qd == QDot::kInt) {
      get_qdot_kernels_generic(wf, &s.k);
      s.kind = kKindGenericDot;
      return s;
    }
  }
  // The AMX kernels take bf16 x rows; models in other dtypes stay on the FMA tiers, which keep
  // x in fp32 (rounding an fp32/fp16 model's activations to bf16 would lose precision).
  if (amx_prefill) {
    ok = q ? amx_qkernels(wf, &s.k) : amx_kernels(dt, &s.k);
    s.kind = static_cast<int>(Isa::kAmx);
  }
  if (!ok && !q && bf16dot_prefill(tier, path)) {
    ok = get_kernels_avx512bf16(dt, &s.k);  // false for fp32 / fp16 models: they keep fp32 x and h
    s.kind = kKindAvx512Bf16;
  }
  if (!ok && (tier == Isa::kAmx || tier == Isa::kAvx512)) {
    ok = q ? get_qkernels_avx512(wf, &s.k) : get_kernels_avx512(dt, &s.k);
    s.kind = static_cast<int>(Isa::kAvx512);
  }
  if (!ok && tier == Isa::kAvx2) {
    ok = q ? get_qkernels_avx2(wf, &s.k) : get_kernels_avx2(dt, &s.k);
    s.kind = static_cast<int>(Isa::kAvx2);
  }
  if (!ok) {
    if (q) get_qkernels_generic(wf, false, &s.k);
    else get_kernels_generic(dt, false, &s.k);
    s.kind = static_cast<int>(Isa::kGeneric);
  }
  return s;
}

// Packs one [N, K] matrix into panels; Elem is the raw element (uint16_t / uint32_t).
template <typename Elem>
void pack_matrix(const Elem* src, int64_t N, int64_t K, Elem* dst, int64_t Np, int64_t Kp,
                 int kpack, int G, int gi) {
  for (int64_t p = 0; p < Np / kPanelN; ++p) {
    Elem* panel = dst + p * Kp * kPanelN * G;
    for (int64_t k = 0; k < Kp; ++k) {
      for (int n = 0; n < kPanelN; ++n) {
        const int64_t row = p * kPanelN + n;
        panel[panel_index(kpack, G, k, gi, n)] = (row < N && k < K) ? src[row * K + k] : Elem(0);
      }
    }
  }
}

template <typename Elem>
void unpack_matrix(const Elem* panels, int64_t N, int64_t K, Elem* dst, int64_t Kp, int kpack,
                   int G, int gi) {
  for (int64_t row = 0; row < N; ++row) {
    const Elem* panel = panels + (row / kPanelN) * Kp * kPanelN * G;
    const int n = static_cast<int>(row % kPanelN);
    for (int64_t k = 0; k < K; ++k) dst[row * K + k] = panel[panel_index(kpack, G, k, gi, n)];
  }
}


// Quantises one [N, K] matrix into the panels of matrix gi (see PackedHeader, layout v5): each
// panel's 16 rows are transposed into fp32 and handed to the panel quantiser (moe/quant_panel.h;
// its AVX-512 build where the CPU has it: same bytes, several times faster).
void quant_matrix(const void* src, DType dt, int64_t N, int64_t K, uint8_t* dst, int64_t Np,
                  int64_t Kp, int G, int gi, WFormat wf, int group, std::vector<float>& buf, Isa tier) {
  buf.assign(static_cast<size_t>(Kp * kPanelN), 0.0f);
  const int64_t pbytes = panel_bytes(dt, wf, group, Kp, G);
  // the block's own tier decides (tiers below avx512 use the portable build: the tests pack at
  // every tier and compare both builds with the same independent quantisation)
  const bool avx512 = tier == Isa::kAvx512 || tier == Isa::kAmx;
  const bool avx2 = tier == Isa::kAvx2;
  for (int64_t p = 0; p < Np / kPanelN; ++p) {
    for (int n = 0; n < kPanelN; ++n) {
      const int64_t row = p * kPanelN + n;
      float* col = buf.data() + n;
      if (row >= N) {
        for (int64_t k = 0; k < Kp; ++k) col[k * kPanelN] = 0.0f;
        continue;
      }
      if (dt == DType::kBF16) {
        const uint16_t* r = static_cast<const uint16_t*>(src) + row * K;
        for (int64_t k = 0; k < K; ++k) col[k * kPanelN] = bf16_to_f32(r[k]);
      } else if (dt == DType::kF32) {
        const float* r = static_cast<const float*>(src) + row * K;
        for (int64_t k = 0; k < K; ++k) col[k * kPanelN] = r[k];
      } else {
        for (int64_t k = 0; k < K; ++k) col[k * kPanelN] = load_elem(dt, src, row * K + k);
      }
      for (int64_t k = K; k < Kp; ++k) col[k * kPanelN] = 0.0f;
    }
    uint8_t* panel = dst + p * pbytes;
#if defined(HINA_HAVE_X86_KERNELS)
    if (avx512) {
      quant_panel_avx512(buf.data(), Kp, G, gi, wf, group, panel);
      continue;
    }
    if (avx2) {
      quant_panel_avx2(buf.data(), Kp, G, gi, wf, group, panel);
      continue;
    }
#endif
    qp::quant_panel<4>(buf.data(), Kp, G, gi, wf, group, panel);
  }
  (void)avx512;
  (void)avx2;
}

// Inverse of quant_matrix: the dequantised [N, K] matrix in dtype dt.
void dequant_matrix(const uint8_t* panels, DType dt, int64_t N, int64_t K, void* dst, int64_t Kp,
                    int G, int gi, WFormat wf, int group) {
  Layout L{};
  L.dtype = dt;
  L.wfmt = wf;
  L.group = group;
  std::vector<float> w(static_cast<size_t>(Kp * kPanelN));
  const int64_t pbytes = panel_bytes(dt, wf, group, Kp, G);
  for (int64_t p = 0; p * kPanelN < N; ++p) {
    dequant_panel_f32(panels + p * pbytes, L, Kp, G, gi, w.data());
    for (int n = 0; n < kPanelN && p * kPanelN + n < N; ++n)
      for (int64_t k = 0; k < K; ++k) store_elem(dt, dst, (p * kPanelN + n) * K + k, w[k * kPanelN + n]);
  }
}

struct Scratch {
  AlignedBuf xbuf, hbuf, hqbuf, acc;
  std::vector<int64_t> counts, offsets, cursor;
  std::vector<int32_t> active, row_token;
  std::vector<float> row_w, row_wt;
  std::vector<const void*> xrows;
  std::vector<float*> accrows;
};
thread_local Scratch tls_scratch;

template <typename IdxT>
void check_and_count(const IdxT* idx, int64_t T, int64_t K, int64_t E, std::vector<int64_t>& counts) {
  counts.assign(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < T * K; ++s) {
    const int64_t e = static_cast<int64_t>(idx[s]);
    if (e < 0) continue;
    if (e >= E) {
      throw std::invalid_argument("topk_idx[" + std::to_string(s / K) + ", " +
                                  std::to_string(s % K) + "] = " + std::to_string(e) +
                                  " is out of range: the experts have E = " + std::to_string(E) +
                                  " (negative indices mean 'skip this slot')");
    }
    ++counts[static_cast<size_t>(e)];
  }
}

template <typename IdxT>
void fill_rows(const IdxT* idx, const void* topk_w, DType w_dt, int64_t T, int64_t K, Scratch& s) {
  s.cursor.assign(s.offsets.begin(), s.offsets.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = static_cast<int64_t>(idx[t * K + k]);
      if (e < 0) continue;
      const int64_t r = s.cursor[static_cast<size_t>(e)]++;
      s.row_token[static_cast<size_t>(r)] = static_cast<int32_t>(t);
      s.row_w[static_cast<size_t>(r)] = load_elem(w_dt, topk_w, t * K + k);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Isa resolve_isa(const char* name) {
  const CpuFeatures& f = cpu_features();
  std::string n = name ? name : "auto";
  if (n == "auto") {
    const char* env = std::getenv("HINA_MOE_ISA");
    if (env && *env && std::strcmp(env, "auto") != 0) {
      n = env;
    } else {
      const Isa best = best_isa(f);
      return best == Isa::kNeon ? Isa::kGeneric : best;
    }
  }
  Isa isa;
  if (!isa_from_name(n.c_str(), &isa)) {
    throw std::invalid_argument("isa '" + n +
                                "' is unknown; expected auto, generic, avx2, avx512 or amx");
  }
  if (isa == Isa::kNeon) {
    throw std::invalid_argument("isa 'neon' has no MoE kernels yet; use 'generic'");
  }
  if (!isa_supported(f, isa)) {
    throw std::invalid_argument("isa '" + n + "' is not supported on this machine (" +
                                cpu_summary() + ")");
  }
  return isa;
}

const char* moe_kernel_name(Isa isa, DType dt, MoePath path, WFormat wf, QDot qd) {
  // Names are `<op>_<format>_<kernel>`; built once. Formats: f32, bf16, f16, int8, int4, l12.
  constexpr int kFmts = 6;
  static std::vector<std::string>* table = [] {
    auto* t = new std::vector<std::string>(kNumKinds * kFmts * 2);
    const char* fmts[kFmts] = {"f32", "bf16", "f16", "int8", "int4", "l12"};
    for (int i = 0; i < kNumKinds; ++i)
      for (int d = 0; d < kFmts; ++d)
        for (int p = 0; p < 2; ++p)
          (*t)[(i * kFmts + d) * 2 + p] = std::string(p ? "moe_prefill_" : "moe_decode_") + fmts[d] +
                                      "_" + kind_name(i);
    return t;
  }();
  if (path == MoePath::kAuto) path = MoePath::kDecode;
  const int k = select_kernels(isa, dt, path, wf, qd).kind;
  const int f = wf == WFormat::kLossless ? static_cast<int>(dt)
                : wf == WFormat::kInt8   ? 3
                : wf == WFormat::kInt4   ? 4
                                         : 5;
  return (*table)[(k * kFmts + f) * 2 + (path == MoePath::kPrefill ? 1 : 0)].c_str();
}

PackedHeader plan_packed(DType dt, int64_t E, int64_t H, int64_t I, bool has_gate,
                         bool gate_bias, bool up_bias, bool down_bias, Isa isa, QuantSpec q,
                         bool up_only) {
  // Headers also come back from stores (view): sizes must never wrap. Each dimension fits int32
  // (the driver keeps expert ids and token rows in int32), and the block's bytes are summed
  // with overflow checks up to 2^62, so every derived size and offset is exact.
  constexpr int64_t kMaxDim = INT32_MAX;
  constexpr uint64_t kMaxBytes = uint64_t{1} << 62;
  if (E < 1 || H < 1 || I < 1 || E > kMaxDim || H > kMaxDim || I > kMaxDim) {
    throw std::invalid_argument("experts need 1 <= E, H, I <= 2^31 - 1 (got E=" + std::to_string(E) +
                                ", H=" + std::to_string(H) + ", I=" + std::to_string(I) + ")");
  }
  if (dt != DType::kF32 && dt != DType::kBF16 && dt != DType::kF16) {
    throw std::invalid_argument("unsupported weight dtype");
  }
  if (q.fmt != WFormat::kLossless && q.fmt != WFormat::kInt8 && q.fmt != WFormat::kInt4 &&
      q.fmt != WFormat::kLossless12) {
    throw std::invalid_argument("unknown weight format");
  }
  if (q.fmt == WFormat::kLossless12 && dt != DType::kBF16) {
    throw std::invalid_argument(std::string("weights 'lossless12' needs bfloat16 weights (got ") + dtype_name(dt) +
                                "); use 'lossless' for float32 and float16 models");
  }
  if (q.fmt == WFormat::kInt4 && q.group != 32 && q.group != 64 && q.group != 128) {
    throw std::invalid_argument("int4 group size must be 32, 64 or 128 (got " +
                                std::to_string(q.group) + ")");
  }
  if (up_only && (E != 1 || down_bias || (gate_bias && !has_gate) || (has_gate && gate_bias != up_bias))) {
    throw std::invalid_argument("an up-only (linear) block has E = 1, no down bias, and a gate (paired) only with "
                                "biases on both halves or neither");
  }
  if (up_only && has_gate && q.fmt != WFormat::kInt8 && q.fmt != WFormat::kInt4) {
    throw std::invalid_argument(std::string("a paired linear layer is int8 or int4 (got ") + wformat_name(q.fmt) + ")");
  }
  PackedHeader h;
  h.up_only = up_only;
  h.dtype = static_cast<uint8_t>(dt);
  h.isa = static_cast<uint8_t>(isa);
  h.wfmt = static_cast<uint8_t>(q.fmt);
  h.group = static_cast<uint16_t>(q.fmt == WFormat::kInt4 ? q.group : 0);
  h.kpack = ((q.fmt == WFormat::kLossless || q.fmt == WFormat::kLossless12) && dt == DType::kBF16) ? 2 : 1;
  h.k_align = static_cast<uint16_t>(q.fmt == WFormat::kInt4 && q.group > kKAlign ? q.group : kKAlign);
  h.has_gate = has_gate;
  h.has_gate_bias = gate_bias;
  h.has_up_bias = up_bias;
  h.has_down_bias = down_bias;
  h.E = E;
  h.H = H;
  h.I = I;
  h.Hk = round_up(H, h.k_align);
  h.In = round_up(I, kPanelN);
  h.Ik = round_up(I, h.k_align);
  h.Hn = round_up(H, kPanelN);
  const int G = has_gate ? 2 : 1;
  auto too_big = [&]() {
    throw std::invalid_argument("packed experts of E=" + std::to_string(E) + ", H=" + std::to_string(H) +
                                ", I=" + std::to_string(I) + " would take more than 2^62 bytes");
  };
  auto mul = [&](uint64_t a, uint64_t b) {
    if (a != 0 && b > kMaxBytes / a) too_big();
    return a * b;
  };
  auto add = [&](uint64_t a, uint64_t b) {
    if (b > kMaxBytes - a) too_big();
    return a + b;
  };
  auto a64 = [&](uint64_t b) { return add(b, 63) / 64 * 64; };
  // panel_bytes stays in int64 for dimensions <= 2^31 + 128 (at most 2^38 bytes per panel)
  const uint64_t gu_panel = static_cast<uint64_t>(panel_bytes(dt, q.fmt, h.group, h.Hk, G));
  const uint64_t dn_panel = static_cast<uint64_t>(panel_bytes(dt, q.fmt, h.group, h.Ik, 1));
  const uint64_t e = static_cast<uint64_t>(E);
  h.gu_expert_bytes = a64(mul(static_cast<uint64_t>(h.In / kPanelN), gu_panel));
  h.down_expert_bytes = up_only ? 0 : a64(mul(static_cast<uint64_t>(h.Hn / kPanelN), dn_panel));
  uint64_t n = mul(add(h.gu_expert_bytes, h.down_expert_bytes), e);
  if (gate_bias) n = add(n, a64(mul(mul(4, e), static_cast<uint64_t>(h.In))));
  if (up_bias) n = add(n, a64(mul(mul(4, e), static_cast<uint64_t>(h.In))));
  if (down_bias) n = add(n, a64(mul(mul(4, e), static_cast<uint64_t>(h.Hn))));
  h.nbytes = n;
  return h;
}

PackedExperts::~PackedExperts() {
  if (owns_) std::free(mem_);
}

const void* PackedExperts::gate_up_expert(int64_t e) const {
  return gu_ + static_cast<size_t>(e) * hdr_.gu_expert_bytes;
}
const void* PackedExperts::down_expert(int64_t e) const {
  return down_ + static_cast<size_t>(e) * hdr_.down_expert_bytes;
}

void PackedExperts::bind(void* mem) {
  const PackedHeader& h = hdr_;
  auto a64 = [](int64_t b) { return static_cast<size_t>(round_up(b, 64)); };
  mem_ = mem;
  uint8_t* base = static_cast<uint8_t*>(mem);
  gu_ = base;
  down_ = base + h.gu_expert_bytes * static_cast<size_t>(h.E);
  uint8_t* b = down_ + h.down_expert_bytes * static_cast<size_t>(h.E);
  bias_g_ = bias_u_ = bias_d_ = nullptr;
  if (h.has_gate_bias) { bias_g_ = reinterpret_cast<float*>(b); b += a64(4 * h.E * h.In); }
  if (h.has_up_bias) { bias_u_ = reinterpret_cast<float*>(b); b += a64(4 * h.E * h.In); }
  if (h.has_down_bias) { bias_d_ = reinterpret_cast<float*>(b); }
}

namespace {
void check_tier(Isa isa) {
  if (isa == Isa::kNeon) throw std::invalid_argument("isa 'neon' has no MoE kernels yet");
  if (!isa_supported(cpu_features(), isa)) {
    throw std::invalid_argument(std::string("isa '") + isa_name(isa) +
                                "' is not supported on this machine (" + cpu_summary() + ")");
  }
}
}  // namespace

std::unique_ptr<PackedExperts> PackedExperts::create(const PackedHeader& h, void* mem) {
  const PackedHeader want = plan_packed(static_cast<DType>(h.dtype), h.E, h.H, h.I, h.has_gate,
                                        h.has_gate_bias, h.has_up_bias, h.has_down_bias,
                                        static_cast<Isa>(h.isa),
                                        {static_cast<WFormat>(h.wfmt), h.group ? h.group : 64}, h.up_only != 0);
  if (std::memcmp(&want, &h, sizeof(h)) != 0) {
    throw std::invalid_argument("packed header is not what plan_packed gives for its shapes");
  }
  check_tier(static_cast<Isa>(h.isa));
  if (mem && reinterpret_cast<uintptr_t>(mem) % 64 != 0) {
    throw std::invalid_argument("packed block memory must be 64-byte aligned");
  }
  std::unique_ptr<PackedExperts> pe(new PackedExperts());
  pe->hdr_ = h;
  pe->owns_ = mem == nullptr;
  if (!mem) {
    mem = alloc_weights(h.nbytes);
    std::memset(mem, 0, h.nbytes);  // padding bytes are part of the block's checksum
  }
  pe->bind(mem);
  return pe;
}

std::unique_ptr<PackedExperts> PackedExperts::view(const PackedHeader& h, const void* mem,
                                                   size_t mem_bytes) {
  if (h.magic != PackedHeader{}.magic) throw std::invalid_argument("not a packed-experts header (bad magic)");
  if (h.version != PackedHeader{}.version) {
    throw std::invalid_argument("packed layout version " + std::to_string(h.version) +
                                " is not this build's version " + std::to_string(PackedHeader{}.version));
  }
  if (h.dtype > 2 || h.wfmt > 3 || h.isa > 4) throw std::invalid_argument("packed header has an unknown dtype, format or tier");
  if (h.nbytes != mem_bytes) {
    throw std::invalid_argument("packed block is " + std::to_string(mem_bytes) +
                                " bytes; its header says " + std::to_string(h.nbytes));
  }
  if (!mem) throw std::invalid_argument("null packed block");
  auto pe = create(h, const_cast<void*>(mem));  // never written through: forward/unpack read only
  return pe;
}

std::unique_ptr<PackedExperts> PackedExperts::copy_of(const PackedHeader& h, const void* mem, size_t mem_bytes) {
  view(h, mem, mem_bytes);  // validates; the view itself is dropped
  std::unique_ptr<PackedExperts> pe(new PackedExperts());
  pe->hdr_ = h;
  void* own = alloc_weights(h.nbytes);
  // in 2 MiB pieces over the pool: the page faults (the OS zeroing each fresh page, 44 % of a
  // copy's samples in a profile of 2026-12-02, aa179b1) run on the thread that faults
  constexpr size_t kPiece = size_t(2) << 20;
  const size_t pieces = (h.nbytes + kPiece - 1) / kPiece;
  ThreadPool::global().run(default_num_threads(), [&](int tid, int n) {
    int64_t p0, p1;
    split_range(static_cast<int64_t>(pieces), tid, n, &p0, &p1);
    const size_t b0 = static_cast<size_t>(p0) * kPiece, b1 = std::min(h.nbytes, static_cast<size_t>(p1) * kPiece);
    if (b1 > b0) std::memcpy(static_cast<char*>(own) + b0, static_cast<const char*>(mem) + b0, b1 - b0);
  });
  pe->owns_ = true;
  pe->bind(own);
  return pe;
}

std::unique_ptr<PackedExperts> PackedExperts::pack_linear(DType dt, int64_t out_features, int64_t in_features,
                                                          const void* weight, const void* bias, Isa isa,
                                                          int num_threads, QuantSpec q, bool paired) {
  if (!weight) throw std::invalid_argument("the weight is required");
  if (paired && (out_features < 2 || out_features % 2 != 0))
    throw std::invalid_argument("a paired linear layer needs an even number of outputs (got " +
                                std::to_string(out_features) + ")");
  check_tier(isa);
  const int64_t I = paired ? out_features / 2 : out_features;
  const PackedHeader h = plan_packed(dt, 1, in_features, I, paired, paired && bias != nullptr, bias != nullptr,
                                     false, isa, q, true);
  ExpertWeights w;
  w.dtype = dt;
  w.E = 1;
  w.H = in_features;
  w.I = I;
  const size_t esz = dtype_size(dt);
  if (paired) {  // rows [0, I) the gate matrix, [I, 2 I) the up matrix
    w.gate = weight;
    w.up = static_cast<const uint8_t*>(weight) + static_cast<size_t>(I * in_features) * esz;
    w.gate_bias = bias;
    w.up_bias = bias ? static_cast<const uint8_t*>(bias) + static_cast<size_t>(I) * esz : nullptr;
  } else {
    w.up = weight;
    w.up_bias = bias;
  }
  auto pe = create(h);
  pe->pack_experts(0, w, num_threads);
  return pe;
}

std::unique_ptr<PackedExperts> PackedExperts::pack(const ExpertWeights& w, Isa isa,
                                                   int num_threads, QuantSpec q) {
  if (!w.up || !w.down) throw std::invalid_argument("up and down weights are required");
  check_tier(isa);
  const PackedHeader h = plan_packed(w.dtype, w.E, w.H, w.I, w.gate != nullptr,
                                     w.gate_bias != nullptr, w.up_bias != nullptr,
                                     w.down_bias != nullptr, isa, q);
  auto pe = create(h);
  pe->pack_experts(0, w, num_threads);
  return pe;
}

void PackedExperts::pack_experts(int64_t e0, const ExpertWeights& w, int num_threads) {
  const PackedHeader& h = hdr_;
  if (!w.up || (!w.down && !up_only())) throw std::invalid_argument("up and down weights are required");
  if (w.down && up_only()) throw std::invalid_argument("an up-only (linear) block takes no down weights");
  if (w.dtype != dtype() || w.H != h.H || w.I != h.I || w.E < 1 || e0 < 0 || e0 + w.E > h.E) {
    throw std::invalid_argument("pack_experts: experts [" + std::to_string(e0) + ", " +
                                std::to_string(e0 + w.E) + ") of dtype " + dtype_name(w.dtype) +
                                " H=" + std::to_string(w.H) + " I=" + std::to_string(w.I) +
                                " do not fit the block (E=" + std::to_string(h.E) + ", dtype " +
                                dtype_name(dtype()) + ", H=" + std::to_string(h.H) +
                                ", I=" + std::to_string(h.I) + ")");
  }
  if ((w.gate != nullptr) != has_gate() || (w.gate_bias != nullptr) != has_gate_bias() ||
      (w.up_bias != nullptr) != has_up_bias() || (w.down_bias != nullptr) != has_down_bias()) {
    throw std::invalid_argument("pack_experts: gate / bias arrays differ from the block's header");
  }
  const int G = h.has_gate ? 2 : 1;
  const size_t esz = dtype_size(w.dtype);
  const WFormat wf = wformat();
  const int nth = num_threads > 0 ? num_threads : default_num_threads();
  // lossless12: a panel that does not fit its spill area fails the whole call; the error of the
  // lowest such expert is thrown after the region (exceptions do not cross the pool's threads)
  std::mutex l12_mu;
  int64_t l12_bad_expert = h.E;
  std::string l12_error;
  auto l12_compress = [&](const std::vector<uint16_t>& plain, int64_t panels, int64_t Kp, int Gm,
                          uint8_t* dst, const char* what, int64_t e) {
    const int64_t plain_bytes = panel_bytes(DType::kBF16, WFormat::kLossless, 0, Kp, Gm);
    const int64_t stored = panel_bytes(DType::kBF16, WFormat::kLossless12, 0, Kp, Gm);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t spilled = l12_compress_panel(plain.data() + p * plain_bytes / 2, plain_bytes, dst + p * stored);
      const L12Geometry g = l12_geometry(plain_bytes);
      if (spilled <= g.cap) continue;
      std::lock_guard<std::mutex> lock(l12_mu);
      if (e < l12_bad_expert) {
        l12_bad_expert = e;
        l12_error = "lossless12 cannot store expert " + std::to_string(e) + "'s " + what + " panel " +
                    std::to_string(p) + " (output rows " + std::to_string(p * kPanelN) + ".." +
                    std::to_string(p * kPanelN + kPanelN - 1) + "): " + std::to_string(spilled) + " of its " +
                    std::to_string(g.nb) + " blocks of 64 weights have a high byte (sign and exponent) " +
                    "outside the panel's 16 most frequent, more than the " + std::to_string(g.cap) +
                    " its spill area holds; store these weights as 'lossless'";
      }
      return false;
    }
    return true;
  };
  ThreadPool::global().run(static_cast<int>(std::min<int64_t>(nth, w.E)), [&](int tid, int n) {
    int64_t s0, s1;
    split_range(w.E, tid, n, &s0, &s1);
    std::vector<float> buf;
    std::vector<uint16_t> plain;  // lossless12: one matrix's plain bf16 panels
    for (int64_t se = s0; se < s1; ++se) {
      const int64_t e = e0 + se;
      const size_t gu_off = static_cast<size_t>(se * w.I * w.H);
      const size_t dn_off = static_cast<size_t>(se * w.H * w.I);
      uint8_t* gu_dst = gu_ + static_cast<size_t>(e) * h.gu_expert_bytes;
      uint8_t* dn_dst = down_ + static_cast<size_t>(e) * h.down_expert_bytes;
      if (wf == WFormat::kLossless) {
        // Packing only moves elements, so the element type is just its size (bf16/fp16 or fp32).
        auto pack_expert = [&](auto elem) {
          using El = decltype(elem);
          if (w.gate)
            pack_matrix(static_cast<const El*>(w.gate) + gu_off, w.I, w.H,
                        reinterpret_cast<El*>(gu_dst), h.In, h.Hk, h.kpack, G, 0);
          pack_matrix(static_cast<const El*>(w.up) + gu_off, w.I, w.H,
                      reinterpret_cast<El*>(gu_dst), h.In, h.Hk, h.kpack, G, G - 1);
          if (w.down)
            pack_matrix(static_cast<const El*>(w.down) + dn_off, w.H, w.I,
                        reinterpret_cast<El*>(dn_dst), h.Hn, h.Ik, h.kpack, 1, 0);
        };
        if (esz == 2) pack_expert(uint16_t{});
        else pack_expert(uint32_t{});
      } else if (wf == WFormat::kLossless12) {
        // the expert's plain bf16 panels (the lossless layout), then each compressed into the block
        plain.assign(static_cast<size_t>(std::max(h.In * h.Hk * G, h.Hn * h.Ik)), 0);
        auto src = [&](const void* base, size_t off) { return static_cast<const uint16_t*>(base) + off; };
        if (w.gate) pack_matrix(src(w.gate, gu_off), w.I, w.H, plain.data(), h.In, h.Hk, h.kpack, G, 0);
        pack_matrix(src(w.up, gu_off), w.I, w.H, plain.data(), h.In, h.Hk, h.kpack, G, G - 1);
        if (!l12_compress(plain, h.In / kPanelN, h.Hk, G, gu_dst, G == 2 ? "gate/up" : "up", e)) continue;
        if (w.down) {
          pack_matrix(src(w.down, dn_off), w.H, w.I, plain.data(), h.Hn, h.Ik, h.kpack, 1, 0);
          if (!l12_compress(plain, h.Hn / kPanelN, h.Ik, 1, dn_dst, "down", e)) continue;
        }
      } else {
        auto at = [&](const void* base, size_t off) {
          return static_cast<const uint8_t*>(base) + off * esz;
        };
        if (w.gate) quant_matrix(at(w.gate, gu_off), w.dtype, w.I, w.H, gu_dst, h.In, h.Hk, G, 0, wf, h.group, buf, isa());
        quant_matrix(at(w.up, gu_off), w.dtype, w.I, w.H, gu_dst, h.In, h.Hk, G, G - 1, wf, h.group, buf, isa());
        if (w.down) quant_matrix(at(w.down, dn_off), w.dtype, w.H, w.I, dn_dst, h.Hn, h.Ik, 1, 0, wf, h.group, buf, isa());
      }
      for (int64_t i = 0; i < h.In; ++i) {
        if (bias_g_)
          bias_g_[e * h.In + i] = i < w.I ? load_elem(w.dtype, w.gate_bias, se * w.I + i) : 0.f;
        if (bias_u_)
          bias_u_[e * h.In + i] = i < w.I ? load_elem(w.dtype, w.up_bias, se * w.I + i) : 0.f;
      }
      if (bias_d_)
        for (int64_t c = 0; c < h.Hn; ++c)
          bias_d_[e * h.Hn + c] = c < w.H ? load_elem(w.dtype, w.down_bias, se * w.H + c) : 0.f;
    }
  });
  if (!l12_error.empty()) throw std::invalid_argument(l12_error);
}

void PackedExperts::unpack(void* gate, void* up, void* down, void* gate_bias, void* up_bias,
                           void* down_bias) const {
  const PackedHeader& h = hdr_;
  const int G = h.has_gate ? 2 : 1;
  const DType dt = dtype();
  const WFormat wf = wformat();
  const bool e16 = dtype_size(dt) == 2;
  const size_t esz = dtype_size(dt);
  for (int64_t e = 0; e < h.E; ++e) {
    const size_t gu_off = static_cast<size_t>(e * h.I * h.H);
    const uint8_t* gu_src = gu_ + static_cast<size_t>(e) * h.gu_expert_bytes;
    const uint8_t* dn_src = down_ + static_cast<size_t>(e) * h.down_expert_bytes;
    if (wf == WFormat::kLossless12) {
      // panel by panel back to the plain bf16 panels, then unpacked as lossless
      auto unpack_l12 = [&](const uint8_t* stored, int64_t panels, int64_t Kp, int Gm, auto&& unpack_plain) {
        const int64_t plain_bytes = panel_bytes(dt, WFormat::kLossless, 0, Kp, Gm);
        const int64_t stored_bytes = panel_bytes(dt, wf, 0, Kp, Gm);
        std::vector<uint16_t> plain(static_cast<size_t>(panels * plain_bytes / 2));
        for (int64_t p = 0; p < panels; ++p)
          l12_decompress_panel_portable(stored + p * stored_bytes, plain_bytes, plain.data() + p * plain_bytes / 2);
        unpack_plain(plain.data());
      };
      auto to = [&](void* base) { return static_cast<uint16_t*>(base) + gu_off; };
      if (gate || up) {
        unpack_l12(gu_src, h.In / kPanelN, h.Hk, G, [&](const uint16_t* pl) {
          if (gate && h.has_gate) unpack_matrix(pl, h.I, h.H, to(gate), h.Hk, h.kpack, G, 0);
          if (up) unpack_matrix(pl, h.I, h.H, to(up), h.Hk, h.kpack, G, G - 1);
        });
      }
      if (down && !h.up_only)
        unpack_l12(dn_src, h.Hn / kPanelN, h.Ik, 1,
                   [&](const uint16_t* pl) { unpack_matrix(pl, h.H, h.I, to(down), h.Ik, h.kpack, 1, 0); });
    } else if (wf != WFormat::kLossless) {
      auto at = [&](void* base) { return static_cast<uint8_t*>(base) + gu_off * esz; };
      if (gate && h.has_gate) dequant_matrix(gu_src, dt, h.I, h.H, at(gate), h.Hk, G, 0, wf, h.group);
      if (up) dequant_matrix(gu_src, dt, h.I, h.H, at(up), h.Hk, G, G - 1, wf, h.group);
      if (down && !h.up_only) dequant_matrix(dn_src, dt, h.H, h.I, at(down), h.Ik, 1, 0, wf, h.group);
    } else {
      auto unpack_expert = [&](auto elem) {  // element type by size only, as in pack()
        using El = decltype(elem);
        auto* gs = reinterpret_cast<const El*>(gu_src);
        if (gate && h.has_gate) unpack_matrix(gs, h.I, h.H, static_cast<El*>(gate) + gu_off, h.Hk, h.kpack, G, 0);
        if (up) unpack_matrix(gs, h.I, h.H, static_cast<El*>(up) + gu_off, h.Hk, h.kpack, G, G - 1);
        if (down && !h.up_only) unpack_matrix(reinterpret_cast<const El*>(dn_src), h.H, h.I, static_cast<El*>(down) + gu_off, h.Ik, h.kpack, 1, 0);
      };
      if (e16) unpack_expert(uint16_t{});
      else unpack_expert(uint32_t{});
    }
    for (int64_t i = 0; i < h.I; ++i) {
      if (gate_bias && bias_g_) store_elem(dt, gate_bias, e * h.I + i, bias_g_[e * h.In + i]);
      if (up_bias && bias_u_) store_elem(dt, up_bias, e * h.I + i, bias_u_[e * h.In + i]);
    }
    if (down_bias && bias_d_)
      for (int64_t c = 0; c < h.H; ++c) store_elem(dt, down_bias, e * h.H + c, bias_d_[e * h.Hn + c]);
  }
}

void PackedExperts::unpack_row_quant(void* codes, void* scales) const {
  const PackedHeader& h = hdr_;
  const WFormat wf = wformat();
  if (!h.up_only || (wf != WFormat::kInt8 && wf != WFormat::kInt4))
    throw std::invalid_argument(std::string("unpack_row_quant reads an up-only int8 or int4 block; this one is ") +
                                (h.up_only ? "" : "MoE experts in ") + wformat_name(wf));
  const int64_t N = h.I, K = h.H, group = h.group;
  if (wf == WFormat::kInt4 && K % group != 0)
    throw std::invalid_argument("unpack_row_quant: int4 rows of " + std::to_string(K) +
                                " values are not whole groups of " + std::to_string(group));
  const int G = h.has_gate ? 2 : 1;  // a paired block: output rows [0, I) matrix 0, [I, 2 I) matrix 1
  const int64_t pbytes = panel_bytes(dtype(), wf, group, h.Hk, G);
  for (int gi = 0; gi < G; ++gi) {
    for (int64_t p = 0; p * kPanelN < N; ++p) {
      const uint8_t* panel = gu_ + p * pbytes;
      for (int n = 0; n < kPanelN && p * kPanelN + n < N; ++n) {
        const int64_t row = gi * N + p * kPanelN + n;
        if (wf == WFormat::kInt8) {
          std::memcpy(static_cast<float*>(scales) + row, panel + gi * 64 + n * 4, 4);
          int8_t* q = static_cast<int8_t*>(codes) + row * K;
          for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int8_t>(panel[64 * G + q8_index(k, G, gi, n)]);
          continue;
        }
        uint8_t* q = static_cast<uint8_t*>(codes) + row * (K / 2);
        for (int64_t g = 0; g < K / group; ++g) {
          const uint8_t* c = panel + q4_codes_at(g, G, static_cast<int>(group));
          static_cast<float*>(scales)[row * (K / group) + g] =
              q4_scale(panel[q4_scales_at(g, G, static_cast<int>(group)) + gi * 16 + n], q4_factors(panel, gi)[n]);
          for (int64_t j = 0; j < group / 2; ++j)
            q[g * group / 2 + j] = static_cast<uint8_t>((int4_q(c, j, G, gi, n) + 8) |
                                                        (int4_q(c, group / 2 + j, G, gi, n) + 8) << 4);
        }
      }
    }
  }
}

const char* PackedExperts::forward(const void* x, int64_t T, const void* topk_idx, int idx_bits,
                                   const void* topk_w, int64_t K, void* out,
                                   const MoeParams& p) const {
  // Path choice needs the routing counts, so forward_with does the routing and calls back here
  // through `select` below; keep a single implementation.
  if (up_only()) throw std::invalid_argument("this block is a dense linear layer (up-only): run it with linear()");
  if (idx_bits != 32 && idx_bits != 64) throw std::invalid_argument("topk_idx must be int32 or int64");
  if (T < 0 || K < 0) throw std::invalid_argument("T and K must be >= 0");
  MoePath path = p.path;
  if (path == MoePath::kAuto) {
    path = T >= p.prefill_min_tokens ? MoePath::kPrefill : MoePath::kDecode;
  }
  const Selected sel = select_kernels(isa(), dtype(), path, wformat(), p.qdot);
  return forward_with(*this, sel.k, moe_kernel_name(isa(), dtype(), path, wformat(), p.qdot), x, T,
                      topk_idx, idx_bits, topk_w, K, out, p);
}

const char* PackedExperts::linear(const void* x, int64_t T, void* out, const MoeParams& p) const {
  if (!up_only()) throw std::invalid_argument("linear() runs up-only blocks (pack_linear); this block is MoE experts");
  if (T < 0) throw std::invalid_argument("T must be >= 0");
  MoeParams lp = p;
  lp.act = Act::kIdentity;
  lp.alpha = 1.0f;
  lp.gate_limit = lp.up_limit = lp.post_act_limit = INFINITY;
  lp.up_offset = 0.0f;
  lp.weight_on_input = false;
  lp.topk_w_dtype = DType::kF32;
  MoePath path = lp.path;
  if (path == MoePath::kAuto) path = T >= lp.prefill_min_tokens ? MoePath::kPrefill : MoePath::kDecode;
  // every token routed to the one expert with weight 1 (the weight is not read: no down pass)
  thread_local std::vector<int32_t> zeros;
  thread_local std::vector<float> ones;
  if (static_cast<int64_t>(zeros.size()) < T) {
    zeros.assign(static_cast<size_t>(T), 0);
    ones.assign(static_cast<size_t>(T), 1.0f);
  }
  const Selected sel = select_kernels(isa(), dtype(), path, wformat(), lp.qdot);
  return forward_with(*this, sel.k, moe_kernel_name(isa(), dtype(), path, wformat(), lp.qdot), x, T,
                      zeros.data(), 32, ones.data(), 1, out, lp);
}

namespace detail {

// f(r0, r1) over rows [0, n), split over the threads when the rows hold enough elements
// (n * per_row) to be worth a parallel region.
template <class F>
void for_rows(ThreadPool& pool, int nthreads, int64_t n, int64_t per_row, F&& f) {
  if (n * per_row < (1 << 16) || nthreads < 2) {
    f(int64_t{0}, n);
    return;
  }
  pool.run(nthreads, [&](int tid, int nt) {
    int64_t r0, r1;
    split_range(n, tid, nt, &r0, &r1);
    f(r0, r1);
  });
}

void* alloc_weights(size_t bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  if (bytes < 2 * kHuge) return aligned_alloc64(bytes);
  void* p = nullptr;
  if (posix_memalign(&p, kHuge, bytes) != 0) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
#ifdef HINA_PREFETCH_TUNING
  const char* thp = std::getenv("HINA_THP");  // tuning builds: 0 = no huge-page hint
  if (thp && std::atoi(thp) == 0) return p;
#endif
  // whole huge pages inside the block only; a hint: failure changes nothing
  madvise(p, bytes / kHuge * kHuge, MADV_HUGEPAGE);
#endif
  return p;
}

const char* forward_with(const PackedExperts& pe, const KernelImpl& kern, const char* name,
                         const void* x, int64_t T, const void* topk_idx, int idx_bits,
                         const void* topk_w, int64_t K, void* out, const MoeParams& p) {
  const PackedHeader& hd = pe.header();
  const DType dt = pe.dtype();
  const int64_t E = hd.E;
  if (idx_bits != 32 && idx_bits != 64) throw std::invalid_argument("topk_idx must be int32 or int64");
  if (T < 0 || K < 0) throw std::invalid_argument("T and K must be >= 0");
  if (p.num_threads < 0) throw std::invalid_argument("num_threads must be >= 0");
  if (p.prefill_min_tokens < 1) throw std::invalid_argument("prefill_min_tokens must be >= 1");
  if (T == 0) return name;
  if (!x || !out || (K > 0 && (!topk_idx || !topk_w))) throw std::invalid_argument("null pointer argument");
  // a prefill-sized call (PoolBackend::kMixed puts its regions on OpenMP's team)
  const ThreadPool::PrefillScope prefill(T >= kMixedTeamRows);

  Scratch& s = tls_scratch;
  // Routing metadata: rows grouped per expert, in token order inside an expert.
  if (idx_bits == 32) check_and_count(static_cast<const int32_t*>(topk_idx), T, K, E, s.counts);
  else check_and_count(static_cast<const int64_t*>(topk_idx), T, K, E, s.counts);
  s.offsets.assign(static_cast<size_t>(E) + 1, 0);
  s.active.clear();
  for (int64_t e = 0; e < E; ++e) {
    s.offsets[e + 1] = s.offsets[e] + s.counts[e];
    if (s.counts[e] > 0) s.active.push_back(static_cast<int32_t>(e));
  }
  const int64_t S = s.offsets[E];
  s.row_token.resize(static_cast<size_t>(S));
  s.row_w.resize(static_cast<size_t>(S));
  if (idx_bits == 32) fill_rows(static_cast<const int32_t*>(topk_idx), topk_w, p.topk_w_dtype, T, K, s);
  else fill_rows(static_cast<const int64_t*>(topk_idx), topk_w, p.topk_w_dtype, T, K, s);

  Layout L{dt, hd.kpack, hd.has_gate ? 2 : 1, hd.H, hd.I, hd.Hk, hd.In, hd.Ik, hd.Hn,
           pe.wformat(), hd.group};
  ActParams ap{p.act, p.alpha, p.gate_limit, p.up_limit, p.post_act_limit, p.up_offset};
  const int nthreads = p.num_threads > 0 ? p.num_threads : default_num_threads();
  ThreadPool& pool = ThreadPool::global();
  const int64_t H = hd.H, Hk = hd.Hk, Ik = hd.Ik, Hn = hd.Hn, In = hd.In;
  const size_t esz = dtype_size(dt);
  const bool woi = p.weight_on_input;

  // ---- x rows in the kernel's input format, zero-padded to Hk ----
  // fp32 kernels: one row per token (per routed row with weight_on_input, whose rows differ);
  // bf16 (AMX) kernels: one row per routed row, contiguous in grouped order (A tiles).
  const bool per_row = kern.x_bf16 || woi;
  const int64_t nx = per_row ? S : T;
  // Tile loads read 16 rows at the row stride: a stride that is a multiple of 512 bytes maps
  // the rows onto few L1 sets (4 KiB aliasing), so such strides get one extra cache line.
  auto padded = [](int64_t n, size_t esz) { return (n * static_cast<int64_t>(esz)) % 512 == 0 ? n + 64 / static_cast<int64_t>(esz) : n; };
  const int64_t xs = kern.x_bf16 ? padded(Hk, 2) : Hk;
  const size_t xrow_bytes = kern.qdot ? static_cast<size_t>(qrow_bytes(Hk))
                                      : static_cast<size_t>(xs) * (kern.x_bf16 ? 2 : 4);
  uint8_t* xbuf = static_cast<uint8_t*>(
      s.xbuf.get(xrow_bytes * static_cast<size_t>(nx + kern.row_slack)));
  if (kern.row_slack) std::memset(xbuf + xrow_bytes * nx, 0, xrow_bytes * kern.row_slack);
  auto prep_x = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = per_row ? s.row_token[r] : r;
      const float scale = woi ? s.row_w[r] : 1.0f;
      const uint8_t* src = static_cast<const uint8_t*>(x) + static_cast<size_t>(t * H) * esz;
      uint8_t* dst = xbuf + xrow_bytes * static_cast<size_t>(r);
      if (kern.x_bf16) {
        uint16_t* d = reinterpret_cast<uint16_t*>(dst);
        if (woi) {
          for (int64_t c = 0; c < H; ++c) d[c] = f32_to_bf16(scale * load_elem(dt, src, c));
        } else if (dt == DType::kBF16) {
          std::memcpy(d, src, static_cast<size_t>(H) * 2);
        } else {
          for (int64_t c = 0; c < H; ++c) d[c] = f32_to_bf16(load_elem(dt, src, c));
        }
        std::memset(d + H, 0, static_cast<size_t>(xs - H) * 2);
      } else {
        // integer-dot kernels: the fp32 row goes through a per-thread buffer into quant_act_row
        thread_local std::vector<float> qtmp;
        if (kern.qdot) qtmp.resize(static_cast<size_t>(Hk));
        float* d = kern.qdot ? qtmp.data() : reinterpret_cast<float*>(dst);
        if (woi) {
          for (int64_t c = 0; c < H; ++c) d[c] = round_to(dt, scale * load_elem(dt, src, c));
        } else {
          for (int64_t c = 0; c < H; ++c) d[c] = load_elem(dt, src, c);
        }
        std::memset(d + H, 0, static_cast<size_t>(Hk - H) * 4);
        if (kern.qdot) quant_act_row(d, Hk, dst);
      }
    }
  };
  for_rows(pool, nthreads, nx, H, prep_x);
  s.xrows.resize(static_cast<size_t>(S));
  for (int64_t r = 0; r < S; ++r)
    s.xrows[r] = xbuf + xrow_bytes * static_cast<size_t>(per_row ? r : s.row_token[r]);

  // ---- h rows [S][Ik]: kernels write [0, In); the k-padding [In, Ik) must read as zero ----
  // (a paired up-only block: rows of 2 In, its up half from In)
  const size_t hesz = kern.h_bf16 ? 2 : 4;
  const bool paired = hd.up_only && hd.has_gate;
  const int64_t hw = paired ? 2 * In : Ik;
  const int64_t hs = kern.h_bf16 ? padded(hw, 2) : hw;  // h row stride
  uint8_t* hbuf = static_cast<uint8_t*>(
      s.hbuf.get(hesz * static_cast<size_t>(hs) * static_cast<size_t>(S + kern.row_slack)));
  if (hs > In && !paired)  // (a paired block's kernels write its whole rows; no down pass reads them)
    for (int64_t r = 0; r < S; ++r)
      std::memset(hbuf + hesz * static_cast<size_t>(r * hs + In), 0, hesz * static_cast<size_t>(hs - In));
  if (kern.row_slack)
    std::memset(hbuf + hesz * static_cast<size_t>(S * hs), 0, hesz * static_cast<size_t>(kern.row_slack * hs));

  float* acc = static_cast<float*>(s.acc.get(sizeof(float) * static_cast<size_t>(T * Hn)));
  s.accrows.resize(static_cast<size_t>(S));
  s.row_wt.resize(static_cast<size_t>(S));
  for (int64_t r = 0; r < S; ++r) {
    s.accrows[r] = acc + s.row_token[r] * Hn;
    s.row_wt[r] = woi ? 1.0f : s.row_w[r];
  }

  // the step trace's parts of an experts' call (moe/step_trace.h; not of linear()'s up-only blocks)
  auto mark = [&](StepOp op) {
    if (!hd.up_only) lap(op);
  };
  mark(StepOp::kExpertsPrep);
  // Dynamic split (see the header comment): pieces of about kItemBytes, at most np / (2 x
  // threads) panels.
  const bool dyn = !p.static_split && nthreads > 1;
  const int64_t item_bytes = dynamic_item_bytes();
  auto chunk_of = [item_bytes, nthreads](int64_t np, int64_t panel_bytes) {
    const int64_t want = item_bytes > 0 ? item_bytes / panel_bytes : 8;
    const int64_t parts = 2 * static_cast<int64_t>(nthreads);
    return std::clamp<int64_t>(want, 1, std::max<int64_t>(1, (np + parts - 1) / parts));
  };

  // ---- region 1: gate/up + activation ----
  // Every job carries the first panel of the job its thread runs next (w_next); kernels that
  // prefetch it (KernelImpl::uses_w_next, AMX) get the dynamic split's next item claimed ahead.
  const int64_t gu_pb = gu_panel_bytes(L), dn_pb = down_panel_bytes(L);
  auto gu_panel = [&](int32_t e, int64_t p) {
    return static_cast<const uint8_t*>(pe.gate_up_expert(e)) + p * gu_pb;
  };
  auto gateup_expert = [&](int32_t e, int64_t p0, int64_t p1, const void* w_next) {
    const int64_t r0 = s.offsets[e];
    GateUpJob j;
    j.w = pe.gate_up_expert(e);
    j.bias_g = pe.bias_g() ? pe.bias_g() + e * In : nullptr;
    j.bias_u = pe.bias_u() ? pe.bias_u() + e * In : nullptr;
    j.p0 = p0;
    j.p1 = p1;
    j.x = s.xrows.data() + r0;
    j.x_stride = xs;
    j.nt = s.counts[e];
    j.h = hbuf + hesz * static_cast<size_t>(r0 * hs);
    j.h_stride = hs;
    j.L = &L;
    j.act = &ap;
    j.w_next = w_next;
    j.pair = paired ? In : 0;
    kern.gateup(j);
  };
  if (S > 0 && dyn) {
    const int64_t np = In / kPanelN, chunk = chunk_of(np, gu_pb), nchunks = (np + chunk - 1) / chunk;
    const int64_t items = nchunks * static_cast<int64_t>(s.active.size());
    auto item_expert = [&](int64_t it) { return s.active[static_cast<size_t>(it / nchunks)]; };
    std::atomic<int64_t> next{0};
    pool.run(nthreads, [&](int, int) {
      // kernels that prefetch w_next claim their next item before running the current one;
      // the others claim as they go (a thread then holds no item another could take)
      const bool ahead = kern.uses_w_next;
      for (int64_t it = next.fetch_add(1, std::memory_order_relaxed); it < items;) {
        const int64_t nx = ahead ? next.fetch_add(1, std::memory_order_relaxed) : items;
        const int64_t p0 = (it % nchunks) * chunk;
        gateup_expert(item_expert(it), p0, std::min(np, p0 + chunk),
                      nx < items ? gu_panel(item_expert(nx), (nx % nchunks) * chunk) : nullptr);
        it = ahead ? nx : next.fetch_add(1, std::memory_order_relaxed);
      }
    });
  } else if (S > 0) {
    pool.run(nthreads, [&](int tid, int n) {
      int64_t p0, p1;
      split_range(In / kPanelN, tid, n, &p0, &p1);
      if (p0 == p1) return;
      for (size_t a = 0; a < s.active.size(); ++a)
        gateup_expert(s.active[a], p0, p1, a + 1 < s.active.size() ? gu_panel(s.active[a + 1], p0) : nullptr);
    });
  }

  mark(StepOp::kExpertsGateUp);
  // ---- up-only blocks (linear layers, via linear()): h rows are the output ----
  // E = 1 and K = 1, so routed row r is token r; h already holds x W^T + b (identity act).
  if (hd.up_only) {
    const int64_t I = hd.I, halves = paired ? 2 : 1, N = halves * I;  // a paired block: [gate | up] rows
    if (kern.h_bf16 && dt != DType::kBF16) throw std::logic_error("bf16 h rows for a non-bf16 block");
    auto emit = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t half = 0; half < halves; ++half) {
          uint8_t* dst = static_cast<uint8_t*>(out) + static_cast<size_t>(r * N + half * I) * esz;
          const uint8_t* src = hbuf + hesz * static_cast<size_t>(r * hs + half * In);
          if (kern.h_bf16) std::memcpy(dst, src, static_cast<size_t>(I) * 2);  // rounded once, by the kernel
          else store_row(dt, dst, reinterpret_cast<const float*>(src), I);
        }
    };
    for_rows(pool, nthreads, S, N, emit);
    return name;
  }

  // ---- integer-dot kernels: h rows quantised for down (rows are independent) ----
  const int64_t hq_bytes = kern.qdot ? qrow_bytes(Ik) : 0;
  uint8_t* hq = kern.qdot ? static_cast<uint8_t*>(s.hqbuf.get(static_cast<size_t>(S * hq_bytes))) : nullptr;
  if (kern.qdot && S > 0) {
    auto quant_h = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        quant_act_row(reinterpret_cast<const float*>(hbuf) + r * hs, Ik, hq + r * hq_bytes);
    };
    for_rows(pool, nthreads, S, Ik, quant_h);
  }
  mark(StepOp::kExpertsQuantH);

  // ---- region 2: down + weight + scatter-add + conversion to x's dtype ----
  // H panels [p0, p1) of every token's output, all experts in ascending order.
  auto down_panels = [&](int64_t p0, int64_t p1) {
    const int64_t c0 = p0 * kPanelN, c1 = p1 * kPanelN;
    for (int64_t t = 0; t < T; ++t) std::memset(acc + t * Hn + c0, 0, sizeof(float) * (c1 - c0));
    for (size_t a = 0; a < s.active.size(); ++a) {
      const int32_t e = s.active[a];
      const int64_t r0 = s.offsets[e];
      DownJob j;
      j.w = pe.down_expert(e);
      j.bias = pe.bias_d() ? pe.bias_d() + e * Hn : nullptr;
      j.p0 = p0;
      j.p1 = p1;
      if (kern.qdot) {
        j.h = hq + r0 * hq_bytes;
        j.h_stride = hq_bytes;
      } else {
        j.h = hbuf + hesz * static_cast<size_t>(r0 * hs);
        j.h_stride = hs;
      }
      j.nt = s.counts[e];
      j.wt = s.row_wt.data() + r0;
      j.acc = s.accrows.data() + r0;
      j.L = &L;
      if (a + 1 < s.active.size())
        j.w_next = static_cast<const uint8_t*>(pe.down_expert(s.active[a + 1])) + p0 * dn_pb;
      kern.down(j);
    }
    const int64_t ce = std::min(c1, H);
    for (int64_t t = 0; t < T; ++t) {
      const float* a = acc + t * Hn;
      store_row(dt, static_cast<uint8_t*>(out) + static_cast<size_t>(t * H + c0) * esz, a + c0, ce - c0);
    }
  };
  if (dyn) {
    const int64_t np = Hn / kPanelN, chunk = chunk_of(np, dn_pb), items = (np + chunk - 1) / chunk;
    std::atomic<int64_t> next{0};
    pool.run(nthreads, [&](int, int) {
      for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;)
        down_panels(it * chunk, std::min(np, (it + 1) * chunk));
    });
  } else {
    pool.run(nthreads, [&](int tid, int n) {
      int64_t p0, p1;
      split_range(Hn / kPanelN, tid, n, &p0, &p1);
      if (p0 != p1) down_panels(p0, p1);
    });
  }
  mark(StepOp::kExpertsDown);
  return name;
}

}  // namespace detail
}  // namespace hina
