// [NOTE] moe_*_generic: the scalar oracle every SIMD MoE kernel is tested against.
//
// Data layout (shared by all ISAs, see PackedHeader, layout v1):
//   | array            | shape                                  | notes                          |
//   |------------------|----------------------------------------|--------------------------------|
//   | gate/up panel    | bf16: [Hk/2][G][16][2]; else [Hk][G][16] | 16 rows of I, G=2: gate, up  |
//   | down panel       | bf16: [Ik/2][16][2];    else [Ik][16]    | 16 rows of H                 |
//   | x rows (input)   | [nt][Hk] fp32 (or bf16 for the AMX twin), zero-padded               |
//   | h rows           | [nt][Ik] fp32 (or bf16 for the AMX twin), columns >= I are 0        |
//   | acc rows         | [T][Hn] fp32, out_t accumulates w * y                               |
// Plan: plain loops, fp32 accumulation in k order; no blocking, no vectors (compiled at the
// baseline flags, so it runs everywhere).
// Limits: slow by design; only meant as the reference and the last-resort fallback.
#include "moe/kernel_api.h"

namespace hina::detail {
namespace {

template <bool XBf16>
inline float xval(const void* row, int64_t k) {
  if constexpr (XBf16) return bf16_to_f32(static_cast<const uint16_t*>(row)[k]);
  else return static_cast<const float*>(row)[k];
}

template <bool XBf16, bool HBf16>
void gateup_generic(const GateUpJob& j) {
  const Layout& L = *j.L;
  const int64_t panel_elems = L.Hk * kPanelN * L.G;
  const bool gated = L.G == 2;
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const int64_t pbase = p * panel_elems;
    for (int64_t r = 0; r < j.nt; ++r) {
      const void* xr = j.x[r];
      for (int n = 0; n < kPanelN; ++n) {
        const int64_t col = p * kPanelN + n;
        float g = 0.0f, u = 0.0f;
        for (int64_t k = 0; k < L.Hk; ++k) {
          const float xv = xval<XBf16>(xr, k);
          u += load_elem(L.dtype, j.w, pbase + panel_index(L.kpack, L.G, k, L.G - 1, n)) * xv;
          if (gated) g += load_elem(L.dtype, j.w, pbase + panel_index(L.kpack, L.G, k, 0, n)) * xv;
        }
        float h = 0.0f;
        if (col < L.I) {
          if (j.bias_g) g += j.bias_g[col];
          if (j.bias_u) u += j.bias_u[col];
          h = h_scalar(*j.act, gated, g, u);
        }
        if constexpr (HBf16) static_cast<uint16_t*>(j.h)[r * j.h_stride + col] = f32_to_bf16(h);
        else static_cast<float*>(j.h)[r * j.h_stride + col] = h;
      }
    }
  }
}

template <bool HBf16>
void down_generic(const DownJob& j) {
  const Layout& L = *j.L;
  const int64_t panel_elems = L.Ik * kPanelN;
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const int64_t pbase = p * panel_elems;
    for (int64_t r = 0; r < j.nt; ++r) {
      for (int n = 0; n < kPanelN; ++n) {
        const int64_t col = p * kPanelN + n;
        if (col >= L.H) break;
        float y = 0.0f;
        for (int64_t k = 0; k < L.Ik; ++k) {
          const float hv = HBf16 ? bf16_to_f32(static_cast<const uint16_t*>(j.h)[r * j.h_stride + k])
                                 : static_cast<const float*>(j.h)[r * j.h_stride + k];
          y += load_elem(L.dtype, j.w, pbase + panel_index(L.kpack, 1, k, 0, n)) * hv;
        }
        if (j.bias) y += j.bias[col];
        j.acc[r][col] += j.wt[r] * y;
      }
    }
  }
}

}  // namespace

bool get_kernels_generic(DType dt, bool amx_twin, KernelImpl* k) {
  if (amx_twin) {
    if (dt != DType::kBF16) return false;
    k->gateup = &gateup_generic<true, true>;
    k->down = &down_generic<true>;
    k->x_bf16 = k->h_bf16 = true;
    k->row_slack = 0;
    return true;
  }
  k->gateup = &gateup_generic<false, false>;
  k->down = &down_generic<false>;
  k->x_bf16 = k->h_bf16 = false;
  k->row_slack = 0;
  return true;
}

}  // namespace hina::detail
