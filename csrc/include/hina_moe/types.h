// The C API's shared vocabulary: dtypes, weight formats, activations, paths, and the tier
// resolution every entry point takes (hina_moe/experts.h holds the experts op's numerics).
#pragma once

#include <cstddef>
#include <cstdint>

#include "hina_moe/cpu_features.h"

namespace hina {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
const char* dtype_name(DType dt);   // "float32" | "bfloat16" | "float16"
const char* dtype_short(DType dt);  // "f32" | "bf16" | "f16" (the <format> in kernel names)
size_t dtype_size(DType dt);

// How expert weights are stored. kLossless: the model's dtype, lossless. kLossless12: bf16
// weights, lossless, in about 75 % of their bytes (layout below); kernels give the bits of
// kLossless.
enum class WFormat : int { kLossless = 0, kInt8 = 1, kInt4 = 2, kLossless12 = 3 };
const char* wformat_name(WFormat f);  // "lossless" | "int8" | "int4" | "lossless12"
bool wformat_from_name(const char* name, WFormat* out);
struct QuantSpec {
  WFormat fmt = WFormat::kLossless;
  int group = 32;  // int4 only: 32, 64 or 128
};

// A quantised matrix W [N, K] in plain row order, the codes and scales of the packed formats
// above without the panels (PackedExperts::unpack_row_quant writes one from an up-only block;
// mla_decode reads kv_b_proj's weight in it):
//   kInt8: codes int8 [N, K], scales float32 [N]: W[n, k] = scales[n] * codes[n, k].
//   kInt4: codes uint8 [N, K / 2], scales float32 [N, K / group]: group g of row n is the
//          group / 2 bytes at codes + n * K / 2 + g * group / 2, byte j holding q(g*group + j) + 8
//          in its low nibble and q(g*group + group/2 + j) + 8 in its high one (the two halves of
//          the group, so that one vector of bytes gives two vectors of consecutive k);
//          W[n, k] = scale(n, k / group) * q(k). K is a multiple of group (32, 64 or 128).
struct RowQuant {
  WFormat fmt = WFormat::kLossless;  // kInt8 or kInt4 when set
  const void* codes = nullptr;
  const void* scales = nullptr;
  int64_t group = 0;  // kInt4's group size
};

enum class Act : int { kSilu, kGelu, kGeluTanh, kRelu, kRelu2, kSigmoidAlpha, kIdentity };
const char* act_name(Act act);  // "silu" | "gelu" | "gelu_tanh" | "relu" | "relu2" | "sigmoid_alpha" | "identity"
bool act_from_name(const char* name, Act* out);

enum class MoePath : int { kAuto = 0, kDecode = 1, kPrefill = 2 };
const char* path_name(MoePath path);  // "auto" | "decode" | "prefill"

// Auto path choice: the prefill path (tokens grouped per expert; AMX tiles or AVX512-BF16 dot
// products for bf16, 4- or 8-row weight reuse on the FMA tiers) from this many tokens on, the decode path (one token at a time) below.
// Measured on OLMoE-shaped layers (benchmarks/bench_native_paths.py, benchmarks/RESULTS.md): the
// prefill path is as fast or faster from T = 2 on, on both the AMX and the AVX-512 tier, because
// the decode path streams each expert's weights once per token.
constexpr int kDefaultPrefillMinTokens = 2;
// Rows (tokens) from which a call counts as prefill-sized for PoolBackend::kMixed (its regions on
// OpenMP's team): a prefill, or a decode batch of as many sequences, where a region is long
// beside one OpenMP join.
constexpr int64_t kMixedTeamRows = 32;

// Which kernel family computes quantised weights (see the numerics above). kAuto: the integer
// dot where the tier has a SIMD kernel for it, except the AMX prefill path of bf16 models,
// which keeps its bf16 tiles; kInt: always the integer dot (the generic tier runs its scalar
// emulation); kExpand: always the expansion kernels. Lossless weights ignore it.
enum class QDot : int { kAuto = 0, kInt = 1, kExpand = 2 };
const char* qdot_name(QDot q);  // "auto" | "int" | "expand"
bool qdot_from_name(const char* name, QDot* out);

// "auto" -> the best tier here, unless the env var HINA_MOE_ISA names a (lower) tier; other
// names must be supported by this CPU. Throws std::invalid_argument naming the tier and what
// the CPU supports.
Isa resolve_isa(const char* name);
// Hardware threads this process may run on (sched_getaffinity), >= 1.
int default_num_threads();

}  // namespace hina
