// [NOTE] moe_decode_<q>_avx512vnni / moe_prefill_<q>_avx512vnni (q: int8, int4): integer dot
// products of quantised weights with quantised activations (W8A8 / W4A8).
// Flags: the avx512 TU's flags + -mavx512vnni; selected for tiers avx512 and amx only when the
// CPU reports AVX512-VNNI (the tier itself guarantees F/BW/VL only).
//
// Data layout: layout v5 quantised panels (PackedHeader; moe_generic.cpp has the table) and
// quantised activation rows (kernel_api.h: [Kp] int8, [Kp/32] fp32 scales, [Kp/32] int32 sums).
//   | operand        | register view                                                       |
//   |----------------|---------------------------------------------------------------------|
//   | int8 weights   | one zmm per 4 k and matrix: 16 lanes (output rows) x 4 k, signed q  |
//   | int4 weights   | one zmm per 8 k and matrix: v & 0x0f = k 0..3, v >> 4 & 0x0f = k 4..7 |
//   | activations    | 4 consecutive int8 qx broadcast to every lane (vpbroadcastd)        |
// Register plan: vpdpbusd multiplies unsigned bytes by signed bytes, so the WEIGHTS are the
// unsigned operand: int8 q ^ 0x80 = q + 128 (one vpxord per 64 bytes), int4 the stored q + 8.
// The offset is removed exactly by starting each block's int32 accumulator at -128 * sum(qx_b)
// (int8) or -8 * sum(qx_b) (int4): the correction depends only on the activations, so no
// per-row weight sums are stored. Per 32-k block: 8 vpdpbusd per row and matrix (int8: 8 quads
// into that accumulator; int4: 4 loads, the low nibbles into it, the high ones masked in place,
// 16 (q + 8), into a second chain that the block's end shifts back: the same integer), then
// vcvtdq2ps and one FMA with the block's activation scale; int8 multiplies the row scale once
// at the end, int4 applies each group's step (q4_step) with one FMA per group and the row
// factor once at the end (experts.h fixes this order; the generic emulation follows it, so only the
// activation epilogue differs from it).
// NT <= 4 (int8) / 3 (int4) rows share each loaded weight vector (prefill reuse): NT * G (int4:
// 2 NT * G) int32 and NT * G fp32 accumulators stay in registers.
// Software prefetch of the weight stream (moe/prefetch.h: the job's distance, pf::ahead, by CPU
// vendor and rows, into L2), one line per 64 bytes consumed.
// Known limits: the block sums are exact int32 (|sum| <= 32 * 255 * 127); a block is 32 k, so
// a k padding of up to 31 zero columns is multiplied too (Kp is a multiple of 32 anyway).
#include <immintrin.h>

#include <cstring>

#include "kernels/avx512/qpanel_loops.h"
#include "kernels/avx512/vec_avx512.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {

inline void prefetch(const void* p) { pf::line(p); }

// 4 int8 activations (k .. k+3) in every lane.
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// out[r][gi]: 16 columns of matrix gi dotted with row r, all scales applied (experts.h order).
template <WFormat F, int G, int NT>
inline void qdot_panel(const uint8_t* panel, int64_t Kp, int group, int ahead, const float* dsc, const QRows<NT>& x,
                       __m512 out[][2]) {
  if constexpr (F == WFormat::kInt8) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512 af[NT][G];
    for (int r = 0; r < NT; ++r)
      for (int gi = 0; gi < G; ++gi) af[r][gi] = _mm512_setzero_ps();
    const uint8_t* w = panel + 64 * G;
    for (int64_t b = 0; b < Kp / kActBlock; ++b) {
      __m512i ai[NT][G];
      for (int r = 0; r < NT; ++r) {
        const __m512i c = _mm512_set1_epi32(-128 * x.sum[r][b]);
        for (int gi = 0; gi < G; ++gi) ai[r][gi] = c;
      }
      const int64_t kb = b * kActBlock;
      for (int qd = 0; qd < kActBlock / 4; ++qd, w += 64 * G) {
        if (ahead) prefetch(w + ahead);
        if (ahead && G == 2) prefetch(w + ahead + 64);
        __m512i xb[NT];
        for (int r = 0; r < NT; ++r) xb[r] = bcast4(x.q[r] + kb + qd * 4);
        for (int gi = 0; gi < G; ++gi) {
          const __m512i u = _mm512_xor_si512(_mm512_load_si512(w + gi * 64), flip);
          for (int r = 0; r < NT; ++r) ai[r][gi] = _mm512_dpbusd_epi32(ai[r][gi], u, xb[r]);
        }
      }
      for (int r = 0; r < NT; ++r) {
        const __m512 sb = _mm512_set1_ps(x.s[r][b]);
        for (int gi = 0; gi < G; ++gi) af[r][gi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r][gi]), sb, af[r][gi]);
      }
    }
    for (int gi = 0; gi < G; ++gi) {
      const __m512 sc = _mm512_load_ps(reinterpret_cast<const float*>(panel + gi * 64));
      for (int r = 0; r < NT; ++r) out[r][gi] = _mm512_mul_ps(af[r][gi], sc);
    }
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i m4h = _mm512_set1_epi8(static_cast<char>(0xf0));
    __m512 y[NT][G];
    for (int r = 0; r < NT; ++r)
      for (int gi = 0; gi < G; ++gi) y[r][gi] = _mm512_setzero_ps();
    // the groups' steps: one row decodes them here, several read them from dsc (qpanel_loops.h);
    // the rows' factors multiply the sums once at the end (experts.h's order)
    Q4Walk<G> q(panel, group);
    for (int64_t k0 = 0, g = 0; k0 < Kp; k0 += group, ++g, q.next()) {
      if (ahead) q.prefetch(ahead, prefetch);
      __m512 bg[NT][G];
      for (int r = 0; r < NT; ++r)
        for (int gi = 0; gi < G; ++gi) bg[r][gi] = _mm512_setzero_ps();
      const uint8_t* w = q.codes();
      for (int64_t kb = k0; kb < k0 + group; kb += kActBlock) {
        const int64_t b = kb / kActBlock;
        // Two chains per row and matrix: ai the low nibbles (with the block's offset correction),
        // ah the high nibbles kept in place (16 * (q + 8), no shift per vector), which the block's
        // end shifts back; int32 sums, so the result is the same integer as one chain's. (One
        // chain for several rows, the high nibbles shifted down once a vector, measured no
        // faster: 2026-12-05, 8e7a8ac.)
        __m512i ai[NT][G], ah[NT][G];
        for (int r = 0; r < NT; ++r) {
          const __m512i c = _mm512_set1_epi32(-8 * x.sum[r][b]);
          for (int gi = 0; gi < G; ++gi) {
            ai[r][gi] = c;
            ah[r][gi] = _mm512_setzero_si512();
          }
        }
        for (int o = 0; o < kActBlock / 8; ++o, w += 64 * G) {
          __m512i xl[NT], xh[NT];
          for (int r = 0; r < NT; ++r) {
            xl[r] = bcast4(x.q[r] + kb + o * 8);
            xh[r] = bcast4(x.q[r] + kb + o * 8 + 4);
          }
          for (int gi = 0; gi < G; ++gi) {
            const __m512i v = _mm512_load_si512(w + gi * 64);
            const __m512i lo = _mm512_and_si512(v, m4);
            const __m512i hi16 = _mm512_and_si512(v, m4h);
            for (int r = 0; r < NT; ++r) {
              ai[r][gi] = _mm512_dpbusd_epi32(ai[r][gi], lo, xl[r]);
              ah[r][gi] = _mm512_dpbusd_epi32(ah[r][gi], hi16, xh[r]);
            }
          }
        }
        for (int r = 0; r < NT; ++r) {
          const __m512 sb = _mm512_set1_ps(x.s[r][b]);
          for (int gi = 0; gi < G; ++gi) {
            const __m512i sum = _mm512_add_epi32(ai[r][gi], _mm512_srai_epi32(ah[r][gi], 4));
            bg[r][gi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), sb, bg[r][gi]);
          }
        }
      }
      for (int gi = 0; gi < G; ++gi) {
        const __m512 d = NT > 1 || dsc ? _mm512_load_ps(dsc + (g * G + gi) * kPanelN) : v512::q4_steps16(q.scales() + gi * 16);
        for (int r = 0; r < NT; ++r) y[r][gi] = _mm512_fmadd_ps(bg[r][gi], d, y[r][gi]);
      }
    }
    for (int gi = 0; gi < G; ++gi) {
      const __m512 f = _mm512_load_ps(q4_factors(panel, gi));
      for (int r = 0; r < NT; ++r) out[r][gi] = _mm512_mul_ps(y[r][gi], f);
    }
  }
}

// The integer-dot family for the shared panel loops (kernels/avx512/qpanel_loops.h).
struct IntDot {
  template <WFormat F>
  static constexpr int max_rows() { return F == WFormat::kInt8 ? 4 : 3; }

  template <WFormat F, int G, int NT>
  static void gateup_dot(const GateUpJob& j, const uint8_t* panel, int64_t r0, int ahead, const float* dsc,
                         __m512 (&acc)[NT][2]) {
    QRows<NT> xr;
    for (int r = 0; r < NT; ++r) xr.set(r, j.x[r0 + r], j.L->Hk);
    qdot_panel<F, G, NT>(panel, j.L->Hk, j.L->group, ahead, dsc, xr, acc);
  }

  template <WFormat F, int NT>
  static void down_dot(const DownJob& j, const uint8_t* panel, int64_t r0, int ahead, const float* dsc,
                       __m512 (&y)[NT][2]) {
    QRows<NT> hr;
    for (int r = 0; r < NT; ++r) hr.set(r, static_cast<const uint8_t*>(j.h) + (r0 + r) * j.h_stride, j.L->Ik);
    qdot_panel<F, 1, NT>(panel, j.L->Ik, j.L->group, ahead, dsc, hr, y);
  }
};

}  // namespace

bool get_qdot_kernels_avx512vnni(WFormat wf, KernelImpl* k) {
  switch (wf) {
    case WFormat::kInt8:
      k->gateup = &qloops512::gateup_dispatch<IntDot, WFormat::kInt8>;
      k->down = &qloops512::down<IntDot, WFormat::kInt8>;
      break;
    case WFormat::kInt4:
      k->gateup = &qloops512::gateup_dispatch<IntDot, WFormat::kInt4>;
      k->down = &qloops512::down<IntDot, WFormat::kInt4>;
      break;
    default: return false;
  }
  k->x_bf16 = k->h_bf16 = false;
  k->row_slack = 0;
  k->qdot = true;
  return true;
}

}  // namespace hina::detail
