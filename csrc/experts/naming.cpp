// Names: of dtypes, weight formats, activations, paths, qdot families (and their parsers), and
// of the kernel a forward runs (moe_kernel_name: `moe_<path>_<format>_<kernel>`).
#include <cmath>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>


#include "hina_moe/experts.h"
#include "hina_moe/thread_pool.h"
#include "moe/kernel_api.h"
#include "dispatch/select.h"

namespace hina {

using namespace detail;

namespace {
// An enum whose values are 0, 1, ..., N - 1 named by a table ("unknown" outside it), and parsed.
template <class E, size_t N>
const char* name_in(const char* const (&names)[N], E v) {
  const auto i = static_cast<size_t>(v);
  return i < N ? names[i] : "unknown";
}
template <class E, size_t N>
bool parse_in(const char* const (&names)[N], const char* name, E* out) {
  for (size_t i = 0; i < N; ++i) {
    if (std::strcmp(name, names[i]) == 0) {
      *out = static_cast<E>(i);
      return true;
    }
  }
  return false;
}
constexpr const char* kDTypeNames[] = {"float32", "bfloat16", "float16"};
constexpr const char* kDTypeShort[] = {"f32", "bf16", "f16"};
constexpr const char* kActNames[] = {"silu", "gelu", "gelu_tanh", "relu", "relu2", "sigmoid_alpha", "identity"};
constexpr const char* kWFormatNames[] = {"lossless", "int8", "int4", "lossless12"};
constexpr const char* kPathNames[] = {"auto", "decode", "prefill"};
constexpr const char* kQDotNames[] = {"auto", "int", "expand"};
static_assert(static_cast<int>(DType::kF16) == 2 && static_cast<int>(Act::kIdentity) == 6 &&
                  static_cast<int>(WFormat::kLossless12) == 3 && static_cast<int>(MoePath::kPrefill) == 2 &&
                  static_cast<int>(QDot::kExpand) == 2,
              "the name tables follow the enums' values");
}  // namespace

const char* dtype_name(DType dt) { return name_in(kDTypeNames, dt); }
const char* dtype_short(DType dt) { return name_in(kDTypeShort, dt); }
size_t dtype_size(DType dt) { return dt == DType::kF32 ? 4 : 2; }


const char* act_name(Act act) { return name_in(kActNames, act); }
bool act_from_name(const char* name, Act* out) { return parse_in(kActNames, name, out); }
const char* wformat_name(WFormat f) { return name_in(kWFormatNames, f); }
bool wformat_from_name(const char* name, WFormat* out) { return parse_in(kWFormatNames, name, out); }
const char* path_name(MoePath path) { return name_in(kPathNames, path); }
const char* qdot_name(QDot q) { return name_in(kQDotNames, q); }
bool qdot_from_name(const char* name, QDot* out) { return parse_in(kQDotNames, name, out); }

const char* moe_kernel_name(Isa isa, DType dt, MoePath path, WFormat wf, QDot qd) {
  // Names are `<op>_<format>_<kernel>`; built once. Formats: f32, bf16, f16, int8, int4, l12.
  constexpr int kFmts = 6;
  static std::vector<std::string>* table = [] {
    auto* t = new std::vector<std::string>(kNumKinds * kFmts * 2);
    const char* fmts[kFmts] = {"f32", "bf16", "f16", "int8", "int4", "l12"};
    for (int i = 0; i < kNumKinds; ++i)
      for (int d = 0; d < kFmts; ++d)
        for (int p = 0; p < 2; ++p)
          (*t)[(i * kFmts + d) * 2 + p] = std::string(p ? "moe_prefill_" : "moe_decode_") + fmts[d] +
                                      "_" + kind_name(i);
    return t;
  }();
  if (path == MoePath::kAuto) path = MoePath::kDecode;
  const int k = select_kernels(isa, dt, path, wf, qd).kind;
  const int f = wf == WFormat::kLossless ? static_cast<int>(dt)
                : wf == WFormat::kInt8   ? 3
                : wf == WFormat::kInt4   ? 4
                                         : 5;
  return (*table)[(k * kFmts + f) * 2 + (path == MoePath::kPrefill ? 1 : 0)].c_str();
}
}  // namespace hina
