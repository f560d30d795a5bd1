// [NOTE] moe_decode_<q>_avx2 / moe_prefill_<q>_avx2 (q: int8, int4)
// Flags: -mavx2 -mfma -mf16c (tier `avx2`).
//
// Data layout: layout v5 quantised panels (PackedHeader; moe_generic.cpp has the table); one
// 16-column panel is two ymm halves (lanes 0-7, 8-15), 32 bytes each per 4 k (int8) / 8 k (int4).
// Register plan: weights expanded to fp32 in registers, FMA'd with broadcast fp32 x / h:
//   int8: byte j of each lane by vpslld + vpsrad + vcvtdq2ps; row scale applied once at the end.
//   int4: (v >> shift & 15) | 0x4B000000 is the float 2^23 + nibble, minus 2^23 + 8 gives q
//         exactly. Group scale applied per group with one FMA.
//   NT <= 2 rows x G matrices x 2 halves accumulators (all k of a lane share a chain: AVX2
//   machines have fewer FMA ports and less bandwidth, so the chain latency is not the limit).
// Known limits: not tuned.
#include <immintrin.h>

#include <type_traits>

#include "kernels/avx2/qpanel_loops_avx2.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {

constexpr int kMaxRows = 2;

inline void prefetch(const void* p) { pf::line(p); }

// Layout v3 lanes (4 k of one output row per dword): byte J, sign-extended, as fp32.
template <int J>
inline __m256 i8_lane_ps(__m256i v) {
  if constexpr (J == 3) return _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
  else return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * J), 24));
}
// int4: the nibble of k % 8 = J as q: (n & 15) | 0x4B000000 = float 2^23 + n, minus 2^23 + 8.
template <int J>
inline __m256 i4_lane_ps(__m256i v) {
  constexpr int sh = (J & 3) * 8 + (J >= 4 ? 4 : 0);
  const __m256i s = sh ? _mm256_srli_epi32(v, sh) : v;
  const __m256i n = _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(15)), _mm256_set1_epi32(0x4B000000));
  return _mm256_sub_ps(_mm256_castsi256_ps(n), _mm256_set1_ps(8388616.0f));
}

// out[r][gi][half]: dot products of one quantised panel with NT fp32 rows, scales applied.
template <WFormat F, int G, int NT>
inline void qpanel_dot(const uint8_t* panel, int64_t Kp, int group, int ahead, const float* dsc, const float* const* x,
                       __m256 out[][2][2]) {
  for (int r = 0; r < NT; ++r)
    for (int gi = 0; gi < G; ++gi) out[r][gi][0] = out[r][gi][1] = _mm256_setzero_ps();
  if constexpr (F == WFormat::kInt8) {
    const uint8_t* w = panel + 64 * G;
    for (int64_t k = 0; k < Kp; k += 4, w += 4 * G * kPanelN) {
      if (ahead) prefetch(w + ahead);
      if (ahead && G == 2) prefetch(w + ahead + 64);
      for (int gi = 0; gi < G; ++gi)
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + gi * 4 * kPanelN + half * 32));
          const __m256 w0 = i8_lane_ps<0>(v), w1 = i8_lane_ps<1>(v);
          const __m256 w2 = i8_lane_ps<2>(v), w3 = i8_lane_ps<3>(v);
          for (int r = 0; r < NT; ++r) {
            __m256 a = out[r][gi][half];
            a = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(&x[r][k]), a);
            a = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(&x[r][k + 1]), a);
            a = _mm256_fmadd_ps(w2, _mm256_broadcast_ss(&x[r][k + 2]), a);
            out[r][gi][half] = _mm256_fmadd_ps(w3, _mm256_broadcast_ss(&x[r][k + 3]), a);
          }
        }
    }
    for (int gi = 0; gi < G; ++gi)
      for (int half = 0; half < 2; ++half) {
        const __m256 sc = _mm256_loadu_ps(reinterpret_cast<const float*>(panel + gi * 64) + half * 8);
        for (int r = 0; r < NT; ++r) out[r][gi][half] = _mm256_mul_ps(out[r][gi][half], sc);
      }
  } else {
    // a group's scales: the rows' factors times its steps, read from dsc for several rows
    // (qpanel_loops_avx2.h), decoded here for one
    Q4Walk<G> q(panel, group);
    for (int64_t k0 = 0, g = 0; k0 < Kp; k0 += group, ++g, q.next()) {
      if (ahead) q.prefetch(ahead, prefetch);
      __m256 a[NT][G][2];
      for (int r = 0; r < NT; ++r)
        for (int gi = 0; gi < G; ++gi) a[r][gi][0] = a[r][gi][1] = _mm256_setzero_ps();
      const uint8_t* w = q.codes();
      for (int kk = 0; kk < group; kk += 8, w += G * 4 * kPanelN) {
        for (int gi = 0; gi < G; ++gi)
          for (int half = 0; half < 2; ++half) {
            const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + gi * 4 * kPanelN + half * 32));
            auto step = [&](auto jc) {
              constexpr int J = decltype(jc)::value;
              const __m256 wj = i4_lane_ps<J>(v);
              for (int r = 0; r < NT; ++r)
                a[r][gi][half] = _mm256_fmadd_ps(wj, _mm256_broadcast_ss(&x[r][k0 + kk + J]), a[r][gi][half]);
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
      for (int gi = 0; gi < G; ++gi)
        for (int half = 0; half < 2; ++half) {
          const __m256 t = NT > 1 || dsc ? _mm256_load_ps(dsc + (g * G + gi) * kPanelN + half * 8)
                                         : qloops256::q4_steps8(q.scales() + gi * 16 + half * 8);
          const __m256 sc = _mm256_mul_ps(_mm256_load_ps(q4_factors(panel, gi) + half * 8), t);
          for (int r = 0; r < NT; ++r) out[r][gi][half] = _mm256_fmadd_ps(a[r][gi][half], sc, out[r][gi][half]);
        }
    }
  }
}

// The expansion family for the shared panel loops (kernels/avx2/qpanel_loops_avx2.h).
struct Expand {
  template <WFormat>
  static constexpr int max_rows() { return kMaxRows; }

  template <WFormat F, int G, int NT>
  static void gateup_dot(const GateUpJob& j, const uint8_t* panel, int64_t r0, int ahead, const float* dsc,
                         __m256 (&acc)[NT][2][2]) {
    const float* xr[NT];
    for (int r = 0; r < NT; ++r) xr[r] = static_cast<const float*>(j.x[r0 + r]);
    qpanel_dot<F, G, NT>(panel, j.L->Hk, j.L->group, ahead, dsc, xr, acc);
  }

  template <WFormat F, int NT>
  static void down_dot(const DownJob& j, const uint8_t* panel, int64_t r0, int ahead, const float* dsc,
                       __m256 (&y)[NT][2][2]) {
    const float* hr[NT];
    for (int r = 0; r < NT; ++r) hr[r] = static_cast<const float*>(j.h) + (r0 + r) * j.h_stride;
    qpanel_dot<F, 1, NT>(panel, j.L->Ik, j.L->group, ahead, dsc, hr, y);
  }
};

}  // namespace

bool get_qkernels_avx2(WFormat wf, KernelImpl* k) {
  k->x_bf16 = k->h_bf16 = false;
  k->row_slack = 0;
  switch (wf) {
    case WFormat::kInt8:
      k->gateup = &qloops256::gateup_dispatch<Expand, WFormat::kInt8>;
      k->down = &qloops256::down<Expand, WFormat::kInt8>;
      return true;
    case WFormat::kInt4:
      k->gateup = &qloops256::gateup_dispatch<Expand, WFormat::kInt4>;
      k->down = &qloops256::down<Expand, WFormat::kInt4>;
      return true;
    default: return false;
  }
}

}  // namespace hina::detail
