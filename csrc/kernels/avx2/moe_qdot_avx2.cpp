// moe_<path>_<q>_avx2dot: the vpmaddubsw + vpmaddwd build of kernels/avx2/qdot_avx2_impl.h
// (its [NOTE] has the layout and register plan). Flags: -mavx2 -mfma -mf16c.
#include "kernels/avx2/qdot_avx2_impl.h"

namespace hina::detail {
bool get_qdot_kernels_avx2(WFormat wf, KernelImpl* k) { return get_kernels<false>(wf, k); }
}  // namespace hina::detail
