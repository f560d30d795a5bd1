// Panel loops shared by the AVX-512 tier's two quantised-kernel families: weight expansion
// (moe_q_avx512.cpp) and integer dot products (moe_qdot_avx512vnni.cpp). They differ only in
// how a panel is dotted with a block of rows; the loops over panels and row blocks, the bias,
// activation and h store (gate/up) and the routing-weighted scatter-add (down) are here.
// A family is a struct with
//   template <WFormat F> static constexpr int max_rows();     rows sharing one weight pass
//   template <WFormat F, int G, int NT> static void gateup_dot(const GateUpJob&, const uint8_t* panel,
//                                                              int64_t r0, int ahead, const float* dsc,
//                                                              __m512 (&acc)[NT][2]);
//   template <WFormat F, int NT> static void down_dot(const DownJob&, const uint8_t* panel,
//                                                     int64_t r0, int ahead, const float* dsc, __m512 (&y)[NT][2]);
// (acc[r][gi]: 16 columns of matrix gi (gate, up) for row r0 + r, all scales applied; ahead: the
// job's prefetch distance, pf::ahead, 0 for none; dsc: int4's group steps decoded for the whole
// panel (q4_step, without the row factor), [Kp / group][G][16] floats, for a job of more than
// one row (NT > 1 reads them), else null: the dot of one row decodes each group's itself).
// Include only from TUs compiled with at least the avx512 tier's flags.
#pragma once

#include <immintrin.h>

#include <type_traits>

#include "kernels/avx512/vec_avx512.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail::qloops512 {
namespace {  // internal linkage: each including TU (each with its own ISA flags) keeps its copy

// Calls f(std::integral_constant<int, NT>{}, r0) over rows [0, nt) in blocks of M, then the rest.
template <int M, class Fn>
inline void row_blocks(int64_t nt, Fn&& f) {
  int64_t r0 = 0;
  for (; r0 + M <= nt; r0 += M) f(std::integral_constant<int, M>{}, r0);
  switch (nt - r0) {
    case 3: if constexpr (M > 3) f(std::integral_constant<int, 3>{}, r0); break;
    case 2: if constexpr (M > 2) f(std::integral_constant<int, 2>{}, r0); break;
    case 1: if constexpr (M > 1) f(std::integral_constant<int, 1>{}, r0); break;
    default: break;
  }
}

// int4's group steps of one panel, decoded once for its row blocks (see dsc above); null for a
// job of one row (decode; it decodes in line) or a format without them. The dots of several rows
// only read these, so their loops hold no decoding constants.
template <WFormat F, int G>
inline const float* panel_steps(const uint8_t* panel, int64_t Kp, int group, int64_t nt) {
  if constexpr (F != WFormat::kInt4) {
    return nullptr;
  } else {
    if (nt <= 1) return nullptr;
    thread_local AlignedBuf buf;
    const int64_t ng = Kp / group;
    float* out = static_cast<float*>(buf.get(static_cast<size_t>(ng * G * kPanelN) * sizeof(float)));
    Q4Walk<G> q(panel, group);
    for (int64_t g = 0; g < ng; ++g, q.next())
      for (int gi = 0; gi < G; ++gi) _mm512_store_ps(out + (g * G + gi) * kPanelN, v512::q4_steps16(q.scales() + gi * 16));
    return out;
  }
}

template <class Fam, WFormat F, bool Gated>
void gateup(const GateUpJob& j) {
  pf::reload();
  const int ahead = pf::ahead(j.nt);
  constexpr int G = Gated ? 2 : 1;
  const Layout& L = *j.L;
  const int64_t pbytes = gu_panel_bytes(L);
  float* h = static_cast<float*>(j.h);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint8_t* panel = static_cast<const uint8_t*>(j.w) + p * pbytes;
    const int64_t col0 = p * kPanelN;
    const __mmask16 valid = v512::valid_mask(col0, L.I);
    const __m512 bg = j.bias_g ? _mm512_load_ps(j.bias_g + col0) : _mm512_setzero_ps();
    const __m512 bu = j.bias_u ? _mm512_load_ps(j.bias_u + col0) : _mm512_setzero_ps();
    const float* dsc = panel_steps<F, G>(panel, L.Hk, L.group, j.nt);
    row_blocks<Fam::template max_rows<F>()>(j.nt, [&](auto nt_c, int64_t r0) {
      constexpr int NT = decltype(nt_c)::value;
      __m512 acc[NT][2];
      Fam::template gateup_dot<F, G, NT>(j, panel, r0, ahead, dsc, acc);
      for (int r = 0; r < NT; ++r) {
        const __m512 g = Gated ? _mm512_add_ps(acc[r][0], bg) : _mm512_setzero_ps();
        const __m512 u = _mm512_add_ps(acc[r][G - 1], bu);
        float* hr = h + (r0 + r) * j.h_stride + col0;
        if (Gated && j.pair) {  // a paired linear layer: both halves as they are
          _mm512_store_ps(hr, _mm512_maskz_mov_ps(valid, g));
          _mm512_store_ps(hr + j.pair, _mm512_maskz_mov_ps(valid, u));
          continue;
        }
        _mm512_store_ps(hr, v512::h_vec(*j.act, Gated, g, u, valid));
      }
    });
  }
}

template <class Fam, WFormat F>
void down(const DownJob& j) {
  pf::reload();
  const int ahead = pf::ahead(j.nt);
  const int64_t pbytes = down_panel_bytes(*j.L);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint8_t* panel = static_cast<const uint8_t*>(j.w) + p * pbytes;
    const int64_t col0 = p * kPanelN;
    const __m512 b = j.bias ? _mm512_load_ps(j.bias + col0) : _mm512_setzero_ps();
    const float* dsc = panel_steps<F, 1>(panel, j.L->Ik, j.L->group, j.nt);
    row_blocks<Fam::template max_rows<F>()>(j.nt, [&](auto nt_c, int64_t r0) {
      constexpr int NT = decltype(nt_c)::value;
      __m512 y[NT][2];
      Fam::template down_dot<F, NT>(j, panel, r0, ahead, dsc, y);
      for (int r = 0; r < NT; ++r) {
        float* a = j.acc[r0 + r] + col0;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(j.wt[r0 + r]), _mm512_add_ps(y[r][0], b),
                                            _mm512_loadu_ps(a)));
      }
    });
  }
}

template <class Fam, WFormat F>
void gateup_dispatch(const GateUpJob& j) {
  if (j.L->G == 2) gateup<Fam, F, true>(j);
  else gateup<Fam, F, false>(j);
}

}  // namespace
}  // namespace hina::detail::qloops512
