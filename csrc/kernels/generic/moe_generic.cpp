// [NOTE] moe_*_generic: the scalar oracle every SIMD MoE kernel is tested against, for every
// weight format (lossless f32/bf16/f16, int8, int4).
//
// Data layout: layout v5 quantised panels (see PackedHeader in hina_moe/experts.h):
//   | format | one panel (16 output rows, reduction length Kp, G matrices)                       |
//   |--------|-----------------------------------------------------------------------------------|
//   | int8   | [G][16] fp32 row scales (64*G B), then [Kp/4][G][16][4] int8 (4 k per 32-bit lane) |
//   | int4   | [G][16] fp32 row factors (64*G B), then blocks of 4/G groups: 64 B of one-byte     |
//   |        | scale codes ([4/G][G][16]), then each group's [group/8][G][16][4] code bytes (byte  |
//   |        | j of a lane: k = j low nibble, k = j + 4 high nibble, stored as q + 8); a group's   |
//   |        | scale is q4_scale(code, factor) (kernel_api.h)                                      |
//   x rows [nt][Hk] and h rows [nt][Ik] are fp32 (bf16 for the AMX twin), as for native weights.
//   Lossless panels: bf16 [Kp/2][G][16][2] (VNNI pairs), f32/f16 [Kp][G][16].
// Plan: each panel is expanded to fp32 w[k][16] (lossless: the values; quantised: scale * q),
// then plain loops with fp32 accumulation in k order; no blocking, no vectors (baseline flags).
// The AMX twin reads x and h as bf16 and rounds w to bf16 (a no-op for bf16 weights), as the
// AMX kernels do when they expand a quantised panel to tiles.
// Limits: slow by design; only meant as the reference and the last-resort fallback.
#include <cmath>
#include <vector>

#include "moe/kernel_api.h"

namespace hina::detail {

void dequant_panel_f32(const uint8_t* panel, const Layout& L, int64_t Kp, int G, int gi, float* w) {
  if (L.wfmt == WFormat::kInt8) {
    const float* sc = reinterpret_cast<const float*>(panel + gi * 64);
    const int8_t* q = reinterpret_cast<const int8_t*>(panel + 64 * G);
    for (int64_t k = 0; k < Kp; ++k)
      for (int n = 0; n < kPanelN; ++n) w[k * kPanelN + n] = sc[n] * static_cast<float>(q[q8_index(k, G, gi, n)]);
    return;
  }
  const int group = L.group;
  const float* fac = q4_factors(panel, gi);
  for (int64_t b = 0; b < Kp / group; ++b) {
    const uint8_t* sc = panel + q4_scales_at(b, G, group) + gi * 16;
    const uint8_t* codes = panel + q4_codes_at(b, G, group);
    for (int k = 0; k < group; ++k)
      for (int n = 0; n < kPanelN; ++n)
        w[(b * group + k) * kPanelN + n] = q4_scale(sc[n], fac[n]) * int4_value(codes, k, G, gi, n);
  }
}

namespace {

template <bool Bf16>
inline float act_in(const void* row, int64_t k) {
  if constexpr (Bf16) return bf16_to_f32(static_cast<const uint16_t*>(row)[k]);
  else return static_cast<const float*>(row)[k];
}

// One panel matrix as fp32 w[k][16], rounded to bf16 for the AMX twin.
template <bool Twin>
void panel_weights(const uint8_t* panel, const Layout& L, int64_t Kp, int G, int gi, std::vector<float>& w) {
  w.resize(static_cast<size_t>(Kp * kPanelN));
  if (L.wfmt == WFormat::kLossless) {
    for (int64_t k = 0; k < Kp; ++k)
      for (int n = 0; n < kPanelN; ++n)
        w[k * kPanelN + n] = load_elem(L.dtype, panel, panel_index(L.kpack, G, k, gi, n));
  } else {
    dequant_panel_f32(panel, L, Kp, G, gi, w.data());
  }
  if constexpr (Twin)
    for (float& v : w) v = bf16_to_f32(f32_to_bf16(v));
}

template <bool Twin>
void gateup_generic(const GateUpJob& j) {
  const Layout& L = *j.L;
  const bool gated = L.G == 2;
  const int64_t pbytes = gu_panel_bytes(L);
  std::vector<float> wg, wu;
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint8_t* panel = static_cast<const uint8_t*>(j.w) + p * pbytes;
    panel_weights<Twin>(panel, L, L.Hk, L.G, L.G - 1, wu);
    if (gated) panel_weights<Twin>(panel, L, L.Hk, L.G, 0, wg);
    for (int64_t r = 0; r < j.nt; ++r) {
      const void* xr = j.x[r];
      for (int n = 0; n < kPanelN; ++n) {
        const int64_t col = p * kPanelN + n;
        float g = 0.0f, u = 0.0f;
        for (int64_t k = 0; k < L.Hk; ++k) {
          const float xv = act_in<Twin>(xr, k);
          u += wu[k * kPanelN + n] * xv;
          if (gated) g += wg[k * kPanelN + n] * xv;
        }
        float h = 0.0f, hu = 0.0f;  // (hu: a paired linear layer's up half, j.pair on)
        if (col < L.I) {
          if (j.bias_g) g += j.bias_g[col];
          if (j.bias_u) u += j.bias_u[col];
          if (gated && j.pair) h = g, hu = u;
          else h = h_scalar(*j.act, gated, g, u);
        }
        const int64_t at = r * j.h_stride + col;
        if constexpr (Twin) static_cast<uint16_t*>(j.h)[at] = f32_to_bf16(h);
        else static_cast<float*>(j.h)[at] = h;
        if (gated && j.pair) {
          if constexpr (Twin) static_cast<uint16_t*>(j.h)[at + j.pair] = f32_to_bf16(hu);
          else static_cast<float*>(j.h)[at + j.pair] = hu;
        }
      }
    }
  }
}

template <bool Twin>
void down_generic(const DownJob& j) {
  const Layout& L = *j.L;
  const int64_t pbytes = down_panel_bytes(L);
  std::vector<float> w;
  for (int64_t p = j.p0; p < j.p1; ++p) {
    panel_weights<Twin>(static_cast<const uint8_t*>(j.w) + p * pbytes, L, L.Ik, 1, 0, w);
    for (int64_t r = 0; r < j.nt; ++r) {
      const uint8_t* hr = static_cast<const uint8_t*>(j.h) + r * j.h_stride * (Twin ? 2 : 4);
      for (int n = 0; n < kPanelN; ++n) {
        const int64_t col = p * kPanelN + n;
        if (col >= L.H) break;
        float y = 0.0f;
        for (int64_t k = 0; k < L.Ik; ++k) y += w[k * kPanelN + n] * act_in<Twin>(hr, k);
        if (j.bias) y += j.bias[col];
        j.acc[r][col] += j.wt[r] * y;
      }
    }
  }
}

// ---- integer dot (qdot): the exact emulation of the contract in experts.h ----

// Column n of matrix gi of a quantised panel dotted with a quantised activation row.
float qdot_col(const uint8_t* panel, const Layout& L, int64_t Kp, int G, int gi, int n, const void* row) {
  const int8_t* qx = static_cast<const int8_t*>(row);
  const float* sx = qrow_scales(row, Kp);
  if (L.wfmt == WFormat::kInt8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(panel + 64 * G);
    float a = 0.0f;
    for (int64_t b = 0; b < Kp / kActBlock; ++b) {
      int32_t isum = 0;
      for (int64_t k = b * kActBlock; k < (b + 1) * kActBlock; ++k) isum += q[q8_index(k, G, gi, n)] * qx[k];
      a = std::fma(static_cast<float>(isum), sx[b], a);
    }
    return reinterpret_cast<const float*>(panel + gi * 64)[n] * a;
  }
  const int group = L.group;
  float y = 0.0f;
  for (int64_t g = 0; g < Kp / group; ++g) {
    const uint8_t* codes = panel + q4_codes_at(g, G, group);
    float bg = 0.0f;
    for (int b = 0; b < group / kActBlock; ++b) {
      int32_t isum = 0;
      for (int k = b * kActBlock; k < (b + 1) * kActBlock; ++k) isum += int4_q(codes, k, G, gi, n) * qx[g * group + k];
      bg = std::fma(static_cast<float>(isum), sx[g * group / kActBlock + b], bg);
    }
    y = std::fma(bg, q4_step(panel[q4_scales_at(g, G, group) + gi * 16 + n]), y);
  }
  return q4_factors(panel, gi)[n] * y;
}

void gateup_generic_dot(const GateUpJob& j) {
  const Layout& L = *j.L;
  const bool gated = L.G == 2;
  const int64_t pbytes = gu_panel_bytes(L);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint8_t* panel = static_cast<const uint8_t*>(j.w) + p * pbytes;
    for (int64_t r = 0; r < j.nt; ++r) {
      for (int n = 0; n < kPanelN; ++n) {
        const int64_t col = p * kPanelN + n;
        float h = 0.0f, hu = 0.0f;  // (hu: a paired linear layer's up half, j.pair on)
        if (col < L.I) {
          float u = qdot_col(panel, L, L.Hk, L.G, L.G - 1, n, j.x[r]);
          float g = gated ? qdot_col(panel, L, L.Hk, L.G, 0, n, j.x[r]) : 0.0f;
          if (j.bias_g) g += j.bias_g[col];
          if (j.bias_u) u += j.bias_u[col];
          if (gated && j.pair) h = g, hu = u;
          else h = h_scalar(*j.act, gated, g, u);
        }
        static_cast<float*>(j.h)[r * j.h_stride + col] = h;
        if (gated && j.pair) static_cast<float*>(j.h)[r * j.h_stride + col + j.pair] = hu;
      }
    }
  }
}

void down_generic_dot(const DownJob& j) {
  const Layout& L = *j.L;
  const int64_t pbytes = down_panel_bytes(L);
  for (int64_t p = j.p0; p < j.p1; ++p) {
    const uint8_t* panel = static_cast<const uint8_t*>(j.w) + p * pbytes;
    for (int64_t r = 0; r < j.nt; ++r) {
      const uint8_t* hr = static_cast<const uint8_t*>(j.h) + r * j.h_stride;  // bytes
      for (int n = 0; n < kPanelN; ++n) {
        const int64_t col = p * kPanelN + n;
        if (col >= L.H) break;
        float y = qdot_col(panel, L, L.Ik, 1, 0, n, hr);
        if (j.bias) y += j.bias[col];
        j.acc[r][col] = std::fma(j.wt[r], y, j.acc[r][col]);
      }
    }
  }
}

}  // namespace

bool get_qdot_kernels_generic(WFormat wf, KernelImpl* k) {
  if (wf != WFormat::kInt8 && wf != WFormat::kInt4) return false;
  k->gateup = &gateup_generic_dot;
  k->down = &down_generic_dot;
  k->x_bf16 = k->h_bf16 = false;
  k->row_slack = 0;
  k->qdot = true;
  return true;
}

bool get_kernels_generic(DType dt, bool amx_twin, KernelImpl* k) {
  if (amx_twin && dt != DType::kBF16) return false;
  return get_qkernels_generic(WFormat::kLossless, amx_twin, k);
}

bool get_qkernels_generic(WFormat, bool amx_twin, KernelImpl* k) {  // every format: see panel_weights
  k->gateup = amx_twin ? &gateup_generic<true> : &gateup_generic<false>;
  k->down = amx_twin ? &down_generic<true> : &down_generic<false>;
  k->x_bf16 = k->h_bf16 = amx_twin;
  k->row_slack = 0;
  k->qdot = false;
  return true;
}

}  // namespace hina::detail
