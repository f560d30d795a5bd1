// [NOTE] moe_<path>_<q>_avx2dot and moe_<path>_<q>_avxvnni (q: int8, int4): integer dot products
// of quantised weights with quantised activations (W8A8 / W4A8) on 256-bit vectors, for tier
// avx2 (and avx512 on CPUs without AVX512-VNNI). One implementation, two builds:
//   moe_qdot_avx2.cpp    -mavx2 -mfma -mf16c            Vnni = false (vpmaddubsw + vpmaddwd)
//   moe_qdot_avxvnni.cpp the same + -mavxvnni            Vnni = true  (vpdpbusd ymm), chosen
//                                                        when the CPU reports AVX-VNNI
//
// Data layout: layout v5 quantised panels (PackedHeader; moe_generic.cpp has the table) and
// quantised activation rows (kernel_api.h); one 16-lane panel row of 64 bytes is two ymm halves
// (lanes 0-7, 8-15).
// Register plan (Vnni): as moe_qdot_avx512vnni.cpp on ymm halves: vpdpbusd with the weights as
// the unsigned operand (int8 q ^ 0x80, int4 q + 8), each block's accumulator starting at
// -128 (-8) x the activation block sum.
// Register plan (no Vnni): vpmaddubsw (u8 x s8 pairs -> saturating int16) + vpmaddwd with ones
// (-> int32 quads) + vpaddd into one int32 accumulator per row, matrix and half and 32-k block:
//   int8: the sign trick keeps every pair sum below 2^15: |qx| (vpabsb) is the unsigned
//         operand and the weights take qx's sign (vpsignb), so |qx| * (+-q) <= 127 * 127 and a
//         pair <= 32258. The product is exact and signed: no offset correction.
//   int4: the nibbles q + 8 (0..15) are the unsigned operand as stored (v & 0x0f, v >> 4 &
//         0x0f): a pair <= 2 * 15 * 127, so the low- and high-nibble products are added in
//         int16 (<= 7620) before one vpmaddwd; the offset is removed by starting the block's
//         accumulator at -8 * sum(qx_b).
//   Per block: vcvtdq2ps + one FMA with the block's activation scale; int8 multiplies the row
//   scale at the end, int4 applies each group's step with one FMA and the row factor at the end
//   (experts.h's order, as the
//   generic emulation).
// NT <= 2 (int8) / 1 (int4) rows share each weight load: 16 ymm registers hold NT x G x 2 int32
// and as many fp32 accumulators (int4 also its group sums).
// Known limits: not tuned.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "kernels/avx2/qpanel_loops_avx2.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {  // internal linkage: each including TU keeps its own copy, built with its flags

inline void prefetch(const void* p) { pf::line(p); }

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// vpdpbusd ymm (AVX-VNNI) in the TU built with -mavxvnni; never called elsewhere.
inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#else
  (void)u8;
  (void)s8;
  __builtin_unreachable();
  return acc;
#endif
}

// out[r][gi][half]: dot products of one quantised panel with NT quantised rows, scales applied.
template <bool Vnni, WFormat F, int G, int NT>
inline void qdot_panel(const uint8_t* panel, int64_t Kp, int group, int ahead, const float* dsc, const QRows<NT>& x,
                       __m256 out[][2][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  (void)ones;
  if constexpr (F == WFormat::kInt8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    (void)flip;
    __m256 af[NT][G][2];
    for (int r = 0; r < NT; ++r)
      for (int gi = 0; gi < G; ++gi) af[r][gi][0] = af[r][gi][1] = _mm256_setzero_ps();
    const uint8_t* w = panel + 64 * G;
    for (int64_t b = 0; b < Kp / kActBlock; ++b) {
      __m256i ai[NT][G][2];  // vpdpbusd: weights q + 128, offset removed by the start value
      for (int r = 0; r < NT; ++r) {
        const __m256i c = Vnni ? _mm256_set1_epi32(-128 * x.sum[r][b]) : _mm256_setzero_si256();
        for (int gi = 0; gi < G; ++gi) ai[r][gi][0] = ai[r][gi][1] = c;
      }
      const int64_t kb = b * kActBlock;
      for (int qd = 0; qd < kActBlock / 4; ++qd, w += 64 * G) {
        if (ahead) prefetch(w + ahead);
        if (ahead && G == 2) prefetch(w + ahead + 64);
        __m256i xs[NT], xa[NT];
        for (int r = 0; r < NT; ++r) {
          xs[r] = bcast4(x.q[r] + kb + qd * 4);
          if constexpr (!Vnni) xa[r] = _mm256_abs_epi8(xs[r]);
        }
        for (int gi = 0; gi < G; ++gi)
          for (int half = 0; half < 2; ++half) {
            const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + gi * 64 + half * 32));
            for (int r = 0; r < NT; ++r) {
              if constexpr (Vnni) {
                ai[r][gi][half] = dpbusd(ai[r][gi][half], _mm256_xor_si256(wv, flip), xs[r]);
              } else {
                const __m256i p16 = _mm256_maddubs_epi16(xa[r], _mm256_sign_epi8(wv, xs[r]));
                ai[r][gi][half] = _mm256_add_epi32(ai[r][gi][half], _mm256_madd_epi16(p16, ones));
              }
            }
          }
      }
      for (int r = 0; r < NT; ++r) {
        const __m256 sb = _mm256_set1_ps(x.s[r][b]);
        for (int gi = 0; gi < G; ++gi)
          for (int half = 0; half < 2; ++half)
            af[r][gi][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r][gi][half]), sb, af[r][gi][half]);
      }
    }
    for (int gi = 0; gi < G; ++gi)
      for (int half = 0; half < 2; ++half) {
        const __m256 sc = _mm256_loadu_ps(reinterpret_cast<const float*>(panel + gi * 64) + half * 8);
        for (int r = 0; r < NT; ++r) out[r][gi][half] = _mm256_mul_ps(af[r][gi][half], sc);
      }
  } else {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int r = 0; r < NT; ++r)
      for (int gi = 0; gi < G; ++gi) out[r][gi][0] = out[r][gi][1] = _mm256_setzero_ps();
    // the groups' steps: one row decodes them here, several read them from dsc
    // (qpanel_loops_avx2.h); the rows' factors multiply the sums once at the end (experts.h's order)
    Q4Walk<G> q(panel, group);
    for (int64_t k0 = 0, g = 0; k0 < Kp; k0 += group, ++g, q.next()) {
      if (ahead) q.prefetch(ahead, prefetch);
      __m256 bg[NT][G][2];
      for (int r = 0; r < NT; ++r)
        for (int gi = 0; gi < G; ++gi) bg[r][gi][0] = bg[r][gi][1] = _mm256_setzero_ps();
      const uint8_t* w = q.codes();
      for (int64_t kb = k0; kb < k0 + group; kb += kActBlock) {
        const int64_t b = kb / kActBlock;
        __m256i ai[NT][G][2];
        for (int r = 0; r < NT; ++r) {
          const __m256i c = _mm256_set1_epi32(-8 * x.sum[r][b]);
          for (int gi = 0; gi < G; ++gi) ai[r][gi][0] = ai[r][gi][1] = c;
        }
        for (int o = 0; o < kActBlock / 8; ++o, w += 64 * G) {
          __m256i xl[NT], xh[NT];
          for (int r = 0; r < NT; ++r) {
            xl[r] = bcast4(x.q[r] + kb + o * 8);
            xh[r] = bcast4(x.q[r] + kb + o * 8 + 4);
          }
          for (int gi = 0; gi < G; ++gi)
            for (int half = 0; half < 2; ++half) {
              const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + gi * 64 + half * 32));
              const __m256i lo = _mm256_and_si256(v, m4);
              const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
              for (int r = 0; r < NT; ++r) {
                if constexpr (Vnni) {
                  ai[r][gi][half] = dpbusd(dpbusd(ai[r][gi][half], lo, xl[r]), hi, xh[r]);
                } else {
                  const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[r]), _mm256_maddubs_epi16(hi, xh[r]));
                  ai[r][gi][half] = _mm256_add_epi32(ai[r][gi][half], _mm256_madd_epi16(p16, ones));
                }
              }
            }
        }
        for (int r = 0; r < NT; ++r) {
          const __m256 sb = _mm256_set1_ps(x.s[r][b]);
          for (int gi = 0; gi < G; ++gi)
            for (int half = 0; half < 2; ++half)
              bg[r][gi][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r][gi][half]), sb, bg[r][gi][half]);
        }
      }
      for (int gi = 0; gi < G; ++gi)
        for (int half = 0; half < 2; ++half) {
          const __m256 d = NT > 1 || dsc ? _mm256_load_ps(dsc + (g * G + gi) * kPanelN + half * 8)
                                          : qloops256::q4_steps8(q.scales() + gi * 16 + half * 8);
          for (int r = 0; r < NT; ++r) out[r][gi][half] = _mm256_fmadd_ps(bg[r][gi][half], d, out[r][gi][half]);
        }
    }
    for (int gi = 0; gi < G; ++gi)
      for (int half = 0; half < 2; ++half) {
        const __m256 f = _mm256_load_ps(q4_factors(panel, gi) + half * 8);
        for (int r = 0; r < NT; ++r) out[r][gi][half] = _mm256_mul_ps(out[r][gi][half], f);
      }
  }
}

// The integer-dot family for the shared panel loops (kernels/avx2/qpanel_loops_avx2.h).
template <bool Vnni>
struct IntDot {
  template <WFormat F>
  static constexpr int max_rows() { return F == WFormat::kInt8 ? 2 : 1; }

  template <WFormat F, int G, int NT>
  static void gateup_dot(const GateUpJob& j, const uint8_t* panel, int64_t r0, int ahead, const float* dsc,
                         __m256 (&acc)[NT][2][2]) {
    QRows<NT> xr;
    for (int r = 0; r < NT; ++r) xr.set(r, j.x[r0 + r], j.L->Hk);
    qdot_panel<Vnni, F, G, NT>(panel, j.L->Hk, j.L->group, ahead, dsc, xr, acc);
  }

  template <WFormat F, int NT>
  static void down_dot(const DownJob& j, const uint8_t* panel, int64_t r0, int ahead, const float* dsc,
                       __m256 (&y)[NT][2][2]) {
    QRows<NT> hr;
    for (int r = 0; r < NT; ++r) hr.set(r, static_cast<const uint8_t*>(j.h) + (r0 + r) * j.h_stride, j.L->Ik);
    qdot_panel<Vnni, F, 1, NT>(panel, j.L->Ik, j.L->group, ahead, dsc, hr, y);
  }
};

template <bool Vnni>
bool get_kernels(WFormat wf, KernelImpl* k) {
  switch (wf) {
    case WFormat::kInt8:
      k->gateup = &qloops256::gateup_dispatch<IntDot<Vnni>, WFormat::kInt8>;
      k->down = &qloops256::down<IntDot<Vnni>, WFormat::kInt8>;
      break;
    case WFormat::kInt4:
      k->gateup = &qloops256::gateup_dispatch<IntDot<Vnni>, WFormat::kInt4>;
      k->down = &qloops256::down<IntDot<Vnni>, WFormat::kInt4>;
      break;
    default: return false;
  }
  k->x_bf16 = k->h_bf16 = false;
  k->row_slack = 0;
  k->qdot = true;
  return true;
}

}  // namespace
}  // namespace hina::detail
