// The MoE driver: packing, routing metadata, kernel dispatch, threading. Compiled at the
// baseline flags; only calls into an ISA translation unit after runtime dispatch.
//
// One forward = two parallel regions on the library's pool:
//   1. gate/up + activation: every thread owns a contiguous range of I panels and runs it for
//      every active expert, so each thread streams its own slice of each expert's weights;
//   2. down + routing weight + scatter-add + output conversion: every thread owns a range of H
//      panels of the fp32 accumulator, so no two threads ever add into the same element and the
//      sum over experts runs in ascending expert order (deterministic for any thread count).
// The tiled (x_bf16, AMX) prefill kernels split both regions dynamically instead: threads claim
// work items from a shared counter (region 1: (active expert, chunk of <= 8 I panels), expert-
// major; region 2: chunks of <= 8 H panels, each run over all experts in ascending order), so a
// thread that runs slower (memory contention, a descheduled vCPU) ends up with less of the work.
// Every output element is still produced by one item in one fixed order: results do not depend
// on the split. The FMA-tier kernels (decode and prefill) keep the static split.
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "hina_moe/moe.h"
#include "hina_moe/thread_pool.h"
#include "moe/kernel_api.h"

namespace hina {

using namespace detail;

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
const char* path_name(MoePath path) {
  switch (path) {
    case MoePath::kAuto: return "auto";
    case MoePath::kDecode: return "decode";
    case MoePath::kPrefill: return "prefill";
  }
  return "unknown";
}

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

// Which kernels run for (tier, dtype, concrete path), and under which name.
struct Selected {
  KernelImpl k;
  Isa kernel_isa;
};

Selected select_kernels(Isa tier, DType dt, MoePath path) {
  Selected s{};
  bool ok = false;
  if (tier == Isa::kAmx && path == MoePath::kPrefill && dt == DType::kBF16) {
    ok = get_kernels_amx(dt, &s.k);
    s.kernel_isa = Isa::kAmx;
  }
  if (!ok && (tier == Isa::kAmx || tier == Isa::kAvx512)) {
    ok = get_kernels_avx512(dt, &s.k);
    s.kernel_isa = Isa::kAvx512;
  }
  if (!ok && tier == Isa::kAvx2) {
    ok = get_kernels_avx2(dt, &s.k);
    s.kernel_isa = Isa::kAvx2;
  }
  if (!ok) {
    get_kernels_generic(dt, false, &s.k);
    s.kernel_isa = Isa::kGeneric;
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

void* aligned_alloc64(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, bytes < 64 ? 64 : bytes) != 0) throw std::bad_alloc();
  return p;
}

// Grow-only 64-byte aligned scratch.
struct AlignedBuf {
  void* p = nullptr;
  size_t cap = 0;
  ~AlignedBuf() { std::free(p); }
  void* get(size_t bytes) {
    if (bytes > cap) {
      std::free(p);
      p = aligned_alloc64(bytes);
      cap = bytes;
    }
    return p;
  }
};

struct Scratch {
  AlignedBuf xbuf, hbuf, acc;
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
void fill_rows(const IdxT* idx, const float* topk_w, int64_t T, int64_t K, Scratch& s) {
  s.cursor.assign(s.offsets.begin(), s.offsets.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = static_cast<int64_t>(idx[t * K + k]);
      if (e < 0) continue;
      const int64_t r = s.cursor[static_cast<size_t>(e)]++;
      s.row_token[static_cast<size_t>(r)] = static_cast<int32_t>(t);
      s.row_w[static_cast<size_t>(r)] = topk_w[t * K + k];
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

const char* moe_kernel_name(Isa isa, DType dt, MoePath path) {
  // Names are `<op>_<format>_<isa>`; built once.
  static std::vector<std::string>* table = [] {
    auto* t = new std::vector<std::string>(4 * 3 * 2);
    for (int i = 0; i < 4; ++i)
      for (int d = 0; d < 3; ++d)
        for (int p = 0; p < 2; ++p)
          (*t)[(i * 3 + d) * 2 + p] = std::string(p ? "moe_prefill_" : "moe_decode_") +
                                      dtype_short(static_cast<DType>(d)) + "_" +
                                      isa_name(static_cast<Isa>(i));
    return t;
  }();
  if (path == MoePath::kAuto) path = MoePath::kDecode;
  const Isa k = select_kernels(isa, dt, path).kernel_isa;
  return (*table)[(static_cast<int>(k) * 3 + static_cast<int>(dt)) * 2 +
                  (path == MoePath::kPrefill ? 1 : 0)]
      .c_str();
}

PackedExperts::~PackedExperts() { std::free(mem_); }

const void* PackedExperts::gate_up_expert(int64_t e) const {
  return gu_ + static_cast<size_t>(e) * gu_expert_bytes_;
}
const void* PackedExperts::down_expert(int64_t e) const {
  return down_ + static_cast<size_t>(e) * down_expert_bytes_;
}

std::unique_ptr<PackedExperts> PackedExperts::pack(const ExpertWeights& w, Isa isa,
                                                   int num_threads) {
  if (w.E < 1 || w.H < 1 || w.I < 1) {
    throw std::invalid_argument("experts need E, H, I >= 1 (got E=" + std::to_string(w.E) +
                                ", H=" + std::to_string(w.H) + ", I=" + std::to_string(w.I) + ")");
  }
  if (!w.up || !w.down) throw std::invalid_argument("up and down weights are required");
  if (w.dtype != DType::kF32 && w.dtype != DType::kBF16 && w.dtype != DType::kF16) {
    throw std::invalid_argument("unsupported weight dtype");
  }
  if (isa == Isa::kNeon) throw std::invalid_argument("isa 'neon' has no MoE kernels yet");
  if (!isa_supported(cpu_features(), isa)) {
    throw std::invalid_argument(std::string("isa '") + isa_name(isa) +
                                "' is not supported on this machine (" + cpu_summary() + ")");
  }

  std::unique_ptr<PackedExperts> pe(new PackedExperts());
  PackedHeader& h = pe->hdr_;
  h.dtype = static_cast<uint8_t>(w.dtype);
  h.isa = static_cast<uint8_t>(isa);
  h.kpack = w.dtype == DType::kBF16 ? 2 : 1;
  h.has_gate = w.gate != nullptr;
  h.E = w.E;
  h.H = w.H;
  h.I = w.I;
  h.Hk = round_up(w.H, kKAlign);
  h.In = round_up(w.I, kPanelN);
  h.Ik = round_up(w.I, kKAlign);
  h.Hn = round_up(w.H, kPanelN);
  const int G = h.has_gate ? 2 : 1;
  const size_t esz = dtype_size(w.dtype);

  auto a64 = [](size_t b) { return static_cast<size_t>(round_up(static_cast<int64_t>(b), 64)); };
  pe->gu_expert_bytes_ = a64(static_cast<size_t>(h.In * h.Hk * G) * esz);
  pe->down_expert_bytes_ = a64(static_cast<size_t>(h.Hn * h.Ik) * esz);
  const size_t gu_bytes = pe->gu_expert_bytes_ * static_cast<size_t>(w.E);
  const size_t down_bytes = pe->down_expert_bytes_ * static_cast<size_t>(w.E);
  const size_t bg_bytes = w.gate_bias ? a64(sizeof(float) * static_cast<size_t>(w.E * h.In)) : 0;
  const size_t bu_bytes = w.up_bias ? a64(sizeof(float) * static_cast<size_t>(w.E * h.In)) : 0;
  const size_t bd_bytes = w.down_bias ? a64(sizeof(float) * static_cast<size_t>(w.E * h.Hn)) : 0;
  pe->nbytes_ = gu_bytes + down_bytes + bg_bytes + bu_bytes + bd_bytes;
  pe->mem_ = aligned_alloc64(pe->nbytes_);
  uint8_t* base = static_cast<uint8_t*>(pe->mem_);
  pe->gu_ = base;
  pe->down_ = base + gu_bytes;
  uint8_t* bias_base = base + gu_bytes + down_bytes;
  if (w.gate_bias) { pe->bias_g_ = reinterpret_cast<float*>(bias_base); bias_base += bg_bytes; }
  if (w.up_bias) { pe->bias_u_ = reinterpret_cast<float*>(bias_base); bias_base += bu_bytes; }
  if (w.down_bias) { pe->bias_d_ = reinterpret_cast<float*>(bias_base); }

  PackedExperts* raw = pe.get();
  const int nth = num_threads > 0 ? num_threads : default_num_threads();
  ThreadPool::global().run(std::min<int64_t>(nth, w.E), [&](int tid, int n) {
    int64_t e0, e1;
    split_range(w.E, tid, n, &e0, &e1);
    for (int64_t e = e0; e < e1; ++e) {
      const size_t gu_off = static_cast<size_t>(e * w.I * w.H);
      const size_t dn_off = static_cast<size_t>(e * w.H * w.I);
      uint8_t* gu_dst = raw->gu_ + static_cast<size_t>(e) * raw->gu_expert_bytes_;
      uint8_t* dn_dst = raw->down_ + static_cast<size_t>(e) * raw->down_expert_bytes_;
      // Packing only moves elements, so the element type is just its size (bf16/fp16 or fp32).
      auto pack_expert = [&](auto elem) {
        using El = decltype(elem);
        if (w.gate)
          pack_matrix(static_cast<const El*>(w.gate) + gu_off, w.I, w.H,
                      reinterpret_cast<El*>(gu_dst), h.In, h.Hk, h.kpack, G, 0);
        pack_matrix(static_cast<const El*>(w.up) + gu_off, w.I, w.H,
                    reinterpret_cast<El*>(gu_dst), h.In, h.Hk, h.kpack, G, G - 1);
        pack_matrix(static_cast<const El*>(w.down) + dn_off, w.H, w.I,
                    reinterpret_cast<El*>(dn_dst), h.Hn, h.Ik, h.kpack, 1, 0);
      };
      if (esz == 2) pack_expert(uint16_t{});
      else pack_expert(uint32_t{});
      for (int64_t i = 0; i < h.In; ++i) {
        if (raw->bias_g_)
          raw->bias_g_[e * h.In + i] = i < w.I ? load_elem(w.dtype, w.gate_bias, e * w.I + i) : 0.f;
        if (raw->bias_u_)
          raw->bias_u_[e * h.In + i] = i < w.I ? load_elem(w.dtype, w.up_bias, e * w.I + i) : 0.f;
      }
      if (raw->bias_d_)
        for (int64_t c = 0; c < h.Hn; ++c)
          raw->bias_d_[e * h.Hn + c] = c < w.H ? load_elem(w.dtype, w.down_bias, e * w.H + c) : 0.f;
    }
  });
  return pe;
}

void PackedExperts::unpack(void* gate, void* up, void* down, void* gate_bias, void* up_bias,
                           void* down_bias) const {
  const PackedHeader& h = hdr_;
  const int G = h.has_gate ? 2 : 1;
  const DType dt = dtype();
  const bool e16 = dtype_size(dt) == 2;
  for (int64_t e = 0; e < h.E; ++e) {
    const size_t gu_off = static_cast<size_t>(e * h.I * h.H);
    const uint8_t* gu_src = gu_ + static_cast<size_t>(e) * gu_expert_bytes_;
    const uint8_t* dn_src = down_ + static_cast<size_t>(e) * down_expert_bytes_;
    auto unpack_expert = [&](auto elem) {  // element type by size only, as in pack()
      using El = decltype(elem);
      auto* gs = reinterpret_cast<const El*>(gu_src);
      if (gate && h.has_gate) unpack_matrix(gs, h.I, h.H, static_cast<El*>(gate) + gu_off, h.Hk, h.kpack, G, 0);
      if (up) unpack_matrix(gs, h.I, h.H, static_cast<El*>(up) + gu_off, h.Hk, h.kpack, G, G - 1);
      if (down) unpack_matrix(reinterpret_cast<const El*>(dn_src), h.H, h.I, static_cast<El*>(down) + gu_off, h.Ik, h.kpack, 1, 0);
    };
    if (e16) unpack_expert(uint16_t{});
    else unpack_expert(uint32_t{});
    for (int64_t i = 0; i < h.I; ++i) {
      if (gate_bias && bias_g_) store_elem(dt, gate_bias, e * h.I + i, bias_g_[e * h.In + i]);
      if (up_bias && bias_u_) store_elem(dt, up_bias, e * h.I + i, bias_u_[e * h.In + i]);
    }
    if (down_bias && bias_d_)
      for (int64_t c = 0; c < h.H; ++c) store_elem(dt, down_bias, e * h.H + c, bias_d_[e * h.Hn + c]);
  }
}

const char* PackedExperts::forward(const void* x, int64_t T, const void* topk_idx, int idx_bits,
                                   const float* topk_w, int64_t K, void* out,
                                   const MoeParams& p) const {
  // Path choice needs the routing counts, so forward_with does the routing and calls back here
  // through `select` below; keep a single implementation.
  if (idx_bits != 32 && idx_bits != 64) throw std::invalid_argument("topk_idx must be int32 or int64");
  if (T < 0 || K < 0) throw std::invalid_argument("T and K must be >= 0");
  MoePath path = p.path;
  if (path == MoePath::kAuto) {
    path = T >= p.prefill_min_tokens ? MoePath::kPrefill : MoePath::kDecode;
  }
  const Selected sel = select_kernels(isa(), dtype(), path);
  return forward_with(*this, sel.k, moe_kernel_name(isa(), dtype(), path), x, T, topk_idx,
                      idx_bits, topk_w, K, out, p);
}

namespace detail {

const char* forward_with(const PackedExperts& pe, const KernelImpl& kern, const char* name,
                         const void* x, int64_t T, const void* topk_idx, int idx_bits,
                         const float* topk_w, int64_t K, void* out, const MoeParams& p) {
  const PackedHeader& hd = pe.header();
  const DType dt = pe.dtype();
  const int64_t E = hd.E;
  if (idx_bits != 32 && idx_bits != 64) throw std::invalid_argument("topk_idx must be int32 or int64");
  if (T < 0 || K < 0) throw std::invalid_argument("T and K must be >= 0");
  if (p.num_threads < 0) throw std::invalid_argument("num_threads must be >= 0");
  if (p.prefill_min_tokens < 1) throw std::invalid_argument("prefill_min_tokens must be >= 1");
  if (T == 0) return name;
  if (!x || !out || (K > 0 && (!topk_idx || !topk_w))) throw std::invalid_argument("null pointer argument");
  if (kern.x_bf16 && dt != DType::kBF16) throw std::invalid_argument("kernel needs bf16 weights");

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
  if (idx_bits == 32) fill_rows(static_cast<const int32_t*>(topk_idx), topk_w, T, K, s);
  else fill_rows(static_cast<const int64_t*>(topk_idx), topk_w, T, K, s);

  Layout L{dt, hd.kpack, hd.has_gate ? 2 : 1, hd.H, hd.I, hd.Hk, hd.In, hd.Ik, hd.Hn};
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
  const size_t xrow_bytes = static_cast<size_t>(xs) * (kern.x_bf16 ? 2 : 4);
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
        } else {
          std::memcpy(d, src, static_cast<size_t>(H) * 2);
        }
        std::memset(d + H, 0, static_cast<size_t>(xs - H) * 2);
      } else {
        float* d = reinterpret_cast<float*>(dst);
        if (woi) {
          for (int64_t c = 0; c < H; ++c) d[c] = round_to(dt, scale * load_elem(dt, src, c));
        } else {
          for (int64_t c = 0; c < H; ++c) d[c] = load_elem(dt, src, c);
        }
        std::memset(d + H, 0, static_cast<size_t>(Hk - H) * 4);
      }
    }
  };
  if (nx * H >= (1 << 16) && nthreads > 1) {
    pool.run(nthreads, [&](int tid, int n) {
      int64_t r0, r1;
      split_range(nx, tid, n, &r0, &r1);
      prep_x(r0, r1);
    });
  } else {
    prep_x(0, nx);
  }
  s.xrows.resize(static_cast<size_t>(S));
  for (int64_t r = 0; r < S; ++r)
    s.xrows[r] = xbuf + xrow_bytes * static_cast<size_t>(per_row ? r : s.row_token[r]);

  // ---- h rows [S][Ik]: kernels write [0, In); the k-padding [In, Ik) must read as zero ----
  const size_t hesz = kern.h_bf16 ? 2 : 4;
  const int64_t hs = kern.h_bf16 ? padded(Ik, 2) : Ik;  // h row stride
  uint8_t* hbuf = static_cast<uint8_t*>(
      s.hbuf.get(hesz * static_cast<size_t>(hs) * static_cast<size_t>(S + kern.row_slack)));
  if (hs > In)
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

  // Dynamic split for the tiled kernels (see the header comment); items of <= 8 panels.
  const bool dyn = kern.x_bf16 && nthreads > 1;
  auto chunk_of = [](int64_t np) { return std::max<int64_t>(1, std::min<int64_t>(8, (np + 3) / 4)); };

  // ---- region 1: gate/up + activation ----
  auto gateup_expert = [&](int32_t e, int64_t p0, int64_t p1) {
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
    kern.gateup(j);
  };
  if (S > 0 && dyn) {
    const int64_t np = In / kPanelN, chunk = chunk_of(np), nchunks = (np + chunk - 1) / chunk;
    const int64_t items = nchunks * static_cast<int64_t>(s.active.size());
    std::atomic<int64_t> next{0};
    pool.run(nthreads, [&](int, int) {
      for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        const int64_t p0 = (it % nchunks) * chunk;
        gateup_expert(s.active[static_cast<size_t>(it / nchunks)], p0, std::min(np, p0 + chunk));
      }
    });
  } else if (S > 0) {
    pool.run(nthreads, [&](int tid, int n) {
      int64_t p0, p1;
      split_range(In / kPanelN, tid, n, &p0, &p1);
      if (p0 == p1) return;
      for (int32_t e : s.active) gateup_expert(e, p0, p1);
    });
  }

  // ---- region 2: down + weight + scatter-add + conversion to x's dtype ----
  // H panels [p0, p1) of every token's output, all experts in ascending order.
  auto down_panels = [&](int64_t p0, int64_t p1) {
    const int64_t c0 = p0 * kPanelN, c1 = p1 * kPanelN;
    for (int64_t t = 0; t < T; ++t) std::memset(acc + t * Hn + c0, 0, sizeof(float) * (c1 - c0));
    for (int32_t e : s.active) {
      const int64_t r0 = s.offsets[e];
      DownJob j;
      j.w = pe.down_expert(e);
      j.bias = pe.bias_d() ? pe.bias_d() + e * Hn : nullptr;
      j.p0 = p0;
      j.p1 = p1;
      j.h = hbuf + hesz * static_cast<size_t>(r0 * hs);
      j.h_stride = hs;
      j.nt = s.counts[e];
      j.wt = s.row_wt.data() + r0;
      j.acc = s.accrows.data() + r0;
      j.L = &L;
      kern.down(j);
    }
    const int64_t ce = std::min(c1, H);
    for (int64_t t = 0; t < T; ++t) {
      const float* a = acc + t * Hn;
      if (dt == DType::kF32) {
        std::memcpy(static_cast<float*>(out) + t * H + c0, a + c0, sizeof(float) * (ce - c0));
      } else {
        for (int64_t c = c0; c < ce; ++c) store_elem(dt, out, t * H + c, a[c]);
      }
    }
  };
  if (dyn) {
    const int64_t np = Hn / kPanelN, chunk = chunk_of(np), items = (np + chunk - 1) / chunk;
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
  return name;
}

}  // namespace detail
}  // namespace hina
