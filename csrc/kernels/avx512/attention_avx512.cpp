// Decode attention with AVX-512 F/BW/VL: the same computation as attention_impl.h (float32
// math, one rounding at the end), 16 float32 lanes a vector, the query and the output held in
// registers, four keys scored at a time, and a vector exp for the softmax.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "hina_moe/cpu_features.h"
#include "hina_moe/attention.h"
#include "hina_moe/ops.h"
#include "moe/attention_impl.h"
#include "dispatch/select.h"
#include "moe/mla_impl.h"
#include "vec_avx512.h"

namespace hina::detail {

// mla_scores_avx512bf16.cpp (its own flags): the passes over a bf16 latent cache on bf16 dot products
void mla_latent_scores_bf16dot(const float* ql, int64_t G, int64_t L, const uint16_t* lat, int64_t cs,
                               const int32_t* kept, int64_t n, float* sc, int64_t S);
void mla_latent_sums_bf16dot(const float* p, int64_t G, int64_t L, const uint16_t* lat, int64_t cs,
                             const int32_t* kept, int64_t n, int64_t S, float* ol);

namespace {

// Whether bfloat16 latent caches are read with bf16 dot products (mla_scores_avx512bf16.cpp;
// the choice is dispatch/select.cpp's)
bool bf16_dots() { return detail::mla_scores_bf16(); }

// 16 values of a row as float32 (bf16: shift into the high half; f16: the F16C conversion).
template <class T>
__m512 load16(const T* p);
template <>
__m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
__m512 load16<uint16_t>(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <>
__m512 load16<attn_impl::Half>(const attn_impl::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x for x <= 0 (scores minus their maximum), attn_impl's polynomial; x below -87 gives 0.
inline __m512 exp_neg(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(attn_impl::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(attn_impl::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(attn_impl::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(attn_impl::kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(attn_impl::kExpPoly[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(e));
}

// One (batch, head) row; NC = D / 16 vectors per row (D a multiple of 16, at most 256), the
// query and the output accumulator held in registers.
template <class T, int NC>
void one_head(const T* q, const T* k, const T* v, const int32_t* keys, int64_t S, int64_t ks, int64_t vs, float scale,
              float sink, T* out, float* sc) {
  auto key = [keys](int64_t j) { return keys ? static_cast<int64_t>(keys[j]) : j; };
  __m512 qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = load16(q + 16 * c);
  float mx = -INFINITY;
  int64_t j = 0;
  for (; j + 4 <= S; j += 4) {  // four keys at a time: four independent chains and reductions
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    const T* k0 = k + key(j) * ks;
    const T* k1 = k + key(j + 1) * ks;
    const T* k2 = k + key(j + 2) * ks;
    const T* k3 = k + key(j + 3) * ks;
    for (int c = 0; c < NC; ++c) {
      s0 = _mm512_fmadd_ps(qv[c], load16(k0 + 16 * c), s0);
      s1 = _mm512_fmadd_ps(qv[c], load16(k1 + 16 * c), s1);
      s2 = _mm512_fmadd_ps(qv[c], load16(k2 + 16 * c), s2);
      s3 = _mm512_fmadd_ps(qv[c], load16(k3 + 16 * c), s3);
    }
    sc[j] = _mm512_reduce_add_ps(s0) * scale;
    sc[j + 1] = _mm512_reduce_add_ps(s1) * scale;
    sc[j + 2] = _mm512_reduce_add_ps(s2) * scale;
    sc[j + 3] = _mm512_reduce_add_ps(s3) * scale;
    mx = std::max({mx, sc[j], sc[j + 1], sc[j + 2], sc[j + 3]});
  }
  for (; j < S; ++j) {
    __m512 s0 = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) s0 = _mm512_fmadd_ps(qv[c], load16(k + key(j) * ks + 16 * c), s0);
    sc[j] = _mm512_reduce_add_ps(s0) * scale;
    mx = std::max(mx, sc[j]);
  }
  mx = std::max(mx, sink);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= S; j += 16) {
    const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sc + j), vmx));
    _mm512_storeu_ps(sc + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (j < S) {
    const __mmask16 m = static_cast<__mmask16>((1u << (S - j)) - 1);
    const __m512 e = exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + j), vmx));
    _mm512_mask_storeu_ps(sc + j, m, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
  }
  // no key attended: zeros, as SDPA gives
  const float inv = S ? 1.0f / (_mm512_reduce_add_ps(vsum) + attn_impl::sink_share(sink, mx, S)) : 0.f;
  __m512 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
  for (j = 0; j < S; ++j) {
    const T* vr = v + key(j) * vs;
    const __m512 p = _mm512_set1_ps(sc[j]);
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(p, load16(vr + 16 * c), acc[c]);
  }
  alignas(64) float res[16 * NC];
  for (int c = 0; c < NC; ++c) _mm512_store_ps(res + 16 * c, acc[c]);
  for (int i = 0; i < 16 * NC; ++i) attn_impl::Elem<T>::put(out, i, res[i] * inv);
}

template <class T, int NC>
void heads_nc(const AttnDecodeArgs& a, int64_t h0, int64_t h1) {
  thread_local AlignedBuf scratch, key_buf;
  float* sc = static_cast<float*>(scratch.get(static_cast<size_t>(a.S) * sizeof(float)));
  int32_t* keys = a.mask ? static_cast<int32_t*>(key_buf.get(static_cast<size_t>(a.S) * sizeof(int32_t))) : nullptr;
  attn_impl::for_heads<T>(a, h0, h1, keys,
                          [&](const T* q, const T* k, const T* v, const int32_t* kept, int64_t n, float sink, T* out) {
    one_head<T, NC>(q, k, v, kept, n, a.k_strides[2], a.v_strides[2], a.scale, sink, out, sc);
  });
}

// Head sizes of 16 * {2, 4, 5, 6, 8, 12, 16} (32 ... 256: every common one); others run the
// baseline loops.
template <class T>
void heads(const AttnDecodeArgs& a, int64_t h0, int64_t h1) {
  switch (a.D) {
    case 32: return heads_nc<T, 2>(a, h0, h1);
    case 64: return heads_nc<T, 4>(a, h0, h1);
    case 80: return heads_nc<T, 5>(a, h0, h1);
    case 96: return heads_nc<T, 6>(a, h0, h1);
    case 128: return heads_nc<T, 8>(a, h0, h1);
    case 192: return heads_nc<T, 12>(a, h0, h1);
    case 256: return heads_nc<T, 16>(a, h0, h1);
    default: return attn_impl::heads<T>(a, h0, h1);
  }
}

// 16 bf16 values (masked: the first m) as float32.
inline __m512 bf16_ps(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// v rounded to bfloat16 and back: what PyTorch's bf16 elementwise ops keep of a float32 result.
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v512::cvt_bf16(v)), 16));
}

// mla_impl.h's vector type for its blocked loops: 16 float32 lanes.
struct Vec {
  using Reg = __m512;
  static constexpr int kWidth = 16;
  template <class T>
  static Reg load(const T* p) { return load16(p); }
  static Reg loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg set1(float v) { return _mm512_set1_ps(v); }
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static float sum(Reg v) { return _mm512_reduce_add_ps(v); }
  static Reg load_i8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void load_nibbles(const uint8_t* p, Reg& lo, Reg& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
};

// mla_impl.h's vector policy: 16 lanes, four accumulators for the dot products, exp_neg.
struct MlaOps {
  template <class T>
  static void to_float(const T* x, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, load16(x + i));
    for (; i < n; ++i) y[i] = attn_impl::Elem<T>::get(x, i);
  }
  template <class T>
  static float dot(const float* a, const T* b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), load16(b + i + 16), s1);
      s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), load16(b + i + 32), s2);
      s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), load16(b + i + 48), s3);
    }
    for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), s0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    for (; i < n; ++i) s += a[i] * attn_impl::Elem<T>::get(b, i);
    return s;
  }
  template <class T>
  static void axpy(float s, const T* x, float* acc, int64_t n) {
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(vs, load16(x + i), _mm512_loadu_ps(acc + i)));
    for (; i < n; ++i) acc[i] += s * attn_impl::Elem<T>::get(x, i);
  }
  // kv_b_proj's weight quantised (MlaDecodeArgs::wq)
  static void qabsorb(const float* s, const mla_impl::QBlock& w, float* acc, int64_t L) {
    mla_impl::qabsorb_vec<Vec>(s, w, acc, L);
  }
  static void qdots(const float* a, const float* gsum, const mla_impl::QBlock& w, float* out, int64_t L) {
    mla_impl::qdots_vec<Vec>(a, gsum, w, out, L);
  }
  static float exp_sum(float* x, int64_t n, float mx) {
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(x + i), vmx));
      _mm512_storeu_ps(x + i, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    float sum = _mm512_reduce_add_ps(vsum);
    for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - mx));
    return sum;
  }
  // Register-blocked (mla_impl.h): four heads by four positions for the scores (16 of the 32
  // zmm registers), eight heads by 32 values for the sums.
  template <class T>
  static void latent_scores(const float* ql, int64_t G, int64_t L, const T* lat, int64_t cs, const int32_t* kept,
                            int64_t n, float* sc, int64_t S, float* row) {
    if constexpr (std::is_same_v<T, uint16_t>) {  // bfloat16
      if (L % 32 == 0 && bf16_dots()) return mla_latent_scores_bf16dot(ql, G, L, lat, cs, kept, n, sc, S);
    }
    if (L % 16) return mla_impl::latent_scores_rows<MlaOps>(ql, G, L, lat, cs, kept, n, sc, S, row);
    mla_impl::latent_scores_blocked<Vec, 4, 4>(ql, G, L, lat, cs, kept, n, sc, S);
  }
  template <class T>
  static void latent_sums(const float* p, int64_t G, int64_t L, const T* lat, int64_t cs, const int32_t* kept,
                          int64_t n, int64_t S, float* ol, float* row) {
    if constexpr (std::is_same_v<T, uint16_t>) {  // bfloat16
      if (L % 32 == 0 && bf16_dots()) return mla_latent_sums_bf16dot(p, G, L, lat, cs, kept, n, S, ol);
    }
    if (L % 32) return mla_impl::latent_sums_rows<MlaOps>(p, G, L, lat, cs, kept, n, S, ol, row);
    mla_impl::latent_sums_blocked<Vec, 8, 2>(p, G, L, lat, cs, kept, n, S, ol);
  }
};

}  // namespace

// rope_rotate_half for bfloat16, 16 values of each half at a time: out_lo = round(round(lo c_lo)
// + round(-hi s_lo)), out_hi = round(round(hi c_hi) + round(lo s_hi)), float32 products of bf16
// values being exact, each rounding the one rope_rows makes (the same bits).
void rope_rotate_half_bf16_avx512(const uint16_t* x, int64_t B, int64_t heads, int64_t D, const uint16_t* cos,
                                  const uint16_t* sin, uint16_t* out, bool half_table) {
  const int64_t half = D / 2, width = half_table ? half : D, hi_off = half_table ? 0 : half;
  for (int64_t b = 0; b < B; ++b) {
    const uint16_t* c = cos + b * width;
    const uint16_t* s = sin + b * width;
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* xr = x + (b * heads + h) * D;
      uint16_t* yr = out + (b * heads + h) * D;
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = half - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (half - i)) - 1u);
        const __m512 lo = bf16_ps(xr + i, m), hi = bf16_ps(xr + half + i, m);
        const __m512 ylo = round_bf16(_mm512_add_ps(round_bf16(_mm512_mul_ps(lo, bf16_ps(c + i, m))),
                                                    round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi),
                                                                             bf16_ps(s + i, m)))));
        const __m512 yhi = round_bf16(_mm512_add_ps(round_bf16(_mm512_mul_ps(hi, bf16_ps(c + hi_off + i, m))),
                                                    round_bf16(_mm512_mul_ps(lo, bf16_ps(s + hi_off + i, m)))));
        _mm256_mask_storeu_epi16(yr + i, m, v512::cvt_bf16(ylo));
        _mm256_mask_storeu_epi16(yr + half + i, m, v512::cvt_bf16(yhi));
      }
    }
  }
}

void attention_decode_avx512(const AttnDecodeArgs& a, int64_t h0, int64_t h1) {
  switch (a.dtype) {
    case DType::kF32: heads<float>(a, h0, h1); break;
    case DType::kBF16: heads<uint16_t>(a, h0, h1); break;
    case DType::kF16: heads<attn_impl::Half>(a, h0, h1); break;
  }
}

void mla_decode_avx512(const MlaDecodeArgs& a, int64_t h0, int64_t h1) { mla_impl::run<MlaOps>(a, h0, h1); }

}  // namespace hina::detail
