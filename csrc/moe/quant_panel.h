// Quantisation of one 16-row panel (the contract in hina_moe/experts.h), written once with GCC/Clang
// vector extensions so that the same lane-wise operations compile to SSE2/NEON in the baseline
// translation unit and to AVX-512 in kernels/avx512/quant_avx512.cpp: lane n is output row n,
// and every lane performs exactly the scalar definition's operations in the same order (each
// TU including this is built with -ffp-contract=off, so no FMA contraction changes a rounding).
// The bytes written are therefore identical whichever TU runs (tested against an independent
// scalar quantisation in csrc/tests/test_quant.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "moe/kernel_api.h"

namespace hina::detail::qp {

// W lanes per vector: 16 (AVX-512), 8 (AVX2), 4 (SSE2 / NEON): the width each build's registers
// hold natively (a wider generic vector would be lowered element by element). A panel's 16 rows
// are processed as 16 / W independent chunks of W rows.
typedef float f4v __attribute__((vector_size(16)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f16v __attribute__((vector_size(64)));
template <int W> struct VecOf;
template <> struct VecOf<4> { typedef f4v type; };
template <> struct VecOf<8> { typedef f8v type; };
template <> struct VecOf<16> { typedef f16v type; };
// int32 and int8 lanes of the same widths (activation quantisation)
typedef int32_t i4v __attribute__((vector_size(16)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef int8_t b4v __attribute__((vector_size(4)));
typedef int8_t b8v __attribute__((vector_size(8)));
typedef int8_t b16v __attribute__((vector_size(16)));
template <int W> struct IntVecOf;
template <> struct IntVecOf<4> { typedef i4v type; typedef b4v bytes; };
template <> struct IntVecOf<8> { typedef i8v type; typedef b8v bytes; };
template <> struct IntVecOf<16> { typedef i16v type; typedef b16v bytes; };

// (The vector type comes from a namespace-scope typedef: GCC ignores vector_size on a typedef
// that depends on a template parameter.)
template <int W>
struct Lanes {
  typedef typename VecOf<W>::type F;

  static inline F splat(float x) { return F{} + x; }
  static inline F load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static inline F absv(F v) { return v < 0.0f ? -v : v; }
  // Round to nearest even for |v| <= 2^22 (callers clamp first): two roundings of 1.5 * 2^23.
  static inline F rne_small(F v) { return (v + 12582912.0f) - 12582912.0f; }
  static inline F clampv(F v, float lo, float hi) { return v < lo ? splat(lo) : (v > hi ? splat(hi) : v); }
  static inline F int4_q(F w, F inv) {
    F v = w * inv;
    v = v == v ? v : splat(0.0f);
    return clampv(rne_small(clampv(v, -9.0f, 8.0f)), -8.0f, 7.0f);
  }

  // Lanes [c0, c0 + W) of the panel. wt: the panel's 16 rows, transposed and zero-padded:
  // wt[k * 16 + n], k < Kp.
  static void chunk(const float* wt, int64_t Kp, int G, int gi, WFormat wf, int group, uint8_t* panel, int c0) {
    if (wf == WFormat::kInt8) {
      F amax = splat(0.0f);
      for (int64_t k = 0; k < Kp; ++k) {
        const F a = absv(load(wt + k * kPanelN + c0));
        amax = a > amax ? a : amax;
      }
      const F sc = amax / 127.0f;
      std::memcpy(panel + gi * 64 + c0 * 4, &sc, sizeof(sc));
      uint8_t* q = panel + 64 * G;
      for (int64_t k = 0; k < Kp; ++k) {
        F v = sc > 0.0f ? load(wt + k * kPanelN + c0) / sc : splat(0.0f);
        v = v == v ? v : splat(0.0f);
        v = clampv(rne_small(clampv(v, -128.0f, 128.0f)), -127.0f, 127.0f);
        // layout v3: lane n of quad k/4 holds k % 4 in byte k & 3
        int8_t* dst = reinterpret_cast<int8_t*>(q + q8_index(k, G, gi, c0));
        for (int n = 0; n < W; ++n) dst[4 * n] = static_cast<int8_t>(static_cast<int>(v[n]));
      }
      return;
    }
    // int4 (layout v5, kernel_api.h): each group's signed extreme m; the row factor F is the
    // largest |m| / 8 of the row, and a group's scale is F times a step (q4_step). The step codes
    // tried: e0, the one nearest |m| / 8 in 2^(1/8) steps, then 6 smaller, then one larger; the
    // one with the smallest squared error is kept (ties: the earlier).
    const int64_t ng = Kp / group;
    std::vector<float> mg(static_cast<size_t>(ng * W));
    F fmax = splat(0.0f);
    for (int64_t b = 0; b < ng; ++b) {
      const float* w = wt + b * group * kPanelN + c0;
      F m = splat(0.0f);
      for (int k = 0; k < group; ++k) {
        const F x = load(w + k * kPanelN);
        m = absv(x) > absv(m) ? x : m;
      }
      std::memcpy(&mg[static_cast<size_t>(b * W)], &m, sizeof(m));
      const F a = absv(m) / 8.0f;
      fmax = a > fmax ? a : fmax;
    }
    alignas(64) float fl[W];
    std::memcpy(fl, &fmax, sizeof(fl));
    std::memcpy(panel + gi * 64 + c0 * 4, fl, sizeof(fl));
    constexpr int kCand = 8;
    for (int64_t b = 0; b < ng; ++b) {
      const float* w = wt + b * group * kPanelN + c0;
      alignas(64) float dl[kCand][W], il[kCand][W];
      uint8_t codes[kCand][W];
      for (int n = 0; n < W; ++n) {
        const float m = mg[static_cast<size_t>(b * W + n)];
        const int e0 = q4_nearest_step(m / 8.0f, fl[n]);
        const uint8_t sign = m > 0.0f ? 8 : 0;  // the scale's sign is -m's: m quantises to -8
        for (int i = 0; i < kCand; ++i) {
          int e = e0 + (i < kCand - 1 ? i : -1);
          e = e < 0 ? 0 : (e > 127 ? 127 : e);
          codes[i][n] = static_cast<uint8_t>((e >> 3) << 4 | sign | (e & 7));
          dl[i][n] = q4_scale(codes[i][n], fl[n]);
          il[i][n] = dl[i][n] != 0.0f ? 1.0f / dl[i][n] : 0.0f;
        }
      }
      F dv[kCand], iv[kCand], err[kCand];
      for (int i = 0; i < kCand; ++i) {
        dv[i] = load(dl[i]);
        iv[i] = load(il[i]);
        err[i] = splat(0.0f);
      }
      for (int k = 0; k < group; ++k) {
        const F x = load(w + k * kPanelN);
        for (int i = 0; i < kCand; ++i) {
          const F dq = dv[i] * int4_q(x, iv[i]);
          const F e = x - dq;
          err[i] += e * e;
        }
      }
      alignas(64) float el[kCand][W], ibest[W];
      for (int i = 0; i < kCand; ++i) std::memcpy(el[i], &err[i], sizeof(err[i]));
      uint8_t* scales = panel + q4_scales_at(b, G, group) + gi * 16 + c0;
      for (int n = 0; n < W; ++n) {
        int best = 0;
        for (int i = 1; i < kCand; ++i)
          if (el[i][n] < el[best][n]) best = i;
        scales[n] = codes[best][n];
        ibest[n] = il[best][n];
      }
      const F inv = load(ibest);
      uint8_t* bytes = panel + q4_codes_at(b, G, group);
      // layout v3-v5: per 8 k, byte j of lane n holds k = j (low nibble) and k = j + 4 (high)
      for (int k8 = 0; k8 < group; k8 += 8)
        for (int jb = 0; jb < 4; ++jb) {
          const F lo = int4_q(load(w + (k8 + jb) * kPanelN), inv) + 8.0f;
          const F hi = int4_q(load(w + (k8 + jb + 4) * kPanelN), inv) + 8.0f;
          uint8_t* dst = bytes + q4_index(k8 + jb, G, gi, c0);
          for (int n = 0; n < W; ++n)
            dst[4 * n] = static_cast<uint8_t>(static_cast<int>(lo[n]) | (static_cast<int>(hi[n]) << 4));
        }
    }
  }
};

// v rotated by K lanes (a tree reduction step that keeps the vector type).
template <int K, typename V, size_t... Is>
static inline V rotate_lanes(V v, std::index_sequence<Is...>) {
  return __builtin_shufflevector(v, v, ((Is + K) % sizeof...(Is))...);
}
// NaN-propagating max (NaN if either is NaN), exact in any order.
template <typename V>
static inline V max_nan(V a, V m) { return (a > m || a != a) ? a : m; }

// The activation quantisation of the integer-dot kernels (experts.h): one row of Kp fp32 values
// (Kp a multiple of 32) into [Kp] int8, [Kp/32] fp32 scales, [Kp/32] int32 sums. Lane-wise
// operations only (the block max is exact in any order, NaN-propagating), so every build
// writes the same bytes.
template <int W>
static inline void quant_act_row(const float* x, int64_t Kp, uint8_t* row) {
  typedef typename VecOf<W>::type F;
  typedef typename IntVecOf<W>::type I;
  typedef typename IntVecOf<W>::bytes B;
  typedef Lanes<W> L;
  constexpr int NV = kActBlock / W;
  int8_t* q = reinterpret_cast<int8_t*>(row);
  float* sc = reinterpret_cast<float*>(row + Kp);
  int32_t* sums = reinterpret_cast<int32_t*>(row + Kp + Kp / 8);
  for (int64_t b = 0; b < Kp / kActBlock; ++b) {
    F xv[NV];
    F m = L::splat(0.0f);
    for (int i = 0; i < NV; ++i) {
      xv[i] = L::load(x + b * kActBlock + i * W);
      const F a = L::absv(xv[i]);
      m = (a > m || a != a) ? a : m;
    }
    const auto seq = std::make_index_sequence<W>{};
    if constexpr (W >= 16) m = max_nan(m, rotate_lanes<8>(m, seq));
    if constexpr (W >= 8) m = max_nan(m, rotate_lanes<4>(m, seq));
    m = max_nan(m, rotate_lanes<2>(m, seq));
    m = max_nan(m, rotate_lanes<1>(m, seq));
    const float s = (m[0] + 0.0f) / 127.0f;  // + 0: an all-zero block's -0 and +0 agree
    sc[b] = s;
    int8_t* qb = q + b * kActBlock;
    if (!(s > 0.0f)) {  // zero block (or NaN scale): q = 0; a NaN scale still reaches the output
      std::memset(qb, 0, kActBlock);
      sums[b] = 0;
      continue;
    }
    const F sv = L::splat(s);
    I tot = I{} + 0;
    for (int i = 0; i < NV; ++i) {
      F v = xv[i] / sv;
      v = v == v ? v : L::splat(0.0f);
      v = L::rne_small(L::clampv(v, -127.0f, 127.0f));
      const I qi = __builtin_convertvector(v, I);
      tot += qi;
      const B qbv = __builtin_convertvector(qi, B);
      std::memcpy(qb + i * W, &qbv, W);
    }
    if constexpr (W >= 16) tot += rotate_lanes<8>(tot, seq);
    if constexpr (W >= 8) tot += rotate_lanes<4>(tot, seq);
    tot += rotate_lanes<2>(tot, seq);
    tot += rotate_lanes<1>(tot, seq);
    sums[b] = tot[0];
  }
}

template <int W>
static inline void quant_panel(const float* wt, int64_t Kp, int G, int gi, WFormat wf, int group, uint8_t* panel) {
  for (int c0 = 0; c0 < kPanelN; c0 += W) Lanes<W>::chunk(wt, Kp, G, gi, wf, group, panel, c0);
}

}  // namespace hina::detail::qp
