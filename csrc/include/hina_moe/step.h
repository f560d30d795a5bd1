// A decoder layer's decode step in two calls, a whole stack's step in one, and its timeline.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "hina_moe/attention.h"
#include "hina_moe/experts.h"
#include "hina_moe/ops.h"
#include "hina_moe/types.h"

namespace hina {

// A pre-norm decoder layer's decode step before the KV-cache update (csrc/moe/layer_step.cpp):
// h = rms_norm(x); [q | k | v] = qkv.linear(h); q and k through their RMSNorms (qk_norm 1: over
// the whole projection, 2: per head, 0: none); q, k rotated (rope_rotate_half); v copied. Every
// buffer C-contiguous in dtype, none overlapping another, except k and v: head h of row b goes
// to k + (b * kv_bstride + h * kv_hstride) elements (likewise v), so they can be one position
// of a KV cache laid out [B, Hkv, capacity, D] (hi_na_moe.kv_cache); kv_hstride = D and
// kv_bstride = Hkv D is the contiguous [B, Hkv, D].
struct LayerPreArgs {
  DType dtype;
  int64_t B, H;  // rows (one new token each), hidden size
  const void* x;  // [B, H]
  const void* ln1_w;
  float ln1_eps;
  const PackedExperts* qkv;  // an up-only block: [B, H] -> [B, (Hq + 2 Hkv) D]
  MoeParams qkv_params;
  int64_t Hq, Hkv, D;
  int qk_norm;
  const void* qn_w;  // [Hq D] (qk_norm 1) or [D] (2)
  const void* kn_w;
  float qn_eps, kn_eps;
  const void* cos;  // row b at cos + b * cos_bstride elements, D values (likewise sin)
  const void* sin;
  int64_t cos_bstride;
  void* h;        // scratch [B, H]
  void* qkv_out;  // scratch [B, (Hq + 2 Hkv) D]
  void* qk_tmp;   // scratch [B, (Hq + Hkv) D]
  void* q;        // out [B, Hq, D]
  void* k;        // out [B, Hkv, D] at the strides below
  void* v;        // out [B, Hkv, D] at the strides below
  int64_t kv_bstride, kv_hstride;  // elements
  bool half_table = false;  // cos and sin rows of D/2 values (rope_rotate_half's half_table: GPT-OSS)
  // the rotation is rope_interleaved_f32's (ERNIE 4.5): cos and sin are float32, cos_bstride counts
  // float32 values
  bool interleaved_f32 = false;
  int64_t rot = 0;  // rope_rotate_half's rotary dims (0: D)
  // Latent attention (hi_na_moe.mla: DeepSeek-V2/V3's MLA) when mla.rope is not kNone. Then Hq
  // is its heads (Hkv, D, qk_norm, qk_tmp's size above unused) and the step is, per row:
  //   h = rms_norm(x); [qa | c | kr] = qkv.linear(h) (qkv: the packed group of q_proj, or q_a_proj,
  //   and kv_a_proj_with_mqa: [B, H] -> [B, nqa + L + Dr], nqa = q_lora or Hq (Dn + Dr));
  //   with q_lora > 0: qf = q_b.linear(rms_norm(qa, qa_w)), else qf = qa (each head Dn + Dr values);
  //   q [B, Hq, Dn + Dr] = qf with each head's last Dr values rotated (rope_latent, form mla.rope;
  //   cos as rope_latent's tab: float32 pairs for kComplex, cos_bstride then counting float32
  //   values); k + b * kv_bstride: rms_norm(c, kv_w) (the latent cache's slot of row b, L values);
  //   v + b * v_bstride: kr rotated (the rope key's slot, Dr values).
  // qk_tmp: scratch [B, q_lora + Hq (Dn + Dr)].
  struct Latent {
    LatentRope rope = LatentRope::kNone;
    int64_t Dn = 0, Dr = 0, L = 0, q_lora = 0, v_bstride = 0;
    const PackedExperts* q_b = nullptr;  // with q_lora: [B, q_lora] -> [B, Hq (Dn + Dr)]
    MoeParams q_b_params;
    const void* qa_w = nullptr;
    float qa_eps = 0.f;
    const void* kv_w = nullptr;
    float kv_eps = 0.f;
    // optional [B] in dtype: every query value of row b times q_scale[b], rounded to the dtype
    // (Mistral 4's query scale of the position, after the rotary embedding)
    const void* q_scale = nullptr;
  } mla;
};
// isa: the tier of rope_rotate_half in the step (the same bits at every tier; latent attention's
// rope_latent has one build and ignores it).
void layer_decode_pre(const LayerPreArgs& a, int num_threads, Isa isa);

// The step after the cache update: the attention (attn, with its sinks when set; skipped when
// attn.q is null, its out then already holding the heads' outputs), o = o_proj.linear(attn.out), sum = x + o and
// normed = rms_norm(sum) (add_rms_norm), then, with a router, logits = router.linear(normed) and,
// with select.w, the router's selection from them (router_select), and with experts, the MoE
// block's experts and the residual add into sum; or, in a dense layer (mlp.gate_up set, no
// router), sum += gated_mlp_decode(normed).
struct LayerPostArgs {
  DType dtype;
  int64_t B, H;
  AttnDecodeArgs attn;  // out: scratch [B, Hq D]
  const PackedExperts* o;
  MoeParams o_params;
  void* o_out;  // scratch [B, H]
  const void* x;
  const void* ln2_w;
  float ln2_eps;
  void* sum;     // out [B, H]
  void* normed;  // out [B, H]
  const PackedExperts* router = nullptr;  // [B, H] -> [B, E]
  MoeParams router_params;
  void* logits = nullptr;  // out [B, E]
  // with a router and select.w set: then router_select() on the logits (its dtype, logits and
  // B are taken from here)
  RouterSelectArgs select{};
  // with the selection and experts set: then the MoE block's experts on it and the layer's last
  // residual add, sum += experts.forward(normed, select.idx, select.w) (add(): rounded as
  // PyTorch's add), experts_out: scratch [B, H]
  const PackedExperts* experts = nullptr;
  MoeParams experts_params;  // num_threads: experts_threads below; topk_w_dtype: select.w_dtype
  int experts_threads = 0;
  void* experts_out = nullptr;
  // with the experts and shared_mlp.gate_up set: the block's shared expert too, before the
  // residual add: experts_out = shared_combine(experts_out, gated_mlp_decode(normed),
  // shared_gate.linear(normed)) (shared_mlp's dtype, B, x, gu, m and out are set here;
  // shared_logit: scratch [B])
  // shared_gate null: a shared expert without a gate, added as it is (ERNIE 4.5):
  // experts_out = add(experts_out, gated_mlp_decode(normed))
  GatedMlpArgs shared_mlp{};
  const PackedExperts* shared_gate = nullptr;  // [B, H] -> [B, 1]
  MoeParams shared_gate_params;
  void* shared_logit = nullptr;
  // a router of another dtype than the layer's (ERNIE 4.5's float32 router, which casts its input):
  // normed converted to router_dtype into router_in (scratch [B, H] of it) for its linear; the
  // logits (and select.dtype) are then of router_dtype
  DType router_dtype = DType::kF32;
  bool router_cast = false;
  void* router_in = nullptr;
  // a dense layer: its gated MLP (dtype, B and x set here; gu, m and out: scratch), no router
  GatedMlpArgs mlp{};
  // latent attention: with mla's weight set (mla.has_weight()), mla_decode(mla) runs instead of
  // attention_decode(attn), its out set here to attn.out ([B, H Dv]; attn's other fields unused)
  MlaDecodeArgs mla{};
};
// Routing replay, for benchmarks and tests only (hi_na_moe.fastpath.replay): while ids is set,
// each router layer_decode_post runs takes the next layer of ids [layers, rows, k] (a cursor, one
// layer per router call, reset by set_route_replay) and its logits become 0.125 (k - j) at row
// b's j-th id and -1e4 elsewhere, so the selection after them picks exactly those experts in
// that order. chosen (null: none) [layers, rows, k] receives what router_select then chose. A
// call it cannot serve (cursor past layers, more rows than rows, an id outside [0, E)) keeps the
// router's own logits and counts an error the caller must check. One step at a time: not for
// concurrent steps. ids null: off, one null check a router call.
void set_route_replay(const int32_t* ids, int64_t layers, int64_t rows, int64_t k, int64_t* chosen);
int64_t route_replay_cursor();
void set_route_replay_cursor(int64_t layer);
int64_t route_replay_errors();
// Returns the name of the experts' kernel that ran (forward()'s), or null when none ran.
const char* layer_decode_post(const LayerPostArgs& a, int num_threads, Isa attn_isa);

// One decoder layer of decode_layers(): its two calls' arguments with what stays between steps
// (weights, sizes, the packed blocks, the router's selection form, the experts, a shared expert's
// blocks); decode_layers sets the rest, scratch included. The layer must have a router with a
// selection and experts, or be dense (post.mlp.gate_up set).
struct DecodeLayer {
  LayerPreArgs pre;
  LayerPostArgs post;
  int num_threads;
  Isa attn_isa;
};
// Where a layer's KV cache is: buffers k and v laid out [B, Hkv, capacity, D] with these element
// strides (the last dimension contiguous); this step writes position pos and the attention reads
// positions [0, S) (hi_na_moe.kv_cache: a DynamicCache's slot, pos = S - 1; a StaticCache's
// buffers, S = their capacity and the mask hiding what is not written yet).
// A latent attention layer's: k the latent cache [B, 1, capacity, L], v the rope keys' [B, 1,
// capacity, Dr] with their own strides v_bstride, v_sstride (for other layers these equal k's).
struct DecodeKV {
  int64_t k, v;  // addresses
  int64_t bstride, hstride, sstride, S, pos;
  int64_t v_bstride, v_sstride;
};
// A decode step through L decoder layers, one after the other, as L pairs of layer_decode_pre and
// layer_decode_post (with the experts) compute them: the same kernels on the same values, so
// the same bits. x [B, H] the first layer's input, out [B, H] the last layer's output; cos and
// sin as LayerPreArgs, and the attention mask (null: none) as AttnDecodeArgs, the same for every
// layer. scratch: at least decode_layers_scratch(layers, L, B) bytes. names[l]: the experts'
// kernel layer l ran. norm_w non-null: then also normed [B, H] = rms_norm(out) with that weight
// and norm_eps (the stack's final norm, as hi_na_moe.dense's NativeNorm runs it).
// q_scale: as LayerPreArgs::mla's, for every latent attention layer (null: none).
// head non-null (with norm_w): then also logits [B, head's outputs] = head->linear(normed) with
// head_params (the causal LM's lm_head, as hi_na_moe.dense's NativeLinear runs it).
size_t decode_layers_scratch(const DecodeLayer* layers, int64_t L, int64_t B);
void decode_layers(const DecodeLayer* layers, const DecodeKV* kv, int64_t L, int64_t B, const void* x, const void* cos,
                   const void* sin, int64_t cos_bstride, const uint8_t* mask, int64_t mask_bstride, void* scratch,
                   void* out, const char** names, const void* norm_w = nullptr, float norm_eps = 0.f,
                   void* normed = nullptr, const void* q_scale = nullptr, const PackedExperts* head = nullptr,
                   const MoeParams* head_params = nullptr, void* logits = nullptr);

// One layer of decode_layers by itself, its two calls apart, for a caller that runs something
// of the layer between or after them (hi_na_moe.fastpath.layers: the attention in PyTorch where
// the kernel does not apply, experts or a shared expert outside the call). The same argument
// filling as decode_layers, so the same kernels on the same values. Parts decode_layers requires
// are optional here: with no router and no post.mlp, the second call ends after the residual add
// and norm; with a router and post.select.k = 0, after the router's logits; with a selection and
// no experts, after the selection. kv: as decode_layers' (pre writes position kv.pos; post reads
// [0, kv.S), and may be given another cache than pre, as a cache's own update returns it).
// heads non-null: the heads' outputs [B, Hq Dv] are already there (the attention does not run).
// scratch: at least decode_layer_scratch(d, B) bytes; decode_layer_regions says where in it the
// caller finds what the calls leave: the queries (pre: [B, Hq, D], latent attention's
// [B, Hq, Dn + Dr]), normed [B, H], the logits [B, E] and the selection's weights and indices.
struct DecodeRegions {
  size_t q, normed, logits, w, idx, total;  // byte offsets into the scratch; total its size
};
size_t decode_layer_scratch(const DecodeLayer& d, int64_t B);
DecodeRegions decode_layer_regions(const DecodeLayer& d, int64_t B);
void decode_layer_pre(const DecodeLayer& d, const DecodeKV& kv, int64_t B, const void* x, const void* cos,
                      const void* sin, int64_t cos_bstride, const void* q_scale, void* scratch);
// Returns the experts' kernel name, or null when no experts ran.
const char* decode_layer_post(const DecodeLayer& d, const DecodeKV& kv, int64_t B, const void* x, const uint8_t* mask,
                              int64_t mask_bstride, void* scratch, void* sum, void* heads);

// The timeline of decode_layers, op by op, in a tuning build (HINA_PREFETCH_TUNING; a release
// build records nothing and step_trace_compiled() is false). Each event is one op of one layer:
// its span [t0, t1) in nanoseconds of steady_clock on the calling thread, the ops following each
// other without gaps from the call's start (the final norm's and the head's layer is -1); the experts' call in its
// parts (the routing metadata and input rows, the gate/up region, the h rows' quantisation, the
// down region; kExperts what follows it); a gated MLP (a dense layer's kMlp*, a shared expert's
// kShared*) in its gate/up linear with the activation, and its down linear, kShared then being
// the shared expert's sigmoid gate and the sum. One stepping thread at a
// time; take_step_trace() returns the events since its last call (at most 1 << 20) and clears them.
enum class StepOp : int32_t {
  kNorm, kQkv, kRopeKv, kAttn, kO, kAddNorm, kMlpGateUp, kMlpDown, kRouter, kSelect, kExpertsPrep, kExpertsGateUp,
  kExpertsQuantH, kExpertsDown, kExperts, kSharedGateUp, kSharedDown, kShared, kAdd, kFinalNorm, kHead, kCount
};
const char* step_op_name(StepOp op);
struct StepTraceEvent {
  int32_t layer;
  StepOp op;
  int64_t t0, t1;
};
bool step_trace_compiled();
std::vector<StepTraceEvent> take_step_trace();

}  // namespace hina
