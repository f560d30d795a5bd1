// [NOTE] Quantisation of packed panels (int8 / int4) and of activation rows (integer-dot
// kernels), AVX-512 build of moe/quant_panel.h.
// Flags: the avx512 TU's flags + -ffp-contract=off (the lane-wise code must round exactly as the
// baseline build of the same header does: the packed bytes do not depend on the machine).
#include "moe/quant_panel.h"

namespace hina::detail {

void quant_panel_avx512(const float* wt, int64_t Kp, int G, int gi, WFormat wf, int group, uint8_t* panel) {
  qp::quant_panel<16>(wt, Kp, G, gi, wf, group, panel);
}

void quant_act_row_avx512(const float* x, int64_t Kp, uint8_t* row) { qp::quant_act_row<16>(x, Kp, row); }

}  // namespace hina::detail
