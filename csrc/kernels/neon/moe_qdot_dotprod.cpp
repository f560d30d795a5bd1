// moe_<path>_<q>_dotprod: the sdot build of kernels/neon/qdot_neon_impl.h (its [NOTE] has the
// layout and register plan). Flags: -march=armv8.2-a+dotprod; called only when the CPU reports
// asimddp (dispatch/select.cpp).
#if !defined(__ARM_FEATURE_DOTPROD)
#error "moe_qdot_dotprod.cpp needs -march=armv8.2-a+dotprod (CMakeLists.txt)"
#endif
#include "kernels/neon/qdot_neon_impl.h"

namespace hina::detail {
bool get_qdot_kernels_dotprod(WFormat wf, KernelImpl* k) { return get_kernels<true>(wf, k); }
}  // namespace hina::detail
