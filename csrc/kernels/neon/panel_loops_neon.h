// Panel loops shared by the Arm tiers' kernel families: fp32 FMAs on lossless weights
// (moe_neon.cpp), integer dot products on quantised ones (qdot_neon_impl.h, built as neondot,
// dotprod and i8mm) and bf16 dot products (moe_bf16_neonbf16.cpp). They differ only in how a panel is dotted with a block of rows; the loops over
// panels and row blocks, the scalar gate/up epilogue (kernel_api.h's gateup_row_scalar) and the
// routing-weighted scatter-add of down are here, as the x86 tiers share theirs
// (kernels/avx512/qpanel_loops.h). A family is a struct with
//   static constexpr bool kQdot;   quantised activation rows (KernelImpl::qdot)
//   static constexpr int kRows;    rows sharing one pass over a panel (1: each row alone)
//   static constexpr bool kBf16Rows;  x and h rows in bf16 (KernelImpl::x_bf16 / h_bf16: h is
//                                  rounded once, after the activation), else fp32 / quantised
//   template <int G, int NT> static void dot(const uint8_t* panel, int64_t Kp, int group,
//                                            int64_t ahead, const void* const* rows,
//                                            float (*out)[G][kPanelN]);
//   static const void* down_row(const DownJob&, int64_t r);   row r of h
// (dot: out[r][gi][n] is column n of matrix gi (gate, up) dotted with rows[r], every scale
// applied; NT <= kRows; Kp the reduction length, group int4's group; ahead the prefetch distance
// in bytes, pf::bytes(), 0 for none).
// Include only from aarch64 TUs; each includer keeps its own copy (its own -march).
#pragma once

#if !defined(__aarch64__)
#error "kernels/neon is built for aarch64 only (CMakeLists.txt)"
#endif
#include <cmath>
#include <type_traits>

#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail::loops_neon {
namespace {  // internal linkage: each including TU (each with its own -march) keeps its copy

// Calls f(std::integral_constant<int, NT>{}, r0) over rows [0, nt) in blocks of M, then the
// rest as one block (fewer than M rows: the largest block that fits, recursively).
template <int M, class Fn>
inline void row_blocks(int64_t nt, Fn&& f) {
  int64_t r0 = 0;
  for (; r0 + M <= nt; r0 += M) f(std::integral_constant<int, M>{}, r0);
  if constexpr (M > 1)
    if (r0 < nt) row_blocks<M - 1>(nt - r0, [&](auto nt_c, int64_t r) { f(nt_c, r0 + r); });
}

template <class Fam, bool Gated>
void gateup(const GateUpJob& j) {
  pf::reload();
  constexpr int G = Gated ? 2 : 1;
  const Layout& L = *j.L;
  const int64_t pbytes = gu_panel_bytes(L), ahead = pf::bytes();
  using HT = std::conditional_t<Fam::kBf16Rows, uint16_t, float>;
  HT* h = static_cast<HT*>(j.h);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint8_t* panel = static_cast<const uint8_t*>(j.w) + p * pbytes;
    row_blocks<Fam::kRows>(j.nt, [&](auto nt_c, int64_t r0) {
      constexpr int NT = decltype(nt_c)::value;
      alignas(16) float acc[NT][G][kPanelN];
      Fam::template dot<G, NT>(panel, L.Hk, L.group, ahead, j.x + r0, acc);
      for (int r = 0; r < NT; ++r) gateup_row_scalar<Gated>(j, p, &acc[r][0][0], h + (r0 + r) * j.h_stride);
    });
  }
}

template <class Fam>
void down(const DownJob& j) {
  pf::reload();
  const Layout& L = *j.L;
  const int64_t pbytes = down_panel_bytes(L), ahead = pf::bytes();
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint8_t* panel = static_cast<const uint8_t*>(j.w) + p * pbytes;
    row_blocks<Fam::kRows>(j.nt, [&](auto nt_c, int64_t r0) {
      constexpr int NT = decltype(nt_c)::value;
      const void* rows[NT];
      for (int r = 0; r < NT; ++r) rows[r] = Fam::down_row(j, r0 + r);
      alignas(16) float y[NT][1][kPanelN];
      Fam::template dot<1, NT>(panel, L.Ik, L.group, ahead, rows, y);
      for (int r = 0; r < NT; ++r)
        for (int n = 0; n < kPanelN; ++n) {
          const int64_t col = p * kPanelN + n;
          if (col >= L.H) break;
          float yv = y[r][0][n];
          if (j.bias) yv += j.bias[col];
          j.acc[r0 + r][col] = std::fma(j.wt[r0 + r], yv, j.acc[r0 + r][col]);
        }
    });
  }
}

template <class Fam>
void gateup_dispatch(const GateUpJob& j) {
  if (j.L->G == 2) gateup<Fam, true>(j);
  else gateup<Fam, false>(j);
}

// The kernel table entries of a family (its rows' format, no slack, no next-job hint).
template <class Fam>
inline void set_kernels(KernelImpl* k) {
  k->gateup = &gateup_dispatch<Fam>;
  k->down = &down<Fam>;
  k->x_bf16 = k->h_bf16 = Fam::kBf16Rows;
  k->row_slack = 0;
  k->uses_w_next = false;
  k->qdot = Fam::kQdot;
}

}  // namespace
}  // namespace hina::detail::loops_neon
