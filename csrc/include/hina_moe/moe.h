// The whole C API in one include (the torch-free core): the headers by concern below. New code
// includes only the one it needs; the experts op's numerics contract is in hina_moe/experts.h.
#pragma once

#include "hina_moe/attention.h"
#include "hina_moe/cpu_features.h"
#include "hina_moe/experts.h"
#include "hina_moe/ops.h"
#include "hina_moe/step.h"
#include "hina_moe/types.h"
