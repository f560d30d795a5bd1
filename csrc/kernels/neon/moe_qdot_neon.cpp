// moe_<path>_<q>_neondot: the smull/smlal + sadalp build of kernels/neon/qdot_neon_impl.h (its
// [NOTE] has the layout and register plan). Flags: -march=armv8-a (tier neon: every aarch64 CPU).
#include "kernels/neon/qdot_neon_impl.h"

namespace hina::detail {
bool get_qdot_kernels_neon(WFormat wf, KernelImpl* k) { return get_kernels<false>(wf, k); }
}  // namespace hina::detail
