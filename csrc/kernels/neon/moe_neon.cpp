// [NOTE] moe_decode_<fmt>_neon / moe_prefill_<fmt>_neon (fmt: f32, bf16, f16): the experts of
// lossless weights on Advanced SIMD, tiers neon and dotprod (the dot-product extension adds
// nothing to fp32 FMAs). Flags: -march=armv8-a (every aarch64 CPU); aarch64 builds only.
//
// Data layout: the x86 tiers' packed panels unchanged (PackedHeader; moe_generic.cpp's table):
//   | array          | shape                                      |
//   |----------------|--------------------------------------------|
//   | gate/up panel  | bf16 [Hk/2][G][16][2], f32/f16 [Hk][G][16] |
//   | down panel     | bf16 [Ik/2][16][2],    f32/f16 [Ik][16]    |
//   | x / h rows     | fp32, [nt][Hk] / [nt][Ik]                  |
// One 16-column panel row is four q registers (columns 4q .. 4q + 3); a bf16 k pair of 16
// columns (64 bytes) is four 32-bit-lane vectors whose low halves are the even k and high halves
// the odd k: the even k widen by a shift left of 16, the odd k by masking the low half (exact).
// Register plan (one row): G x 4 accumulators for the even k and as many for the odd k (16 of 32
// for a gated panel), summed once at the end: two independent FMA chains per column, so the
// 4-cycle FMA latency of Neoverse N1/V1 hides behind 8 (down: 4 x 2) chains in flight. x comes
// two k at a time in a d register and feeds the FMAs by lane (fmla by element).
// Epilogue: bias, limits and activation per column in scalar code (h_scalar, the oracle's own:
// 16 columns a panel against Hk x 16 x G FMAs, and it keeps the Arm tiers' h as close to the
// generic kernels as possible); the routing-weighted scatter-add with one fused multiply-add.
// Prefill: for now each row runs the decode loop alone (the panel stays in L2 for the expert's
// other rows); register-blocked prefill tiles are the next step on Arm.
// Known limits: never run on Arm hardware; tested under qemu-user, speed estimated with llvm-mca
// (benchmarks/log/arm.md).
#if !defined(__aarch64__)
#error "kernels/neon is built for aarch64 only (CMakeLists.txt)"
#endif
#include <arm_neon.h>

#include "kernels/neon/panel_loops_neon.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {

// Four columns of row k of a f32 / f16 panel matrix as fp32.
template <DType D>
inline float32x4_t load4(const void* base, int64_t elem) {
  if constexpr (D == DType::kF32) {
    return vld1q_f32(static_cast<const float*>(base) + elem);
  } else {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(static_cast<const uint16_t*>(base) + elem)));
  }
}

// out[gi][0..15]: matrix gi of one panel (reduction length Kp, G matrices) dotted with fp32 x.
template <DType D, int G>
inline void dot_panel(const void* panel, int64_t Kp, const float* x, int64_t ahead, float (*out)[kPanelN]) {
  float32x4_t ae[G][4], ao[G][4];
  for (int gi = 0; gi < G; ++gi)
    for (int q = 0; q < 4; ++q) ae[gi][q] = ao[gi][q] = vdupq_n_f32(0.0f);
  if constexpr (D == DType::kBF16) {
    const uint32x4_t odd_mask = vdupq_n_u32(0xffff0000u);
    const uint8_t* w = static_cast<const uint8_t*>(panel);
    for (int64_t k = 0; k < Kp; k += 2, w += 64 * G) {
      if (ahead) {
        pf::line(w + ahead);
        if (G == 2) pf::line(w + ahead + 64);
      }
      const float32x2_t xv = vld1_f32(x + k);
      for (int gi = 0; gi < G; ++gi)
        for (int q = 0; q < 4; ++q) {
          const uint32x4_t v = vld1q_u32(reinterpret_cast<const uint32_t*>(w + gi * 64 + q * 16));
          ae[gi][q] = vfmaq_lane_f32(ae[gi][q], vreinterpretq_f32_u32(vshlq_n_u32(v, 16)), xv, 0);
          ao[gi][q] = vfmaq_lane_f32(ao[gi][q], vreinterpretq_f32_u32(vandq_u32(v, odd_mask)), xv, 1);
        }
    }
  } else {
    constexpr int64_t esz = D == DType::kF32 ? 4 : 2;
    const char* wb = static_cast<const char*>(panel);
    for (int64_t k = 0; k < Kp; k += 2) {
      if (ahead)
        for (int64_t o = 0; o < 2 * G * kPanelN * esz; o += 64) pf::line(wb + k * G * kPanelN * esz + o + ahead);
      const float32x2_t xv = vld1_f32(x + k);
      for (int gi = 0; gi < G; ++gi)
        for (int q = 0; q < 4; ++q) {
          const int64_t e = (k * G + gi) * kPanelN + q * 4;
          ae[gi][q] = vfmaq_lane_f32(ae[gi][q], load4<D>(panel, e), xv, 0);
          ao[gi][q] = vfmaq_lane_f32(ao[gi][q], load4<D>(panel, e + G * kPanelN), xv, 1);
        }
    }
  }
  for (int gi = 0; gi < G; ++gi)
    for (int q = 0; q < 4; ++q) vst1q_f32(out[gi] + q * 4, vaddq_f32(ae[gi][q], ao[gi][q]));
}

// The family of kernels/neon/panel_loops_neon.h: one row at a time.
template <DType D>
struct Lossless {
  static constexpr bool kQdot = false;
  static constexpr bool kBf16Rows = false;
  static constexpr int kRows = 1;
  template <int G, int NT>
  static void dot(const uint8_t* panel, int64_t Kp, int, int64_t ahead, const void* const* rows,
                  float (*out)[G][kPanelN]) {
    static_assert(NT == 1);
    dot_panel<D, G>(panel, Kp, static_cast<const float*>(rows[0]), ahead, out[0]);
  }
  static const void* down_row(const DownJob& j, int64_t r) { return static_cast<const float*>(j.h) + r * j.h_stride; }
};

}  // namespace

bool get_kernels_neon(DType dt, KernelImpl* k) {
  switch (dt) {
    case DType::kF32: loops_neon::set_kernels<Lossless<DType::kF32>>(k); break;
    case DType::kBF16: loops_neon::set_kernels<Lossless<DType::kBF16>>(k); break;
    case DType::kF16: loops_neon::set_kernels<Lossless<DType::kF16>>(k); break;
    default: return false;
  }
  return true;
}

}  // namespace hina::detail
