// [NOTE] moe_decode_<fmt>_avx512 / moe_prefill_<fmt>_avx512 (fmt: f32, bf16, f16)
// Flags: -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c (exactly what tier `avx512`
// guarantees; no bf16/fp16/vnni instructions, so it runs on every AVX-512 F/BW/VL CPU).
//
// Data layout (layout v1, shared with every ISA):
//   | array          | shape                                      | bytes per 16-col step  |
//   |----------------|--------------------------------------------|------------------------|
//   | gate/up panel  | bf16 [Hk/2][G][16][2], f32/f16 [Hk][G][16] | G*64 (bf16, 2 k), G*64 / G*32 |
//   | down panel     | bf16 [Ik/2][16][2],    f32/f16 [Ik][16]    | 64                     |
//   | x rows         | [nt][Hk] fp32, zero-padded                 |                        |
//   | h rows         | [nt][Ik] fp32 (h is never rounded on this path)                     |
// Register plan (one panel = 16 output columns = one zmm per row):
//   bf16: one 64-byte load holds 16 columns x 2 k; even k = (v << 16), odd k = (v & 0xffff0000)
//   gives two fp32 zmm without a permute; each is FMA'd with a broadcast x[k] / x[k+1].
//   Accumulators: NT <= 4 rows x {gate, up} x {even, odd} = up to 16 zmm; the two halves keep
//   two independent FMA chains per output and are summed at the end.
//   f16: vcvtph2ps of a 32-byte load; f32: plain loads; k unrolled by 2 for two chains.
//   Loop order: panel outer, 4-row chunks inner, so a panel (Hk*64*G bytes) is read from DRAM
//   once and re-read from L2 by the following row chunks (prefill fallback).
// Software prefetch of the weight stream: moe/prefetch.h (a distance by CPU vendor, into L2).
// Activation, limits, bias, column masking and the routing-weighted scatter-add are fused
// (vectorised exp/erfc in vec_avx512.h; |rel err| of silu/gelu vs libm ~1e-7).
// Known limits: activations are kept in fp32 (no vdpbf16ps: that would round x/h to bf16);
// x rows are broadcast from memory (one load per k per row), fine for NT <= 4.
#include <immintrin.h>

#include "kernels/avx512/vec_avx512.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {

constexpr int kMaxRows = 4;
inline void prefetch(const void* p) { pf::line(p); }

inline void bf16_pair(const uint16_t* p, __m512& even, __m512& odd) {
  const __m512i v = _mm512_load_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

template <DType D>
inline __m512 load16(const void* base, int64_t elem_off) {
  if constexpr (D == DType::kF32) {
    return _mm512_load_ps(static_cast<const float*>(base) + elem_off);
  } else {
    return _mm512_cvtph_ps(
        _mm256_load_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + elem_off)));
  }
}

// Dot products of one panel with NT rows: gate (if Gated) and up, 16 columns each.
template <DType D, bool Gated, int NT>
inline void gateup_block(const void* panel, int64_t Hk, const float* const* x, __m512* g_out,
                         __m512* u_out) {
  constexpr int G = Gated ? 2 : 1;
  __m512 g0[NT], g1[NT], u0[NT], u1[NT];
  for (int r = 0; r < NT; ++r) g0[r] = g1[r] = u0[r] = u1[r] = _mm512_setzero_ps();
  if constexpr (D == DType::kBF16) {
    const uint16_t* w = static_cast<const uint16_t*>(panel);
    for (int64_t k = 0; k < Hk; k += 2, w += G * 32) {
      prefetch(reinterpret_cast<const char*>(w) + pf::bytes());
      if (Gated) prefetch(reinterpret_cast<const char*>(w) + pf::bytes() + 64);
      __m512 ue, uo, ge, go;
      bf16_pair(w + (G - 1) * 32, ue, uo);
      if constexpr (Gated) bf16_pair(w, ge, go);
      for (int r = 0; r < NT; ++r) {
        const __m512 x0 = _mm512_set1_ps(x[r][k]), x1 = _mm512_set1_ps(x[r][k + 1]);
        u0[r] = _mm512_fmadd_ps(ue, x0, u0[r]);
        u1[r] = _mm512_fmadd_ps(uo, x1, u1[r]);
        if constexpr (Gated) {
          g0[r] = _mm512_fmadd_ps(ge, x0, g0[r]);
          g1[r] = _mm512_fmadd_ps(go, x1, g1[r]);
        }
      }
    }
  } else {
    constexpr int64_t esz = D == DType::kF32 ? 4 : 2;
    const char* wb = static_cast<const char*>(panel);
    for (int64_t k = 0; k < Hk; k += 2) {
      prefetch(wb + (k * G * 16) * esz + pf::bytes());
      if (Gated || esz == 4) prefetch(wb + (k * G * 16) * esz + pf::bytes() + 64);
      const __m512 ua = load16<D>(panel, (k * G + G - 1) * 16);
      const __m512 ub = load16<D>(panel, ((k + 1) * G + G - 1) * 16);
      __m512 ga, gb;
      if constexpr (Gated) {
        ga = load16<D>(panel, (k * G) * 16);
        gb = load16<D>(panel, ((k + 1) * G) * 16);
      }
      for (int r = 0; r < NT; ++r) {
        const __m512 x0 = _mm512_set1_ps(x[r][k]), x1 = _mm512_set1_ps(x[r][k + 1]);
        u0[r] = _mm512_fmadd_ps(ua, x0, u0[r]);
        u1[r] = _mm512_fmadd_ps(ub, x1, u1[r]);
        if constexpr (Gated) {
          g0[r] = _mm512_fmadd_ps(ga, x0, g0[r]);
          g1[r] = _mm512_fmadd_ps(gb, x1, g1[r]);
        }
      }
    }
  }
  for (int r = 0; r < NT; ++r) {
    u_out[r] = _mm512_add_ps(u0[r], u1[r]);
    if constexpr (Gated) g_out[r] = _mm512_add_ps(g0[r], g1[r]);
  }
}

template <DType D, int NT>
inline void down_block(const void* panel, int64_t Ik, const float* h, int64_t hs, __m512* y) {
  __m512 a0[NT], a1[NT];
  for (int r = 0; r < NT; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  if constexpr (D == DType::kBF16) {
    const uint16_t* w = static_cast<const uint16_t*>(panel);
    for (int64_t k = 0; k < Ik; k += 2, w += 32) {
      prefetch(reinterpret_cast<const char*>(w) + pf::bytes());
      __m512 we, wo;
      bf16_pair(w, we, wo);
      for (int r = 0; r < NT; ++r) {
        a0[r] = _mm512_fmadd_ps(we, _mm512_set1_ps(h[r * hs + k]), a0[r]);
        a1[r] = _mm512_fmadd_ps(wo, _mm512_set1_ps(h[r * hs + k + 1]), a1[r]);
      }
    }
  } else {
    constexpr int64_t esz = D == DType::kF32 ? 4 : 2;
    const char* wb = static_cast<const char*>(panel);
    for (int64_t k = 0; k < Ik; k += 2) {
      prefetch(wb + k * 16 * esz + pf::bytes());
      if (esz == 4) prefetch(wb + k * 16 * esz + pf::bytes() + 64);
      const __m512 wa = load16<D>(panel, k * 16), wbv = load16<D>(panel, (k + 1) * 16);
      for (int r = 0; r < NT; ++r) {
        a0[r] = _mm512_fmadd_ps(wa, _mm512_set1_ps(h[r * hs + k]), a0[r]);
        a1[r] = _mm512_fmadd_ps(wbv, _mm512_set1_ps(h[r * hs + k + 1]), a1[r]);
      }
    }
  }
  for (int r = 0; r < NT; ++r) y[r] = _mm512_add_ps(a0[r], a1[r]);
}

template <DType D, bool Gated, int NT>
inline void gateup_rows(const GateUpJob& j, const void* panel, int64_t r0, int64_t col0,
                        __m512 bg, __m512 bu, __mmask16 valid) {
  const float* xr[NT];
  for (int r = 0; r < NT; ++r) xr[r] = static_cast<const float*>(j.x[r0 + r]);
  __m512 g[NT], u[NT];
  for (int r = 0; r < NT; ++r) g[r] = _mm512_setzero_ps();
  gateup_block<D, Gated, NT>(panel, j.L->Hk, xr, g, u);
  float* h = static_cast<float*>(j.h);
  for (int r = 0; r < NT; ++r) {
    const __m512 hv = v512::h_vec(*j.act, Gated, _mm512_add_ps(g[r], bg),
                                  _mm512_add_ps(u[r], bu), valid);
    _mm512_store_ps(h + (r0 + r) * j.h_stride + col0, hv);
  }
}

template <DType D, bool Gated>
void gateup_avx512(const GateUpJob& j) {
  const Layout& L = *j.L;
  constexpr int G = Gated ? 2 : 1;
  const int64_t panel_bytes = L.Hk * kPanelN * G * (D == DType::kF32 ? 4 : 2);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const void* panel = static_cast<const char*>(j.w) + p * panel_bytes;
    const int64_t col0 = p * kPanelN;
    const __mmask16 valid = v512::valid_mask(col0, L.I);
    const __m512 bg = j.bias_g ? _mm512_load_ps(j.bias_g + col0) : _mm512_setzero_ps();
    const __m512 bu = j.bias_u ? _mm512_load_ps(j.bias_u + col0) : _mm512_setzero_ps();
    int64_t r0 = 0;
    for (; r0 + kMaxRows <= j.nt; r0 += kMaxRows) gateup_rows<D, Gated, 4>(j, panel, r0, col0, bg, bu, valid);
    switch (j.nt - r0) {
      case 3: gateup_rows<D, Gated, 3>(j, panel, r0, col0, bg, bu, valid); break;
      case 2: gateup_rows<D, Gated, 2>(j, panel, r0, col0, bg, bu, valid); break;
      case 1: gateup_rows<D, Gated, 1>(j, panel, r0, col0, bg, bu, valid); break;
      default: break;
    }
  }
}

template <DType D, int NT>
inline void down_rows(const DownJob& j, const void* panel, int64_t r0, int64_t col0, __m512 b) {
  __m512 y[NT];
  down_block<D, NT>(panel, j.L->Ik, static_cast<const float*>(j.h) + r0 * j.h_stride, j.h_stride, y);
  for (int r = 0; r < NT; ++r) {
    float* a = j.acc[r0 + r] + col0;
    _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(j.wt[r0 + r]), _mm512_add_ps(y[r], b),
                                        _mm512_loadu_ps(a)));
  }
}

template <DType D>
void down_avx512(const DownJob& j) {
  pf::reload();
  const Layout& L = *j.L;
  const int64_t panel_bytes = L.Ik * kPanelN * (D == DType::kF32 ? 4 : 2);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const void* panel = static_cast<const char*>(j.w) + p * panel_bytes;
    const int64_t col0 = p * kPanelN;
    const __m512 b = j.bias ? _mm512_load_ps(j.bias + col0) : _mm512_setzero_ps();
    int64_t r0 = 0;
    for (; r0 + kMaxRows <= j.nt; r0 += kMaxRows) down_rows<D, 4>(j, panel, r0, col0, b);
    switch (j.nt - r0) {
      case 3: down_rows<D, 3>(j, panel, r0, col0, b); break;
      case 2: down_rows<D, 2>(j, panel, r0, col0, b); break;
      case 1: down_rows<D, 1>(j, panel, r0, col0, b); break;
      default: break;
    }
  }
}

template <DType D>
void gateup_dispatch(const GateUpJob& j) {
  pf::reload();
  if (j.L->G == 2) gateup_avx512<D, true>(j);
  else gateup_avx512<D, false>(j);
}

}  // namespace

bool get_kernels_avx512(DType dt, KernelImpl* k) {
  k->x_bf16 = k->h_bf16 = false;
  k->row_slack = 0;
  switch (dt) {
    case DType::kF32: k->gateup = &gateup_dispatch<DType::kF32>; k->down = &down_avx512<DType::kF32>; return true;
    case DType::kBF16: k->gateup = &gateup_dispatch<DType::kBF16>; k->down = &down_avx512<DType::kBF16>; return true;
    case DType::kF16: k->gateup = &gateup_dispatch<DType::kF16>; k->down = &down_avx512<DType::kF16>; return true;
  }
  return false;
}

}  // namespace hina::detail
