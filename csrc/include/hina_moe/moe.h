// The fused MoE experts op (lossless formats: fp32 / bf16 / fp16 weights). Torch-free C++ API.
//
// Semantics (the contract with the Python side). Shape letters: T tokens, E experts, K top-k,
// H hidden, I expert intermediate. For each token t and slot k with e = topk_idx[t,k]
// (e < 0: skip the slot) and w = topk_w[t,k]:
//   xin = x_t, or with weight_on_input: xin = round_to_weight_dtype(w * x_t) and w := 1
//   g = W_gate[e] @ xin + b_gate[e]            (gated experts only; W_gate [E,I,H])
//   u = W_up[e]   @ xin + b_up[e]              (W_up [E,I,H])
//   gated:   h = min(act(min(g, gate_limit)), post_act_limit) * (clamp(u, ±up_limit) + up_offset)
//   no gate: h = act(u)
//   y = W_down[e] @ h + b_down[e]              (W_down [E,H,I])
//   out_t = sum over slots of w * y            (fp32 accumulation; out written in x's dtype)
// h stays in fp32 on every path except the AMX prefill path, where it is rounded to bf16 to
// feed the tiles (what PyTorch itself does when the model runs in bf16).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "hina_moe/cpu_features.h"

namespace hina {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
const char* dtype_name(DType dt);   // "float32" | "bfloat16" | "float16"
const char* dtype_short(DType dt);  // "f32" | "bf16" | "f16" (the <format> in kernel names)
size_t dtype_size(DType dt);

enum class Act : int { kSilu, kGelu, kGeluTanh, kRelu, kRelu2, kSigmoidAlpha, kIdentity };
const char* act_name(Act act);  // "silu" | "gelu" | "gelu_tanh" | "relu" | "relu2" | "sigmoid_alpha" | "identity"
bool act_from_name(const char* name, Act* out);

enum class MoePath : int { kAuto = 0, kDecode = 1, kPrefill = 2 };
const char* path_name(MoePath path);  // "auto" | "decode" | "prefill"

// Auto path choice: the prefill path (tokens grouped per expert; AMX tiles for bf16, 4-row weight
// reuse on the FMA tiers) from this many tokens on, the decode path (one token at a time) below.
// Measured on OLMoE-shaped layers (benchmarks/bench_native_paths.py, benchmarks/RESULTS.md): the
// prefill path is as fast or faster from T = 2 on, on both the AMX and the AVX-512 tier, because
// the decode path streams each expert's weights once per token.
constexpr int kDefaultPrefillMinTokens = 2;

// Unpacked weights, caller-owned, C-contiguous, all in `dtype`. Biases are optional (nullptr).
struct ExpertWeights {
  DType dtype = DType::kBF16;
  int64_t E = 0, H = 0, I = 0;
  const void* gate = nullptr;  // [E, I, H], nullptr for experts without a gate
  const void* up = nullptr;    // [E, I, H]
  const void* down = nullptr;  // [E, H, I]
  const void* gate_bias = nullptr;  // [E, I]
  const void* up_bias = nullptr;    // [E, I]
  const void* down_bias = nullptr;  // [E, H]
};

struct MoeParams {
  Act act = Act::kSilu;
  float alpha = 1.702f;  // only used by sigmoid_alpha
  float gate_limit = INFINITY;
  float up_limit = INFINITY;
  float post_act_limit = INFINITY;
  float up_offset = 0.0f;
  bool weight_on_input = false;
  int num_threads = 0;  // 0: default_num_threads()
  MoePath path = MoePath::kAuto;
  int prefill_min_tokens = kDefaultPrefillMinTokens;
};

// Versioned tag carried by packed weights, so a kernel never reads a layout it was not written
// for. Layout v1 (ISA-independent; one layout serves generic/avx2/avx512/amx):
//   per expert, the output dimension is cut into panels of 16 rows (zero-padded), the reduction
//   dimension is zero-padded to a multiple of 32; bf16 panels hold [Kp/2][G][16][2] (VNNI pairs,
//   the AMX B-tile layout), fp32/fp16 panels [Kp][G][16]; G = 2 interleaves gate and up so one
//   pass streams both, G = 1 for down (and for up without a gate).
struct PackedHeader {
  uint32_t magic = 0x454D4E48;  // "HNME"
  uint16_t version = 1;
  uint8_t dtype = 0;            // DType
  uint8_t isa = 0;              // Isa the kernels were chosen for
  uint8_t panel_n = 16;         // output rows per panel
  uint8_t kpack = 1;            // reduction elements per pair (2 for bf16)
  uint8_t k_align = 32;         // reduction dimension padding
  uint8_t has_gate = 0;
  int64_t E = 0, H = 0, I = 0;
  int64_t Hk = 0;  // H padded to k_align (reduction length of gate/up)
  int64_t In = 0;  // I padded to panel_n (output rows of gate/up)
  int64_t Ik = 0;  // I padded to k_align (reduction length of down)
  int64_t Hn = 0;  // H padded to panel_n (output rows of down)
};

class PackedExperts {
 public:
  // Copies and packs. Throws std::invalid_argument on bad shapes or an ISA this machine lacks.
  static std::unique_ptr<PackedExperts> pack(const ExpertWeights& w, Isa isa, int num_threads = 0);
  ~PackedExperts();

  // Runs the op; returns the name of the kernel that ran ("moe_decode_bf16_avx512", ...).
  // x, out: [T, H] in dtype(); topk_idx: [T, K] int32 (idx_bits 32) or int64 (idx_bits 64);
  // topk_w: [T, K] fp32. out is overwritten. Throws std::invalid_argument on a bad argument
  // (e.g. an expert index >= E) before touching out.
  const char* forward(const void* x, int64_t T, const void* topk_idx, int idx_bits,
                      const float* topk_w, int64_t K, void* out, const MoeParams& p) const;

  // Exact inverse of pack(). Destinations as in ExpertWeights (nullptr: skip that array).
  void unpack(void* gate, void* up, void* down, void* gate_bias, void* up_bias,
              void* down_bias) const;

  const PackedHeader& header() const { return hdr_; }
  DType dtype() const { return static_cast<DType>(hdr_.dtype); }
  Isa isa() const { return static_cast<Isa>(hdr_.isa); }
  int64_t E() const { return hdr_.E; }
  int64_t H() const { return hdr_.H; }
  int64_t I() const { return hdr_.I; }
  bool has_gate() const { return hdr_.has_gate != 0; }
  bool has_gate_bias() const { return bias_g_ != nullptr; }
  bool has_up_bias() const { return bias_u_ != nullptr; }
  bool has_down_bias() const { return bias_d_ != nullptr; }
  size_t nbytes() const { return nbytes_; }

  // Internal views used by the driver and the tests.
  const void* gate_up_expert(int64_t e) const;
  const void* down_expert(int64_t e) const;
  const float* bias_g() const { return bias_g_; }
  const float* bias_u() const { return bias_u_; }
  const float* bias_d() const { return bias_d_; }

 private:
  PackedExperts() = default;
  PackedHeader hdr_;
  void* mem_ = nullptr;  // one 64-byte aligned block: gate_up panels, down panels, biases
  size_t nbytes_ = 0;
  size_t gu_expert_bytes_ = 0, down_expert_bytes_ = 0;
  uint8_t* gu_ = nullptr;
  uint8_t* down_ = nullptr;
  float* bias_g_ = nullptr;  // [E, In] fp32 (exact copies of the bf16/fp16/fp32 values)
  float* bias_u_ = nullptr;  // [E, In]
  float* bias_d_ = nullptr;  // [E, Hn]
};

// Name of the kernel `forward` would run for this tier, dtype and path (kAuto is not a path).
const char* moe_kernel_name(Isa isa, DType dt, MoePath path);
// "auto" -> the best tier here, unless the env var HINA_MOE_ISA names a (lower) tier; other
// names must be supported by this CPU. Throws std::invalid_argument naming the tier and what
// the CPU supports.
Isa resolve_isa(const char* name);
// Hardware threads this process may run on (sched_getaffinity), >= 1.
int default_num_threads();

}  // namespace hina
