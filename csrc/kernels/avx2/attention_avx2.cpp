// Decode attention with AVX2 + FMA + F16C: attention_impl.h's computation (float32 math, one
// rounding at the end) 8 float32 lanes a vector. Sixteen ymm registers cannot hold a 128-wide
// query and output at once as the AVX-512 build does: scores take the query from L1, and the
// output is accumulated kCols columns per pass over the kept keys (128: one pass for the
// common head sizes, some accumulators spilled to L1). Four keys are scored at a time; the
// softmax uses a vector exp. hi_na_moe.attention uses this build up to 512 cached positions
// only: beyond, PyTorch's SDPA measured faster (benchmarks/bench_attention_kernel.py).
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "moe/attention_impl.h"
#include "moe/mla_impl.h"

namespace hina::detail {
namespace {

template <class T>
__m256 load8(const T* p);
template <>
__m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
__m256 load8<uint16_t>(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <>
__m256 load8<attn_impl::Half>(const attn_impl::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// e^x for x <= 0, attn_impl's polynomial; x below -87 gives 0.
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(attn_impl::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(attn_impl::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(attn_impl::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(attn_impl::kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(attn_impl::kExpPoly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

constexpr int kCols = 128;  // output columns accumulated per pass over the keys

// One (batch, head) row, D a multiple of 8; qf: the query as float32 (D values), sc: n floats.
template <class T>
void one_head(const float* qf, const T* k, const T* v, const int32_t* keys, int64_t n, int64_t D, int64_t ks,
              int64_t vs, float scale, float sink, T* out, float* sc) {
  auto key = [keys](int64_t j) { return keys ? static_cast<int64_t>(keys[j]) : j; };
  float mx = -INFINITY;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* k0 = k + key(j) * ks;
    const T* k1 = k + key(j + 1) * ks;
    const T* k2 = k + key(j + 2) * ks;
    const T* k3 = k + key(j + 3) * ks;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 qv = _mm256_loadu_ps(qf + i);
      s0 = _mm256_fmadd_ps(qv, load8(k0 + i), s0);
      s1 = _mm256_fmadd_ps(qv, load8(k1 + i), s1);
      s2 = _mm256_fmadd_ps(qv, load8(k2 + i), s2);
      s3 = _mm256_fmadd_ps(qv, load8(k3 + i), s3);
    }
    sc[j] = hsum(s0) * scale;
    sc[j + 1] = hsum(s1) * scale;
    sc[j + 2] = hsum(s2) * scale;
    sc[j + 3] = hsum(s3) * scale;
    mx = std::max({mx, sc[j], sc[j + 1], sc[j + 2], sc[j + 3]});
  }
  for (; j < n; ++j) {
    const T* kr = k + key(j) * ks;
    __m256 s0 = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i), load8(kr + i), s0);
    sc[j] = hsum(s0) * scale;
    mx = std::max(mx, sc[j]);
  }
  mx = std::max(mx, sink);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vmx));
    _mm256_storeu_ps(sc + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  for (; j < n; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
  sum += attn_impl::sink_share(sink, mx, n);
  const float inv = n ? 1.0f / sum : 0.f;  // no key attended: zeros, as SDPA gives
  for (int64_t c0 = 0; c0 < D; c0 += kCols) {
    const int nc = static_cast<int>(std::min<int64_t>(kCols, D - c0) / 8);
    __m256 acc[kCols / 8];
    for (int c = 0; c < kCols / 8; ++c) acc[c] = _mm256_setzero_ps();
    for (j = 0; j < n; ++j) {
      const T* vr = v + key(j) * vs + c0;
      const __m256 p = _mm256_set1_ps(sc[j]);
      for (int c = 0; c < nc; ++c) acc[c] = _mm256_fmadd_ps(p, load8(vr + 8 * c), acc[c]);
    }
    alignas(32) float res[kCols];
    for (int c = 0; c < nc; ++c) _mm256_store_ps(res + 8 * c, acc[c]);
    for (int i = 0; i < 8 * nc; ++i) attn_impl::Elem<T>::put(out, c0 + i, res[i] * inv);
  }
}

template <class T>
void heads(const AttnDecodeArgs& a, int64_t h0, int64_t h1) {
  if (a.D % 8) return attn_impl::heads<T>(a, h0, h1);
  thread_local AlignedBuf scratch, key_buf, q_buf;
  float* sc = static_cast<float*>(scratch.get(static_cast<size_t>(a.S) * sizeof(float)));
  float* qf = static_cast<float*>(q_buf.get(static_cast<size_t>(a.D) * sizeof(float)));
  int32_t* keys = a.mask ? static_cast<int32_t*>(key_buf.get(static_cast<size_t>(a.S) * sizeof(int32_t))) : nullptr;
  attn_impl::for_heads<T>(a, h0, h1, keys,
                          [&](const T* q, const T* k, const T* v, const int32_t* kept, int64_t n, float sink, T* out) {
    for (int64_t i = 0; i < a.D; ++i) qf[i] = attn_impl::Elem<T>::get(q, i);
    one_head(qf, k, v, kept, n, a.D, a.k_strides[2], a.v_strides[2], a.scale, sink, out, sc);
  });
}

// mla_impl.h's vector type for its blocked loops: 8 float32 lanes.
struct Vec {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  template <class T>
  static Reg load(const T* p) { return load8(p); }
  static Reg loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Reg set1(float v) { return _mm256_set1_ps(v); }
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static float sum(Reg v) { return hsum(v); }
  static Reg load_i8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void load_nibbles(const uint8_t* p, Reg& lo, Reg& hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
};

// mla_impl.h's vector policy: 8 lanes, four accumulators for the dot products, exp_neg.
struct MlaOps {
  template <class T>
  static void to_float(const T* x, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, load8(x + i));
    for (; i < n; ++i) y[i] = attn_impl::Elem<T>::get(x, i);
  }
  template <class T>
  static float dot(const float* a, const T* b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), s1);
      s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), load8(b + i + 16), s2);
      s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), load8(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), s0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < n; ++i) s += a[i] * attn_impl::Elem<T>::get(b, i);
    return s;
  }
  template <class T>
  static void axpy(float s, const T* x, float* acc, int64_t n) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(vs, load8(x + i), _mm256_loadu_ps(acc + i)));
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
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmx));
      _mm256_storeu_ps(x + i, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - mx));
    return sum;
  }
  // Register-blocked (mla_impl.h): three heads by four positions for the scores (12 of the 16
  // ymm registers), four heads by 16 values for the sums.
  template <class T>
  static void latent_scores(const float* ql, int64_t G, int64_t L, const T* lat, int64_t cs, const int32_t* kept,
                            int64_t n, float* sc, int64_t S, float* row) {
    if (L % 8) return mla_impl::latent_scores_rows<MlaOps>(ql, G, L, lat, cs, kept, n, sc, S, row);
    mla_impl::latent_scores_blocked<Vec, 3, 4>(ql, G, L, lat, cs, kept, n, sc, S);
  }
  template <class T>
  static void latent_sums(const float* p, int64_t G, int64_t L, const T* lat, int64_t cs, const int32_t* kept,
                          int64_t n, int64_t S, float* ol, float* row) {
    if (L % 16) return mla_impl::latent_sums_rows<MlaOps>(p, G, L, lat, cs, kept, n, S, ol, row);
    mla_impl::latent_sums_blocked<Vec, 4, 2>(p, G, L, lat, cs, kept, n, S, ol);
  }
};

}  // namespace

void attention_decode_avx2(const AttnDecodeArgs& a, int64_t h0, int64_t h1) {
  switch (a.dtype) {
    case DType::kF32: heads<float>(a, h0, h1); break;
    case DType::kBF16: heads<uint16_t>(a, h0, h1); break;
    case DType::kF16: heads<attn_impl::Half>(a, h0, h1); break;
  }
}

void mla_decode_avx2(const MlaDecodeArgs& a, int64_t h0, int64_t h1) { mla_impl::run<MlaOps>(a, h0, h1); }

}  // namespace hina::detail
