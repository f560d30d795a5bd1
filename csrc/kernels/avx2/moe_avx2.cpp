// [NOTE] moe_decode_<fmt>_avx2 / moe_prefill_<fmt>_avx2 (fmt: f32, bf16, f16)
// Flags: -mavx2 -mfma -mf16c (tier `avx2`).
//
// Data layout: layout v1 (see moe_avx512.cpp / PackedHeader); one 16-column panel is two ymm
// halves (columns 0-7, 8-15).
//   | array          | shape                                      |
//   |----------------|--------------------------------------------|
//   | gate/up panel  | bf16 [Hk/2][G][16][2], f32/f16 [Hk][G][16] |
//   | down panel     | bf16 [Ik/2][16][2],    f32/f16 [Ik][16]    |
//   | x / h rows     | fp32, [nt][Hk] / [nt][Ik]                  |
// Register plan: NT <= 2 rows x {gate, up} x {lo, hi} = 8 ymm accumulators, 4 weight ymm,
// broadcasts from memory; bf16 pairs split by shift (even k) / mask (odd k) as on AVX-512.
// bf16 prefill (bf16_tile, row blocks of 4 and a remainder of 3): 4 rows over both matrices
// would need 16 accumulators, so a tile walks one matrix (both halves) at a time: 4 rows x
// {lo, hi} = 8 accumulators, the 4 split weight vectors, 2 broadcasts; each weight load and
// split feeds 4 rows instead of 2. The FMA chain of every element is unchanged (bit for bit).
// Epilogue: bias, limits, activation (vec_avx2.h: the AVX-512 build's vector exp/erfc, 8 columns
// at a time; the scalar libm one cost 2-4 % of an OLMoE-shaped prefill at T = 512) and the column
// mask, per 8-column half.
#include <immintrin.h>

#include "kernels/avx2/vec_avx2.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {

constexpr int kMaxRows = 2;
inline void prefetch(const void* p) { pf::line(p); }

inline void bf16_pair(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

template <DType D>
inline __m256 load8(const void* base, int64_t elem_off) {
  if constexpr (D == DType::kF32) {
    return _mm256_load_ps(static_cast<const float*>(base) + elem_off);
  } else {
    return _mm256_cvtph_ps(
        _mm_load_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + elem_off)));
  }
}

// acc[r][0..3] = gate lo, gate hi, up lo, up hi (gate unused when !Gated).
template <DType D, bool Gated, int NT>
inline void gateup_block(const void* panel, int64_t Hk, const float* const* x, __m256 acc[][4]) {
  constexpr int G = Gated ? 2 : 1;
  for (int r = 0; r < NT; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  if constexpr (D == DType::kBF16) {
    const uint16_t* w = static_cast<const uint16_t*>(panel);
    for (int64_t k = 0; k < Hk; k += 2, w += G * 32) {
      prefetch(reinterpret_cast<const char*>(w) + pf::bytes());
      if (Gated) prefetch(reinterpret_cast<const char*>(w) + pf::bytes() + 64);
      for (int half = 0; half < 2; ++half) {
        __m256 ue, uo, ge, go;
        bf16_pair(w + (G - 1) * 32 + half * 16, ue, uo);
        if constexpr (Gated) bf16_pair(w + half * 16, ge, go);
        for (int r = 0; r < NT; ++r) {
          const __m256 x0 = _mm256_broadcast_ss(&x[r][k]), x1 = _mm256_broadcast_ss(&x[r][k + 1]);
          acc[r][2 + half] = _mm256_fmadd_ps(uo, x1, _mm256_fmadd_ps(ue, x0, acc[r][2 + half]));
          if constexpr (Gated)
            acc[r][half] = _mm256_fmadd_ps(go, x1, _mm256_fmadd_ps(ge, x0, acc[r][half]));
        }
      }
    }
  } else {
    constexpr int64_t esz = D == DType::kF32 ? 4 : 2;
    const char* wb = static_cast<const char*>(panel);
    for (int64_t k = 0; k < Hk; ++k) {
      prefetch(wb + (k * G * 16) * esz + pf::bytes());
      const int64_t ub = (k * G + G - 1) * 16, gb = k * G * 16;
      const __m256 ul = load8<D>(panel, ub), uh = load8<D>(panel, ub + 8);
      __m256 gl, gh;
      if constexpr (Gated) { gl = load8<D>(panel, gb); gh = load8<D>(panel, gb + 8); }
      for (int r = 0; r < NT; ++r) {
        const __m256 xv = _mm256_broadcast_ss(&x[r][k]);
        acc[r][2] = _mm256_fmadd_ps(ul, xv, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(uh, xv, acc[r][3]);
        if constexpr (Gated) {
          acc[r][0] = _mm256_fmadd_ps(gl, xv, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(gh, xv, acc[r][1]);
        }
      }
    }
  }
}

// One matrix gi (both halves) of a bf16 panel for NT rows: acc[r][half]. Each weight vector
// feeds NT = 3-4 rows (gateup_block / down_block: 1-2), and each element's FMA chain is theirs
// (the same k order), so the result is the same bit for bit. Kept out of line: inlined into the
// row loops, GCC holds the accumulators on the stack.
template <int G, int NT>
__attribute__((noinline)) void bf16_tile(const uint16_t* panel, int gi, int64_t Kk, const float* const* x,
                                         __m256 (*acc)[2]) {
  __m256 a[NT][2];
  for (int r = 0; r < NT; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  const uint16_t* w = panel + gi * 32;
  const int64_t ahead = pf::bytes();
  for (int64_t k = 0; k < Kk; k += 2, w += G * 32) {
    prefetch(reinterpret_cast<const char*>(w) + ahead);
    __m256 e0, o0, e1, o1;
    bf16_pair(w, e0, o0);
    bf16_pair(w + 16, e1, o1);
    for (int r = 0; r < NT; ++r) {
      const __m256 x0 = _mm256_broadcast_ss(&x[r][k]), x1 = _mm256_broadcast_ss(&x[r][k + 1]);
      a[r][0] = _mm256_fmadd_ps(o0, x1, _mm256_fmadd_ps(e0, x0, a[r][0]));
      a[r][1] = _mm256_fmadd_ps(o1, x1, _mm256_fmadd_ps(e1, x0, a[r][1]));
    }
  }
  for (int r = 0; r < NT; ++r) {
    acc[r][0] = a[r][0];
    acc[r][1] = a[r][1];
  }
}

template <DType D, int NT>
inline void down_block(const void* panel, int64_t Ik, const float* h, int64_t hs, __m256 acc[][2]) {
  for (int r = 0; r < NT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  if constexpr (D == DType::kBF16) {
    const uint16_t* w = static_cast<const uint16_t*>(panel);
    for (int64_t k = 0; k < Ik; k += 2, w += 32) {
      prefetch(reinterpret_cast<const char*>(w) + pf::bytes());
      for (int half = 0; half < 2; ++half) {
        __m256 we, wo;
        bf16_pair(w + half * 16, we, wo);
        for (int r = 0; r < NT; ++r) {
          acc[r][half] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(&h[r * hs + k + 1]),
                                         _mm256_fmadd_ps(we, _mm256_broadcast_ss(&h[r * hs + k]), acc[r][half]));
        }
      }
    }
  } else {
    constexpr int64_t esz = D == DType::kF32 ? 4 : 2;
    const char* wb = static_cast<const char*>(panel);
    for (int64_t k = 0; k < Ik; ++k) {
      prefetch(wb + k * 16 * esz + pf::bytes());
      const __m256 wl = load8<D>(panel, k * 16), wh = load8<D>(panel, k * 16 + 8);
      for (int r = 0; r < NT; ++r) {
        const __m256 hv = _mm256_broadcast_ss(&h[r * hs + k]);
        acc[r][0] = _mm256_fmadd_ps(wl, hv, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(wh, hv, acc[r][1]);
      }
    }
  }
}

// bf16 row blocks of this many rows and more run bf16_tile (prefill); fewer (decode) the blocks
// of both matrices.
constexpr int kTileRows = 3, kTileMax = 4;

template <DType D, bool Gated, int NT>
inline void gateup_rows(const GateUpJob& j, const void* panel, int64_t r0, int64_t col0) {
  const float* xr[NT];
  for (int r = 0; r < NT; ++r) xr[r] = static_cast<const float*>(j.x[r0 + r]);
  __m256 acc[NT][4];
  if constexpr (D == DType::kBF16 && NT >= kTileRows) {
    constexpr int G = Gated ? 2 : 1;
    __m256 t[NT][2];
    for (int gi = 0; gi < G; ++gi) {
      bf16_tile<G, NT>(static_cast<const uint16_t*>(panel), gi, j.L->Hk, xr, t);
      const int at = gi == G - 1 ? 2 : 0;  // acc: gate lo, gate hi, up lo, up hi
      for (int r = 0; r < NT; ++r) {
        acc[r][at] = t[r][0];
        acc[r][at + 1] = t[r][1];
      }
    }
  } else {
    gateup_block<D, Gated, NT>(panel, j.L->Hk, xr, acc);
  }
  float* h = static_cast<float*>(j.h);
  for (int half = 0; half < 2; ++half) {
    const int64_t c = col0 + half * 8;
    const __m256 valid = v256::valid_mask(c, j.L->I);
    const __m256 bg = j.bias_g ? _mm256_loadu_ps(j.bias_g + c) : _mm256_setzero_ps();
    const __m256 bu = j.bias_u ? _mm256_loadu_ps(j.bias_u + c) : _mm256_setzero_ps();
    for (int r = 0; r < NT; ++r)
      _mm256_storeu_ps(h + (r0 + r) * j.h_stride + c,
                       v256::h_vec(*j.act, Gated, _mm256_add_ps(acc[r][half], bg), _mm256_add_ps(acc[r][2 + half], bu), valid));
  }
}

template <DType D, bool Gated>
void gateup_avx2(const GateUpJob& j) {
  constexpr int G = Gated ? 2 : 1;
  const int64_t panel_bytes = j.L->Hk * kPanelN * G * (D == DType::kF32 ? 4 : 2);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const void* panel = static_cast<const char*>(j.w) + p * panel_bytes;
    int64_t r0 = 0;
    if constexpr (D == DType::kBF16) {
      for (; r0 + kTileMax <= j.nt; r0 += kTileMax) gateup_rows<D, Gated, kTileMax>(j, panel, r0, p * kPanelN);
      if (j.nt - r0 == 3) {
        gateup_rows<D, Gated, 3>(j, panel, r0, p * kPanelN);
        continue;
      }
    }
    for (; r0 + kMaxRows <= j.nt; r0 += kMaxRows) gateup_rows<D, Gated, 2>(j, panel, r0, p * kPanelN);
    if (r0 < j.nt) gateup_rows<D, Gated, 1>(j, panel, r0, p * kPanelN);
  }
}

template <DType D, int NT>
inline void down_rows(const DownJob& j, const void* panel, int64_t r0, int64_t col0) {
  __m256 acc[NT][2];
  if constexpr (D == DType::kBF16 && NT >= kTileRows) {
    const float* hr[NT];
    for (int r = 0; r < NT; ++r) hr[r] = static_cast<const float*>(j.h) + (r0 + r) * j.h_stride;
    bf16_tile<1, NT>(static_cast<const uint16_t*>(panel), 0, j.L->Ik, hr, acc);
  } else {
    down_block<D, NT>(panel, j.L->Ik, static_cast<const float*>(j.h) + r0 * j.h_stride, j.h_stride, acc);
  }
  const __m256 bl = j.bias ? _mm256_load_ps(j.bias + col0) : _mm256_setzero_ps();
  const __m256 bh = j.bias ? _mm256_load_ps(j.bias + col0 + 8) : _mm256_setzero_ps();
  for (int r = 0; r < NT; ++r) {
    float* a = j.acc[r0 + r] + col0;
    const __m256 w = _mm256_broadcast_ss(&j.wt[r0 + r]);
    _mm256_storeu_ps(a, _mm256_fmadd_ps(w, _mm256_add_ps(acc[r][0], bl), _mm256_loadu_ps(a)));
    _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(w, _mm256_add_ps(acc[r][1], bh), _mm256_loadu_ps(a + 8)));
  }
}

template <DType D>
void down_avx2(const DownJob& j) {
  pf::reload();
  const int64_t panel_bytes = j.L->Ik * kPanelN * (D == DType::kF32 ? 4 : 2);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const void* panel = static_cast<const char*>(j.w) + p * panel_bytes;
    int64_t r0 = 0;
    if constexpr (D == DType::kBF16) {
      for (; r0 + kTileMax <= j.nt; r0 += kTileMax) down_rows<D, kTileMax>(j, panel, r0, p * kPanelN);
      if (j.nt - r0 == 3) {
        down_rows<D, 3>(j, panel, r0, p * kPanelN);
        continue;
      }
    }
    for (; r0 + kMaxRows <= j.nt; r0 += kMaxRows) down_rows<D, 2>(j, panel, r0, p * kPanelN);
    if (r0 < j.nt) down_rows<D, 1>(j, panel, r0, p * kPanelN);
  }
}

template <DType D>
void gateup_dispatch(const GateUpJob& j) {
  pf::reload();
  if (j.L->G == 2) gateup_avx2<D, true>(j);
  else gateup_avx2<D, false>(j);
}

}  // namespace

bool get_kernels_avx2(DType dt, KernelImpl* k) {
  k->x_bf16 = k->h_bf16 = false;
  k->row_slack = 0;
  switch (dt) {
    case DType::kF32: k->gateup = &gateup_dispatch<DType::kF32>; k->down = &down_avx2<DType::kF32>; return true;
    case DType::kBF16: k->gateup = &gateup_dispatch<DType::kBF16>; k->down = &down_avx2<DType::kBF16>; return true;
    case DType::kF16: k->gateup = &gateup_dispatch<DType::kF16>; k->down = &down_avx2<DType::kF16>; return true;
  }
  return false;
}

}  // namespace hina::detail
