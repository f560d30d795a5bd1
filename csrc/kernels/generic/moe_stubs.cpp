// Non-x86 builds: no SIMD MoE kernels yet; the dispatcher falls back to the generic ones.
#include "hina_moe/attention.h"
#include "moe/kernel_api.h"

namespace hina::detail {
bool get_kernels_avx2(DType, KernelImpl*) { return false; }
bool get_kernels_avx512(DType, KernelImpl*) { return false; }
bool get_kernels_amx(DType, KernelImpl*) { return false; }
bool get_kernels_avx512bf16(DType, KernelImpl*) { return false; }
bool get_qkernels_avx2(WFormat, KernelImpl*) { return false; }
bool get_qkernels_avx512(WFormat, KernelImpl*) { return false; }
bool get_qkernels_amx(WFormat, KernelImpl*) { return false; }
bool get_qdot_kernels_avx512vnni(WFormat, KernelImpl*) { return false; }
bool get_qdot_kernels_avx2(WFormat, KernelImpl*) { return false; }
bool get_qdot_kernels_avxvnni(WFormat, KernelImpl*) { return false; }
bool get_l12_kernels_avx512(KernelImpl*) { return false; }
bool get_l12_kernels_avx512vbmi(KernelImpl*) { return false; }
void l12_decompress_panel_avx512(const uint8_t*, int64_t, uint16_t*) {}
void quant_act_row_avx512(const float*, int64_t, uint8_t*) {}
void quant_act_row_avx2(const float*, int64_t, uint8_t*) {}
void attention_decode_avx512(const AttnDecodeArgs&, int64_t, int64_t) {}
void attention_decode_avx2(const AttnDecodeArgs&, int64_t, int64_t) {}
}  // namespace hina::detail
