// Panel loops (and the int4 scale decoding) shared by the AVX2 tier's quantised-kernel families: weight expansion
// (moe_q_avx2.cpp) and integer dot products (qdot_avx2_impl.h, built as avx2dot and avxvnni).
// They differ only in how a panel is dotted with a block of rows; the loops over panels and row
// blocks, bias + activation + h store (gate/up) and the routing-weighted scatter-add (down) are
// here (the activation vectorised: vec_avx2.h). A family is a struct with
//   template <WFormat F> static constexpr int max_rows();
//   template <WFormat F, int G, int NT> static void gateup_dot(const GateUpJob&, const uint8_t* panel,
//                                                              int64_t r0, int ahead, const float* dsc,
//                                                              __m256 (&acc)[NT][2][2]);
//   template <WFormat F, int NT> static void down_dot(const DownJob&, const uint8_t* panel,
//                                                     int64_t r0, int ahead, const float* dsc, __m256 (&y)[NT][2][2]);
// (acc[r][gi][half]: columns half*8 .. half*8+7 of matrix gi for row r0 + r, scales applied;
// ahead: the job's prefetch distance, pf::ahead, 0 for none; dsc: int4's group scales decoded
// for the whole panel as steps (q4_step, without the row factor), [Kp / group][G][16] floats, for
// a job of more than one row (NT > 1 reads them), else null: the dot of one row decodes each
// group's itself).
// Include only from TUs compiled with at least -mavx2 -mfma.
#pragma once

#include <immintrin.h>

#include <type_traits>

#include "kernels/avx2/vec_avx2.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail::qloops256 {
namespace {  // internal linkage: each including TU (each with its own ISA flags) keeps its copy

// 8 steps of an int4 group, q4_step (kernel_api.h) bit for bit, from 8 scale codes: the
// magnitude from the table's first 8 entries by the low 3 bits (vpermps), the sign bit from bit
// 3, times 2^-a by subtracting a from the exponent field.
inline __m256 q4_steps8(const uint8_t* codes) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256 mag = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kQ4Step), c);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28);
  const __m256i a = _mm256_slli_epi32(_mm256_srli_epi32(c, 4), 23);
  return _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_xor_si256(_mm256_castps_si256(mag), sign), a));
}

// Calls f(std::integral_constant<int, NT>{}, r0) over rows [0, nt) in blocks of M (M <= 4),
// then one block of the rest.
template <int M, class Fn>
inline void row_blocks(int64_t nt, Fn&& f) {
  static_assert(M >= 1 && M <= 4, "AVX2 quantised kernels share a weight pass over at most 4 rows");
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
      for (int gi = 0; gi < G; ++gi)
        for (int half = 0; half < 2; ++half)
          _mm256_store_ps(out + (g * G + gi) * kPanelN + half * 8, q4_steps8(q.scales() + gi * 16 + half * 8));
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
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint8_t* panel = static_cast<const uint8_t*>(j.w) + p * pbytes;
    const int64_t col0 = p * kPanelN;
    const float* dsc = panel_steps<F, G>(panel, L.Hk, L.group, j.nt);
    row_blocks<Fam::template max_rows<F>()>(j.nt, [&](auto nt_c, int64_t r0) {
      constexpr int NT = decltype(nt_c)::value;
      __m256 acc[NT][2][2];
      Fam::template gateup_dot<F, G, NT>(j, panel, r0, ahead, dsc, acc);
      for (int half = 0; half < 2; ++half) {
        const int64_t c = col0 + half * 8;
        const __m256 valid = v256::valid_mask(c, L.I);
        const __m256 bg = j.bias_g ? _mm256_loadu_ps(j.bias_g + c) : _mm256_setzero_ps();
        const __m256 bu = j.bias_u ? _mm256_loadu_ps(j.bias_u + c) : _mm256_setzero_ps();
        for (int r = 0; r < NT; ++r) {
          const __m256 g = Gated ? _mm256_add_ps(acc[r][0][half], bg) : _mm256_setzero_ps();
          const __m256 u = _mm256_add_ps(acc[r][G - 1][half], bu);
          float* hr = static_cast<float*>(j.h) + (r0 + r) * j.h_stride + c;
          if (Gated && j.pair) {  // a paired linear layer: both halves as they are
            _mm256_storeu_ps(hr, _mm256_and_ps(g, valid));
            _mm256_storeu_ps(hr + j.pair, _mm256_and_ps(u, valid));
            continue;
          }
          _mm256_storeu_ps(hr, v256::h_vec(*j.act, Gated, g, u, valid));
        }
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
    const float* dsc = panel_steps<F, 1>(panel, j.L->Ik, j.L->group, j.nt);
    row_blocks<Fam::template max_rows<F>()>(j.nt, [&](auto nt_c, int64_t r0) {
      constexpr int NT = decltype(nt_c)::value;
      __m256 y[NT][2][2];
      Fam::template down_dot<F, NT>(j, panel, r0, ahead, dsc, y);
      for (int r = 0; r < NT; ++r) {
        const __m256 w = _mm256_set1_ps(j.wt[r0 + r]);
        for (int half = 0; half < 2; ++half) {
          float* a = j.acc[r0 + r] + col0 + half * 8;
          const __m256 b = j.bias ? _mm256_loadu_ps(j.bias + col0 + half * 8) : _mm256_setzero_ps();
          _mm256_storeu_ps(a, _mm256_fmadd_ps(w, _mm256_add_ps(y[r][0][half], b), _mm256_loadu_ps(a)));
        }
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
}  // namespace hina::detail::qloops256
