// Decode attention (one query row per (batch, head)), written once and compiled twice: at the
// baseline (csrc/moe/attention.cpp) and with AVX-512 F/BW/VL (csrc/kernels/avx512/
// attention_avx512.cpp). The loops run over kLanes independent float32 accumulators so the
// compiler vectorises them without reassociating (no -ffast-math).
//
//   scores_j = (q . k_j) * scale, j < S;  p = softmax(scores);  out = sum_j p_j v_j
//
// With attention sinks (a per-head logit z, GPT-OSS) the softmax's denominator also holds e^z:
// m = max(max_j scores_j, z), p_j = e^(scores_j - m) / (sum_i e^(scores_i - m) + e^(z - m)).
// Without sinks z = -inf, which changes nothing.
//
// float32 math, one rounding to the dtype at the end; the softmax's exponentials use std::exp.
// Keys and values are read through strides (elements) of [batch, kv head, position], the last
// dimension contiguous: transformers' DynamicCache hands out contiguous [B, Hkv, S, D] tensors,
// other caches views of larger buffers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "hina_moe/attention.h"
#include "kernel_api.h"

namespace hina::attn_impl {

constexpr int kLanes = 16;

template <class T>
struct Elem;
template <>
struct Elem<float> {
  static float get(const float* p, int64_t i) { return p[i]; }
  static void put(float* p, int64_t i, float v) { p[i] = v; }
};
template <>
struct Elem<uint16_t> {  // bfloat16
  static float get(const uint16_t* p, int64_t i) { return detail::bf16_to_f32(p[i]); }
  static void put(uint16_t* p, int64_t i, float v) { p[i] = detail::f32_to_bf16(v); }
};
struct Half {  // float16, stored as uint16_t
  uint16_t bits;
};
template <>
struct Elem<Half> {
  static float get(const Half* p, int64_t i) { return detail::f16_to_f32(p[i].bits); }
  static void put(Half* p, int64_t i, float v) { p[i].bits = detail::f32_to_f16(v); }
};

template <class T>
static inline float dot(const float* q, const T* k, int64_t D) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += q[i + l] * Elem<T>::get(k, i + l);
  float s = 0.f;
  for (; i < D; ++i) s += q[i] * Elem<T>::get(k, i);
  for (float v : lane) s += v;
  return s;
}

template <class T>
static inline void axpy(float a, const T* v, float* acc, int64_t D) {
  for (int64_t i = 0; i < D; ++i) acc[i] += a * Elem<T>::get(v, i);
}

// The keys row b attends to: nullptr (all S) or their indices in `keys`; returns how many.
inline int64_t select_keys(const AttnDecodeArgs& a, int64_t b, int32_t* keys) {
  if (!a.mask) return a.S;
  const uint8_t* m = a.mask + b * a.mask_bstride;
  int64_t n = 0;
  for (int64_t j = 0; j < a.S; ++j)
    if (m[j]) keys[n++] = static_cast<int32_t>(j);
  return n;
}

// The sink's term of the softmax's denominator, e^(sink - mx) with mx the maximum over the
// scores and the sink: 0 without a sink (-inf) or without keys (the row's output is zeros then).
inline float sink_share(float sink, float mx, int64_t n) {
  return sink == -INFINITY || n == 0 ? 0.f : std::exp(sink - mx);
}

// One (batch, head) row over n keys (their indices in `keys`, or 0..n-1 when keys is null).
// scratch: n + 2 D floats.
template <class T>
void one_head(const T* q, const T* k, const T* v, const int32_t* keys, int64_t n, int64_t D, int64_t ks, int64_t vs,
              float scale, float sink, T* out, float* scratch) {
  float* sc = scratch;
  float* acc = scratch + n;
  float* qf = acc + D;
  for (int64_t i = 0; i < D; ++i) qf[i] = Elem<T>::get(q, i);
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    sc[j] = dot(qf, k + (keys ? keys[j] : j) * ks, D) * scale;
    mx = std::max(mx, sc[j]);
  }
  mx = std::max(mx, sink);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    sc[j] = std::exp(sc[j] - mx);
    sum += sc[j];
  }
  sum += sink_share(sink, mx, n);
  for (int64_t i = 0; i < D; ++i) acc[i] = 0.f;
  for (int64_t j = 0; j < n; ++j) axpy(sc[j], v + (keys ? keys[j] : j) * vs, acc, D);
  const float inv = n ? 1.f / sum : 0.f;  // no key attended: zeros, as SDPA gives
  for (int64_t i = 0; i < D; ++i) Elem<T>::put(out, i, acc[i] * inv);
}

// Every build's driver: head(q, k, v, keys, n, sink, out) for each (batch, query head) of [h0, h1),
// with k and v at that row's kv head, the kept keys' indices (keys, a buffer of S; null without
// a mask) gathered once per batch row, and the head's sink logit (-inf: none).
template <class T, class Head>
void for_heads(const AttnDecodeArgs& a, int64_t h0, int64_t h1, int32_t* keys, Head&& head) {
  const int64_t groups = a.Hq / a.Hkv;
  int64_t row = -1, n = a.S;
  for (int64_t bh = h0; bh < h1; ++bh) {
    const int64_t b = bh / a.Hq, kvh = bh % a.Hq / groups;
    if (a.mask && b != row) n = select_keys(a, row = b, keys);
    head(static_cast<const T*>(a.q) + bh * a.D, static_cast<const T*>(a.k) + b * a.k_strides[0] + kvh * a.k_strides[1],
         static_cast<const T*>(a.v) + b * a.v_strides[0] + kvh * a.v_strides[1], a.mask ? keys : nullptr, n,
         a.sinks ? a.sinks[bh % a.Hq] : -INFINITY, static_cast<T*>(a.out) + bh * a.D);
  }
}

// e^x = 2^n p(r) with x = n ln2 + r (|r| <= ln2 / 2), for the vector builds' softmax: ln2 in two
// parts, and p's degree-6 Taylor coefficients, highest first (relative error below 2e-7).
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;
constexpr float kExpPoly[7] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

template <class T>
void heads(const AttnDecodeArgs& a, int64_t h0, int64_t h1) {
  thread_local std::vector<float> scratch;
  thread_local std::vector<int32_t> keys;
  scratch.resize(static_cast<size_t>(a.S + 2 * a.D));
  keys.resize(static_cast<size_t>(a.S));
  for_heads<T>(a, h0, h1, keys.data(),
              [&](const T* q, const T* k, const T* v, const int32_t* kept, int64_t n, float sink, T* out) {
    one_head(q, k, v, kept, n, a.D, a.k_strides[2], a.v_strides[2], a.scale, sink, out, scratch.data());
  });
}

inline void run(const AttnDecodeArgs& a, int64_t h0, int64_t h1) {
  switch (a.dtype) {
    case DType::kF32: heads<float>(a, h0, h1); break;
    case DType::kBF16: heads<uint16_t>(a, h0, h1); break;
    case DType::kF16: heads<Half>(a, h0, h1); break;
  }
}

}  // namespace hina::attn_impl
