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

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
  }
  return "unknown";
}
const char* dtype_short(DType dt) {
  switch (dt) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "unknown";
}
size_t dtype_size(DType dt) { return dt == DType::kF32 ? 4 : 2; }

const char* act_name(Act act) {
  switch (act) {
    case Act::kSilu: return "silu";
    case Act::kGelu: return "gelu";
    case Act::kGeluTanh: return "gelu_tanh";
    case Act::kRelu: return "relu";
    case Act::kRelu2: return "relu2";
    case Act::kSigmoidAlpha: return "sigmoid_alpha";
    case Act::kIdentity: return "identity";
  }
  return "unknown";
}
bool act_from_name(const char* name, Act* out) {
  for (Act a : {Act::kSilu, Act::kGelu, Act::kGeluTanh, Act::kRelu, Act::kRelu2,
                Act::kSigmoidAlpha, Act::kIdentity}) {
    if (std::strcmp(name, act_name(a)) == 0) {
      *out = a;
      return true;
    }
  }
  return false;
}
const char* wformat_name(WFormat f) {
  switch (f) {
    case WFormat::kLossless: return "lossless";
    case WFormat::kInt8: return "int8";
    case WFormat::kInt4: return "int4";
    case WFormat::kLossless12: return "lossless12";
  }
  return "unknown";
}
bool wformat_from_name(const char* name, WFormat* out) {
  for (WFormat f : {WFormat::kLossless, WFormat::kInt8, WFormat::kInt4, WFormat::kLossless12}) {
    if (std::strcmp(name, wformat_name(f)) == 0) {
      *out = f;
      return true;
    }
  }
  return false;
}
const char* path_name(MoePath path) {
  switch (path) {
    case MoePath::kAuto: return "auto";
    case MoePath::kDecode: return "decode";
    case MoePath::kPrefill: return "prefill";
  }
  return "unknown";
}

const char* qdot_name(QDot q) {
  switch (q) {
    case QDot::kAuto: return "auto";
    case QDot::kInt: return "int";
    case QDot::kExpand: return "expand";
  }
  return "unknown";
}
bool qdot_from_name(const char* name, QDot* out) {
  for (QDot q : {QDot::kAuto, QDot::kInt, QDot::kExpand}) {
    if (std::strcmp(name, qdot_name(q)) == 0) {
      *out = q;
      return true;
    }
  }
  return false;
}

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
