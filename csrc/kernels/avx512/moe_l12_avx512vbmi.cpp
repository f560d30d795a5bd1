// The AVX512-VBMI build of the lossless12 decode kernels (kernels/avx512/l12_avx512_impl.h has
// the design); only called when the CPU reports AVX512-VBMI (dispatch/select.cpp).
#include "kernels/avx512/l12_avx512_impl.h"

#if !defined(__AVX512VBMI__)
#error "moe_l12_avx512vbmi.cpp must be built with -mavx512vbmi"
#endif

namespace hina::detail {

bool get_l12_kernels_avx512vbmi(KernelImpl* k) {
  l12_kernels(k);
  return true;
}

}  // namespace hina::detail
