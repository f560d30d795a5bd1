// silu_mul (csrc/moe/mlp.cpp) with AVX-512 F/BW/VL: silu through vec_avx512.h's vector exp, 16
// values at a time; the roundings to the dtype as the baseline build does them.
#include <immintrin.h>

#include "kernels/avx512/vec_avx512.h"
#include "moe/kernel_api.h"

namespace hina::detail {

namespace {

template <DType D>
void run(const void* g, const void* u, int64_t n, void* out) {
  alignas(64) float gs[16], as[16];
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t c = n - i0 < 16 ? n - i0 : 16;
    for (int64_t i = 0; i < c; ++i) gs[i] = load_elem(D, g, i0 + i);
    for (int64_t i = c; i < 16; ++i) gs[i] = 0.0f;
    const __m512 z = _mm512_load_ps(gs);
    _mm512_store_ps(as, v512::z_sigmoid(z, z));
    // below -87 the vector exp clamps its argument: those lanes (and NaN) as the baseline does
    __mmask16 far = _mm512_cmp_ps_mask(z, _mm512_set1_ps(-87.0f), _CMP_NGE_UQ);
    while (far) {
      const int i = __builtin_ctz(far);
      far &= far - 1;
      as[i] = act_scalar(Act::kSilu, gs[i], 0.0f);
    }
    for (int64_t i = 0; i < c; ++i) store_elem(D, out, i0 + i, round_to(D, as[i]) * load_elem(D, u, i0 + i));
  }
}

}  // namespace

void silu_mul_avx512(DType dt, const void* g, const void* u, int64_t n, void* out) {
  switch (dt) {
    case DType::kF32: return run<DType::kF32>(g, u, n, out);
    case DType::kBF16: return run<DType::kBF16>(g, u, n, out);
    case DType::kF16: return run<DType::kF16>(g, u, n, out);
  }
}

}  // namespace hina::detail
