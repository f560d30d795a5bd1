// Decode attention of multi-head latent attention (hina::mla_decode, csrc/include/hina_moe/moe.h),
// written once over a vector-ops policy and compiled per tier: the baseline loops
// (csrc/moe/mla.cpp, attention_impl.h's kLanes accumulators), AVX2 (csrc/kernels/avx2/
// mla_avx2.cpp) and AVX-512 (csrc/kernels/avx512/mla_avx512.cpp).
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
// Each thread takes a group of heads and reads each cached position once for all of them: the
// position's latent and rope key are made float32 once, then scored against every head of the
// group, and once more for the weighted sums.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_impl.h"
#include "hina_moe/moe.h"

namespace hina::mla_impl {

using attn_impl::Elem;

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
  // x[i] = e^(x[i] - mx), returning their sum
  static float exp_sum(float* x, int64_t n, float mx) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - mx));
    return sum;
  }
};

// Heads [h0, h1) of every batch row.
template <class Ops, class T>
void heads(const MlaDecodeArgs& a, int64_t h0, int64_t h1) {
  const int64_t G = h1 - h0, L = a.L, R = a.Dr, S = a.S, rows = a.Dn + a.Dv;
  // per head: its latent query (L) and rope query (R), its scores (S), its latent output (L);
  // then one position's latent and rope key as float32 (L + R)
  thread_local std::vector<float> scratch;
  thread_local std::vector<int32_t> kept;
  scratch.resize(static_cast<size_t>(G * (2 * L + R + S) + L + R));
  kept.resize(static_cast<size_t>(S));
  float* ql = scratch.data();
  float* qr = ql + G * L;
  float* sc = qr + G * R;
  float* ol = sc + G * S;
  float* row = ol + G * L;
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
    auto pos = [&](int64_t j) { return a.mask ? static_cast<int64_t>(kept[j]) : j; };
    // the queries: the nope part through the key rows of W into the latent space
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = h0 + g;
      float* q = ql + g * L;
      std::fill(q, q + L, 0.f);
      const T* qh = qn + b * a.qn_strides[0] + h * a.qn_strides[1];
      const T* wh = w + h * rows * L;
      for (int64_t d = 0; d < a.Dn; ++d) Ops::axpy(Elem<T>::get(qh, d), wh + d * L, q, L);
      Ops::to_float(qp + b * a.qr_strides[0] + h * a.qr_strides[1], qr + g * R, R);
    }
    // the scores: each kept position once, for every head of the group
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = pos(j);
      Ops::to_float(lat + b * a.c_strides[0] + s * a.c_strides[1], row, L);
      Ops::to_float(kr + b * a.kr_strides[0] + s * a.kr_strides[1], row + L, R);
      for (int64_t g = 0; g < G; ++g)
        sc[g * S + j] = (Ops::dot(ql + g * L, row, L) + Ops::dot(qr + g * R, row + L, R)) * a.scale;
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
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = pos(j);
      Ops::to_float(lat + b * a.c_strides[0] + s * a.c_strides[1], row, L);
      for (int64_t g = 0; g < G; ++g) Ops::axpy(sc[g * S + j], row, ol + g * L, L);
    }
    // out of the latent space through the value rows of W
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = h0 + g;
      const T* wv = w + (h * rows + a.Dn) * L;
      T* oh = out + (b * a.H + h) * a.Dv;
      for (int64_t e = 0; e < a.Dv; ++e) Elem<T>::put(oh, e, Ops::dot(ol + g * L, wv + e * L, L));
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
