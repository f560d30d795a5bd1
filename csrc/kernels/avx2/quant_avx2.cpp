// [NOTE] Quantisation of packed panels (int8 / int4) and of activation rows (integer-dot
// kernels), AVX2 build of moe/quant_panel.h.
// Flags: the avx2 TU's flags + -ffp-contract=off (same bytes as every other build).
#include "moe/quant_panel.h"

namespace hina::detail {

void quant_panel_avx2(const float* wt, int64_t Kp, int G, int gi, WFormat wf, int group, uint8_t* panel) {
  qp::quant_panel<8>(wt, Kp, G, gi, wf, group, panel);
}

void quant_act_row_avx2(const float* x, int64_t Kp, uint8_t* row) { qp::quant_act_row<8>(x, Kp, row); }

}  // namespace hina::detail
