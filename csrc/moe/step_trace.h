// decode_layers' timeline in a tuning build (HINA_PREFETCH_TUNING; hina_moe/step.h's StepTraceEvent):
// lap(op) closes the span since the previous lap as op's while a decode_layers call runs on this
// thread (layer_step.cpp). A release build compiles every lap to nothing.
#pragma once

#include "hina_moe/step.h"

namespace hina::detail {

#ifdef HINA_PREFETCH_TUNING
void lap(StepOp op);
#else
inline void lap(StepOp) {}
#endif

}  // namespace hina::detail
