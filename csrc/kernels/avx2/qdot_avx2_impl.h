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
// Decode (qdot_panel): a block of NT <= 2 (int8) / 1 (int4) rows walks both matrices of a panel
// at once: each activation broadcast feeds G x 2 weight vectors, and 16 ymm registers hold
// NT x G x 2 int32 and as many fp32 accumulators (int4 also its group sums). Weight-bound.
// Prefill tiles (qdot_tile_q8 / _q4, blocks of 4 rows and the remainders of 3 (int8) / 2-3 (int4)): with
// 1-2 rows a weight load, the loop was bound by loads and spills, and a block of 4 rows over
// both matrices would need 4 x 2 x 2 accumulators a level, more than the 16 registers. So a tile
// walks one matrix (both halves) of the panel at a time for 4 rows, and holds only the
// innermost level in registers: 8 sums, the 2 weight vectors (int4: their 4 nibble vectors),
// the row's broadcasts and a temporary, 14-15 of 16. The fp32 levels (int8: the row sums over
// blocks; int4: the group sum and the sum over groups) are read and written once a 32-k block /
// group, in a small stack buffer (L1); with the widening, offset, conversion and FMAs that is
// about a fifth of an int4 block's vector ops (44 of ~225 at group 64, GCC's code counted
// 2026-12-08); the order of the scale applications is experts.h's, unchanged. Per weight
// vector and row:
//   int8: vpsignb + vpmaddubsw + vpmaddwd + vpaddd; |qx| comes from a per-row-block buffer
//         (abs_rows) instead of a vpabsb in the loop.
//   int4: 2 vpmaddubsw + 2 vpaddw: a block's 8 products of <= 2 * 15 * 127 per int16 lane sum to
//         <= 30480 < 2^15, so the block is widened once (vpmaddwd with ones) and its offset
//         -8 * sum(qx_b) subtracted then; the nibble decoding (3 ops a vector) is shared by 4
//         rows. Vnni: 2 vpdpbusd into an int32 sum that starts at the offset.
// A pass reads only its matrix's lines of the panel; the panel stays in L2 across the
// expert's row blocks, so walking the matrices one after the other reads no more from memory.
// Known limits: measured on Zen 4 with HINA_MOE_ISA=avx2 only (no AVX2-only CPU here);
// the avxvnni build is compiled and shares the code but never ran here (no AVX-VNNI).
#pragma once

#include <immintrin.h>

#include <cstdlib>
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

// vpdpbusd ymm (AVX-VNNI) in the TU built with -mavxvnni; never called elsewhere, except in the
// tests' build of the Vnni code (HINA_QDOT_EMULATED_VNNI: csrc/tests/qdot_vnni_emulated.cpp),
// which computes the same int32 sums with AVX2 so that code runs on CPUs without AVX-VNNI.
inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#elif defined(HINA_QDOT_EMULATED_VNNI)
  // bytes 0, 2 and 1, 3 of each lane widened to int16 (u zero-, s sign-extended): exact products
  const __m256i ue = _mm256_and_si256(u8, _mm256_set1_epi16(0x00ff)), uo = _mm256_srli_epi16(u8, 8);
  const __m256i se = _mm256_srai_epi16(_mm256_slli_epi16(s8, 8), 8), so = _mm256_srai_epi16(s8, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so)));
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

// An empty asm that takes v in and out of a ymm register: the sums of a k step exist in
// registers there, so GCC neither re-associates the integer chains across the unrolled k steps
// (it kept every product of a block live and spilled most of them: 2026-12-07) nor interleaves
// the steps beyond the registers.
inline void in_reg(__m256i& v) { asm("" : "+x"(v)); }

// |q| of NT activation rows, [NT][Kp]: the unsigned operand of int8's sign trick, made once per
// row block for both matrices instead of one vpabsb per row and k step in the tile's inner loop.
template <int NT>
inline const int8_t* abs_rows(const QRows<NT>& x, int64_t Kp) {
  thread_local AlignedBuf buf;
  int8_t* out = static_cast<int8_t*>(buf.get(static_cast<size_t>(NT * Kp)));
  for (int r = 0; r < NT; ++r)
    for (int64_t k = 0; k < Kp; k += 32)
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + r * Kp + k),
                         _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q[r] + k))));
  return out;
}

// out[r][0..15]: matrix gi of an int8 panel (both halves) dotted with NT quantised rows, scales
// applied (the tile plan in the [NOTE]). xa: abs_rows (without Vnni).
// Not inlined: inside the panel loops GCC kept the tile's accumulators and row pointers on the
// stack (a load and a store per vpaddd); alone it holds them in registers (2026-12-07).
template <bool Vnni, int G, int NT>
__attribute__((noinline)) void qdot_tile_q8(const uint8_t* panel, int gi, int64_t Kp, int ahead, const QRows<NT>& x,
                                            const int8_t* xa, float (*out)[kPanelN]) {
  const __m256i ones = _mm256_set1_epi16(1);
  (void)ones;
  (void)xa;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  (void)flip;
  alignas(32) float af[NT][kPanelN];  // the fp32 level lives in L1: the registers hold the int32 one
  const uint8_t* w = panel + 64 * G + 64 * gi;
  for (int64_t b = 0; b < Kp / kActBlock; ++b) {
    const int64_t kb = b * kActBlock;
    __m256i ai[NT][2];
    for (int r = 0; r < NT; ++r) ai[r][0] = ai[r][1] = Vnni ? _mm256_set1_epi32(-128 * x.sum[r][b]) : _mm256_setzero_si256();
    for (int qd = 0; qd < kActBlock / 4; ++qd, w += 64 * G) {
      if (ahead) prefetch(w + ahead);
      __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
      __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32));
      if constexpr (Vnni) {
        w0 = _mm256_xor_si256(w0, flip);
        w1 = _mm256_xor_si256(w1, flip);
      }
      for (int r = 0; r < NT; ++r) {
        const __m256i xs = bcast4(x.q[r] + kb + qd * 4);
        if constexpr (Vnni) {
          ai[r][0] = dpbusd(ai[r][0], w0, xs);
          ai[r][1] = dpbusd(ai[r][1], w1, xs);
        } else {
          const __m256i xu = bcast4(xa + r * Kp + kb + qd * 4);
          ai[r][0] = _mm256_add_epi32(ai[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xu, _mm256_sign_epi8(w0, xs)), ones));
          ai[r][1] = _mm256_add_epi32(ai[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xu, _mm256_sign_epi8(w1, xs)), ones));
        }
      }
      for (int r = 0; r < NT; ++r) {
        in_reg(ai[r][0]);
        in_reg(ai[r][1]);
      }
    }
    for (int r = 0; r < NT; ++r) {
      const __m256 sb = _mm256_set1_ps(x.s[r][b]);
      for (int half = 0; half < 2; ++half) {
        const __m256 v = _mm256_cvtepi32_ps(ai[r][half]);
        float* a = af[r] + half * 8;
        _mm256_store_ps(a, b == 0 ? _mm256_mul_ps(v, sb) : _mm256_fmadd_ps(v, sb, _mm256_load_ps(a)));
      }
    }
  }
  for (int half = 0; half < 2; ++half) {
    const __m256 sc = _mm256_loadu_ps(reinterpret_cast<const float*>(panel + gi * 64) + half * 8);
    for (int r = 0; r < NT; ++r) _mm256_store_ps(out[r] + half * 8, _mm256_mul_ps(_mm256_load_ps(af[r] + half * 8), sc));
  }
}

// out[r][0..15]: matrix gi of an int4 panel dotted with NT quantised rows (the [NOTE]'s plan),
// dsc the panel's steps (panel_steps; a tile always has several rows). The group's blocks are
// known at compile time (NB = group / 32: groups 32, 64, 128), so the epilogue has no branch (a
// runtime count tested blk == 0, blk + 1 < nblk and g == 0 for each row and half: 24 branches a
// block), and the offset 8 * sum(qx_b) is a shift of the sum broadcast from memory (was a scalar
// shift, vmovd and vpbroadcastd): 1.1-1.2x the int4 gate/up rate of d5f90a3's tile in L2 (log:
// whole-model.md, 2026-12-08). The fp32 levels start at +0 and take FMAs, as qdot_panel's do,
// so a row's bits are those of the row alone (mul and fma + 0 differ only in a zero's sign).
template <bool Vnni, int G, int NT, int NB>
__attribute__((noinline)) void qdot_tile_q4(const uint8_t* panel, int gi, int64_t Kp, int ahead, const float* dsc,
                                            const QRows<NT>& x, float (*out)[kPanelN]) {
  constexpr int group = NB * kActBlock;
  const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  (void)ones;
  alignas(32) float y[NT][kPanelN], bg[NT][kPanelN];  // both fp32 levels in L1
  for (int r = 0; r < NT; ++r)
    for (int half = 0; half < 2; ++half) _mm256_store_ps(y[r] + half * 8, _mm256_setzero_ps());
  Q4Walk<G> q(panel, group);
  for (int64_t k0 = 0, g = 0; k0 < Kp; k0 += group, ++g, q.next()) {
    if (ahead) q.prefetch(ahead, prefetch);
    const uint8_t* w = q.codes() + 64 * gi;
    const float* d = dsc + (g * G + gi) * kPanelN;
    auto block = [&](auto blk_c) {
      constexpr int blk = decltype(blk_c)::value;
      const int64_t b = k0 / kActBlock + blk, kb = b * kActBlock;
      // no Vnni: int16 sums of the block (8 vpmaddubsw terms of <= 2 * 15 * 127 each: <= 30480),
      // widened once at its end; Vnni: int32 from the offset correction
      __m256i s[NT][2];
      for (int r = 0; r < NT; ++r) s[r][0] = s[r][1] = Vnni ? _mm256_set1_epi32(-8 * x.sum[r][b]) : _mm256_setzero_si256();
      for (int o = 0; o < kActBlock / 8; ++o, w += 64 * G) {
        const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
        const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32));
        const __m256i lo0 = _mm256_and_si256(v0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
        const __m256i lo1 = _mm256_and_si256(v1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
        for (int r = 0; r < NT; ++r) {
          const __m256i xl = bcast4(x.q[r] + kb + o * 8);
          const __m256i xh = bcast4(x.q[r] + kb + o * 8 + 4);
          if constexpr (Vnni) {
            s[r][0] = dpbusd(dpbusd(s[r][0], lo0, xl), hi0, xh);
            s[r][1] = dpbusd(dpbusd(s[r][1], lo1, xl), hi1, xh);
          } else {
            s[r][0] = _mm256_add_epi16(s[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl), _mm256_maddubs_epi16(hi0, xh)));
            s[r][1] = _mm256_add_epi16(s[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl), _mm256_maddubs_epi16(hi1, xh)));
          }
        }
        for (int r = 0; r < NT; ++r) {
          in_reg(s[r][0]);
          in_reg(s[r][1]);
        }
      }
      for (int r = 0; r < NT; ++r) {
        const __m256 sb = _mm256_broadcast_ss(x.s[r] + b);
        const __m256i off = _mm256_slli_epi32(_mm256_set1_epi32(x.sum[r][b]), 3);
        (void)off;
        for (int half = 0; half < 2; ++half) {
          const __m256i t = Vnni ? s[r][half] : _mm256_sub_epi32(_mm256_madd_epi16(s[r][half], ones), off);
          float* a = bg[r] + half * 8;
          const __m256 bv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sb, blk == 0 ? _mm256_setzero_ps() : _mm256_load_ps(a));
          if constexpr (blk + 1 < NB) {
            _mm256_store_ps(a, bv);
          } else {
            float* yr = y[r] + half * 8;
            _mm256_store_ps(yr, _mm256_fmadd_ps(bv, _mm256_load_ps(d + half * 8), _mm256_load_ps(yr)));
          }
        }
      }
    };
    block(std::integral_constant<int, 0>{});
    if constexpr (NB > 1) block(std::integral_constant<int, 1>{});
    if constexpr (NB > 2) {
      block(std::integral_constant<int, 2>{});
      block(std::integral_constant<int, 3>{});
    }
  }
  for (int half = 0; half < 2; ++half) {
    const __m256 f = _mm256_load_ps(q4_factors(panel, gi) + half * 8);
    for (int r = 0; r < NT; ++r) _mm256_store_ps(out[r] + half * 8, _mm256_mul_ps(_mm256_load_ps(y[r] + half * 8), f));
  }
}

// The integer-dot family for the shared panel loops (kernels/avx2/qpanel_loops_avx2.h). Tiles:
// blocks of tile_rows() and more rows run the tiles (one matrix at a time); fewer (decode), and
// every block of a family without tiles (the kernels before them: tuning builds, for A/B), run
// qdot_panel.
template <bool Vnni, bool Tiles = true>
struct IntDot {
  template <WFormat F>
  static constexpr int max_rows() { return Tiles ? 4 : F == WFormat::kInt8 ? 2 : 1; }
  // int8's 2-row qdot_panel shares each activation broadcast by 4 weight vectors, as fast as a
  // 2-row tile in decode; int4's holds 1 row.
  template <WFormat F>
  static constexpr int tile_rows() { return F == WFormat::kInt8 ? 3 : 2; }

  template <WFormat F, int G, int NT>
  static void dot(const uint8_t* panel, int64_t Kp, int group, int ahead, const float* dsc, const QRows<NT>& x,
                  __m256 (&acc)[NT][2][2]) {
    if constexpr (Tiles && NT >= tile_rows<F>()) {
      const int8_t* xa = F == WFormat::kInt8 && !Vnni ? abs_rows(x, Kp) : nullptr;
      alignas(32) float o[NT][kPanelN];
      for (int gi = 0; gi < G; ++gi) {
        if constexpr (F == WFormat::kInt4) {
          switch (group) {
            // (a group's prefetches cover both matrices' codes: the first pass issues them)
            case 32: qdot_tile_q4<Vnni, G, NT, 1>(panel, gi, Kp, gi == 0 ? ahead : 0, dsc, x, o); break;
            case 64: qdot_tile_q4<Vnni, G, NT, 2>(panel, gi, Kp, gi == 0 ? ahead : 0, dsc, x, o); break;
            default: qdot_tile_q4<Vnni, G, NT, 4>(panel, gi, Kp, gi == 0 ? ahead : 0, dsc, x, o); break;  // 128 (packing allows no other)
          }
        } else {
          qdot_tile_q8<Vnni, G, NT>(panel, gi, Kp, ahead, x, xa, o);
        }
        for (int r = 0; r < NT; ++r)
          for (int half = 0; half < 2; ++half) acc[r][gi][half] = _mm256_load_ps(o[r] + half * 8);
      }
    } else {
      qdot_panel<Vnni, F, G, NT>(panel, Kp, group, ahead, dsc, x, acc);
    }
  }

  // A panel's row blocks after the first find its lines in L2 (the first block's pass brought
  // them, and its prefetches the next panels'), so only the first int4 tile prefetches.
  template <WFormat F, int NT>
  static int tile_ahead(int64_t r0, int ahead) {
    return F == WFormat::kInt4 && Tiles && NT >= tile_rows<F>() && r0 > 0 ? 0 : ahead;
  }

  template <WFormat F, int G, int NT>
  static void gateup_dot(const GateUpJob& j, const uint8_t* panel, int64_t r0, int ahead, const float* dsc,
                         __m256 (&acc)[NT][2][2]) {
    QRows<NT> xr;
    for (int r = 0; r < NT; ++r) xr.set(r, j.x[r0 + r], j.L->Hk);
    dot<F, G, NT>(panel, j.L->Hk, j.L->group, tile_ahead<F, NT>(r0, ahead), dsc, xr, acc);
  }

  template <WFormat F, int NT>
  static void down_dot(const DownJob& j, const uint8_t* panel, int64_t r0, int ahead, const float* dsc,
                       __m256 (&y)[NT][2][2]) {
    QRows<NT> hr;
    for (int r = 0; r < NT; ++r) hr.set(r, static_cast<const uint8_t*>(j.h) + (r0 + r) * j.h_stride, j.L->Ik);
    dot<F, 1, NT>(panel, j.L->Ik, j.L->group, tile_ahead<F, NT>(r0, ahead), dsc, hr, y);
  }
};

template <class Fam>
bool set_kernels(WFormat wf, KernelImpl* k) {
  switch (wf) {
    case WFormat::kInt8:
      k->gateup = &qloops256::gateup_dispatch<Fam, WFormat::kInt8>;
      k->down = &qloops256::down<Fam, WFormat::kInt8>;
      break;
    case WFormat::kInt4:
      k->gateup = &qloops256::gateup_dispatch<Fam, WFormat::kInt4>;
      k->down = &qloops256::down<Fam, WFormat::kInt4>;
      break;
    default: return false;
  }
  return true;
}

template <bool Vnni>
bool get_kernels(WFormat wf, KernelImpl* k) {
#ifdef HINA_PREFETCH_TUNING
  // tuning builds: HINA_QDOT_TILES=0 selects the kernels without tiles (A/B in one process)
  const char* tiles = std::getenv("HINA_QDOT_TILES");
  if (!(tiles && std::atoi(tiles) == 0 ? set_kernels<IntDot<Vnni, false>>(wf, k) : set_kernels<IntDot<Vnni>>(wf, k)))
    return false;
#else
  if (!set_kernels<IntDot<Vnni>>(wf, k)) return false;
#endif
  k->x_bf16 = k->h_bf16 = false;
  k->row_slack = 0;
  k->qdot = true;
  return true;
}

}  // namespace
}  // namespace hina::detail
