// The experts' codecs outside the kernels: the integer-dot kernels' activation quantisation, and
// lossless12's panel compression and portable decompression, with the wrapper that runs a tier's
// plain bf16 kernels on decompressed panels. Baseline flags with -ffp-contract=off (the portable
// build of moe/quant_panel.h's lane-wise code).
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
#include "dispatch/select.h"
#include "moe/quant_panel.h"

namespace hina {

using namespace detail;

namespace detail {

// The activation quantisation of the integer-dot kernels (experts.h): the portable build of
// moe/quant_panel.h's lane-wise code here (no FMA contraction in this file), the AVX-512 / AVX2
// builds where the CPU has them (same bytes: tested).
void quant_act_row_portable(const float* x, int64_t Kp, uint8_t* row) { qp::quant_act_row<4>(x, Kp, row); }

void quant_act_row(const float* x, int64_t Kp, uint8_t* row) {
#if defined(HINA_HAVE_X86_KERNELS)
  const int best = quant_act_build();
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

namespace detail {
namespace {

// ---- lossless12 on every tier and path: the tier's plain bf16 kernels on decompressed panels ----
// Per job, its panels are decompressed a few at a time into a per-thread buffer, and the plain
// kernel runs on that buffer as a job of its own: panels [0, n) there, with the output columns
// (h, biases, acc rows, and the I / H limits of the column masks) shifted to the chunk's first
// column. The plain kernel reads the same words as it would from a lossless block, so the
// outputs are its bits.
bool get_plain_bf16(Plain pl, KernelImpl* k) {
  switch (pl) {
    case Plain::kGeneric: return get_kernels_generic(DType::kBF16, false, k);
    case Plain::kAvx2: return get_kernels_avx2(DType::kBF16, k);
    case Plain::kAvx512: return get_kernels_avx512(DType::kBF16, k);
    case Plain::kAvx512Bf16: return get_kernels_avx512bf16(DType::kBF16, k);
    case Plain::kAmx: return amx_kernels(DType::kBF16, k);
    case Plain::kNeon: return neon_kernels(DType::kBF16, k);
    case Plain::kNeonBf16: return neonbf16_kernels(DType::kBF16, k);
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

}  // namespace

bool l12_wrapped_kernels(Plain p, KernelImpl* k) {
  switch (p) {
    case Plain::kGeneric: return wrapped_l12<Plain::kGeneric>(k);
    case Plain::kAvx2: return wrapped_l12<Plain::kAvx2>(k);
    case Plain::kAvx512: return wrapped_l12<Plain::kAvx512>(k);
    case Plain::kAvx512Bf16: return wrapped_l12<Plain::kAvx512Bf16>(k);
    case Plain::kAmx: return wrapped_l12<Plain::kAmx>(k);
    case Plain::kNeon: return wrapped_l12<Plain::kNeon>(k);
    case Plain::kNeonBf16: return wrapped_l12<Plain::kNeonBf16>(k);
  }
  return false;
}

}  // namespace detail
}  // namespace hina
