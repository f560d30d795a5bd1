// The F/BW/VL build of the lossless12 decode kernels and the panel decompressor
// (kernels/avx512/l12_avx512_impl.h has the design).
#include "kernels/avx512/l12_avx512_impl.h"

namespace hina::detail {

void l12_decompress_panel_avx512(const uint8_t* panel, int64_t plain_bytes, uint16_t* plain) {
  l12_decompress_panel(panel, plain_bytes, plain);
}

bool get_l12_kernels_avx512(KernelImpl* k) {
  l12_kernels(k);
  return true;
}

}  // namespace hina::detail
