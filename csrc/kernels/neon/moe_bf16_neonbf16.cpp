// [NOTE] moe_<path>_bf16_neonbf16: tier bf16's experts (and dense linear layers) of lossless
// bf16 weights: BFDOT for a single row (decode), BFMMLA (FEAT_BF16) for row pairs (prefill).
// Flags: -march=armv8.2-a+dotprod+i8mm+bf16; called only when the CPU reports asimddp, i8mm and
// bf16 (dispatch/select.cpp); -ffp-contract=off. bf16 models only: fp32 / fp16 models keep the
// neon FMA kernels (rounding their activations to bf16 would lose precision), as on x86.
//
// Why: the neon kernel widens each weight pair with a shift and a mask before two fp32 FMAs, 4
// instructions per 4 columns x 2 k; BFDOT does those 2 k in one instruction on the pair as
// stored, and BFMMLA 2 rows x 2 columns x 4 k in one.
// Numerics: the contract of the x86 bf16 dot kernel (KernelImpl::x_bf16 / h_bf16; its reference
// is the generic AMX twin): x rows are the bf16 model's own activations, gate/up accumulate in
// fp32, the activation runs in fp32 (the scalar epilogue) and h is rounded once to bf16; down
// accumulates in fp32. What BFDOT / BFMMLA compute (Arm ARM, BFDOT / BFMMLA, FEAT_EBF16 absent or
// FPCR.EBF = 0, the Linux default): acc + (a0 b0 + a1 b1) with the two products (exact for bf16
// inputs) summed and the sum added to acc each rounded to fp32 with round-to-odd, not
// round-to-nearest, denormal inputs and results flushed to zero, default NaN; BFMMLA's element is
// two such steps in k order (k, k + 1 then k + 2, k + 3). With FPCR.EBF = 1 both are fused (the
// pair sum unrounded) under FPCR's rounding mode. So they differ from the twin's fp32 FMAs by up
// to 2 ulp a k pair rather than 1/2 per k, by the flushed denormals and by the order: the tests
// bound them against the twin and require decode == prefill bit for bit.
// Bit for bit: every column is one chain over k in order: the single-row loop keeps one
// accumulator a column and adds k pairs in order, BFMMLA adds k pairs in the same order, so a
// row gives the same bits alone or in a pair, whatever its neighbours (under either FPCR.EBF).
//
// Data layout: the shared bf16 panels as stored (PackedHeader layout v1, moe_generic.cpp):
//   | array          | shape                      | BFDOT operand          | BFMMLA operand      |
//   |----------------|----------------------------|------------------------|---------------------|
//   | gate/up panel  | bf16 [Hk/2][G][16][2]      | 4 q regs a k pair:     | zip1 / zip2 (32-bit |
//   | down panel     | bf16 [Ik/2][16][2]         | column c's (k, k + 1)  | lanes) of k pairs   |
//   |                |                            | in lane c % 4          | s, s + 1: 2 columns |
//   |                |                            |                        | x 4 k each          |
//   | x / h rows     | bf16, zero-padded to Hk / Ik (the driver's)                               |
// BFDOT takes the layout as it is; BFMMLA needs one zip a weight vector, shared by two row pairs
// (4 rows). A layout of 4 k a column would spare the zip but make BFDOT's lanes hold half
// columns (an extra add a column and another summation order than BFMMLA's): the shared layout
// keeps one packed block for every tier, x86 and Arm.
// Register plan: single row: G x 4 accumulators (one a 4 columns: the order above), x's 4 k in
// a d register feeding BFDOT by pair (bfdot by element). Row pairs: one matrix of the panel at a
// time over the whole reduction, 8 tiles a pair ([row 0 c, row 0 c + 1, row 1 c, row 1 c + 1]),
// 2 pairs = 16 tiles, 2 activation pairs, the step's weight vectors and their zips: within 32.
// 4 rows go as two pairs, 3 as a pair and a row, 2 as a pair (panel_loops_neon.h's row blocks).
// Known limits: never run on Arm hardware; tested under qemu-user -cpu max, speed estimated with
// llvm-mca (benchmarks/log/arm.md). lossless12 panels still run the neon kernels (codecs.cpp
// wraps those).
#if !defined(__aarch64__)
#error "kernels/neon is built for aarch64 only (CMakeLists.txt)"
#endif
#if !defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#error "moe_bf16_neonbf16.cpp needs -march=...+bf16 (CMakeLists.txt)"
#endif
#include <arm_neon.h>

#include "kernels/neon/panel_loops_neon.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {

inline bfloat16x8_t ld8(const uint8_t* p) { return vld1q_bf16(reinterpret_cast<const bfloat16_t*>(p)); }
inline bfloat16x4_t ld4(const uint16_t* p) { return vld1_bf16(reinterpret_cast<const bfloat16_t*>(p)); }

// out[gi][0..15]: matrix gi of one panel dotted with one bf16 row x (Kp a multiple of 4).
template <int G>
inline void dot_row(const uint8_t* panel, int64_t Kp, const uint16_t* x, int64_t ahead, float (*out)[kPanelN]) {
  float32x4_t a[G][4];
  for (int gi = 0; gi < G; ++gi)
    for (int q = 0; q < 4; ++q) a[gi][q] = vdupq_n_f32(0.0f);
  const uint8_t* w = panel;
  for (int64_t k = 0; k < Kp; k += 4, w += 128 * G) {  // two k pairs a step
    if (ahead)
      for (int l = 0; l < 2 * G; ++l) pf::line(w + ahead + 64 * l);
    const bfloat16x4_t xv = ld4(x + k);
    for (int gi = 0; gi < G; ++gi)
      for (int q = 0; q < 4; ++q) a[gi][q] = vbfdotq_lane_f32(a[gi][q], ld8(w + gi * 64 + q * 16), xv, 0);
    for (int gi = 0; gi < G; ++gi)
      for (int q = 0; q < 4; ++q) a[gi][q] = vbfdotq_lane_f32(a[gi][q], ld8(w + (G + gi) * 64 + q * 16), xv, 1);
  }
  for (int gi = 0; gi < G; ++gi)
    for (int q = 0; q < 4; ++q) vst1q_f32(out[gi] + q * 4, a[gi][q]);
}

inline bfloat16x8_t zip1_32(bfloat16x8_t a, bfloat16x8_t b) {
  return vreinterpretq_bf16_u32(vzip1q_u32(vreinterpretq_u32_bf16(a), vreinterpretq_u32_bf16(b)));
}
inline bfloat16x8_t zip2_32(bfloat16x8_t a, bfloat16x8_t b) {
  return vreinterpretq_bf16_u32(vzip2q_u32(vreinterpretq_u32_bf16(a), vreinterpretq_u32_bf16(b)));
}

// out[r][gi][0..15] for 2 P rows: P row pairs by BFMMLA, one matrix at a time.
template <int G, int P>
inline void dot_pairs(const uint8_t* panel, int64_t Kp, int64_t ahead, const void* const* rows,
                      float (*out)[G][kPanelN]) {
  const uint16_t* x[2 * P];
  for (int r = 0; r < 2 * P; ++r) x[r] = static_cast<const uint16_t*>(rows[r]);
  for (int gi = 0; gi < G; ++gi) {
    float32x4_t t[P][8];  // tile 2q: columns 4q, 4q + 1; tile 2q + 1: columns 4q + 2, 4q + 3
    for (int pr = 0; pr < P; ++pr)
      for (int i = 0; i < 8; ++i) t[pr][i] = vdupq_n_f32(0.0f);
    const uint8_t* w = panel + gi * 64;
    for (int64_t k = 0; k < Kp; k += 4, w += 128 * G) {
      if (ahead) {
        pf::line(w + ahead);
        pf::line(w + ahead + 64 * G);
      }
      bfloat16x8_t xa[P];
      for (int pr = 0; pr < P; ++pr) xa[pr] = vcombine_bf16(ld4(x[2 * pr] + k), ld4(x[2 * pr + 1] + k));
      for (int q = 0; q < 4; ++q) {
        const bfloat16x8_t v0 = ld8(w + q * 16), v1 = ld8(w + G * 64 + q * 16);
        const bfloat16x8_t b0 = zip1_32(v0, v1), b1 = zip2_32(v0, v1);
        for (int pr = 0; pr < P; ++pr) {
          t[pr][2 * q] = vbfmmlaq_f32(t[pr][2 * q], xa[pr], b0);
          t[pr][2 * q + 1] = vbfmmlaq_f32(t[pr][2 * q + 1], xa[pr], b1);
        }
      }
    }
    for (int pr = 0; pr < P; ++pr)
      for (int q = 0; q < 4; ++q) {
        const float64x2_t lo = vreinterpretq_f64_f32(t[pr][2 * q]), hi = vreinterpretq_f64_f32(t[pr][2 * q + 1]);
        vst1q_f32(out[2 * pr][gi] + q * 4, vreinterpretq_f32_f64(vzip1q_f64(lo, hi)));
        vst1q_f32(out[2 * pr + 1][gi] + q * 4, vreinterpretq_f32_f64(vzip2q_f64(lo, hi)));
      }
  }
}

// The family of kernels/neon/panel_loops_neon.h: 4 rows as two BFMMLA pairs, 3 as a pair and a
// row, 2 as a pair, a single row by BFDOT.
struct Bf16Dot {
  static constexpr bool kQdot = false;
  static constexpr bool kBf16Rows = true;
  static constexpr int kRows = 4;
  template <int G, int NT>
  static void dot(const uint8_t* panel, int64_t Kp, int, int64_t ahead, const void* const* rows,
                  float (*out)[G][kPanelN]) {
    if constexpr (NT == 4) {
      dot_pairs<G, 2>(panel, Kp, ahead, rows, out);
    } else if constexpr (NT >= 2) {
      dot_pairs<G, 1>(panel, Kp, ahead, rows, out);
      if constexpr (NT == 3) dot_row<G>(panel, Kp, static_cast<const uint16_t*>(rows[2]), ahead, out[2]);
    } else {
      dot_row<G>(panel, Kp, static_cast<const uint16_t*>(rows[0]), ahead, out[0]);
    }
  }
  static const void* down_row(const DownJob& j, int64_t r) { return static_cast<const uint16_t*>(j.h) + r * j.h_stride; }
};

}  // namespace

bool get_kernels_neonbf16(DType dt, KernelImpl* k) {
  if (dt != DType::kBF16) return false;
  loops_neon::set_kernels<Bf16Dot>(k);
  return true;
}

}  // namespace hina::detail
