// A gated MLP's decode step (hi_na_moe.mlp: a shared expert, a dense MLP) and a shared expert's
// sigmoid gate (Qwen2-MoE), on the library's own kernels.
//
//   gated_mlp_decode: [g | u] = gate_up.linear(x); m = round(round(silu(g)) * u); out = down.linear(m)
//
// with every intermediate rounded to the dtype where PyTorch's ops round it (F.silu returns the
// dtype, the product is rounded once). The baseline build computes silu as PyTorch's scalar
// loop writes it, x / (1 + std::exp(-x)) in float32 (act_scalar, the experts' oracle); the AVX-512 build uses a vector exp
// (vec_avx512.h, ~2 ulp), as PyTorch's vectorised silu uses its own: the result can differ
// from F.silu's in the last bit of the dtype, so hi_na_moe.mlp probes a module within rounding.
//
//   shared_combine: out = round(routed + round(round(sigmoid(logit)) * shared)), one logit per row
//
// is bit for bit what transformers' Qwen2MoeSparseMoeBlock computes from the same three tensors
// for a decode step while torch.sigmoid runs PyTorch's scalar loop on the B logits, 1 / (1 +
// std::exp(-x)) in float32 with the same libm: under two vectors of its build (at most 31 float32
// values on AVX-512, 15 on AVX2; any number in its baseline build; for 16-bit dtypes its vector
// loop agrees too where the rounding hides the vector exp). hi_na_moe.layers calls it on as many
// rows as hi_na_moe.mlp.sigmoid_rows finds (tests/test_mlp.py checks both).
#include <cmath>

#include "hina_moe/ops.h"
#include "dispatch/select.h"
#include "kernel_api.h"

namespace hina {
namespace detail {
void silu_mul_avx512(DType dt, const void* g, const void* u, int64_t n, void* out);
}  // namespace detail

namespace {

float sigmoid_scalar(float x) { return 1.0f / (1.0f + std::exp(-x)); }

template <DType D>
void silu_mul_rows(const void* g, const void* u, int64_t n, void* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = detail::round_to(D, detail::act_scalar(Act::kSilu, detail::load_elem(D, g, i), 0.0f));
    detail::store_elem(D, out, i, a * detail::load_elem(D, u, i));
  }
}

}  // namespace

void silu_mul(DType dt, Isa isa, const void* g, const void* u, int64_t n, void* out) {
#if defined(HINA_HAVE_X86_KERNELS)
  if (detail::vec_build(isa) == detail::VecBuild::kAvx512) return detail::silu_mul_avx512(dt, g, u, n, out);
#endif
  (void)isa;
  switch (dt) {
    case DType::kF32: return silu_mul_rows<DType::kF32>(g, u, n, out);
    case DType::kBF16: return silu_mul_rows<DType::kBF16>(g, u, n, out);
    case DType::kF16: return silu_mul_rows<DType::kF16>(g, u, n, out);
  }
}

void gated_mlp_gate_up(const GatedMlpArgs& a, int num_threads) {
  const size_t es = dtype_size(a.dtype);
  const int64_t I = a.I;
  MoeParams p = a.gate_up_params;
  p.num_threads = num_threads;
  a.gate_up->linear(a.x, a.B, a.gu, p);
  for (int64_t b = 0; b < a.B; ++b) {
    const char* row = static_cast<const char*>(a.gu) + static_cast<size_t>(b * 2 * I) * es;
    silu_mul(a.dtype, a.gate_up->isa(), row, row + static_cast<size_t>(I) * es, I,
             static_cast<char*>(a.m) + static_cast<size_t>(b * I) * es);
  }
}

void gated_mlp_down(const GatedMlpArgs& a, int num_threads) {
  MoeParams d = a.down_params;
  d.num_threads = num_threads;
  a.down->linear(a.m, a.B, a.out, d);
}

void gated_mlp_decode(const GatedMlpArgs& a, int num_threads) {
  gated_mlp_gate_up(a, num_threads);
  gated_mlp_down(a, num_threads);
}

void shared_combine(DType dt, const void* routed, const void* shared, const void* logit, int64_t B, int64_t H,
                    void* out) {
  for (int64_t b = 0; b < B; ++b) {
    const float s = detail::round_to(dt, sigmoid_scalar(detail::load_elem(dt, logit, b)));
    for (int64_t j = 0; j < H; ++j) {
      const int64_t i = b * H + j;
      const float p = detail::round_to(dt, s * detail::load_elem(dt, shared, i));
      detail::store_elem(dt, out, i, detail::load_elem(dt, routed, i) + p);
    }
  }
}

}  // namespace hina
