// [NOTE] moe_decode_l12_avx512: lossless12 weights (PackedHeader in hina_moe/experts.h), decoded
// in registers; and the AVX-512 panel decompressor (the wrapped kernels' path). One
// implementation, two builds (each TU keeps its own copy: internal linkage):
//   moe_l12_avx512.cpp      F/BW/VL (moe_avx512.cpp's flags): the high bytes by vpshufb zmm of
//                           the codes' nibbles, masked and joined from two ymm halves
//   moe_l12_avx512vbmi.cpp  + -mavx512vbmi, chosen when the CPU reports AVX512-VBMI: the code
//                           bytes broadcast to both halves (a load), the upper half shifted by 4
//                           (vpsrlvw), then vpermb, which reads only the index bits it needs
//                           (the table repeats in every 128-bit lane), so no masking or joining:
//                           3 fewer ops per block, the same bytes (tested); one core decoded
//                           6-10 % more packed bytes per second on the AMD EPYC (2026-11-30, 496cb46).
//
// Data layout (one lossless12 panel; nb blocks of 64 weights = two plain bf16 vectors):
//   | part        | bytes                  | holds                                         |
//   |-------------|------------------------|-----------------------------------------------|
//   | table       | 64                     | 16 high bytes, replicated per 128-bit lane    |
//   | flags       | nb/8 padded to 64      | bit b: block b spilled                        |
//   | slots       | nb x 96                | 64 low bytes + 32 code bytes (or high bytes)  |
//   | spill area  | (nb/64 + 8) x 32, pad  | high bytes 32..63 of the spilled blocks       |
// Plan per block: lo = 64 low bytes; hi = vpshufb(table, [c & 15 | c >> 4 & 15]) (normal) or
// [slot's 32 | next spill slot's 32] (spilled); unpacklo/hi_epi8(lo, hi) = the two plain
// vectors, bit for bit. Then exactly the FMAs of moe_avx512.cpp's bf16 kernel on those vectors,
// in its order (per accumulator: k ascending; even/odd k chains summed at the end), and its
// epilogue: the outputs are the plain lossless kernel's bits (tested).
//   gate/up, G = 2: block b = (gate, up) vectors of k pair b; G = 1 (up only) and down: block b
//   = the vectors of k pairs 2b and 2b + 1.
// Registers: NT <= 4 rows x {gate, up} x {even, odd} accumulators, as the plain kernel; more
// rows run in chunks of 4, each decoding the panel again (from L1/L2; the decode path's rows
// per expert are few).
// Prefetch: the block's first and last byte pf::bytes() ahead (moe/prefetch.h), every line of the
// compressed stream, the spill area and the next panel included as the stream reaches them;
// none where pf::l12_prefetch() says so (AMD: 40 % faster per thread without it).
// Known limits: decode only (the driver runs prefill through the wrapped plain kernels, which
// decompress a panel once for all rows).
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "kernels/avx512/vec_avx512.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

namespace hina::detail {
namespace {  // internal linkage: each including TU keeps its own copy, built with its flags

constexpr int kMaxRows = 4;

// Walks the blocks of one panel in order (spilled blocks take the spill slots in order).
struct PanelReader {
  const uint8_t* panel;
  L12Geometry g;
  __m512i table;
  int64_t spilled = 0;

  PanelReader(const void* p, int64_t plain_bytes)
      : panel(static_cast<const uint8_t*>(p)), g(l12_geometry(plain_bytes)),
        table(_mm512_loadu_si512(p)) {}

  const uint8_t* slot(int64_t b) const { return panel + g.slots + b * kL12Slot; }

  inline void block(int64_t b, __m512i& v0, __m512i& v1) {
    const uint8_t* s = slot(b);
    const __m512i lo = _mm512_loadu_si512(s);
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    __m512i hi;
    if (panel[kL12Table + (b >> 3)] >> (b & 7) & 1) {
      const uint8_t* sp = panel + g.spill + std::min(spilled++, g.cap - 1) * kL12SpillSlot;
      hi = _mm512_inserti64x4(_mm512_castsi256_si512(c), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)), 1);
    } else {
#if defined(__AVX512VBMI__)
      // bytes 0-31: code c (low nibble indexes; bits 4-5 pick a copy of the table), 32-63: the
      // 16-bit lanes of c shifted right by 4 (high nibble; the neighbour's bits land in 4-7)
      const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
      hi = _mm512_permutexvar_epi8(_mm512_srlv_epi16(_mm512_broadcast_i64x4(c), shift), table);
#else
      const __m256i nib = _mm256_set1_epi8(0x0f);
      const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(c, nib)),
                                               _mm256_and_si256(_mm256_srli_epi16(c, 4), nib), 1);
      hi = _mm512_shuffle_epi8(table, codes);
#endif
    }
    v0 = _mm512_unpacklo_epi8(lo, hi);
    v1 = _mm512_unpackhi_epi8(lo, hi);
  }

  inline void prefetch(int64_t b) const {
    if (!pf::l12_prefetch()) return;  // left to the hardware prefetchers (AMD: prefetch.h)
    const uint8_t* s = slot(b);
    pf::line(s + pf::bytes());
    pf::line(s + pf::bytes() + kL12Slot - 1);
  }
};

// A plain vector's 16 columns x 2 k as two fp32 vectors (even k, odd k), as moe_avx512.cpp.
inline void split_pair(__m512i v, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Dot products of one panel with NT rows (moe_avx512.cpp's gateup_block for bf16).
template <bool Gated, int NT>
inline void gateup_block(const void* panel, int64_t Hk, const float* const* x, __m512* g_out, __m512* u_out) {
  constexpr int G = Gated ? 2 : 1;
  __m512 g0[NT], g1[NT], u0[NT], u1[NT];
  for (int r = 0; r < NT; ++r) g0[r] = g1[r] = u0[r] = u1[r] = _mm512_setzero_ps();
  PanelReader pr(panel, Hk * kPanelN * G * 2);
  for (int64_t b = 0; b < pr.g.nb; ++b) {
    pr.prefetch(b);
    __m512i v0, v1;
    pr.block(b, v0, v1);
    if constexpr (Gated) {  // v0 = gate, v1 = up, of k pair b
      const int64_t k = 2 * b;
      __m512 ue, uo, ge, go;
      split_pair(v1, ue, uo);
      split_pair(v0, ge, go);
      for (int r = 0; r < NT; ++r) {
        const __m512 x0 = _mm512_set1_ps(x[r][k]), x1 = _mm512_set1_ps(x[r][k + 1]);
        u0[r] = _mm512_fmadd_ps(ue, x0, u0[r]);
        u1[r] = _mm512_fmadd_ps(uo, x1, u1[r]);
        g0[r] = _mm512_fmadd_ps(ge, x0, g0[r]);
        g1[r] = _mm512_fmadd_ps(go, x1, g1[r]);
      }
    } else {  // v0, v1 = up of k pairs 2b, 2b + 1
      const int64_t k = 4 * b;
      __m512 ae, ao, be, bo;
      split_pair(v0, ae, ao);
      split_pair(v1, be, bo);
      for (int r = 0; r < NT; ++r) {
        u0[r] = _mm512_fmadd_ps(ae, _mm512_set1_ps(x[r][k]), u0[r]);
        u1[r] = _mm512_fmadd_ps(ao, _mm512_set1_ps(x[r][k + 1]), u1[r]);
        u0[r] = _mm512_fmadd_ps(be, _mm512_set1_ps(x[r][k + 2]), u0[r]);
        u1[r] = _mm512_fmadd_ps(bo, _mm512_set1_ps(x[r][k + 3]), u1[r]);
      }
    }
  }
  for (int r = 0; r < NT; ++r) {
    u_out[r] = _mm512_add_ps(u0[r], u1[r]);
    if constexpr (Gated) g_out[r] = _mm512_add_ps(g0[r], g1[r]);
  }
}

template <int NT>
inline void down_block(const void* panel, int64_t Ik, const float* h, int64_t hs, __m512* y) {
  __m512 a0[NT], a1[NT];
  for (int r = 0; r < NT; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  PanelReader pr(panel, Ik * kPanelN * 2);
  for (int64_t b = 0; b < pr.g.nb; ++b) {
    pr.prefetch(b);
    __m512i v0, v1;
    pr.block(b, v0, v1);
    const int64_t k = 4 * b;
    __m512 ae, ao, be, bo;
    split_pair(v0, ae, ao);
    split_pair(v1, be, bo);
    for (int r = 0; r < NT; ++r) {
      a0[r] = _mm512_fmadd_ps(ae, _mm512_set1_ps(h[r * hs + k]), a0[r]);
      a1[r] = _mm512_fmadd_ps(ao, _mm512_set1_ps(h[r * hs + k + 1]), a1[r]);
      a0[r] = _mm512_fmadd_ps(be, _mm512_set1_ps(h[r * hs + k + 2]), a0[r]);
      a1[r] = _mm512_fmadd_ps(bo, _mm512_set1_ps(h[r * hs + k + 3]), a1[r]);
    }
  }
  for (int r = 0; r < NT; ++r) y[r] = _mm512_add_ps(a0[r], a1[r]);
}

template <bool Gated, int NT>
inline void gateup_rows(const GateUpJob& j, const void* panel, int64_t r0, int64_t col0, __m512 bg, __m512 bu,
                        __mmask16 valid) {
  const float* xr[NT];
  for (int r = 0; r < NT; ++r) xr[r] = static_cast<const float*>(j.x[r0 + r]);
  __m512 g[NT], u[NT];
  for (int r = 0; r < NT; ++r) g[r] = _mm512_setzero_ps();
  gateup_block<Gated, NT>(panel, j.L->Hk, xr, g, u);
  float* h = static_cast<float*>(j.h);
  for (int r = 0; r < NT; ++r) {
    const __m512 hv = v512::h_vec(*j.act, Gated, _mm512_add_ps(g[r], bg), _mm512_add_ps(u[r], bu), valid);
    _mm512_store_ps(h + (r0 + r) * j.h_stride + col0, hv);
  }
}

template <bool Gated>
void gateup_l12(const GateUpJob& j) {
  const Layout& L = *j.L;
  const int64_t pbytes = gu_panel_bytes(L);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const void* panel = static_cast<const char*>(j.w) + p * pbytes;
    const int64_t col0 = p * kPanelN;
    const __mmask16 valid = v512::valid_mask(col0, L.I);
    const __m512 bg = j.bias_g ? _mm512_load_ps(j.bias_g + col0) : _mm512_setzero_ps();
    const __m512 bu = j.bias_u ? _mm512_load_ps(j.bias_u + col0) : _mm512_setzero_ps();
    int64_t r0 = 0;
    for (; r0 + kMaxRows <= j.nt; r0 += kMaxRows) gateup_rows<Gated, 4>(j, panel, r0, col0, bg, bu, valid);
    switch (j.nt - r0) {
      case 3: gateup_rows<Gated, 3>(j, panel, r0, col0, bg, bu, valid); break;
      case 2: gateup_rows<Gated, 2>(j, panel, r0, col0, bg, bu, valid); break;
      case 1: gateup_rows<Gated, 1>(j, panel, r0, col0, bg, bu, valid); break;
      default: break;
    }
  }
}

void gateup_l12_dispatch(const GateUpJob& j) {
  pf::reload();
  if (j.L->G == 2) gateup_l12<true>(j);
  else gateup_l12<false>(j);
}

template <int NT>
inline void down_rows(const DownJob& j, const void* panel, int64_t r0, int64_t col0, __m512 b) {
  __m512 y[NT];
  down_block<NT>(panel, j.L->Ik, static_cast<const float*>(j.h) + r0 * j.h_stride, j.h_stride, y);
  for (int r = 0; r < NT; ++r) {
    float* a = j.acc[r0 + r] + col0;
    _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(j.wt[r0 + r]), _mm512_add_ps(y[r], b), _mm512_loadu_ps(a)));
  }
}

void down_l12(const DownJob& j) {
  pf::reload();
  const Layout& L = *j.L;
  const int64_t pbytes = down_panel_bytes(L);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const void* panel = static_cast<const char*>(j.w) + p * pbytes;
    const int64_t col0 = p * kPanelN;
    const __m512 b = j.bias ? _mm512_load_ps(j.bias + col0) : _mm512_setzero_ps();
    int64_t r0 = 0;
    for (; r0 + kMaxRows <= j.nt; r0 += kMaxRows) down_rows<4>(j, panel, r0, col0, b);
    switch (j.nt - r0) {
      case 3: down_rows<3>(j, panel, r0, col0, b); break;
      case 2: down_rows<2>(j, panel, r0, col0, b); break;
      case 1: down_rows<1>(j, panel, r0, col0, b); break;
      default: break;
    }
  }
}

inline void l12_decompress_panel(const uint8_t* panel, int64_t plain_bytes, uint16_t* plain) {
  PanelReader pr(panel, plain_bytes);
  for (int64_t b = 0; b < pr.g.nb; ++b) {
    __m512i v0, v1;
    pr.block(b, v0, v1);
    _mm512_storeu_si512(plain + b * 64, v0);
    _mm512_storeu_si512(plain + b * 64 + 32, v1);
  }
}

inline void l12_kernels(KernelImpl* k) {
  k->gateup = &gateup_l12_dispatch;
  k->down = &down_l12;
  k->x_bf16 = k->h_bf16 = false;
  k->row_slack = 0;
  k->uses_w_next = false;
  k->qdot = false;
}

}  // namespace
}  // namespace hina::detail
