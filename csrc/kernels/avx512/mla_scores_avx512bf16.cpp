// mla_decode's two passes over a bfloat16 latent cache on AVX512-BF16 dot products (vdpbf16ps:
// pairs of bf16 products summed into float32 lanes; called from attention_avx512.cpp's policy only
// when the CPU reports AVX512-BF16 and mla_bf16_dots() is on):
// - the scores' latent half: each head's latent query rounded to bfloat16 once (to nearest even),
//   its dot products with the cached rows over pairs of consecutive values;
// - the latent outputs: the probabilities rounded to bfloat16 (as PyTorch's bf16 attention rounds
//   them for the product with the values), two positions a pair: their rows interleaved value by
//   value (vpunpck{l,h}wd, whose per-128-bit-lane order the accumulators keep until the end).
// Against the float32 FMAs of the other builds: no conversion of the cached rows, and two
// multiply-adds a lane per instruction.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace hina::detail {

namespace {

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// 32 bf16 values at p
inline __m512i load32(const uint16_t* p) { return _mm512_loadu_si512(reinterpret_cast<const void*>(p)); }

}  // namespace

// sc[g * S + j] = bf16(ql[g]) . latent(j) for heads g < G and kept positions j < n (latent(j) at
// lat + pos(j) * cs, pos(j) = kept ? kept[j] : j); L a multiple of 32.
void mla_latent_scores_bf16dot(const float* ql, int64_t G, int64_t L, const uint16_t* lat, int64_t cs,
                               const int32_t* kept, int64_t n, float* sc, int64_t S) {
  thread_local std::vector<uint16_t> qb;  // the heads' latent queries in bf16, [G][L]
  qb.resize(static_cast<size_t>(G * L));
  for (int64_t i = 0; i < G * L; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(ql + i + 16), _mm512_loadu_ps(ql + i));
    _mm512_storeu_si512(reinterpret_cast<void*>(qb.data() + i), reinterpret_cast<const __m512i&>(v));
  }
  auto at = [&](int64_t j) { return lat + (kept ? kept[j] : j) * cs; };
  constexpr int kH = 4, kP = 4;  // heads by positions a block: 16 accumulators
  int64_t j = 0;
  for (; j + kP <= n; j += kP) {
    const uint16_t* r[kP];
    for (int p = 0; p < kP; ++p) r[p] = at(j + p);
    int64_t g = 0;
    for (; g + kH <= G; g += kH) {
      __m512 acc[kH][kP];
      for (auto& a : acc)
        for (auto& v : a) v = _mm512_setzero_ps();
      for (int64_t l = 0; l < L; l += 32) {
        __m512i x[kP];
        for (int p = 0; p < kP; ++p) x[p] = load32(r[p] + l);
        for (int h = 0; h < kH; ++h) {
          const __m512i q = load32(qb.data() + (g + h) * L + l);
          for (int p = 0; p < kP; ++p) acc[h][p] = _mm512_dpbf16_ps(acc[h][p], as_bh(q), as_bh(x[p]));
        }
      }
      for (int h = 0; h < kH; ++h)
        for (int p = 0; p < kP; ++p) sc[(g + h) * S + j + p] = _mm512_reduce_add_ps(acc[h][p]);
    }
    for (; g < G; ++g)
      for (int p = 0; p < kP; ++p) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t l = 0; l < L; l += 32) a = _mm512_dpbf16_ps(a, as_bh(load32(qb.data() + g * L + l)), as_bh(load32(r[p] + l)));
        sc[g * S + j + p] = _mm512_reduce_add_ps(a);
      }
  }
  for (; j < n; ++j)
    for (int64_t g = 0; g < G; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t l = 0; l < L; l += 32) a = _mm512_dpbf16_ps(a, as_bh(load32(qb.data() + g * L + l)), as_bh(load32(at(j) + l)));
      sc[g * S + j] = _mm512_reduce_add_ps(a);
    }
}

// ol[g * L + l] += sum_j bf16(p[g * S + j]) latent(j)[l] for heads g < G over the kept positions
// j < n (as mla_decode_bf16dot's scores read them); L a multiple of 32.
void mla_latent_sums_bf16dot(const float* p, int64_t G, int64_t L, const uint16_t* lat, int64_t cs,
                             const int32_t* kept, int64_t n, int64_t S, float* ol) {
  const int64_t np = (n + 1) / 2;  // position pairs (an odd last one with a zero row and weight)
  thread_local std::vector<uint16_t> pb, zero;
  thread_local std::vector<float> acc_perm;  // the outputs in vpunpck's lane order, [G][L]
  pb.assign(static_cast<size_t>(G * np * 2 + 32), 0);
  zero.assign(static_cast<size_t>(L), 0);
  acc_perm.assign(static_cast<size_t>(G * L), 0.f);
  for (int64_t g = 0; g < G; ++g) {  // each head's probabilities in bf16, a pair a 32-bit lane
    uint16_t* dst = pb.data() + g * np * 2;
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + g * S + j + 16), _mm512_loadu_ps(p + g * S + j));
      _mm512_storeu_si512(reinterpret_cast<void*>(dst + j), reinterpret_cast<const __m512i&>(v));
    }
    if (j < n) {
      const __mmask16 m0 = static_cast<__mmask16>(n - j >= 16 ? 0xffff : (1u << (n - j)) - 1);
      const __mmask16 m1 = static_cast<__mmask16>(n - j <= 16 ? 0 : (1u << (n - j - 16)) - 1);
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, p + g * S + j + 16),
                                             _mm512_maskz_loadu_ps(m0, p + g * S + j));
      alignas(64) uint16_t tmp[32];
      _mm512_store_si512(reinterpret_cast<void*>(tmp), reinterpret_cast<const __m512i&>(v));
      std::copy(tmp, tmp + (n - j), dst + j);
    }
  }
  const auto* pairs = reinterpret_cast<const uint32_t*>(pb.data());
  auto row = [&](int64_t j) { return j < n ? lat + (kept ? kept[j] : j) * cs : zero.data(); };
  constexpr int kH = 8;               // heads a pass: 16 accumulators
  constexpr int64_t kBlock = 128;     // position pairs a pass: 256 rows of a 512 rank in bf16 stay in L2
  for (int64_t i0 = 0; i0 < np; i0 += kBlock) {
    const int64_t i1 = std::min(np, i0 + kBlock);
    for (int64_t l = 0; l < L; l += 32) {
      for (int64_t g = 0; g < G; g += kH) {
        const int nh = static_cast<int>(std::min<int64_t>(kH, G - g));
        __m512 acc[kH][2];
        for (int h = 0; h < nh; ++h) {
          acc[h][0] = _mm512_loadu_ps(acc_perm.data() + (g + h) * L + l);
          acc[h][1] = _mm512_loadu_ps(acc_perm.data() + (g + h) * L + l + 16);
        }
        for (int64_t i = i0; i < i1; ++i) {
          const __m512i a = load32(row(2 * i) + l), b = load32(row(2 * i + 1) + l);
          const __m512bh lo = as_bh(_mm512_unpacklo_epi16(a, b)), hi = as_bh(_mm512_unpackhi_epi16(a, b));
          for (int h = 0; h < nh; ++h) {
            const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(pairs[(g + h) * np + i])));
            acc[h][0] = _mm512_dpbf16_ps(acc[h][0], lo, w);
            acc[h][1] = _mm512_dpbf16_ps(acc[h][1], hi, w);
          }
        }
        for (int h = 0; h < nh; ++h) {
          _mm512_storeu_ps(acc_perm.data() + (g + h) * L + l, acc[h][0]);
          _mm512_storeu_ps(acc_perm.data() + (g + h) * L + l + 16, acc[h][1]);
        }
      }
    }
  }
  // back to the values' order: lane k of a chunk's first vector is value 8 (k / 4) + k % 4, of
  // its second 8 (k / 4) + 4 + k % 4
  for (int64_t g = 0; g < G; ++g)
    for (int64_t l = 0; l < L; l += 32)
      for (int k = 0; k < 16; ++k) {
        ol[g * L + l + 8 * (k / 4) + k % 4] += acc_perm[g * L + l + k];
        ol[g * L + l + 8 * (k / 4) + 4 + k % 4] += acc_perm[g * L + l + 16 + k];
      }
}

}  // namespace hina::detail
