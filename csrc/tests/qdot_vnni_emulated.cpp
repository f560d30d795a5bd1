// The avxvnni build's code (kernels/avx2/qdot_avx2_impl.h with Vnni = true: its vpdpbusd tiles
// and panels) with vpdpbusd emulated exactly in AVX2, for the tests: the CPUs the tests run on
// need not have AVX-VNNI, and this code must still be checked against genericdot.
// Flags: -mavx2 -mfma -mf16c (CMakeLists.txt); call only where the CPU has AVX2.
#define HINA_QDOT_EMULATED_VNNI 1
#include "kernels/avx2/qdot_avx2_impl.h"

namespace hina::detail {
bool get_qdot_kernels_avxvnni_emulated(WFormat wf, KernelImpl* k) { return get_kernels<true>(wf, k); }
}  // namespace hina::detail
