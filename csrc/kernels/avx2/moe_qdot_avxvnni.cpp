// moe_<path>_<q>_avxvnni: the vpdpbusd (AVX-VNNI, ymm) build of kernels/avx2/qdot_avx2_impl.h
// (its [NOTE] has the layout and register plan). Flags: -mavx2 -mfma -mf16c -mavxvnni; only
// called when the CPU reports AVX-VNNI (dispatch/select.cpp).
#include "kernels/avx2/qdot_avx2_impl.h"

namespace hina::detail {
bool get_qdot_kernels_avxvnni(WFormat wf, KernelImpl* k) { return get_kernels<true>(wf, k); }
}  // namespace hina::detail
