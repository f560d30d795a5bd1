// [NOTE] moe_prefill_bf16_avx512bf16: the prefill of bf16 models on AVX-512 CPUs that have the
// AVX512-BF16 dot product (vdpbf16ps) and no AMX (AMD Zen 4 and later, Intel Cooper Lake).
// Flags: the avx512 TU's flags + -mavx512bf16; called only when cpu_features() reports it
// (dispatch/select.cpp, tier `avx512`).
//
// Why: the plain AVX-512 kernel (moe_avx512.cpp) keeps x and h in fp32 and widens every weight
// pair with two integer ops before two FMAs. Prefill is compute-bound, and there it ran at the
// fp32 FMA peak; vdpbf16ps does a weight pair's two multiply-adds in one instruction on the
// packed pair as stored, so the same work takes half the arithmetic instructions and none of
// the widening.
// Numerics: the contract of the AMX kernels (KernelImpl::x_bf16 / h_bf16), so the generic AMX
// twin is this kernel's reference too: x rows are bf16 (a bf16 model's own activations, copied),
// gate/up accumulate in fp32, the activation runs in fp32 and h is rounded once to bf16, as the
// model's own bf16 matmuls would; down accumulates in fp32 into the fp32 output rows.
// vdpbf16ps treats bf16 denormals as zero (both operands) and flushes a denormal result, which
// the twin does not; outputs differ from it by that and by the summation order.
//
// Data layout (layout v1, as stored; a bf16 panel holds 16 columns x 2 k per 64 bytes, which is
// exactly vdpbf16ps' pair layout, so no repacking):
//   | array          | shape                          | read per k pair        |
//   |----------------|--------------------------------|------------------------|
//   | gate/up panel  | [Hk/2][G][16][2] bf16          | G zmm (gate, up)       |
//   | down panel     | [Ik/2][16][2] bf16             | one zmm per panel      |
//   | x rows         | bf16, row r at x[0] + r * x_stride, zero-padded to Hk |
//   | h rows         | bf16 at h_stride, zero beyond I (the driver pads)     |
// Register plan: one row's k pair is broadcast once (vpbroadcastd) and dotted with every weight
// zmm of the step. gate/up: up to 8 rows x G accumulators (16 zmm with a gate); down: up to 8
// rows x 2 panels (a pair of panels per pass, an odd last panel alone). Every accumulator is
// its own chain: with 8 or more independent vdpbf16ps in flight the dot product's latency
// hides behind its throughput.
// Loop order: panel (pair) outer, 8-row chunks inner, so a panel is read from memory once and
// re-read from L2 by the following chunks (as the plain kernel); the weight stream is software
// prefetched 2-4 KiB ahead (moe/prefetch.h) like the plain kernel's.
// Known limits: bf16 models only (fp32 / fp16 models keep the plain kernel: rounding their
// activations to bf16 would lose precision); decode stays on the plain kernel, which keeps x
// and h in fp32 and is bound by memory, not arithmetic.
#include <immintrin.h>

#include "kernels/avx512/vec_avx512.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {

constexpr int kRows = 8;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m512i pair_of(const uint16_t* row, int64_t k) {  // x[k], x[k+1] in every dword
  uint32_t v;
  __builtin_memcpy(&v, row + k, 4);
  return _mm512_set1_epi32(static_cast<int>(v));
}

// gate/up of NT rows against one panel: g[r], u[r] = 16 columns of x_r W^T.
template <bool Gated, int NT>
inline void gateup_block(const uint16_t* panel, int64_t Hk, const uint16_t* x, int64_t xs,
                         __m512* g, __m512* u) {
  constexpr int G = Gated ? 2 : 1;
  for (int r = 0; r < NT; ++r) g[r] = u[r] = _mm512_setzero_ps();
  const uint16_t* w = panel;
  for (int64_t k = 0; k < Hk; k += 2, w += G * 32) {
    pf::line(reinterpret_cast<const char*>(w) + pf::bytes());
    if (Gated) pf::line(reinterpret_cast<const char*>(w) + pf::bytes() + 64);
    const __m512bh wu = as_bh(_mm512_load_si512(w + (G - 1) * 32));
    __m512bh wg;
    if constexpr (Gated) wg = as_bh(_mm512_load_si512(w));
    for (int r = 0; r < NT; ++r) {
      const __m512bh xb = as_bh(pair_of(x + r * xs, k));
      u[r] = _mm512_dpbf16_ps(u[r], wu, xb);
      if constexpr (Gated) g[r] = _mm512_dpbf16_ps(g[r], wg, xb);
    }
  }
}

template <bool Gated, int NT>
inline void gateup_rows(const GateUpJob& j, const uint16_t* panel, int64_t r0, int64_t col0,
                        __m512 bg, __m512 bu, __mmask16 valid) {
  __m512 g[NT], u[NT];
  gateup_block<Gated, NT>(panel, j.L->Hk, static_cast<const uint16_t*>(j.x[0]) + r0 * j.x_stride,
                          j.x_stride, g, u);
  uint16_t* h = static_cast<uint16_t*>(j.h);
  for (int r = 0; r < NT; ++r) {
    const __m512 gv = Gated ? _mm512_add_ps(g[r], bg) : _mm512_setzero_ps();
    const __m512 hv = v512::h_vec(*j.act, Gated, gv, _mm512_add_ps(u[r], bu), valid);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + (r0 + r) * j.h_stride + col0), v512::cvt_bf16(hv));
  }
}

template <bool Gated>
void gateup_bf16dot(const GateUpJob& j) {
  pf::reload();
  const Layout& L = *j.L;
  const int64_t panel_elems = L.Hk * kPanelN * (Gated ? 2 : 1);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint16_t* panel = static_cast<const uint16_t*>(j.w) + p * panel_elems;
    const int64_t col0 = p * kPanelN;
    const __mmask16 valid = v512::valid_mask(col0, L.I);
    const __m512 bg = j.bias_g ? _mm512_load_ps(j.bias_g + col0) : _mm512_setzero_ps();
    const __m512 bu = j.bias_u ? _mm512_load_ps(j.bias_u + col0) : _mm512_setzero_ps();
    int64_t r0 = 0;
    for (; r0 + kRows <= j.nt; r0 += kRows) gateup_rows<Gated, kRows>(j, panel, r0, col0, bg, bu, valid);
    switch (j.nt - r0) {
      case 7: gateup_rows<Gated, 7>(j, panel, r0, col0, bg, bu, valid); break;
      case 6: gateup_rows<Gated, 6>(j, panel, r0, col0, bg, bu, valid); break;
      case 5: gateup_rows<Gated, 5>(j, panel, r0, col0, bg, bu, valid); break;
      case 4: gateup_rows<Gated, 4>(j, panel, r0, col0, bg, bu, valid); break;
      case 3: gateup_rows<Gated, 3>(j, panel, r0, col0, bg, bu, valid); break;
      case 2: gateup_rows<Gated, 2>(j, panel, r0, col0, bg, bu, valid); break;
      case 1: gateup_rows<Gated, 1>(j, panel, r0, col0, bg, bu, valid); break;
      default: break;
    }
  }
}

// down of NT rows against NP (1 or 2) adjacent panels; adds wt[r] * (y + b) into the acc rows.
template <int NP, int NT>
inline void down_rows(const DownJob& j, const uint16_t* panel, int64_t panel_elems, int64_t r0,
                      int64_t col0, const __m512* b) {
  const int64_t Ik = j.L->Ik, hs = j.h_stride;
  const uint16_t* h = static_cast<const uint16_t*>(j.h) + r0 * hs;
  __m512 a[NP][NT];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < NT; ++r) a[q][r] = _mm512_setzero_ps();
  const uint16_t* w0 = panel;
  const uint16_t* w1 = panel + panel_elems;
  for (int64_t k = 0; k < Ik; k += 2) {
    pf::line(reinterpret_cast<const char*>(w0 + k * 16) + pf::bytes());
    if (NP == 2) pf::line(reinterpret_cast<const char*>(w1 + k * 16) + pf::bytes());
    const __m512bh x0 = as_bh(_mm512_load_si512(w0 + k * 16));
    __m512bh x1;
    if constexpr (NP == 2) x1 = as_bh(_mm512_load_si512(w1 + k * 16));
    for (int r = 0; r < NT; ++r) {
      const __m512bh hb = as_bh(pair_of(h + r * hs, k));
      a[0][r] = _mm512_dpbf16_ps(a[0][r], x0, hb);
      if constexpr (NP == 2) a[1][r] = _mm512_dpbf16_ps(a[1][r], x1, hb);
    }
  }
  for (int r = 0; r < NT; ++r) {
    const __m512 wt = _mm512_set1_ps(j.wt[r0 + r]);
    float* acc = j.acc[r0 + r] + col0;
    for (int q = 0; q < NP; ++q) {
      float* dst = acc + q * kPanelN;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(wt, _mm512_add_ps(a[q][r], b[q]), _mm512_loadu_ps(dst)));
    }
  }
}

template <int NP>
void down_panels(const DownJob& j, const uint16_t* panel, int64_t panel_elems, int64_t col0) {
  __m512 b[NP];
  for (int q = 0; q < NP; ++q)
    b[q] = j.bias ? _mm512_load_ps(j.bias + col0 + q * kPanelN) : _mm512_setzero_ps();
  int64_t r0 = 0;
  for (; r0 + kRows <= j.nt; r0 += kRows) down_rows<NP, kRows>(j, panel, panel_elems, r0, col0, b);
  switch (j.nt - r0) {
    case 7: down_rows<NP, 7>(j, panel, panel_elems, r0, col0, b); break;
    case 6: down_rows<NP, 6>(j, panel, panel_elems, r0, col0, b); break;
    case 5: down_rows<NP, 5>(j, panel, panel_elems, r0, col0, b); break;
    case 4: down_rows<NP, 4>(j, panel, panel_elems, r0, col0, b); break;
    case 3: down_rows<NP, 3>(j, panel, panel_elems, r0, col0, b); break;
    case 2: down_rows<NP, 2>(j, panel, panel_elems, r0, col0, b); break;
    case 1: down_rows<NP, 1>(j, panel, panel_elems, r0, col0, b); break;
    default: break;
  }
}

void down_bf16dot(const DownJob& j) {
  pf::reload();
  const int64_t panel_elems = j.L->Ik * kPanelN;
  for (int64_t p = j.p0; p < j.p1; p += 2) {
    const uint16_t* panel = static_cast<const uint16_t*>(j.w) + p * panel_elems;
    if (p + 1 < j.p1) down_panels<2>(j, panel, panel_elems, p * kPanelN);
    else down_panels<1>(j, panel, panel_elems, p * kPanelN);
  }
}

void gateup_dispatch(const GateUpJob& j) {
  if (j.L->G == 2) gateup_bf16dot<true>(j);
  else gateup_bf16dot<false>(j);
}

}  // namespace

bool get_kernels_avx512bf16(DType dt, KernelImpl* k) {
  if (dt != DType::kBF16) return false;
  k->gateup = &gateup_dispatch;
  k->down = &down_bf16dot;
  k->x_bf16 = k->h_bf16 = true;
  k->row_slack = 0;
  k->uses_w_next = false;
  k->qdot = false;
  return true;
}

}  // namespace hina::detail
