// Decode attention of multi-head latent attention (hina::mla_decode, csrc/include/hina_moe/attention.h),
// written once over a vector-ops policy and compiled per tier: the baseline loops
// (csrc/moe/mla.cpp, attention_impl.h's kLanes accumulators), AVX2 (csrc/kernels/avx2/
// attention_avx2.cpp) and AVX-512 (csrc/kernels/avx512/attention_avx512.cpp).
//
// transformers' MLA modules cache the compressed latent (kv_lora_rank values a position, after
// kv_a_layernorm) and the rotated rope key (qk_rope_head_dim values), and at every step make
// every head's keys and values of every cached position again through kv_b_proj: S x H x
// (Dn + Dv) x L multiply-adds a layer and step, 35 ms a layer at 2048 positions for
// DeepSeek-V2-Lite's shape on this machine's 2 cores. Here kv_b_proj is absorbed instead (the
// DeepSeek-V2 paper's decode form): the query goes into the latent space once (H Dn L
// multiply-adds), scores and the weighted sum run over the latent rows (H S (2L + Dr)), and the
// result comes out through the value rows once (H Dv L).
//
// kv_b_proj's weight is read in the model's dtype, or, when the model's kv_b_proj is quantised
// (scope="all" with int8 / int4), as its codes and scales (RowQuant: a half or a quarter of the
// bytes, and the packed layer's own values instead of their rounding to the dtype).
//
// Each thread takes a group of heads and reads each cached position once for all of them: the
// position's latent and rope key are made float32 once, then scored against every head of the
// group, and once more for the weighted sums. (The AVX-512 policy reads a bfloat16 cache with
// AVX512-BF16 dot products where the CPU has them instead: kernels/avx512/mla_scores_avx512bf16.cpp.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_impl.h"
#include "hina_moe/attention.h"

namespace hina::mla_impl {

using attn_impl::Elem;

// The latent half of the scores, sc[g * S + j] = ql[g] . latent(j) for heads g < G and kept
// positions j < n (latent(j) at lat + pos(j) * cs, pos(j) = kept ? kept[j] : j), and the latent
// outputs, ol[g] += sum_j p[g * S + j] latent(j): position by position, each position made
// float32 once (row: L floats) for every head. A policy's own versions may block them otherwise.
template <class Ops, class T>
void latent_scores_rows(const float* ql, int64_t G, int64_t L, const T* lat, int64_t cs, const int32_t* kept,
                        int64_t n, float* sc, int64_t S, float* row) {
  for (int64_t j = 0; j < n; ++j) {
    Ops::to_float(lat + (kept ? kept[j] : j) * cs, row, L);
    for (int64_t g = 0; g < G; ++g) sc[g * S + j] = Ops::dot(ql + g * L, row, L);
  }
}

template <class Ops, class T>
void latent_sums_rows(const float* p, int64_t G, int64_t L, const T* lat, int64_t cs, const int32_t* kept, int64_t n,
                      int64_t S, float* ol, float* row) {
  for (int64_t j = 0; j < n; ++j) {
    Ops::to_float(lat + (kept ? kept[j] : j) * cs, row, L);
    for (int64_t g = 0; g < G; ++g) Ops::axpy(p[g * S + j], row, ol + g * L, L);
  }
}

// Register-blocked versions of the two for the vector builds, written once over a vector type V
// (V::kWidth float32 lanes; load(const T*) converting, loadf, storef, set1, fma, zero, sum):
// scores of kPos positions against kHeads heads at a time (kHeads x kPos accumulators over L,
// each position's values loaded once for the heads), and the sums of kSumHeads heads over
// kCols vectors of L at a time, their accumulators held across a block of positions (each
// position's values loaded once for the heads). L must be a multiple of kCols * V::kWidth;
// policies fall back to the position-by-position loops otherwise.
template <class V, int kHeads, int kPos, class T>
void latent_scores_blocked(const float* ql, int64_t G, int64_t L, const T* lat, int64_t cs, const int32_t* kept,
                           int64_t n, float* sc, int64_t S) {
  auto at = [&](int64_t j) { return lat + (kept ? kept[j] : j) * cs; };
  auto one = [&](const float* q, const T* r) {  // a dot product of L values, four accumulators
    typename V::Reg a0 = V::zero(), a1 = a0, a2 = a0, a3 = a0;
    int64_t l = 0;
    for (; l + 4 * V::kWidth <= L; l += 4 * V::kWidth) {
      a0 = V::fma(V::loadf(q + l), V::load(r + l), a0);
      a1 = V::fma(V::loadf(q + l + V::kWidth), V::load(r + l + V::kWidth), a1);
      a2 = V::fma(V::loadf(q + l + 2 * V::kWidth), V::load(r + l + 2 * V::kWidth), a2);
      a3 = V::fma(V::loadf(q + l + 3 * V::kWidth), V::load(r + l + 3 * V::kWidth), a3);
    }
    for (; l < L; l += V::kWidth) a0 = V::fma(V::loadf(q + l), V::load(r + l), a0);
    return V::sum(V::add(V::add(a0, a1), V::add(a2, a3)));
  };
  int64_t j = 0;
  for (; j + kPos <= n; j += kPos) {
    const T* r[kPos];
    for (int p = 0; p < kPos; ++p) r[p] = at(j + p);
    int64_t g = 0;
    for (; g + kHeads <= G; g += kHeads) {
      typename V::Reg acc[kHeads][kPos];
      for (auto& a : acc)
        for (auto& v : a) v = V::zero();
      for (int64_t l = 0; l < L; l += V::kWidth) {
        typename V::Reg x[kPos];
        for (int p = 0; p < kPos; ++p) x[p] = V::load(r[p] + l);
        for (int h = 0; h < kHeads; ++h) {
          const typename V::Reg q = V::loadf(ql + (g + h) * L + l);
          for (int p = 0; p < kPos; ++p) acc[h][p] = V::fma(q, x[p], acc[h][p]);
        }
      }
      for (int h = 0; h < kHeads; ++h)
        for (int p = 0; p < kPos; ++p) sc[(g + h) * S + j + p] = V::sum(acc[h][p]);
    }
    for (; g < G; ++g)
      for (int p = 0; p < kPos; ++p) sc[g * S + j + p] = one(ql + g * L, r[p]);
  }
  for (; j < n; ++j)
    for (int64_t g = 0; g < G; ++g) sc[g * S + j] = one(ql + g * L, at(j));
}

// kH heads [g, g + kH) of latent_sums_blocked over positions [j0, j1) and values [l, l + kCols
// V::kWidth) (compile-time counts: the accumulators stay in registers)
template <class V, int kH, int kCols, class At>
inline void latent_sums_tile(const float* p, int64_t g, int64_t L, At at, int64_t j0, int64_t j1, int64_t l, int64_t S,
                             float* ol) {
  typename V::Reg acc[kH][kCols];
  for (int h = 0; h < kH; ++h)
    for (int c = 0; c < kCols; ++c) acc[h][c] = V::loadf(ol + (g + h) * L + l + c * V::kWidth);
  for (int64_t j = j0; j < j1; ++j) {
    const auto* r = at(j) + l;
    typename V::Reg x[kCols];
    for (int c = 0; c < kCols; ++c) x[c] = V::load(r + c * V::kWidth);
    for (int h = 0; h < kH; ++h) {
      const typename V::Reg w = V::set1(p[(g + h) * S + j]);
      for (int c = 0; c < kCols; ++c) acc[h][c] = V::fma(w, x[c], acc[h][c]);
    }
  }
  for (int h = 0; h < kH; ++h)
    for (int c = 0; c < kCols; ++c) V::storef(ol + (g + h) * L + l + c * V::kWidth, acc[h][c]);
}

template <class V, int kSumHeads, int kCols, class T>
void latent_sums_blocked(const float* p, int64_t G, int64_t L, const T* lat, int64_t cs, const int32_t* kept,
                         int64_t n, int64_t S, float* ol) {
  auto at = [&](int64_t j) { return lat + (kept ? kept[j] : j) * cs; };
  constexpr int64_t kBlock = 256;  // positions a pass: 256 rows of a 512 rank in bf16 stay in L2
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t j1 = std::min(n, j0 + kBlock);
    for (int64_t l = 0; l < L; l += kCols * V::kWidth) {
      int64_t g = 0;
      for (; g + kSumHeads <= G; g += kSumHeads) latent_sums_tile<V, kSumHeads, kCols>(p, g, L, at, j0, j1, l, S, ol);
      for (; g < G; ++g) latent_sums_tile<V, 1, kCols>(p, g, L, at, j0, j1, l, S, ol);
    }
  }
}

// Block b of a quantised weight (MlaDecodeArgs::wq): rows 4b .. 4b + 3, their codes and scales
// interleaved (see MlaDecodeArgs) so that the kernel reads them as one sequential stream.
constexpr int kQRows = 4;
constexpr int64_t kQ8Chunk = 64;  // int8: values of a row between its block's other rows'
struct QBlock {
  WFormat fmt;
  const uint8_t* codes;
  const float* scales;  // int8: the 4 rows' scales; int4: group g of row r at 4 g + r
  int64_t group;       // int4's group (int8: unused)
};
inline QBlock qblock(const RowQuant& q, int64_t b, int64_t L) {
  const auto* c = static_cast<const uint8_t*>(q.codes);
  if (q.fmt == WFormat::kInt8) return {q.fmt, c + b * kQRows * L, static_cast<const float*>(q.scales) + b * kQRows, 0};
  return {q.fmt, c + b * kQRows * (L / 2), static_cast<const float*>(q.scales) + b * kQRows * (L / q.group),
          q.group};
}
// int8: the codes of row r from value k on (to the end of its chunk); int4: the bytes of row r's
// group holding value k (k in the group's first half: their low nibbles, else their high ones)
inline const uint8_t* qbytes(const QBlock& w, int r, int64_t k) {
  if (w.fmt == WFormat::kInt8) return w.codes + (k / kQ8Chunk * kQRows + r) * kQ8Chunk + k % kQ8Chunk;
  const int64_t half = w.group / 2;
  return w.codes + (k / w.group * kQRows + r) * half + k % w.group % half;
}
inline float qscale(const QBlock& w, int r, int64_t g) {
  return w.fmt == WFormat::kInt8 ? w.scales[r] : w.scales[g * kQRows + r];
}

// A block's four rows: acc[k] += sum_r s[r] W_r[k] (the query's absorption), and out[r] = a . W_r
// (the value rows), group by group (int8: the row as one group): each row's factor s * scale made
// once a group, the codes exact in float32, a dot product's group sums multiplied by the scales.
inline void qabsorb_rows(const float* s, const QBlock& w, float* acc, int64_t L) {
  if (w.fmt == WFormat::kInt8) {
    for (int64_t c = 0; c < L; c += kQ8Chunk)
      for (int r = 0; r < kQRows; ++r) {
        const float f = s[r] * qscale(w, r, 0);
        const auto* q = reinterpret_cast<const int8_t*>(qbytes(w, r, c));
        for (int64_t k = 0; k < kQ8Chunk; ++k) acc[c + k] += f * static_cast<float>(q[k]);
      }
    return;
  }
  const int64_t G = w.group, half = G / 2;
  for (int64_t g = 0; g * G < L; ++g)
    for (int r = 0; r < kQRows; ++r) {
      const float f = s[r] * qscale(w, r, g);
      const uint8_t* q = qbytes(w, r, g * G);
      float* lo = acc + g * G;
      for (int64_t j = 0; j < half; ++j) {
        lo[j] += f * static_cast<float>((q[j] & 15) - 8);
        lo[half + j] += f * static_cast<float>((q[j] >> 4) - 8);
      }
    }
}
inline void qdots_rows(const float* a, const QBlock& w, float* out, int64_t L) {
  const bool i8 = w.fmt == WFormat::kInt8;
  const int64_t G = i8 ? kQ8Chunk : w.group, half = G / 2;
  for (int r = 0; r < kQRows; ++r) {
    float tot = 0.f;
    for (int64_t g = 0; g * G < L; ++g) {
      const uint8_t* q = qbytes(w, r, g * G);
      const float* x = a + g * G;
      float p = 0.f;
      if (i8) {
        for (int64_t k = 0; k < G; ++k) p += x[k] * static_cast<float>(static_cast<int8_t>(q[k]));
      } else {
        for (int64_t j = 0; j < half; ++j)
          p += x[j] * static_cast<float>((q[j] & 15) - 8) + x[half + j] * static_cast<float>((q[j] >> 4) - 8);
      }
      tot += i8 ? p : qscale(w, r, g) * p;
    }
    out[r] = i8 ? qscale(w, r, 0) * tot : tot;
  }
}

// The same over a vector type V with load_i8 (V::kWidth int8 codes as float32) and load_nibbles
// (V::kWidth bytes as the floats of their low and their high nibbles, 0..15), the four rows
// sharing each load of acc / a. An int4 row's codes are its nibbles minus 8, taken out once a
// group: in the absorption as -8 times the rows' factors added to acc, in a dot product as -8
// times the scale times the group's sum of a (gsum[g], the same for every row). Vectors never
// straddle an int8 chunk or half an int4 group (V::kWidth divides 32).
template <class V>
void qabsorb_vec(const float* s, const QBlock& w, float* acc, int64_t L) {
  using Reg = typename V::Reg;
  constexpr int64_t W = V::kWidth;
  Reg vf[kQRows];
  if (w.fmt == WFormat::kInt8) {
    for (int r = 0; r < kQRows; ++r) vf[r] = V::set1(s[r] * qscale(w, r, 0));
    for (int64_t l = 0; l < L; l += W) {
      Reg x = V::loadf(acc + l);
      for (int r = 0; r < kQRows; ++r) x = V::fma(vf[r], V::load_i8(qbytes(w, r, l)), x);
      V::storef(acc + l, x);
    }
    return;
  }
  const int64_t G = w.group, half = G / 2;
  for (int64_t g = 0; g * G < L; ++g) {
    float c = 0.f;
    for (int r = 0; r < kQRows; ++r) {
      const float f = s[r] * qscale(w, r, g);
      vf[r] = V::set1(f);
      c += f;
    }
    const Reg off = V::set1(-8.f * c);
    const uint8_t* codes = qbytes(w, 0, g * G);  // the four rows' bytes of group g, row after row
    float* lo = acc + g * G;
    float* hi = lo + half;
    for (int64_t j = 0; j < half; j += W) {
      Reg x0 = V::add(V::loadf(lo + j), off), x1 = V::add(V::loadf(hi + j), off);
      for (int r = 0; r < kQRows; ++r) {
        Reg n0, n1;
        V::load_nibbles(codes + r * half + j, n0, n1);
        x0 = V::fma(vf[r], n0, x0);
        x1 = V::fma(vf[r], n1, x1);
      }
      V::storef(lo + j, x0);
      V::storef(hi + j, x1);
    }
  }
}
template <class V>
void qdots_vec(const float* a, const float* gsum, const QBlock& w, float* out, int64_t L) {
  using Reg = typename V::Reg;
  constexpr int64_t W = V::kWidth;
  Reg acc[kQRows];
  for (Reg& v : acc) v = V::zero();
  if (w.fmt == WFormat::kInt8) {
    for (int64_t l = 0; l < L; l += W) {
      const Reg x = V::loadf(a + l);
      for (int r = 0; r < kQRows; ++r) acc[r] = V::fma(x, V::load_i8(qbytes(w, r, l)), acc[r]);
    }
    for (int r = 0; r < kQRows; ++r) out[r] = qscale(w, r, 0) * V::sum(acc[r]);
    return;
  }
  const int64_t G = w.group, half = G / 2;
  float corr[kQRows] = {};
  for (int64_t g = 0; g * G < L; ++g) {
    Reg p[kQRows];
    for (Reg& v : p) v = V::zero();
    const uint8_t* codes = qbytes(w, 0, g * G);
    const float* lo = a + g * G;
    const float* hi = lo + half;
    for (int64_t j = 0; j < half; j += W) {
      const Reg a0 = V::loadf(lo + j), a1 = V::loadf(hi + j);
      for (int r = 0; r < kQRows; ++r) {
        Reg n0, n1;
        V::load_nibbles(codes + r * half + j, n0, n1);
        p[r] = V::fma(a1, n1, V::fma(a0, n0, p[r]));
      }
    }
    for (int r = 0; r < kQRows; ++r) {
      const float sc = qscale(w, r, g);
      acc[r] = V::fma(V::set1(sc), p[r], acc[r]);
      corr[r] += sc * gsum[g];
    }
  }
  for (int r = 0; r < kQRows; ++r) out[r] = V::sum(acc[r]) - 8.f * corr[r];
}

// The baseline policy: attention_impl.h's loops (kLanes independent accumulators, no
// reassociation needed for the compiler to vectorise them).
struct BaseOps {
  template <class T>
  static void to_float(const T* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = Elem<T>::get(x, i);
  }
  template <class T>
  static float dot(const float* a, const T* b, int64_t n) {
    return attn_impl::dot(a, b, n);
  }
  template <class T>
  static void axpy(float s, const T* x, float* acc, int64_t n) {
    attn_impl::axpy(s, x, acc, n);
  }
  static void qabsorb(const float* s, const QBlock& w, float* acc, int64_t L) { qabsorb_rows(s, w, acc, L); }
  static void qdots(const float* a, const float*, const QBlock& w, float* out, int64_t L) { qdots_rows(a, w, out, L); }
  // x[i] = e^(x[i] - mx), returning their sum
  static float exp_sum(float* x, int64_t n, float mx) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - mx));
    return sum;
  }
  template <class T>
  static void latent_scores(const float* ql, int64_t G, int64_t L, const T* lat, int64_t cs, const int32_t* kept,
                            int64_t n, float* sc, int64_t S, float* row) {
    latent_scores_rows<BaseOps>(ql, G, L, lat, cs, kept, n, sc, S, row);
  }
  template <class T>
  static void latent_sums(const float* p, int64_t G, int64_t L, const T* lat, int64_t cs, const int32_t* kept,
                          int64_t n, int64_t S, float* ol, float* row) {
    latent_sums_rows<BaseOps>(p, G, L, lat, cs, kept, n, S, ol, row);
  }
};

// Heads [h0, h1) of every batch row.
template <class Ops, class T>
void heads(const MlaDecodeArgs& a, int64_t h0, int64_t h1) {
  const int64_t G = h1 - h0, L = a.L, R = a.Dr, S = a.S, rows = a.Dn + a.Dv;
  // per head: its latent query (L) and rope query (R), its scores (S), its latent output (L);
  // then one position's latent as float32 (L)
  thread_local std::vector<float> scratch;
  thread_local std::vector<int32_t> kept;
  scratch.resize(static_cast<size_t>(G * (2 * L + R + S) + L + (a.w ? 0 : L / 32 + 1)));
  kept.resize(static_cast<size_t>(S));
  float* ql = scratch.data();
  float* qr = ql + G * L;
  float* sc = qr + G * R;
  float* ol = sc + G * S;
  float* row = ol + G * L;
  float* gsum = row + L;  // (a quantised weight's: the int4 groups' sums of a latent output, L / 32 at most)
  const T* w = static_cast<const T*>(a.w);
  const T* qn = static_cast<const T*>(a.q_nope);
  const T* qp = static_cast<const T*>(a.q_rope);
  const T* lat = static_cast<const T*>(a.latent);
  const T* kr = static_cast<const T*>(a.k_rope);
  T* out = static_cast<T*>(a.out);
  for (int64_t b = 0; b < a.B; ++b) {
    int64_t n = S;
    if (a.mask) {
      const uint8_t* m = a.mask + b * a.mask_bstride;
      n = 0;
      for (int64_t s = 0; s < S; ++s)
        if (m[s]) kept[n++] = static_cast<int32_t>(s);
    }
    const int32_t* kp = a.mask ? kept.data() : nullptr;
    const T* lat_b = lat + b * a.c_strides[0];
    const T* kr_b = kr + b * a.kr_strides[0];
    // the queries: the nope part through the key rows of W into the latent space
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = h0 + g;
      float* q = ql + g * L;
      std::fill(q, q + L, 0.f);
      const T* qh = qn + b * a.qn_strides[0] + h * a.qn_strides[1];
      if (w != nullptr) {
        const T* wh = w + h * rows * L;
        for (int64_t d = 0; d < a.Dn; ++d) Ops::axpy(Elem<T>::get(qh, d), wh + d * L, q, L);
      } else {
        for (int64_t d = 0; d < a.Dn; d += kQRows) {  // (Dn and Dv are multiples of 4: MlaDecodeArgs::wq)
          float sv[kQRows];
          for (int r = 0; r < kQRows; ++r) sv[r] = Elem<T>::get(qh, d + r);
          Ops::qabsorb(sv, qblock(a.wq, (h * rows + d) / kQRows, L), q, L);
        }
      }
      Ops::to_float(qp + b * a.qr_strides[0] + h * a.qr_strides[1], qr + g * R, R);
    }
    // the scores: the latent half, then the rope half, each kept position once for every head
    Ops::latent_scores(ql, G, L, lat_b, a.c_strides[1], kp, n, sc, S, row);
    for (int64_t j = 0; j < n; ++j) {
      const T* k = kr_b + (kp ? kp[j] : j) * a.kr_strides[1];
      for (int64_t g = 0; g < G; ++g) sc[g * S + j] = (sc[g * S + j] + Ops::dot(qr + g * R, k, R)) * a.scale;
    }
    // the softmax of each head, normalised in place (no position attended: zeros, as SDPA gives)
    for (int64_t g = 0; g < G; ++g) {
      float* p = sc + g * S;
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j]);
      const float sum = n ? Ops::exp_sum(p, n, mx) : 0.f;
      const float inv = n ? 1.f / sum : 0.f;
      for (int64_t j = 0; j < n; ++j) p[j] *= inv;
    }
    // the latent outputs: each kept position once again
    std::fill(ol, ol + G * L, 0.f);
    Ops::latent_sums(sc, G, L, lat_b, a.c_strides[1], kp, n, S, ol, row);
    // out of the latent space through the value rows of W
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = h0 + g;
      T* oh = out + (b * a.H + h) * a.Dv;
      if (w != nullptr) {
        const T* wv = w + (h * rows + a.Dn) * L;
        for (int64_t e = 0; e < a.Dv; ++e) Elem<T>::put(oh, e, Ops::dot(ol + g * L, wv + e * L, L));
      } else {
        // int4: each group's sum of the latent output (qdots_vec's -8 per code)
        const float* olg = ol + g * L;
        if (a.wq.fmt == WFormat::kInt4)
          for (int64_t k = 0; k < L / a.wq.group; ++k) {
            float t = 0.f;
            for (int64_t l = k * a.wq.group; l < (k + 1) * a.wq.group; ++l) t += olg[l];
            gsum[k] = t;
          }
        for (int64_t e = 0; e < a.Dv; e += kQRows) {
          float res[kQRows];
          Ops::qdots(olg, gsum, qblock(a.wq, (h * rows + a.Dn + e) / kQRows, L), res, L);
          for (int r = 0; r < kQRows; ++r) Elem<T>::put(oh, e + r, res[r]);
        }
      }
    }
  }
}

template <class Ops>
void run(const MlaDecodeArgs& a, int64_t h0, int64_t h1) {
  switch (a.dtype) {
    case DType::kF32: heads<Ops, float>(a, h0, h1); break;
    case DType::kBF16: heads<Ops, uint16_t>(a, h0, h1); break;
    case DType::kF16: heads<Ops, attn_impl::Half>(a, h0, h1); break;
  }
}

}  // namespace hina::mla_impl
