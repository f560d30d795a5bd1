// AVX2 (+FMA) helpers for the avx2 translation units: the activation epilogue of the gate/up
// kernels, 8 columns at a time. The same formulas and constants as kernels/avx512/vec_avx512.h
// (exp with |rel err| ~ 2 ulp on [-87, 88], erfc with relative accuracy everywhere), so both
// builds compute the same values; 2^n is built in the exponent bits instead of vscalefps (n stays
// in [-126, 127] after the clamp: always a normal float, the same product).
// Only include from TUs compiled with -mavx2 -mfma.
#pragma once

#include <immintrin.h>

#include "moe/kernel_api.h"

namespace hina::detail::v256 {

static inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(act_poly::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(act_poly::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(act_poly::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(act_poly::kExp[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(act_poly::kExp[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// z / (1 + e^(-s z)): silu (s = 1), sigmoid_alpha (s = alpha), gelu_tanh via z*sigmoid(2y).
static inline __m256 z_sigmoid(__m256 z, __m256 sz) {
  const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), sz));
  return _mm256_div_ps(z, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// gelu (erf form) through erfc (Numerical Recipes erfcc, fractional error < 1.2e-7).
static inline __m256 gelu_erf(__m256 z) {
  const __m256 absz = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), z);
  const __m256 w = _mm256_mul_ps(absz, _mm256_set1_ps(0.70710678118654752f));
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.5f), w, _mm256_set1_ps(1.0f)));
  __m256 p = _mm256_set1_ps(act_poly::kErfc[0]);
  for (int i = 1; i < 10; ++i) p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(act_poly::kErfc[i]));
  p = _mm256_fnmadd_ps(w, w, p);  // -w^2 + poly
  const __m256 erfc = _mm256_mul_ps(t, exp_ps(p));
  const __m256 pos = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 one_plus_erf = _mm256_blendv_ps(erfc, _mm256_sub_ps(_mm256_set1_ps(2.0f), erfc), pos);
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), z), one_plus_erf);
}

static inline __m256 act(const ActParams& a, __m256 z) {
  switch (a.act) {
    case Act::kSilu: return z_sigmoid(z, z);
    case Act::kGelu: return gelu_erf(z);
    case Act::kGeluTanh: {
      const __m256 z3 = _mm256_mul_ps(_mm256_mul_ps(z, z), z);
      const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.79788456080286536f),
                                     _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), z3, z));
      return z_sigmoid(z, _mm256_add_ps(y, y));
    }
    // max_ps(a, b) = a > b ? a : b, so a NaN z comes through as in the scalar z < 0 ? 0 : z
    case Act::kRelu: return _mm256_max_ps(_mm256_setzero_ps(), z);
    case Act::kRelu2: { const __m256 r = _mm256_max_ps(_mm256_setzero_ps(), z); return _mm256_mul_ps(r, r); }
    case Act::kSigmoidAlpha: return z_sigmoid(z, _mm256_mul_ps(_mm256_set1_ps(a.alpha), z));
    case Act::kIdentity: return z;
  }
  return z;
}

// Lanes of columns col0 .. col0 + 7 that are < limit (all ones), the others zero.
static inline __m256 valid_mask(int64_t col0, int64_t limit) {
  const int64_t n = limit - col0;
  const int c = n <= 0 ? 0 : n >= 8 ? 8 : static_cast<int>(n);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// h for 8 columns (kernel_api.h's h_scalar, vectorised); lanes outside `valid` are 0.
static inline __m256 h_vec(const ActParams& a, bool gated, __m256 g, __m256 u, __m256 valid) {
  __m256 h;
  if (!gated) {
    h = act(a, u);
  } else {
    // min_ps(a, b) = a < b ? a : b: the limit first, so NaN passes as in the scalar definitions
    g = _mm256_min_ps(_mm256_set1_ps(a.gate_limit), g);
    u = _mm256_min_ps(_mm256_set1_ps(a.up_limit), _mm256_max_ps(_mm256_set1_ps(-a.up_limit), u));
    const __m256 ag = _mm256_min_ps(_mm256_set1_ps(a.post_act_limit), act(a, g));
    h = _mm256_mul_ps(ag, _mm256_add_ps(u, _mm256_set1_ps(a.up_offset)));
  }
  return _mm256_and_ps(valid, h);
}

}  // namespace hina::detail::v256
