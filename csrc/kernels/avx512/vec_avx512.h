// AVX-512 helpers shared by the avx512 and amx translation units (both compiled with at least
// -mavx512f -mavx512bw -mavx512vl). Only include from those TUs.
#pragma once

#include <immintrin.h>

#include "moe/kernel_api.h"

namespace hina::detail::v512 {

// e^x, |rel err| ~ 2 ulp on [-87, 88]; clamps outside (e^-87 ~ 0, e^88 ~ 1.6e38: enough for
// the sigmoid-style uses below, where only 1 + e^x matters).
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(act_poly::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(act_poly::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(act_poly::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(act_poly::kExp[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(act_poly::kExp[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// z / (1 + e^(-s z)): silu (s = 1), sigmoid_alpha (s = alpha), gelu_tanh via z*sigmoid(2y).
static inline __m512 z_sigmoid(__m512 z, __m512 sz) {
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), sz));
  return _mm512_div_ps(z, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// gelu (erf form) through erfc with relative accuracy everywhere (Numerical Recipes erfcc,
// fractional error < 1.2e-7), so the small negative tail keeps its relative precision.
static inline __m512 gelu_erf(__m512 z) {
  const __m512 w = _mm512_mul_ps(_mm512_abs_ps(z), _mm512_set1_ps(0.70710678118654752f));
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                 _mm512_fmadd_ps(_mm512_set1_ps(0.5f), w, _mm512_set1_ps(1.0f)));
  __m512 p = _mm512_set1_ps(act_poly::kErfc[0]);
  for (int i = 1; i < 10; ++i) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(act_poly::kErfc[i]));
  p = _mm512_fnmadd_ps(w, w, p);  // -w^2 + poly
  const __m512 erfc = _mm512_mul_ps(t, exp_ps(p));
  const __mmask16 pos = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 one_plus_erf = _mm512_mask_sub_ps(erfc, pos, _mm512_set1_ps(2.0f), erfc);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), z), one_plus_erf);
}

static inline __m512 act(const ActParams& a, __m512 z) {
  switch (a.act) {
    case Act::kSilu: return z_sigmoid(z, z);
    case Act::kGelu: return gelu_erf(z);
    case Act::kGeluTanh: {
      const __m512 z3 = _mm512_mul_ps(_mm512_mul_ps(z, z), z);
      const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.79788456080286536f),
                                     _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), z3, z));
      return z_sigmoid(z, _mm512_add_ps(y, y));
    }
    // max_ps(a, b) = a > b ? a : b, so a NaN z comes through as in the scalar z < 0 ? 0 : z
    case Act::kRelu: return _mm512_max_ps(_mm512_setzero_ps(), z);
    case Act::kRelu2: { const __m512 r = _mm512_max_ps(_mm512_setzero_ps(), z); return _mm512_mul_ps(r, r); }
    case Act::kSigmoidAlpha: return z_sigmoid(z, _mm512_mul_ps(_mm512_set1_ps(a.alpha), z));
    case Act::kIdentity: return z;
  }
  return z;
}

// h for 16 columns; `valid` masks columns < I (the rest are written as 0).
static inline __m512 h_vec(const ActParams& a, bool gated, __m512 g, __m512 u, __mmask16 valid) {
  __m512 h;
  if (!gated) {
    h = act(a, u);
  } else {
    // min_ps(a, b) = a < b ? a : b: the limit first, so NaN passes as in the scalar definitions
    g = _mm512_min_ps(_mm512_set1_ps(a.gate_limit), g);
    u = _mm512_min_ps(_mm512_set1_ps(a.up_limit), _mm512_max_ps(_mm512_set1_ps(-a.up_limit), u));
    __m512 ag = _mm512_min_ps(_mm512_set1_ps(a.post_act_limit), act(a, g));
    h = _mm512_mul_ps(ag, _mm512_add_ps(u, _mm512_set1_ps(a.up_offset)));
  }
  return _mm512_maskz_mov_ps(valid, h);
}

// fp32 -> bf16, round to nearest even, NaN kept quiet (no avx512bf16 needed).
static inline __m256i cvt_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

// ---- layout v3 quantised lanes (4 k of one output row per dword; see kernel_api.h) ----
// int8: byte J of each dword, sign-extended, as fp32.
template <int J>
static inline __m512 i8_lane_ps(__m512i v) {
  if constexpr (J == 3) return _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
  else return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * J), 24));
}
// int4: the nibble of k % 8 = J (byte J % 4; high nibble for J >= 4) as q = nibble - 8, exact:
// (n & 15) | 0x4B000000 is the float 2^23 + n (0xEA: truth table of (A & B) | C), minus 2^23 + 8.
template <int J>
static inline __m512 i4_lane_ps(__m512i v) {
  constexpr int sh = (J & 3) * 8 + (J >= 4 ? 4 : 0);
  const __m512i s = sh ? _mm512_srli_epi32(v, sh) : v;
  const __m512i n = _mm512_ternarylogic_epi32(s, _mm512_set1_epi32(15), _mm512_set1_epi32(0x4B000000), 0xEA);
  return _mm512_sub_ps(_mm512_castsi512_ps(n), _mm512_set1_ps(8388616.0f));
}

// The 16 steps of an int4 group, q4_step (kernel_api.h) bit for bit, from its 16 scale codes:
// the step from a 16-entry table by the code's low 4 bits (vpermps), times 2^-a by subtracting a
// from its exponent field.
static inline __m512 q4_steps16(const uint8_t* codes) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512 t = _mm512_permutexvar_ps(c, _mm512_loadu_ps(kQ4Step));
  const __m512i a = _mm512_slli_epi32(_mm512_srli_epi32(c, 4), 23);
  return _mm512_castsi512_ps(_mm512_sub_epi32(_mm512_castps_si512(t), a));
}
// The 16 scales of an int4 group, q4_scale bit for bit: factor (the rows' factors) times the steps.
static inline __m512 q4_scales16(const uint8_t* codes, __m512 factor) { return _mm512_mul_ps(factor, q4_steps16(codes)); }

static inline __mmask16 valid_mask(int64_t col0, int64_t limit) {
  const int64_t n = limit - col0;
  if (n >= 16) return 0xffff;
  if (n <= 0) return 0;
  return static_cast<__mmask16>((1u << n) - 1u);
}

}  // namespace hina::detail::v512
