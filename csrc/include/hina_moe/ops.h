// The small ops of a decoder layer's decode step: RMSNorm, residual add, rotary embeddings, the
// router's selection, a gated MLP on packed blocks, a shared expert's gate.
#pragma once

#include <cstdint>

#include "hina_moe/experts.h"
#include "hina_moe/types.h"

namespace hina {

// RMSNorm of `rows` C-contiguous rows of n values (x, weight [n] and out in dtype dt), in
// transformers' Llama-family order of roundings: out = w * round(x / sqrt(mean(x^2) + eps)),
// fp32 math (see csrc/moe/norm.cpp). Single-threaded; out may not overlap x.
void rms_norm(DType dt, const void* x, int64_t rows, int64_t n, const void* weight, float eps, void* out);

// sum = a + b over `count` values of dtype dt, each rounded once to the dtype, as PyTorch adds
// two CPU tensors of that dtype (bit-identical). sum may be a or b; otherwise no overlap.
void add(DType dt, const void* a, const void* b, int64_t count, void* sum);

// A decoder layer's residual add and the RMSNorm that follows it, in one call: sum = a + b as
// add() computes it, then out = rms_norm(sum) as rms_norm() computes it (the same bits as the
// two calls). Rows of n values; out may not overlap a, b or sum.
void add_rms_norm(DType dt, const void* a, const void* b, int64_t rows, int64_t n, const void* weight, float eps,
                  void* sum, void* out);

// Rotary embedding, transformers' rotate_half form, for one position per batch row:
// out = round(round(x * cos) + round(rotate_half(x) * sin)), each product and the sum rounded to
// the dtype as PyTorch's elementwise ops round them (bit-identical). x and out [B, heads, D],
// cos and sin [B, D], all C-contiguous in dtype dt; D even; out may not overlap x. half_table:
// cos and sin are [B, D/2], one angle for both halves (GPT-OSS's tables; the same bits as the
// table written twice). rot (even, <= D; 0: D): partial rotary (GLM-4.5's partial_rotary_factor),
// only the first rot values of each head rotated as a head of rot values, the rest copied as they
// are; the tables then hold rot values a row (rot / 2 with half_table).
void rope_rotate_half(DType dt, const void* x, int64_t B, int64_t heads, int64_t D, const void* cos,
                      const void* sin, void* out, bool half_table = false, int64_t rot = 0);
// The same bits, for many rows (a prompt's B*T positions): bfloat16 on the AVX-512 build at
// tiers avx512/amx (16 values a vector), rows split over num_threads (0: every hardware thread)
// when there are enough; other dtypes and tiers, and partial rotary, the baseline loops.
void rope_rotate_half(DType dt, const void* x, int64_t B, int64_t heads, int64_t D, const void* cos,
                      const void* sin, void* out, Isa isa, int num_threads, bool half_table = false,
                      int64_t rot = 0);
// Rotary embedding, interleaved pairs in float32 (ERNIE 4.5's form): for pair i of a head,
// c = cos[i], s = sin[i] (the first D/2 entries of a float32 table row of table_bstride values),
//   out[2i]     = round_dt(f32(f32(x[2i] * c) + f32(-x[2i+1] * s)))
//   out[2i + 1] = round_dt(f32(f32(x[2i+1] * c) + f32(x[2i] * s)))
// each product and the sum rounded to float32 and the result once to the dtype, as PyTorch's
// float32 elementwise ops after x.float() and the final .to(dtype) round them (bit-identical).
// x and out [B, heads, D] C-contiguous in dtype dt; D even; out may not overlap x. Rows split over
// num_threads (0: every hardware thread) when there are enough.
void rope_interleaved_f32(DType dt, const void* x, int64_t B, int64_t heads, int64_t D, const float* cos,
                          const float* sin, int64_t table_bstride, void* out, int num_threads);

// Rotary embedding of latent attention's rope dims (hi_na_moe.mla) for one position: `heads`
// rows of D values (D even) at x + h * x_hstride elements into out + h * out_hstride (out may
// not overlap x), each product and sum rounded as the module's PyTorch ops round them:
//   kComplex (DeepSeek-V2: x.float() viewed as complex pairs times a complex64 table, then
//     .type_as(x)): tab holds D/2 float32 (re, im) pairs (sin unused); for pair i, (c, s) = tab[i],
//     out[2i] = dt(f32(x0 c) - f32(x1 s)), out[2i+1] = dt(f32(x0 s) + f32(x1 c)) (no FMA, as
//     PyTorch's vectorised complex product; its scalar loop, which runs at under 8 pairs, contracts one);
//   kInterleaved (DeepSeek-V3's rope_interleave: the pairs de-interleaved, then rotate_half): tab
//     and sin rows of D values in dtype, c, s their first D/2; out[i] = r(r(x0 c_i) - r(x1 s_i)),
//     out[D/2 + i] = r(r(x1 c_i) + r(x0 s_i)), r rounding to the dtype;
//   kRotateHalf: rope_rotate_half's bits (tab: cos).
enum class LatentRope : int { kNone = -1, kComplex = 0, kInterleaved = 1, kRotateHalf = 2 };
void rope_latent(DType dt, LatentRope form, const void* x, int64_t heads, int64_t x_hstride, int64_t D,
                 const void* tab, const void* sin, void* out, int64_t out_hstride);

// A MoE router's selection from its logits (csrc/moe/router.cpp), per row of E logits:
//   kSoftmaxTopk: p = softmax(float32(logits)); the k largest p (values and indices), then
//                 optionally w = top / sum(top) (renorm);
//   kTopkSoftmax: the k largest logits, then w = softmax over those k (float32 math);
//   kSigmoidGroupTopk (DeepSeek-V3 and its kin): s = sigmoid(float32(logits)), c = s + sel_bias
//                 (required); the E experts in `groups` groups of E / groups (at least 2), each
//                 group scored by the sum of its two largest c; the topk_group best groups kept
//                 and the k largest c among their experts chosen, both as torch.topk(...,
//                 sorted=False) leaves them (index order: its selection's); w = s of the chosen,
//                 divided by (their sum + eps) with renorm, then times scale. With one group
//                 (groups = topk_group = 1) every expert is a candidate (MiniMax-M2, Hunyuan-V3).
// The top-k moves ties as torch.topk's CPU kernel does (not by index); the softmax and the
// sigmoid use std::exp, so w can differ from PyTorch's in the last float32 bits. w is rounded
// once to w_dtype; idx is int64. Single-threaded (a decode step's few rows).
//   kSoftmaxGroupTopk (DeepSeek-V2): p = softmax(float32(logits)); with groups > 1 each group
//                 scored by its largest p, the topk_group best kept and the others' p taken as 0;
//                 the k largest as torch.topk(..., sorted=False) leaves them, w = p * scale.
//   kSoftmaxGroupTopkInDtype (Mistral 4): every step in the logits' dtype as PyTorch's ops in it
//                 round (r(x): x rounded to that dtype; nothing for float32): p = r(softmax(float32
//                 (logits))); each of the groups scored by r(the sum of its two largest p), the
//                 topk_group best (torch.topk(sorted=False)) kept and the others' p taken as 0; the
//                 k largest as torch.topk(..., sorted=False) leaves them, w = their p; with renorm
//                 w = r(w / r(r(sum of w, in their order) + eps)); then w = r(w * scale).
enum class RouterForm : int {
  kSoftmaxTopk = 0,
  kTopkSoftmax = 1,
  kSigmoidGroupTopk = 2,
  kSoftmaxGroupTopk = 3,
  kSoftmaxGroupTopkInDtype = 4
};
struct RouterSelectArgs {
  DType dtype;         // the logits'
  const void* logits;  // [B, E] contiguous
  int64_t B, E, k;     // 1 <= k <= E
  RouterForm form;
  bool renorm;  // kSoftmaxTopk, kSigmoidGroupTopk and kSoftmaxGroupTopkInDtype
  DType w_dtype;
  void* w;       // out [B, k]
  int64_t* idx;  // out [B, k]
  // kSoftmaxTopk only: with sel_bias [E] (float32), the top k of probs + sel_bias choose the experts
  // and their weights are the probabilities without it (ERNIE 4.5's score correction); renorm
  // then divides by max(sum, norm_min)
  const float* sel_bias = nullptr;
  float norm_min = 0.0f;
  // kSigmoidGroupTopk, kSoftmaxGroupTopk and kSoftmaxGroupTopkInDtype (groups divides E, E / groups
  // >= 2, 1 <= topk_group <= groups, and k <= topk_group * E / groups)
  int64_t groups = 1, topk_group = 1;
  float scale = 1.0f;
  float eps = 1e-20f;  // kSigmoidGroupTopk, kSoftmaxGroupTopkInDtype: the renormalising sum's epsilon
};
void router_select(const RouterSelectArgs& a);

// A gated MLP's decode step on two up-only blocks (csrc/moe/mlp.cpp): [g | u] = gate_up.linear(x)
// (I gate rows, then I up rows), m = round(round(silu(g)) * u), out = down.linear(m), every
// rounding to the dtype where PyTorch's F.silu and product round; silu in float32, the baseline
// build as PyTorch's scalar loop writes it, the AVX-512 build (isa of gate_up) with a vector exp.
struct GatedMlpArgs {
  DType dtype;
  int64_t B, I;
  const PackedExperts* gate_up;  // [B, H] -> [B, 2 I]
  MoeParams gate_up_params;
  const PackedExperts* down;  // [B, I] -> [B, H]
  MoeParams down_params;
  const void* x;  // [B, H]
  void* gu;       // scratch [B, 2 I]
  void* m;        // scratch [B, I]
  void* out;      // out [B, H]
};
void gated_mlp_decode(const GatedMlpArgs& a, int num_threads);
// Its two halves: [g | u] = gate_up.linear(x) and m (gated_mlp_gate_up), then out = down.linear(m).
void gated_mlp_gate_up(const GatedMlpArgs& a, int num_threads);
void gated_mlp_down(const GatedMlpArgs& a, int num_threads);
// out[i] = round(round(silu(g[i])) * u[i]) over n values (gated_mlp_decode's middle step).
void silu_mul(DType dt, Isa isa, const void* g, const void* u, int64_t n, void* out);
// A shared expert's sigmoid gate (Qwen2-MoE): out = round(routed + round(round(sigmoid(logit_b))
// * shared)) per row b of H values, logit [B] one per row; float32 math, std::exp, each step
// rounded to the dtype as PyTorch's sigmoid (its scalar loop, B under two vectors of its build;
// hi_na_moe.mlp.sigmoid_rows), product and add round it. out may be routed.
void shared_combine(DType dt, const void* routed, const void* shared, const void* logit, int64_t B, int64_t H,
                    void* out);

}  // namespace hina
