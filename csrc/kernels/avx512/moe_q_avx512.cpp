// [NOTE] moe_decode_<q>_avx512 / moe_prefill_<q>_avx512 (q: int8, int4)
// Flags: -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c (tier `avx512`; no VNNI).
//
// Data layout: layout v5 quantised panels (PackedHeader; moe_generic.cpp has the table).
//   int8: 64*G bytes of fp32 row scales, then per 4 k: G x 64 bytes (16 lanes x 4 k, int8).
//   int4: 64*G bytes of fp32 row factors, then blocks of 64 bytes of scale codes and the codes
//         of their groups: per 8 k, G x 64 bytes (16 lanes x 4 bytes; byte j: k = j in the low
//         nibble, k = j + 4 in the high one, q + 8).
// Register plan: one panel = 16 output columns = one zmm per row and matrix. Weights are
// expanded to fp32 in registers and FMA'd with broadcast fp32 x / h (no activation
// quantisation, so the result is the dequantised model's, up to summation order):
//   int8: one 64-byte load per 4 k and matrix; byte j of each lane by vpslld + vpsrad (byte 3:
//         vpsrad only) + vcvtdq2ps; two FMA chains; the row scale multiplies the dot product
//         once at the end (exact factoring).
//   int4: one 64-byte load per 8 k and matrix; nibble -> float without a conversion:
//         (v >> shift & 15) | 0x4B000000 is the float 2^23 + nibble (vpsrld + vpternlogd),
//         minus 2^23 + 8 gives q exactly. Per group: two chains per row and matrix, then
//         acc = fma(chains, group scale, acc).
//   Rows: NT <= 4 (int8) / 3 (int4) rows share each expanded weight vector (prefill reuse);
//   the int4 limit keeps 6 accumulators per row plus constants within the 32 zmm registers.
// Software prefetch of the weight stream (moe/prefetch.h: the job's distance, pf::ahead, into L2), one line per
// 64 bytes consumed.
// Known limits: the expansion costs 2-3 vector ops per 16 weights, so int4 decode is bounded
// by the FMA ports before memory on slow-clocked cores (measured in benchmarks/RESULTS.md);
// the integer-dot kernels (moe_qdot_avx512vnni.cpp) avoid the expansion entirely.
#include <immintrin.h>

#include <type_traits>

#include "kernels/avx512/qpanel_loops.h"
#include "kernels/avx512/vec_avx512.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {


inline void prefetch(const void* p) { pf::line(p); }

// Dot products of one quantised panel with NT rows: out[r][gi] for matrices gi < G, 16 columns
// each, scales applied. x[r] points at row r (fp32, Kp long, zero-padded).
template <WFormat F, int G, int NT>
inline void qpanel_dot(const uint8_t* panel, int64_t Kp, int group, int ahead, const float* dsc, const float* const* x,
                       __m512 out[][2]) {
  for (int r = 0; r < NT; ++r)
    for (int gi = 0; gi < G; ++gi) out[r][gi] = _mm512_setzero_ps();
  if constexpr (F == WFormat::kInt8) {
    __m512 a0[NT][G], a1[NT][G];
    for (int r = 0; r < NT; ++r)
      for (int gi = 0; gi < G; ++gi) a0[r][gi] = a1[r][gi] = _mm512_setzero_ps();
    const uint8_t* w = panel + 64 * G;
    for (int64_t k = 0; k < Kp; k += 4, w += 4 * G * kPanelN) {
      if (ahead) prefetch(w + ahead);
      if (ahead && G == 2) prefetch(w + ahead + 64);  // G == 2 consumes 128 bytes per step
      for (int gi = 0; gi < G; ++gi) {
        const __m512i v = _mm512_load_si512(w + gi * 4 * kPanelN);
        const __m512 w0 = v512::i8_lane_ps<0>(v), w1 = v512::i8_lane_ps<1>(v);
        const __m512 w2 = v512::i8_lane_ps<2>(v), w3 = v512::i8_lane_ps<3>(v);
        for (int r = 0; r < NT; ++r) {
          a0[r][gi] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r][k]), a0[r][gi]);
          a1[r][gi] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[r][k + 1]), a1[r][gi]);
          a0[r][gi] = _mm512_fmadd_ps(w2, _mm512_set1_ps(x[r][k + 2]), a0[r][gi]);
          a1[r][gi] = _mm512_fmadd_ps(w3, _mm512_set1_ps(x[r][k + 3]), a1[r][gi]);
        }
      }
    }
    for (int gi = 0; gi < G; ++gi) {
      const __m512 sc = _mm512_load_ps(reinterpret_cast<const float*>(panel + gi * 64));
      for (int r = 0; r < NT; ++r) out[r][gi] = _mm512_mul_ps(_mm512_add_ps(a0[r][gi], a1[r][gi]), sc);
    }
  } else {
    // a group's scales: the rows' factors times its steps, read from dsc for several rows
    // (qpanel_loops.h), decoded here for one
    Q4Walk<G> q(panel, group);
    for (int64_t k0 = 0, g = 0; k0 < Kp; k0 += group, ++g, q.next()) {
      if (ahead) q.prefetch(ahead, prefetch);
      __m512 a0[NT][G], a1[NT][G];
      for (int r = 0; r < NT; ++r)
        for (int gi = 0; gi < G; ++gi) a0[r][gi] = a1[r][gi] = _mm512_setzero_ps();
      const uint8_t* w = q.codes();
      for (int kk = 0; kk < group; kk += 8, w += G * 4 * kPanelN) {
        for (int gi = 0; gi < G; ++gi) {
          const __m512i v = _mm512_load_si512(w + gi * 4 * kPanelN);
          const float* xk[NT];
          for (int r = 0; r < NT; ++r) xk[r] = x[r] + k0 + kk;
          auto step = [&](auto jc) {
            constexpr int J = decltype(jc)::value;
            const __m512 wj = v512::i4_lane_ps<J>(v);
            for (int r = 0; r < NT; ++r) {
              if constexpr (J & 1) a1[r][gi] = _mm512_fmadd_ps(wj, _mm512_set1_ps(xk[r][J]), a1[r][gi]);
              else a0[r][gi] = _mm512_fmadd_ps(wj, _mm512_set1_ps(xk[r][J]), a0[r][gi]);
            }
          };
          step(std::integral_constant<int, 0>{});
          step(std::integral_constant<int, 1>{});
          step(std::integral_constant<int, 2>{});
          step(std::integral_constant<int, 3>{});
          step(std::integral_constant<int, 4>{});
          step(std::integral_constant<int, 5>{});
          step(std::integral_constant<int, 6>{});
          step(std::integral_constant<int, 7>{});
        }
      }
      for (int gi = 0; gi < G; ++gi) {
        const __m512 t = NT > 1 || dsc ? _mm512_load_ps(dsc + (g * G + gi) * kPanelN) : v512::q4_steps16(q.scales() + gi * 16);
        const __m512 sc = _mm512_mul_ps(_mm512_load_ps(q4_factors(panel, gi)), t);
        for (int r = 0; r < NT; ++r)
          out[r][gi] = _mm512_fmadd_ps(_mm512_add_ps(a0[r][gi], a1[r][gi]), sc, out[r][gi]);
      }
    }
  }
}

// The expansion family for the shared panel loops (kernels/avx512/qpanel_loops.h).
struct Expand {
  template <WFormat F>
  static constexpr int max_rows() { return F == WFormat::kInt8 ? 4 : 3; }

  template <WFormat F, int G, int NT>
  static void gateup_dot(const GateUpJob& j, const uint8_t* panel, int64_t r0, int ahead, const float* dsc,
                         __m512 (&acc)[NT][2]) {
    const float* xr[NT];
    for (int r = 0; r < NT; ++r) xr[r] = static_cast<const float*>(j.x[r0 + r]);
    qpanel_dot<F, G, NT>(panel, j.L->Hk, j.L->group, ahead, dsc, xr, acc);
  }

  template <WFormat F, int NT>
  static void down_dot(const DownJob& j, const uint8_t* panel, int64_t r0, int ahead, const float* dsc,
                       __m512 (&y)[NT][2]) {
    const float* hr[NT];
    for (int r = 0; r < NT; ++r) hr[r] = static_cast<const float*>(j.h) + (r0 + r) * j.h_stride;
    qpanel_dot<F, 1, NT>(panel, j.L->Ik, j.L->group, ahead, dsc, hr, y);
  }
};

}  // namespace

bool get_qkernels_avx512(WFormat wf, KernelImpl* k) {
  k->x_bf16 = k->h_bf16 = false;
  k->row_slack = 0;
  switch (wf) {
    case WFormat::kInt8:
      k->gateup = &qloops512::gateup_dispatch<Expand, WFormat::kInt8>;
      k->down = &qloops512::down<Expand, WFormat::kInt8>;
      return true;
    case WFormat::kInt4:
      k->gateup = &qloops512::gateup_dispatch<Expand, WFormat::kInt4>;
      k->down = &qloops512::down<Expand, WFormat::kInt4>;
      return true;
    default: return false;
  }
}

}  // namespace hina::detail
