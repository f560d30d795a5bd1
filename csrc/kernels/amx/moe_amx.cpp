// [NOTE] moe_prefill_bf16_amx: tiled GEMM for many rows per expert, AMX-BF16.
// Flags: the avx512 TU's flags + -mamx-tile -mamx-bf16 (tier `amx`; the process has requested
// the XTILEDATA permission in cpu_features()).
//
// Data layout (layout v1; a bf16 panel IS the AMX B-tile layout, no extra packing):
//   | array          | shape                         | tile view                                  |
//   |----------------|-------------------------------|--------------------------------------------|
//   | gate/up panel  | [Hk/2][G][16][2] bf16         | k-tile kt: B = 16 rows (k pairs) x 64 B,   |
//   |                |                               | row stride G*64 B; up at +64 B when G = 2  |
//   | down panel     | [Ik/2][16][2] bf16            | B = 16 rows x 64 B, stride 64 B            |
//   | x rows         | [S+16][xs] bf16, grouped per expert, contiguous (A = 16 rows x 32 k);   |
//   |                | xs = Hk (+32 when Hk*2 is a multiple of 512 B: avoids L1 set aliasing)   |
//   | h rows         | [S+16][hs] bf16, hs likewise from Ik (h rounded to bf16, like PyTorch)   |
// Tile plan (all 8 tiles configured 16 rows x 64 bytes):
//   gate/up: tmm4/5 = A (rows m0..m0+15, m0+16..m0+31), tmm6 = B gate, tmm7 = B up,
//            tmm0/1 = C gate/up for A0, tmm2/3 = C gate/up for A1 -> 4 dpbf16ps per 4 loads.
//   down:    two panels at a time: tmm4/5 = A (h rows m0.., m0+16..), tmm6/7 = B of panels
//            p, p+1, tmm0/1 = C for A0 x (B0, B1), tmm2/3 = C for A1 -> 4 dpbf16ps per 4 loads
//            (was 2 per 3 with one panel; an odd last panel runs alone).
//   Loop order: panel (pair) outer, 32-row blocks inner (panels stay in L2 across row blocks).
//   Threads: the driver hands these kernels small work items dynamically (moe.cpp header).
//   Epilogue (AVX-512): C tiles stored to a 4 KiB stack buffer; bias, limits, activation,
//   bf16 rounding (gate/up) or routing weight + scatter-add into fp32 rows (down).
// Known limits: rows past the expert's last row are read (garbage rows of the next expert or
// zeroed slack: KernelImpl::row_slack = 16) and their C rows discarded; A tiles are re-loaded
// per panel (from L1/L2); gate/up has no room for a second panel (2 A + 2 B + 4 C = 8 tiles),
// so with <= 16 rows an expert uses 2 of its 4 accumulators; B tiles are not software-prefetched
// (tried: distance 4-16 k-tiles, T0/T1, and THP-backed weights: no gain above noise on the test
// VM); bf16 only (no AMX-FP16 here).
#include <immintrin.h>

#include "kernels/avx512/vec_avx512.h"
#include "moe/kernel_api.h"

namespace hina::detail {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

template <bool Gated>
void gateup_amx(const GateUpJob& j) {
  const Layout& L = *j.L;
  constexpr int G = Gated ? 2 : 1;
  const int64_t Hk = L.Hk, xs = j.x_stride;
  const uint16_t* x0 = static_cast<const uint16_t*>(j.x[0]);
  uint16_t* h = static_cast<uint16_t*>(j.h);
  const int64_t panel_elems = Hk * kPanelN * G;
  alignas(64) float cg[2][16][16];
  alignas(64) float cu[2][16][16];
  configure_tiles();
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint16_t* panel = static_cast<const uint16_t*>(j.w) + p * panel_elems;
    const int64_t col0 = p * kPanelN;
    const __mmask16 valid = v512::valid_mask(col0, L.I);
    const __m512 bg = j.bias_g ? _mm512_load_ps(j.bias_g + col0) : _mm512_setzero_ps();
    const __m512 bu = j.bias_u ? _mm512_load_ps(j.bias_u + col0) : _mm512_setzero_ps();
    for (int64_t m0 = 0; m0 < j.nt; m0 += 32) {
      const bool two = j.nt - m0 > 16;
      _tile_zero(1);
      if (Gated) _tile_zero(0);
      if (two) {
        _tile_zero(3);
        if (Gated) _tile_zero(2);
      }
      const uint16_t* a0 = x0 + m0 * xs;
      const uint16_t* a1 = a0 + 16 * xs;
      for (int64_t kt = 0; kt < Hk / 32; ++kt) {
        const uint16_t* b = panel + kt * 16 * G * 32;
        _tile_loadd(4, a0 + kt * 32, static_cast<int>(xs * 2));
        _tile_loadd(7, b + (G - 1) * 32, G * 64);
        _tile_dpbf16ps(1, 4, 7);
        if (Gated) {
          _tile_loadd(6, b, G * 64);
          _tile_dpbf16ps(0, 4, 6);
        }
        if (two) {
          _tile_loadd(5, a1 + kt * 32, static_cast<int>(xs * 2));
          _tile_dpbf16ps(3, 5, 7);
          if (Gated) _tile_dpbf16ps(2, 5, 6);
        }
      }
      _tile_stored(1, cu[0], 64);
      if (Gated) _tile_stored(0, cg[0], 64);
      if (two) {
        _tile_stored(3, cu[1], 64);
        if (Gated) _tile_stored(2, cg[1], 64);
      }
      const int64_t rows = j.nt - m0 < 32 ? j.nt - m0 : 32;
      for (int64_t rr = 0; rr < rows; ++rr) {
        const int blk = static_cast<int>(rr >> 4), row = static_cast<int>(rr & 15);
        const __m512 u = _mm512_add_ps(_mm512_load_ps(cu[blk][row]), bu);
        const __m512 g = Gated ? _mm512_add_ps(_mm512_load_ps(cg[blk][row]), bg) : _mm512_setzero_ps();
        const __m512 hv = v512::h_vec(*j.act, Gated, g, u, valid);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + (m0 + rr) * j.h_stride + col0),
                            v512::cvt_bf16(hv));
      }
    }
  }
  _tile_release();
}

void down_amx(const DownJob& j) {
  const Layout& L = *j.L;
  const int64_t Ik = L.Ik, hs = j.h_stride;
  const uint16_t* h0 = static_cast<const uint16_t*>(j.h);
  const int64_t panel_elems = Ik * kPanelN;
  alignas(64) float c[2][2][16][16];  // [panel][row block][row][col]
  configure_tiles();
  // Two panels at a time: tmm6/7 = B of panels p, p+1; tmm4/5 = A rows m0.., m0+16..;
  // C: tmm0 (A0,B0), tmm1 (A0,B1), tmm2 (A1,B0), tmm3 (A1,B1) -> 4 dpbf16ps per 4 loads.
  for (int64_t p = j.p0; p < j.p1; p += 2) {
    const bool pp = p + 1 < j.p1;
    const uint16_t* panel = static_cast<const uint16_t*>(j.w) + p * panel_elems;
    const uint16_t* panel1 = panel + panel_elems;
    const int64_t col0 = p * kPanelN;
    const __m512 b0 = j.bias ? _mm512_load_ps(j.bias + col0) : _mm512_setzero_ps();
    const __m512 b1 = j.bias && pp ? _mm512_load_ps(j.bias + col0 + kPanelN) : _mm512_setzero_ps();
    for (int64_t m0 = 0; m0 < j.nt; m0 += 32) {
      const bool two = j.nt - m0 > 16;
      _tile_zero(0);
      if (pp) _tile_zero(1);
      if (two) {
        _tile_zero(2);
        if (pp) _tile_zero(3);
      }
      const uint16_t* a0 = h0 + m0 * hs;
      const uint16_t* a1 = a0 + 16 * hs;
      for (int64_t kt = 0; kt < Ik / 32; ++kt) {
        _tile_loadd(4, a0 + kt * 32, static_cast<int>(hs * 2));
        _tile_loadd(6, panel + kt * 16 * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (pp) {
          _tile_loadd(7, panel1 + kt * 16 * 32, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two) {
          _tile_loadd(5, a1 + kt * 32, static_cast<int>(hs * 2));
          _tile_dpbf16ps(2, 5, 6);
          if (pp) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0][0], 64);
      if (pp) _tile_stored(1, c[1][0], 64);
      if (two) {
        _tile_stored(2, c[0][1], 64);
        if (pp) _tile_stored(3, c[1][1], 64);
      }
      const int64_t rows = j.nt - m0 < 32 ? j.nt - m0 : 32;
      for (int64_t rr = 0; rr < rows; ++rr) {
        const int blk = static_cast<int>(rr >> 4), row = static_cast<int>(rr & 15);
        const __m512 w = _mm512_set1_ps(j.wt[m0 + rr]);
        float* a = j.acc[m0 + rr] + col0;
        const __m512 y0 = _mm512_add_ps(_mm512_load_ps(c[0][blk][row]), b0);
        _mm512_storeu_ps(a, _mm512_fmadd_ps(w, y0, _mm512_loadu_ps(a)));
        if (pp) {
          const __m512 y1 = _mm512_add_ps(_mm512_load_ps(c[1][blk][row]), b1);
          _mm512_storeu_ps(a + kPanelN, _mm512_fmadd_ps(w, y1, _mm512_loadu_ps(a + kPanelN)));
        }
      }
    }
  }
  _tile_release();
}

void gateup_dispatch(const GateUpJob& j) {
  if (j.L->G == 2) gateup_amx<true>(j);
  else gateup_amx<false>(j);
}

}  // namespace

bool get_kernels_amx(DType dt, KernelImpl* k) {
  if (dt != DType::kBF16) return false;
  k->gateup = &gateup_dispatch;
  k->down = &down_amx;
  k->x_bf16 = k->h_bf16 = true;
  k->row_slack = 16;
  return true;
}

}  // namespace hina::detail
