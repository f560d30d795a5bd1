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
//   Threads: the driver hands these kernels small work items dynamically (experts/forward.cpp header).
//   Epilogue (AVX-512): C tiles stored to a 4 KiB stack buffer; bias, limits, activation,
//   bf16 rounding (gate/up) or routing weight + scatter-add into fp32 rows (down).
// Quantised weights (moe_prefill_int8_amx / moe_prefill_int4_amx): each panel (layout v5: 4 k
// per 32-bit lane) is expanded to bf16 (bf16(scale * q), the same VNNI-pair layout) in a
// per-thread buffer right before its tiles run, then the bf16 tile plan above runs unchanged;
// the expansion is paid once per panel and expert, and amortised over the expert's rows. (No
// AMX-INT8 variant: qdot='int' sends the AMX tier's prefill to the avx512vnni kernels.)
// Known limits: rows past the expert's last row are read (garbage rows of the next expert or
// zeroed slack: KernelImpl::row_slack = 16) and their C rows discarded; A tiles are re-loaded
// per panel (from L1/L2); gate/up has no room for a second panel (2 A + 2 B + 4 C = 8 tiles),
// so with <= 16 rows an expert uses 2 of its 4 accumulators; bf16 only (no AMX-FP16 here).
// Weight stream: while a panel (down: a pair) runs, the next one is prefetched into L2, its
// lines spread over the current panel's k-tile iterations (PanelAhead); the last panel of a job
// prefetches the first of the job the driver says this thread runs next (w_next). Without it
// the first row block's B loads stalled on memory and the tiles and the stream took turns:
// benchmarks/bench_prefetch.py --prefill 512 measured bf16 1.13x, int8 1.25x, int4 even.
// (Prefetching a few k-tiles ahead inside the same panel gave nothing: too little lead.)
// Tested without AMX: the C++ tests' build also compiles this file on software tiles
// (moe_amx_sw.cpp, kernels/amx/tiles.h) and runs the amx tier on them where the CPU has none.
#include <immintrin.h>

#include "kernels/amx/tiles.h"
#include "kernels/avx512/vec_avx512.h"
#include "moe/kernel_api.h"
#include "moe/prefetch.h"

// moe_amx_sw.cpp compiles this file a second time on software tiles (kernels/amx/tiles.h), its
// entry points renamed so both builds link into the C++ tests.
#ifdef HINA_AMX_SOFTWARE_TILES
#define HINA_AMX_ENTRY(name) name##_sw
#else
#define HINA_AMX_ENTRY(name) name
#endif

namespace hina::detail {
namespace {

void configure_tiles() {
  tiles::Config cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  tiles::configure(cfg);
}

// ---- quantised panels expanded to bf16 VNNI pairs ----

// Rounded bf16 bits of v in the high half of each dword (finite inputs).
inline __m512i bf16_hi(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}
// Stores 16 columns x (k even, k odd) as [16][2] bf16 pairs.
inline void store_pairs(uint16_t* dst, __m512 even, __m512 odd) {
  const __m512i e = _mm512_srli_epi32(bf16_hi(even), 16);
  const __m512i o = _mm512_and_si512(bf16_hi(odd), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  _mm512_store_si512(dst, _mm512_or_si512(e, o));
}

thread_local AlignedBuf tls_panels;

// Prefetches the next panel (or pair) into L2 while the current one runs: its cache lines are
// spread evenly over the current panel's k-tile iterations, so the weight stream overlaps with
// the tiles instead of stalling the first row block's B loads.
struct PanelAhead {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t per = 0;
  void start(const void* base, int64_t bytes, int64_t iters) {
    p = static_cast<const char*>(base);
    end = p + (base ? bytes : 0);
    per = (bytes / 64 + iters - 1) / iters;
  }
  void step() {
    for (int64_t i = 0; i < per && p < end; ++i, p += 64) pf::line(p);
  }
};

// Expands a quantised panel (G matrices, reduction length Kp) to dst [Kp/2][G][16][2] bf16.
void expand_panel(const uint8_t* panel, const Layout& L, int64_t Kp, int G, uint16_t* dst) {
  if (L.wfmt == WFormat::kInt8) {
    const uint8_t* w = panel + 64 * G;
    for (int gi = 0; gi < G; ++gi) {
      const __m512 sc = _mm512_load_ps(reinterpret_cast<const float*>(panel + gi * 64));
      for (int64_t k = 0; k < Kp; k += 4) {
        const __m512i v = _mm512_load_si512(w + q8_index(k, G, gi, 0));
        store_pairs(dst + ((k >> 1) * G + gi) * 32, _mm512_mul_ps(v512::i8_lane_ps<0>(v), sc),
                    _mm512_mul_ps(v512::i8_lane_ps<1>(v), sc));
        store_pairs(dst + (((k >> 1) + 1) * G + gi) * 32, _mm512_mul_ps(v512::i8_lane_ps<2>(v), sc),
                    _mm512_mul_ps(v512::i8_lane_ps<3>(v), sc));
      }
    }
    return;
  }
  const int group = L.group;
  for (int64_t b = 0; b < Kp / group; ++b) {
    const uint8_t* codes = panel + q4_codes_at(b, G, group);
    for (int gi = 0; gi < G; ++gi) {
      const __m512 sc = v512::q4_scales16(panel + q4_scales_at(b, G, group) + gi * 16,
                                          _mm512_load_ps(q4_factors(panel, gi)));
      for (int kk = 0; kk < group; kk += 8) {
        const __m512i v = _mm512_load_si512(codes + q4_index(kk, G, gi, 0));
        uint16_t* d = dst + (((b * group + kk) >> 1) * G + gi) * 32;  // 4 pairs, G * 32 apart
        store_pairs(d, _mm512_mul_ps(v512::i4_lane_ps<0>(v), sc), _mm512_mul_ps(v512::i4_lane_ps<1>(v), sc));
        store_pairs(d + G * 32, _mm512_mul_ps(v512::i4_lane_ps<2>(v), sc), _mm512_mul_ps(v512::i4_lane_ps<3>(v), sc));
        store_pairs(d + 2 * G * 32, _mm512_mul_ps(v512::i4_lane_ps<4>(v), sc), _mm512_mul_ps(v512::i4_lane_ps<5>(v), sc));
        store_pairs(d + 3 * G * 32, _mm512_mul_ps(v512::i4_lane_ps<6>(v), sc), _mm512_mul_ps(v512::i4_lane_ps<7>(v), sc));
      }
    }
  }
}

template <bool Gated, WFormat F>
void gateup_amx(const GateUpJob& j) {
  const Layout& L = *j.L;
  constexpr int G = Gated ? 2 : 1;
  const int64_t Hk = L.Hk, xs = j.x_stride;
  const uint16_t* x0 = static_cast<const uint16_t*>(j.x[0]);
  uint16_t* h = static_cast<uint16_t*>(j.h);
  const int64_t panel_elems = Hk * kPanelN * G;
  const int64_t pbytes = gu_panel_bytes(L);  // one stored panel, any format
  uint16_t* ebuf = F == WFormat::kLossless ? nullptr : static_cast<uint16_t*>(tls_panels.get(2 * static_cast<size_t>(panel_elems)));
  alignas(64) float cg[2][16][16];
  alignas(64) float cu[2][16][16];
  pf::reload();
  const int64_t iters = (j.nt + 31) / 32 * (Hk / 32);
  PanelAhead ahead;
  configure_tiles();
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint16_t* panel = static_cast<const uint16_t*>(j.w) + p * panel_elems;
    const void* nx = p + 1 < j.p1 ? static_cast<const char*>(j.w) + (p + 1) * pbytes
                                  : pf::amx_mode() >= 2 ? j.w_next : nullptr;
    ahead.start(pf::amx_mode() ? nx : nullptr, pbytes, iters);
    if constexpr (F != WFormat::kLossless) {
      expand_panel(static_cast<const uint8_t*>(j.w) + p * pbytes, L, Hk, G, ebuf);
      panel = ebuf;
    }
    const int64_t col0 = p * kPanelN;
    const __mmask16 valid = v512::valid_mask(col0, L.I);
    const __m512 bg = j.bias_g ? _mm512_load_ps(j.bias_g + col0) : _mm512_setzero_ps();
    const __m512 bu = j.bias_u ? _mm512_load_ps(j.bias_u + col0) : _mm512_setzero_ps();
    for (int64_t m0 = 0; m0 < j.nt; m0 += 32) {
      const bool two = j.nt - m0 > 16;
      HINA_TILE_ZERO(1);
      if (Gated) HINA_TILE_ZERO(0);
      if (two) {
        HINA_TILE_ZERO(3);
        if (Gated) HINA_TILE_ZERO(2);
      }
      const uint16_t* a0 = x0 + m0 * xs;
      const uint16_t* a1 = a0 + 16 * xs;
      for (int64_t kt = 0; kt < Hk / 32; ++kt) {
        ahead.step();
        const uint16_t* b = panel + kt * 16 * G * 32;
        HINA_TILE_LOAD(4, a0 + kt * 32, static_cast<int>(xs * 2));
        HINA_TILE_LOAD(7, b + (G - 1) * 32, G * 64);
        HINA_TILE_DPBF16PS(1, 4, 7);
        if (Gated) {
          HINA_TILE_LOAD(6, b, G * 64);
          HINA_TILE_DPBF16PS(0, 4, 6);
        }
        if (two) {
          HINA_TILE_LOAD(5, a1 + kt * 32, static_cast<int>(xs * 2));
          HINA_TILE_DPBF16PS(3, 5, 7);
          if (Gated) HINA_TILE_DPBF16PS(2, 5, 6);
        }
      }
      HINA_TILE_STORE(1, cu[0], 64);
      if (Gated) HINA_TILE_STORE(0, cg[0], 64);
      if (two) {
        HINA_TILE_STORE(3, cu[1], 64);
        if (Gated) HINA_TILE_STORE(2, cg[1], 64);
      }
      const int64_t rows = j.nt - m0 < 32 ? j.nt - m0 : 32;
      for (int64_t rr = 0; rr < rows; ++rr) {
        const int blk = static_cast<int>(rr >> 4), row = static_cast<int>(rr & 15);
        const __m512 u = _mm512_add_ps(_mm512_load_ps(cu[blk][row]), bu);
        const __m512 g = Gated ? _mm512_add_ps(_mm512_load_ps(cg[blk][row]), bg) : _mm512_setzero_ps();
        uint16_t* hr = h + (m0 + rr) * j.h_stride + col0;
        if (Gated && j.pair) {  // a paired linear layer: both halves as they are
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(hr), v512::cvt_bf16(_mm512_maskz_mov_ps(valid, g)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(hr + j.pair), v512::cvt_bf16(_mm512_maskz_mov_ps(valid, u)));
          continue;
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hr), v512::cvt_bf16(v512::h_vec(*j.act, Gated, g, u, valid)));
      }
    }
  }
  tiles::release();
}

template <WFormat F>
void down_amx(const DownJob& j) {
  const Layout& L = *j.L;
  const int64_t Ik = L.Ik, hs = j.h_stride;
  const uint16_t* h0 = static_cast<const uint16_t*>(j.h);
  const int64_t panel_elems = Ik * kPanelN;
  const int64_t pbytes = down_panel_bytes(L);  // one stored panel, any format
  uint16_t* ebuf = F == WFormat::kLossless ? nullptr : static_cast<uint16_t*>(tls_panels.get(4 * static_cast<size_t>(panel_elems)));
  alignas(64) float c[2][2][16][16];  // [panel][row block][row][col]
  pf::reload();
  const int64_t iters = (j.nt + 31) / 32 * (Ik / 32);
  PanelAhead ahead;
  configure_tiles();
  // Two panels at a time: tmm6/7 = B of panels p, p+1; tmm4/5 = A rows m0.., m0+16..;
  // C: tmm0 (A0,B0), tmm1 (A0,B1), tmm2 (A1,B0), tmm3 (A1,B1) -> 4 dpbf16ps per 4 loads.
  for (int64_t p = j.p0; p < j.p1; p += 2) {
    const bool pp = p + 1 < j.p1;
    const uint16_t* panel = static_cast<const uint16_t*>(j.w) + p * panel_elems;
    int64_t pn = std::min<int64_t>(2, j.p1 - (p + 2));  // panels in the next pair
    const void* nx = nullptr;
    if (pn > 0) {
      nx = static_cast<const char*>(j.w) + (p + 2) * pbytes;
    } else {  // the next job's first pair (the same panels of the next expert)
      pn = std::min<int64_t>(2, j.p1 - j.p0);
      nx = pf::amx_mode() >= 2 ? j.w_next : nullptr;
    }
    ahead.start(pf::amx_mode() ? nx : nullptr, pn * pbytes, iters);
    if constexpr (F != WFormat::kLossless) {
      const uint8_t* q = static_cast<const uint8_t*>(j.w) + p * pbytes;
      expand_panel(q, L, Ik, 1, ebuf);
      if (pp) expand_panel(q + pbytes, L, Ik, 1, ebuf + panel_elems);
      panel = ebuf;
    }
    const uint16_t* panel1 = panel + panel_elems;
    const int64_t col0 = p * kPanelN;
    const __m512 b0 = j.bias ? _mm512_load_ps(j.bias + col0) : _mm512_setzero_ps();
    const __m512 b1 = j.bias && pp ? _mm512_load_ps(j.bias + col0 + kPanelN) : _mm512_setzero_ps();
    for (int64_t m0 = 0; m0 < j.nt; m0 += 32) {
      const bool two = j.nt - m0 > 16;
      HINA_TILE_ZERO(0);
      if (pp) HINA_TILE_ZERO(1);
      if (two) {
        HINA_TILE_ZERO(2);
        if (pp) HINA_TILE_ZERO(3);
      }
      const uint16_t* a0 = h0 + m0 * hs;
      const uint16_t* a1 = a0 + 16 * hs;
      for (int64_t kt = 0; kt < Ik / 32; ++kt) {
        ahead.step();
        HINA_TILE_LOAD(4, a0 + kt * 32, static_cast<int>(hs * 2));
        HINA_TILE_LOAD(6, panel + kt * 16 * 32, 64);
        HINA_TILE_DPBF16PS(0, 4, 6);
        if (pp) {
          HINA_TILE_LOAD(7, panel1 + kt * 16 * 32, 64);
          HINA_TILE_DPBF16PS(1, 4, 7);
        }
        if (two) {
          HINA_TILE_LOAD(5, a1 + kt * 32, static_cast<int>(hs * 2));
          HINA_TILE_DPBF16PS(2, 5, 6);
          if (pp) HINA_TILE_DPBF16PS(3, 5, 7);
        }
      }
      HINA_TILE_STORE(0, c[0][0], 64);
      if (pp) HINA_TILE_STORE(1, c[1][0], 64);
      if (two) {
        HINA_TILE_STORE(2, c[0][1], 64);
        if (pp) HINA_TILE_STORE(3, c[1][1], 64);
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
  tiles::release();
}

template <WFormat F>
void gateup_dispatch(const GateUpJob& j) {
  if (j.L->G == 2) gateup_amx<true, F>(j);
  else gateup_amx<false, F>(j);
}

}  // namespace

bool HINA_AMX_ENTRY(get_kernels_amx)(DType dt, KernelImpl* k) {
  if (dt != DType::kBF16) return false;
  k->gateup = &gateup_dispatch<WFormat::kLossless>;
  k->down = &down_amx<WFormat::kLossless>;
  k->x_bf16 = k->h_bf16 = true;
  k->row_slack = 16;
  k->uses_w_next = true;
  return true;
}

bool HINA_AMX_ENTRY(get_qkernels_amx)(WFormat wf, KernelImpl* k) {
  switch (wf) {
    case WFormat::kInt8: k->gateup = &gateup_dispatch<WFormat::kInt8>; k->down = &down_amx<WFormat::kInt8>; break;
    case WFormat::kInt4: k->gateup = &gateup_dispatch<WFormat::kInt4>; k->down = &down_amx<WFormat::kInt4>; break;
    default: return false;
  }
  k->x_bf16 = k->h_bf16 = true;
  k->row_slack = 16;
  k->uses_w_next = true;
  return true;
}

}  // namespace hina::detail
