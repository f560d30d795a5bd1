// [NOTE] moe_<path>_<q>_neondot and moe_<path>_<q>_dotprod (q: int8, int4): integer dot products
// of quantised weights with quantised activations (W8A8 / W4A8, experts.h's contract: exact int32
// block sums, then fp32 fmas in its order) on Advanced SIMD. One implementation, two builds:
//   moe_qdot_neon.cpp     -march=armv8-a                 Sdot = false (smull/smlal + sadalp), tier neon
//   moe_qdot_dotprod.cpp  -march=armv8.2-a+dotprod       Sdot = true  (sdot by element), tier
//                                                        dotprod, chosen when the CPU reports asimddp
// aarch64 builds only; -ffp-contract=off (the fmas are the contract's, written out).
//
// Data layout: layout v5 quantised panels unchanged (PackedHeader; moe_generic.cpp has the
// table): a panel row of 16 lanes x 4 consecutive k (64 bytes) is four q registers of 4 lanes,
// exactly the operand of sdot (4 int8 products summed into each 32-bit lane), so the x86 layout
// suits NEON as it is. Activation rows as kernel_api.h (int8 q, block scales, block sums).
// Register plan, one row, per 32-k block (G x 4 int32 accumulators, one per matrix and 4 lanes):
//   Sdot: 16 activation bytes (4 quads) in one register; each weight vector meets its quad with
//         sdot by element (no broadcast); int4's nibbles q + 8 as stored (and, ushr), the low
//         nibbles against quad k..k+3 and the high against k+4..k+7, each block's sums starting
//         at -8 x its activation sum (the row's block sums) to remove the offset.
//   no Sdot: smull (low 8 bytes) / smull2 (high) of a weight vector with its 4-byte activation
//         quad repeated, then smlal / smlal2 of the next k step into the same int16 lanes (int8:
//         two products of <= 128 x 127 in int16: <= 32512 < 2^15), and sadalp into int32 pair
//         sums (lane n: k0+k1, k2+k3); int4: a block's 8 products of nibbles (q + 8 <= 15) by
//         activations (>= -127) add in int16 (<= 15240) and widen once at its end, the offset
//         removed as with sdot. addp folds the pair sums to one int32 per lane.
//   Per block: scvtf + one fma with the block's activation scale (int8 into A; int4 into the
//   group's B); int4: one fma with the group's steps (decoded 4 lanes at a time: the table's
//   magnitudes by tbl, the sign and the exponent shift by integer ops, q4_step bit for bit) and
//   the row factor at the end; int8 the row scale at the end.
// Prefill: each row runs the decode loop alone (the panel stays in L2 for the expert's other
// rows); tier i8mm runs row pairs with SMMLA (moe_qdot_i8mm.cpp, which includes this file for
// its single rows).
// Known limits: never run on Arm hardware; tested under qemu-user, speed estimated with llvm-mca
// (benchmarks/log/arm.md).
#pragma once

#if !defined(__aarch64__)
#error "kernels/neon is built for aarch64 only (CMakeLists.txt)"
#endif
#include <arm_neon.h>

#include <cstring>

#include "kernels/neon/panel_loops_neon.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {  // internal linkage: each including TU keeps its own copy, built with its flags

// The steps (q4_step, without the row factor) of 16 lanes from their 16 scale codes.
inline void q4_steps16(const uint8_t* codes, float32x4_t out[4]) {
  uint8x16x2_t tbl;
  tbl.val[0] = vld1q_u8(reinterpret_cast<const uint8_t*>(kQ4Step));
  tbl.val[1] = vld1q_u8(reinterpret_cast<const uint8_t*>(kQ4Step) + 16);
  const uint8x16_t c8 = vld1q_u8(codes);
  const uint16x8_t c16[2] = {vmovl_u8(vget_low_u8(c8)), vmovl_high_u8(c8)};
  for (int q = 0; q < 4; ++q) {
    const uint32x4_t c = q % 2 ? vmovl_high_u16(c16[q / 2]) : vmovl_u16(vget_low_u16(c16[q / 2]));
    // bytes 4 (c & 7) + 0..3 of the table: the magnitude kQ4Step[c & 7]
    const uint32x4_t bytes = vmlaq_n_u32(vdupq_n_u32(0x03020100u), vandq_u32(c, vdupq_n_u32(7)), 0x04040404u);
    const uint32x4_t mag = vreinterpretq_u32_u8(vqtbl2q_u8(tbl, vreinterpretq_u8_u32(bytes)));
    const uint32x4_t sign = vshlq_n_u32(vandq_u32(c, vdupq_n_u32(8)), 28);
    const uint32x4_t a = vshlq_n_u32(vshrq_n_u32(c, 4), 23);
    out[q] = vreinterpretq_f32_u32(vsubq_u32(veorq_u32(mag, sign), a));
  }
}

#if defined(__ARM_FEATURE_DOTPROD)
// sdot of each of 4 weight vectors (one matrix) with activation quad L of xv
template <int L, int G>
inline void sdot4(int32x4_t (&a)[G][4], int gi, const int8_t* w, int8x16_t xv) {
  for (int q = 0; q < 4; ++q) a[gi][q] = vdotq_laneq_s32(a[gi][q], vld1q_s8(w + q * 16), xv, L);
}
// int4: the low nibbles of each of 4 weight vectors against quad L of xv, the high against L + 1
// (each vector decoded just before its two sdots: holding 8 decoded vectors made GCC copy
// registers, 24 movs a block on 64 sdots; 2026-12-07)
template <int L, int G>
inline void sdot4_nibbles(int32x4_t (&a)[G][4], int gi, const uint8_t* w, int8x16_t xv) {
  const uint8x16_t m4 = vdupq_n_u8(0x0f);
  for (int q = 0; q < 4; ++q) {
    const uint8x16_t v = vld1q_u8(w + q * 16);
    a[gi][q] = vdotq_laneq_s32(a[gi][q], vreinterpretq_s8_u8(vandq_u8(v, m4)), xv, L);
    a[gi][q] = vdotq_laneq_s32(a[gi][q], vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), xv, L + 1);
  }
}
#endif

// A 4-byte activation quad repeated over a q register.
inline int8x16_t quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

// int32 sums of one 32-k block, G matrices x 16 lanes: int8. w: the block's first k step
// (64 G bytes a step of 4 k), x: its 32 activation codes.
template <bool Sdot, int G>
inline void block_int8(const int8_t* w, const int8_t* x, int64_t ahead, int32x4_t (&ai)[G][4]) {
  for (int gi = 0; gi < G; ++gi)
    for (int q = 0; q < 4; ++q) ai[gi][q] = vdupq_n_s32(0);
  if (ahead)
    for (int o = 0; o < kActBlock / 4 * 64 * G; o += 64) pf::line(w + o + ahead);
  if constexpr (Sdot) {
#if defined(__ARM_FEATURE_DOTPROD)
    for (int h = 0; h < 2; ++h, x += 16, w += 4 * 64 * G) {
      const int8x16_t xv = vld1q_s8(x);
      for (int gi = 0; gi < G; ++gi) {
        sdot4<0, G>(ai, gi, w + gi * 64, xv);
        sdot4<1, G>(ai, gi, w + 64 * G + gi * 64, xv);
        sdot4<2, G>(ai, gi, w + 128 * G + gi * 64, xv);
        sdot4<3, G>(ai, gi, w + 192 * G + gi * 64, xv);
      }
    }
#endif
  } else {
    int32x4_t ap[G][8];  // pair sums: [2q] lanes 4q, 4q+1; [2q+1] lanes 4q+2, 4q+3
    for (int gi = 0; gi < G; ++gi)
      for (int i = 0; i < 8; ++i) ap[gi][i] = vdupq_n_s32(0);
    for (int s = 0; s < kActBlock / 4; s += 2, w += 2 * 64 * G) {
      const int8x16_t x0 = quad(x + s * 4), x1 = quad(x + s * 4 + 4);
      for (int gi = 0; gi < G; ++gi)
        for (int q = 0; q < 4; ++q) {
          const int8x16_t w0 = vld1q_s8(w + gi * 64 + q * 16), w1 = vld1q_s8(w + 64 * G + gi * 64 + q * 16);
          const int16x8_t lo = vmlal_s8(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)), vget_low_s8(w1), vget_low_s8(x1));
          const int16x8_t hi = vmlal_high_s8(vmull_high_s8(w0, x0), w1, x1);
          ap[gi][2 * q] = vpadalq_s16(ap[gi][2 * q], lo);
          ap[gi][2 * q + 1] = vpadalq_s16(ap[gi][2 * q + 1], hi);
        }
    }
    for (int gi = 0; gi < G; ++gi)
      for (int q = 0; q < 4; ++q) ai[gi][q] = vpaddq_s32(ap[gi][2 * q], ap[gi][2 * q + 1]);
  }
}

// The same for int4: w the block's first 8-k step of codes (64 G bytes a step), xsum the block's
// activation sum. The nibbles q + 8 (0..15) are multiplied as stored (and, ushr: 2 operations a
// weight vector, not 4 with a subtraction each) and the offset 8 * xsum removed from the sums.
template <bool Sdot, int G>
inline void block_int4(const uint8_t* w, const int8_t* x, int32_t xsum, int32x4_t (&ai)[G][4]) {
  const uint8x16_t m4 = vdupq_n_u8(0x0f);
  auto nibbles = [&](const uint8_t* p, int8x16_t& lo, int8x16_t& hi) {
    const uint8x16_t v = vld1q_u8(p);
    lo = vreinterpretq_s8_u8(vandq_u8(v, m4));
    hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
  };
  const int32x4_t off = vdupq_n_s32(-8 * xsum);
  if constexpr (Sdot) {
#if defined(__ARM_FEATURE_DOTPROD)
    for (int gi = 0; gi < G; ++gi)
      for (int q = 0; q < 4; ++q) ai[gi][q] = off;
    for (int o = 0; o < kActBlock / 8; o += 2, x += 16, w += 2 * 64 * G) {
      const int8x16_t xv = vld1q_s8(x);  // quads: step o low, o high, o + 1 low, o + 1 high
      for (int gi = 0; gi < G; ++gi) {
        sdot4_nibbles<0, G>(ai, gi, w + gi * 64, xv);
        sdot4_nibbles<2, G>(ai, gi, w + 64 * G + gi * 64, xv);
      }
    }
#endif
  } else {
    // [2q]: lanes 4q, 4q+1 (4 k each), [2q+1]: lanes 4q+2, 4q+3; a block's 8 products of
    // <= 15 x 127 a lane: <= 15240 < 2^15
    int16x8_t s[G][8];
    for (int o = 0; o < kActBlock / 8; ++o, w += 64 * G) {
      const int8x16_t xl = quad(x + o * 8), xh = quad(x + o * 8 + 4);
      for (int gi = 0; gi < G; ++gi)
        for (int q = 0; q < 4; ++q) {
          int8x16_t lo, hi;
          nibbles(w + gi * 64 + q * 16, lo, hi);
          if (o == 0) {
            s[gi][2 * q] = vmull_s8(vget_low_s8(lo), vget_low_s8(xl));
            s[gi][2 * q + 1] = vmull_high_s8(lo, xl);
          } else {
            s[gi][2 * q] = vmlal_s8(s[gi][2 * q], vget_low_s8(lo), vget_low_s8(xl));
            s[gi][2 * q + 1] = vmlal_high_s8(s[gi][2 * q + 1], lo, xl);
          }
          s[gi][2 * q] = vmlal_s8(s[gi][2 * q], vget_low_s8(hi), vget_low_s8(xh));
          s[gi][2 * q + 1] = vmlal_high_s8(s[gi][2 * q + 1], hi, xh);
        }
    }
    for (int gi = 0; gi < G; ++gi)
      for (int q = 0; q < 4; ++q)
        ai[gi][q] = vaddq_s32(off, vpaddq_s32(vpaddlq_s16(s[gi][2 * q]), vpaddlq_s16(s[gi][2 * q + 1])));
  }
}

// out[gi][0..15]: matrix gi of one quantised panel dotted with one quantised activation row
// (Kp long), every scale applied (experts.h's order).
template <bool Sdot, WFormat F, int G>
inline void qdot_panel(const uint8_t* panel, int64_t Kp, int group, int64_t ahead, const void* row,
                       float (*out)[kPanelN]) {
  const int8_t* qx = static_cast<const int8_t*>(row);
  const float* sx = qrow_scales(row, Kp);
  if constexpr (F == WFormat::kInt8) {
    float32x4_t af[G][4];
    for (int gi = 0; gi < G; ++gi)
      for (int q = 0; q < 4; ++q) af[gi][q] = vdupq_n_f32(0.0f);
    const int8_t* w = reinterpret_cast<const int8_t*>(panel + 64 * G);
    for (int64_t b = 0; b < Kp / kActBlock; ++b, w += kActBlock / 4 * 64 * G) {
      int32x4_t ai[G][4];
      block_int8<Sdot, G>(w, qx + b * kActBlock, ahead, ai);
      const float32x4_t sb = vdupq_n_f32(sx[b]);
      for (int gi = 0; gi < G; ++gi)
        for (int q = 0; q < 4; ++q) af[gi][q] = vfmaq_f32(af[gi][q], vcvtq_f32_s32(ai[gi][q]), sb);
    }
    for (int gi = 0; gi < G; ++gi) {
      const float* sc = reinterpret_cast<const float*>(panel + gi * 64);
      for (int q = 0; q < 4; ++q) vst1q_f32(out[gi] + q * 4, vmulq_f32(vld1q_f32(sc + q * 4), af[gi][q]));
    }
  } else {
    float32x4_t y[G][4];
    for (int gi = 0; gi < G; ++gi)
      for (int q = 0; q < 4; ++q) y[gi][q] = vdupq_n_f32(0.0f);
    Q4Walk<G> walk(panel, group);
    for (int64_t k0 = 0; k0 < Kp; k0 += group, walk.next()) {
      if (ahead) walk.prefetch(ahead, [](const void* p) { pf::line(p); });
      float32x4_t bg[G][4];
      for (int gi = 0; gi < G; ++gi)
        for (int q = 0; q < 4; ++q) bg[gi][q] = vdupq_n_f32(0.0f);
      const uint8_t* w = walk.codes();
      for (int64_t kb = k0; kb < k0 + group; kb += kActBlock, w += kActBlock / 8 * 64 * G) {
        int32x4_t ai[G][4];
        block_int4<Sdot, G>(w, qx + kb, qrow_sums(row, Kp)[kb / kActBlock], ai);
        const float32x4_t sb = vdupq_n_f32(sx[kb / kActBlock]);
        for (int gi = 0; gi < G; ++gi)
          for (int q = 0; q < 4; ++q) bg[gi][q] = vfmaq_f32(bg[gi][q], vcvtq_f32_s32(ai[gi][q]), sb);
      }
      for (int gi = 0; gi < G; ++gi) {
        float32x4_t t[4];
        q4_steps16(walk.scales() + gi * 16, t);
        for (int q = 0; q < 4; ++q) y[gi][q] = vfmaq_f32(y[gi][q], bg[gi][q], t[q]);
      }
    }
    for (int gi = 0; gi < G; ++gi) {
      const float* f = q4_factors(panel, gi);
      for (int q = 0; q < 4; ++q) vst1q_f32(out[gi] + q * 4, vmulq_f32(vld1q_f32(f + q * 4), y[gi][q]));
    }
  }
}

// The family of kernels/neon/panel_loops_neon.h: one row at a time.
template <bool Sdot, WFormat F>
struct QDot {
  static constexpr bool kQdot = true;
  static constexpr bool kBf16Rows = false;
  static constexpr int kRows = 1;
  template <int G, int NT>
  static void dot(const uint8_t* panel, int64_t Kp, int group, int64_t ahead, const void* const* rows,
                  float (*out)[G][kPanelN]) {
    static_assert(NT == 1);
    qdot_panel<Sdot, F, G>(panel, Kp, group, ahead, rows[0], out[0]);
  }
  static const void* down_row(const DownJob& j, int64_t r) { return static_cast<const uint8_t*>(j.h) + r * j.h_stride; }
};

template <bool Sdot>
bool get_kernels(WFormat wf, KernelImpl* k) {
  switch (wf) {
    case WFormat::kInt8: loops_neon::set_kernels<QDot<Sdot, WFormat::kInt8>>(k); break;
    case WFormat::kInt4: loops_neon::set_kernels<QDot<Sdot, WFormat::kInt4>>(k); break;
    default: return false;
  }
  return true;
}

}  // namespace
}  // namespace hina::detail
