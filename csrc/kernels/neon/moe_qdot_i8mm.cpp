// [NOTE] moe_<path>_<q>_i8mm (q: int8, int4): tier i8mm's integer dot products, the dotprod
// tier's contract and packed layout (qdot_neon_impl.h) with SMMLA (FEAT_I8MM) for row pairs.
// Flags: -march=armv8.2-a+dotprod+i8mm; called only when the CPU reports asimddp and i8mm
// (dispatch/select.cpp); -ffp-contract=off (the fmas are the contract's, written out).
//
// SMMLA multiplies a 2x8 int8 matrix by the transpose of another and adds the 2x2 int32 result:
// with two rows' 8 activations of a k step as the first operand and two columns' 8 weights as
// the second, one instruction gives 2 rows x 2 columns x 8 k. The panel's k steps hold 4 k of
// 16 lanes (int8) or 8 k as low and high nibbles (int4), so a column pair's 8 k come from two
// weight vectors by one zip of 32-bit lanes:
//   int8, steps s and s + 1, vector q:  zip1 -> columns 4q, 4q + 1; zip2 -> 4q + 2, 4q + 3
//   int4, step o, vector q (and / ushr): zip1(lo, hi), zip2(lo, hi) the same columns
// The zip is the layout's price (one a weight vector); 4 rows (two pairs) share each, so a job's
// rows go 4 at a time, a remainder of 3 as a pair and a row, of 2 as a pair.
// Tile register t of columns c, c + 1: [row 0 c, row 0 c + 1, row 1 c, row 1 c + 1]. Every fp32
// step runs on tiles too, lane for lane the dotprod tier's per-row operations (the activation
// scale as [s0, s0, s1, s1], int4's group steps as [t(c), t(c + 1)] twice), so the results equal
// the dotprod tier's bit for bit; the int32 block sums are exact in both. The rows are unzipped
// (zip1 / zip2 of 64-bit halves) once at the end.
// Register plan: one matrix and one half panel (8 columns, 4 tiles a pair) at a time over the
// whole reduction, so 4 rows hold 8 int32 tiles, 8 fp32 tiles (int4: 8 more for the group
// sums), 2 activation pairs, 2 weight vectors and their 2 zips: within 32 registers. Each pass
// reads its own 32 bytes of each 64-byte step (nothing twice; each line is fetched twice, once
// a half).
// A single row (decode, or the last of a remainder of 3) runs the dotprod build's sdot code.
// Known limits: never run on Arm hardware; tested under qemu-user -cpu max (Debian 12's qemu 7.2
// has no neoverse-v1 model), speed estimated with llvm-mca (benchmarks/log/arm.md).
#if !defined(__ARM_FEATURE_MATMUL_INT8) || !defined(__ARM_FEATURE_DOTPROD)
#error "moe_qdot_i8mm.cpp needs -march=armv8.2-a+dotprod+i8mm (CMakeLists.txt)"
#endif
#include "kernels/neon/qdot_neon_impl.h"

namespace hina::detail {
namespace {

// The two rows' activations k .. k + 7 as SMMLA's first operand.
inline int8x16_t act_pair(const int8_t* x0, const int8_t* x1, int64_t k) {
  return vcombine_s8(vld1_s8(x0 + k), vld1_s8(x1 + k));
}
// [a, a, b, b]: a per-row value in tile order.
inline float32x4_t rows_tile(float a, float b) { return vcombine_f32(vdup_n_f32(a), vdup_n_f32(b)); }
// [v0, v1, v0, v1] and [v2, v3, v2, v3]: a per-column vector in the order of its two tiles.
inline float32x4_t cols_lo(float32x4_t v) {
  return vreinterpretq_f32_f64(vdupq_laneq_f64(vreinterpretq_f64_f32(v), 0));
}
inline float32x4_t cols_hi(float32x4_t v) {
  return vreinterpretq_f32_f64(vdupq_laneq_f64(vreinterpretq_f64_f32(v), 1));
}
inline int32x4_t zip1_32(int8x16_t a, int8x16_t b) {
  return vzip1q_s32(vreinterpretq_s32_s8(a), vreinterpretq_s32_s8(b));
}
inline int32x4_t zip2_32(int8x16_t a, int8x16_t b) {
  return vzip2q_s32(vreinterpretq_s32_s8(a), vreinterpretq_s32_s8(b));
}
inline int32x4_t mmla(int32x4_t acc, int8x16_t a, int32x4_t b) {
  return vmmlaq_s32(acc, a, vreinterpretq_s8_s32(b));
}
// out0 / out1[0..7] = f[0..7] * the tiles' row 0 / row 1 (tiles [2i] columns 4i, 4i + 1 of the
// half panel, [2i + 1] columns 4i + 2, 4i + 3)
inline void store_rows(const float* f, const float32x4_t (&t)[4], float* out0, float* out1) {
  for (int i = 0; i < 2; ++i) {
    const float64x2_t lo = vreinterpretq_f64_f32(t[2 * i]), hi = vreinterpretq_f64_f32(t[2 * i + 1]);
    const float32x4_t fq = vld1q_f32(f + i * 4);
    vst1q_f32(out0 + i * 4, vmulq_f32(fq, vreinterpretq_f32_f64(vzip1q_f64(lo, hi))));
    vst1q_f32(out1 + i * 4, vmulq_f32(fq, vreinterpretq_f32_f64(vzip2q_f64(lo, hi))));
  }
}

// The activation pairs of P row pairs at k .. k + 7.
template <int P>
inline void act_pairs(int8x16_t (&xa)[P], const int8_t* const* x, int64_t k) {
  for (int pr = 0; pr < P; ++pr) xa[pr] = act_pair(x[2 * pr], x[2 * pr + 1], k);
}
// SMMLA of each row pair with a zipped column pair of weights: b0 into tile 2 qq, b1 into 2 qq + 1.
template <int P>
inline void mmla_pairs(int32x4_t (&ai)[P][4], const int8x16_t (&xa)[P], int qq, int32x4_t b0, int32x4_t b1) {
  for (int pr = 0; pr < P; ++pr) {
    ai[pr][2 * qq] = mmla(ai[pr][2 * qq], xa[pr], b0);
    ai[pr][2 * qq + 1] = mmla(ai[pr][2 * qq + 1], xa[pr], b1);
  }
}
// acc += float(block b's int32 sums) * each row's activation scale of block b (tile order).
template <int P>
inline void add_block(float32x4_t (&acc)[P][4], const int32x4_t (&ai)[P][4], const float* const* sx, int64_t b) {
  for (int pr = 0; pr < P; ++pr) {
    const float32x4_t sb = rows_tile(sx[2 * pr][b], sx[2 * pr + 1][b]);
    for (int i = 0; i < 4; ++i) acc[pr][i] = vfmaq_f32(acc[pr][i], vcvtq_f32_s32(ai[pr][i]), sb);
  }
}

// 2P rows (P pairs; qdot_panel's operands for each) against one quantised panel, every scale
// applied: out[r][gi][0..15], the dotprod tier's qdot_panel of each row, bit for bit.
template <WFormat F, int G, int P>
void qdot_panel_rows(const uint8_t* panel, int64_t Kp, int group, int64_t ahead, const void* const* rows,
                     float (*out)[G][kPanelN]) {
  const int8_t* x[2 * P];
  const float* sx[2 * P];
  for (int r = 0; r < 2 * P; ++r) {
    x[r] = static_cast<const int8_t*>(rows[r]);
    sx[r] = qrow_scales(rows[r], Kp);
  }
  const int64_t nb = Kp / kActBlock;
  // one matrix and one half panel (columns 8 half .. 8 half + 7: vectors q = 2 half, 2 half + 1)
  // at a time: 4 tiles a pair for the sums, as many for the block- and group-scaled ones
  for (int gi = 0; gi < G; ++gi)
    for (int half = 0; half < 2; ++half) {
      const bool first = gi == 0 && half == 0;  // (prefetches once a panel)
      float32x4_t acc[P][4];
      for (auto& ap : acc)
        for (auto& a : ap) a = vdupq_n_f32(0.0f);
      if constexpr (F == WFormat::kInt8) {
        const int8_t* w = reinterpret_cast<const int8_t*>(panel + 64 * G) + gi * 64 + half * 32;
        for (int64_t b = 0; b < nb; ++b, w += kActBlock / 4 * 64 * G) {
          if (ahead && first)
            for (int o = 0; o < kActBlock / 4 * 64 * G; o += 64) pf::line(w + o + ahead);
          int32x4_t ai[P][4];
          for (auto& ap : ai)
            for (auto& a : ap) a = vdupq_n_s32(0);
          for (int t = 0; t < 4; ++t) {  // k steps 2t, 2t + 1 of the block
            int8x16_t xa[P];
            act_pairs<P>(xa, x, b * kActBlock + t * 8);
            for (int qq = 0; qq < 2; ++qq) {
              const int8x16_t v0 = vld1q_s8(w + 2 * t * 64 * G + qq * 16);
              const int8x16_t v1 = vld1q_s8(w + (2 * t + 1) * 64 * G + qq * 16);
              mmla_pairs<P>(ai, xa, qq, zip1_32(v0, v1), zip2_32(v0, v1));
            }
          }
          add_block<P>(acc, ai, sx, b);
        }
        const float* sc = reinterpret_cast<const float*>(panel + gi * 64) + half * 8;
        for (int pr = 0; pr < P; ++pr)
          store_rows(sc, acc[pr], out[2 * pr][gi] + half * 8, out[2 * pr + 1][gi] + half * 8);
      } else {
        const int32_t* sum[2 * P];
        for (int r = 0; r < 2 * P; ++r) sum[r] = qrow_sums(rows[r], Kp);
        const uint8x16_t m4 = vdupq_n_u8(0x0f);
        Q4Walk<G> walk(panel, group);
        for (int64_t k0 = 0; k0 < Kp; k0 += group, walk.next()) {
          if (ahead && first) walk.prefetch(ahead, [](const void* p) { pf::line(p); });
          float32x4_t bg[P][4];
          for (auto& bp : bg)
            for (auto& a : bp) a = vdupq_n_f32(0.0f);
          const uint8_t* w = walk.codes() + gi * 64 + half * 32;
          for (int64_t kb = k0; kb < k0 + group; kb += kActBlock, w += kActBlock / 8 * 64 * G) {
            const int64_t b = kb / kActBlock;
            int32x4_t ai[P][4];
            for (int pr = 0; pr < P; ++pr) {
              const int32x4_t off = vcombine_s32(vdup_n_s32(-8 * sum[2 * pr][b]), vdup_n_s32(-8 * sum[2 * pr + 1][b]));
              for (auto& a : ai[pr]) a = off;
            }
            for (int o = 0; o < 4; ++o) {  // 8-k steps of the block
              int8x16_t xa[P];
              act_pairs<P>(xa, x, kb + o * 8);
              for (int qq = 0; qq < 2; ++qq) {
                const uint8x16_t v = vld1q_u8(w + o * 64 * G + qq * 16);
                const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(v, m4)), hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
                mmla_pairs<P>(ai, xa, qq, zip1_32(lo, hi), zip2_32(lo, hi));
              }
            }
            add_block<P>(bg, ai, sx, b);
          }
          float32x4_t st[4];
          q4_steps16(walk.scales() + gi * 16, st);
          for (int qq = 0; qq < 2; ++qq) {
            const float32x4_t slo = cols_lo(st[2 * half + qq]), shi = cols_hi(st[2 * half + qq]);
            for (int pr = 0; pr < P; ++pr) {
              acc[pr][2 * qq] = vfmaq_f32(acc[pr][2 * qq], bg[pr][2 * qq], slo);
              acc[pr][2 * qq + 1] = vfmaq_f32(acc[pr][2 * qq + 1], bg[pr][2 * qq + 1], shi);
            }
          }
        }
        const float* f = q4_factors(panel, gi) + half * 8;
        for (int pr = 0; pr < P; ++pr)
          store_rows(f, acc[pr], out[2 * pr][gi] + half * 8, out[2 * pr + 1][gi] + half * 8);
      }
    }
}

// The family of kernels/neon/panel_loops_neon.h: 4 rows as two SMMLA pairs sharing each weight
// zip, 3 as a pair and a row, 2 as a pair; a single row (decode) by the dotprod build's sdot.
template <WFormat F>
struct QDotMmla {
  static constexpr bool kQdot = true;
  static constexpr bool kBf16Rows = false;
  static constexpr int kRows = 4;
  template <int G, int NT>
  static void dot(const uint8_t* panel, int64_t Kp, int group, int64_t ahead, const void* const* rows,
                  float (*out)[G][kPanelN]) {
    if constexpr (NT == 4) {
      qdot_panel_rows<F, G, 2>(panel, Kp, group, ahead, rows, out);
    } else if constexpr (NT >= 2) {
      qdot_panel_rows<F, G, 1>(panel, Kp, group, ahead, rows, out);
      if constexpr (NT == 3) qdot_panel<true, F, G>(panel, Kp, group, ahead, rows[2], out[2]);
    } else {
      qdot_panel<true, F, G>(panel, Kp, group, ahead, rows[0], out[0]);
    }
  }
  static const void* down_row(const DownJob& j, int64_t r) { return static_cast<const uint8_t*>(j.h) + r * j.h_stride; }
};

}  // namespace

bool get_qdot_kernels_i8mm(WFormat wf, KernelImpl* k) {
  switch (wf) {
    case WFormat::kInt8: loops_neon::set_kernels<QDotMmla<WFormat::kInt8>>(k); break;
    case WFormat::kInt4: loops_neon::set_kernels<QDotMmla<WFormat::kInt4>>(k); break;
    default: return false;
  }
  return true;
}

}  // namespace hina::detail
