// A pre-norm decoder layer's decode step in two native calls (hi_na_moe.layers): everything
// before the KV-cache update, and everything after it: up to the router's logits, or through the
// router's selection, the experts and the last residual add. Only the
// library's own kernels, composed in the order and with the roundings hi_na_moe's per-module
// path runs them, so both give the same bits (tests/test_layers.py compares them).
#include <algorithm>
#include <chrono>
#include <cstring>

#include "hina_moe/step.h"
#include "hina_moe/thread_pool.h"
#include "hina_moe/tier.h"
#include "kernel_api.h"
#include "step_trace.h"

namespace hina {

namespace {

// decode_layers' timeline (StepTraceEvent): lap(op) closes the span since the previous lap as
// op's, while a decode_layers call is running; nothing in a release build (moe/step_trace.h).
#ifdef HINA_PREFETCH_TUNING
struct Trace {
  std::vector<StepTraceEvent> events;
  int64_t last = 0;
  int32_t layer = 0;
  bool active = false;
} g_trace;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
void trace_start() {
  g_trace.active = true;
  g_trace.last = now_ns();
}
void trace_stop() { g_trace.active = false; }
void trace_layer(int32_t l) { g_trace.layer = l; }
#else
inline void trace_start() {}
inline void trace_stop() {}
inline void trace_layer(int32_t) {}
#endif

}  // namespace

#ifdef HINA_PREFETCH_TUNING
void detail::lap(StepOp op) {
  if (!g_trace.active) return;
  const int64_t t = now_ns();
  if (g_trace.events.size() < (size_t{1} << 20)) g_trace.events.push_back({g_trace.layer, op, g_trace.last, t});
  g_trace.last = t;
}
#endif

const char* step_op_name(StepOp op) {
  static const char* const names[] = {
      "norm",         "qkv",          "rope_kv",      "attention",       "o_proj",       "add_norm",
      "mlp_gate_up",  "mlp_down",     "router",       "select",          "experts_prep", "experts_gate_up",
      "experts_quant_h", "experts_down", "experts",   "shared_gate_up",  "shared_down",  "shared_gate",
      "add",          "final_norm",   "lm_head"};
  static_assert(sizeof(names) / sizeof(names[0]) == static_cast<size_t>(StepOp::kCount));
  const auto i = static_cast<size_t>(op);
  return i < sizeof(names) / sizeof(names[0]) ? names[i] : "?";
}

bool step_trace_compiled() {
#ifdef HINA_PREFETCH_TUNING
  return true;
#else
  return false;
#endif
}

std::vector<StepTraceEvent> take_step_trace() {
#ifdef HINA_PREFETCH_TUNING
  std::vector<StepTraceEvent> out;
  out.swap(g_trace.events);
  return out;
#else
  return {};
#endif
}

namespace {

// layer_decode_pre for latent attention (LayerPreArgs::mla)
void latent_pre(const LayerPreArgs& a, int num_threads) {
  const LayerPreArgs::Latent& m = a.mla;
  const size_t es = dtype_size(a.dtype);
  const int64_t hd = m.Dn + m.Dr, nqf = a.Hq * hd, nqa = m.q_lora > 0 ? m.q_lora : nqf;
  const int64_t n = nqa + m.L + m.Dr;  // a row of the q / kv_a group's output
  auto* y = static_cast<char*>(a.qkv_out);
  auto* tmp = static_cast<char*>(a.qk_tmp);  // [B, q_lora] normed q_a, then [B, nqf] q_b's output
  rms_norm(a.dtype, a.x, a.B, a.H, a.ln1_w, a.ln1_eps, a.h);
  detail::lap(StepOp::kNorm);
  MoeParams p = a.qkv_params;
  p.num_threads = num_threads;
  a.qkv->linear(a.h, a.B, y, p);
  detail::lap(StepOp::kQkv);
  char* qf = y;  // row b's q at qf + b * qf_bstride elements
  int64_t qf_bstride = n;
  if (m.q_lora > 0) {
    for (int64_t b = 0; b < a.B; ++b)
      rms_norm(a.dtype, y + b * n * es, 1, m.q_lora, m.qa_w, m.qa_eps, tmp + b * m.q_lora * es);
    qf = tmp + a.B * m.q_lora * es;
    qf_bstride = nqf;
    MoeParams pb = m.q_b_params;
    pb.num_threads = num_threads;
    m.q_b->linear(tmp, a.B, qf, pb);
  }
  const auto* cos = static_cast<const char*>(a.cos);
  const auto* sin = static_cast<const char*>(a.sin);
  // the tables' element size: float32 (re, im) pairs for the complex form
  const size_t tes = m.rope == LatentRope::kComplex ? sizeof(float) : es;
  for (int64_t b = 0; b < a.B; ++b) {
    const char* qr = qf + b * qf_bstride * es;
    char* qo = static_cast<char*>(a.q) + b * nqf * es;
    for (int64_t h = 0; h < a.Hq; ++h)  // the heads' no-rope parts as they are
      std::memcpy(qo + h * hd * es, qr + h * hd * es, static_cast<size_t>(m.Dn) * es);
    const char* cb = cos + b * a.cos_bstride * tes;
    const char* sb = sin + b * a.cos_bstride * tes;
    rope_latent(a.dtype, m.rope, qr + m.Dn * es, a.Hq, hd, m.Dr, cb, sb, qo + m.Dn * es, hd);
    if (m.q_scale != nullptr) {  // the whole query times the row's scale, each product rounded
      const float s = detail::load_elem(a.dtype, m.q_scale, b);
      for (int64_t i = 0; i < nqf; ++i)
        detail::store_elem(a.dtype, qo, i, detail::load_elem(a.dtype, qo, i) * s);
    }
    const char* yr = y + b * n * es;
    rms_norm(a.dtype, yr + nqa * es, 1, m.L, m.kv_w, m.kv_eps, static_cast<char*>(a.k) + b * a.kv_bstride * es);
    rope_latent(a.dtype, m.rope, yr + (nqa + m.L) * es, 1, m.Dr, m.Dr, cb, sb,
                static_cast<char*>(a.v) + b * m.v_bstride * es, m.Dr);
  }
  detail::lap(StepOp::kRopeKv);  // (with q_b's projection)
}

}  // namespace

void layer_decode_pre(const LayerPreArgs& a, int num_threads, Isa isa) {
  if (a.mla.rope != LatentRope::kNone) return latent_pre(a, num_threads);
  const size_t es = dtype_size(a.dtype);
  const int64_t nq = a.Hq * a.D, nkv = a.Hkv * a.D, n = nq + 2 * nkv;
  auto* qkv = static_cast<char*>(a.qkv_out);
  auto* tmp = static_cast<char*>(a.qk_tmp);  // [B, nq + nkv]: q and k after their norms
  rms_norm(a.dtype, a.x, a.B, a.H, a.ln1_w, a.ln1_eps, a.h);
  detail::lap(StepOp::kNorm);
  MoeParams p = a.qkv_params;
  p.num_threads = num_threads;
  a.qkv->linear(a.h, a.B, a.qkv_out, p);
  detail::lap(StepOp::kQkv);
  const auto* cos = static_cast<const char*>(a.cos);
  const auto* sin = static_cast<const char*>(a.sin);
  for (int64_t b = 0; b < a.B; ++b) {
    const char* qr = qkv + b * n * es;
    const char* kr = qr + nq * es;
    const char* vr = kr + nkv * es;
    char* qn = tmp + b * (nq + nkv) * es;
    char* kn = qn + nq * es;
    if (a.qk_norm == 1) {  // over the whole projection (OLMoE)
      rms_norm(a.dtype, qr, 1, nq, a.qn_w, a.qn_eps, qn);
      rms_norm(a.dtype, kr, 1, nkv, a.kn_w, a.kn_eps, kn);
      qr = qn;
      kr = kn;
    } else if (a.qk_norm == 2) {  // per head (Qwen3)
      rms_norm(a.dtype, qr, a.Hq, a.D, a.qn_w, a.qn_eps, qn);
      rms_norm(a.dtype, kr, a.Hkv, a.D, a.kn_w, a.kn_eps, kn);
      qr = qn;
      kr = kn;
    }
    const size_t tes = a.interleaved_f32 ? sizeof(float) : es;  // the tables' element size
    const char* cb = cos + b * a.cos_bstride * tes;
    const char* sb = sin + b * a.cos_bstride * tes;
    auto rotate = [&](const char* x, int64_t heads, char* out) {
      if (a.interleaved_f32)
        rope_interleaved_f32(a.dtype, x, 1, heads, a.D, reinterpret_cast<const float*>(cb),
                             reinterpret_cast<const float*>(sb), 0, out, 1);
      else
        rope_rotate_half(a.dtype, x, 1, heads, a.D, cb, sb, out, isa, 1, a.half_table, a.rot);
    };
    rotate(qr, a.Hq, static_cast<char*>(a.q) + b * nq * es);
    char* kb = static_cast<char*>(a.k) + b * a.kv_bstride * es;
    char* vb = static_cast<char*>(a.v) + b * a.kv_bstride * es;
    if (a.kv_hstride == a.D) {
      rotate(kr, a.Hkv, kb);
      std::memcpy(vb, vr, static_cast<size_t>(nkv) * es);
    } else {  // one head at a time into the cache's rows
      for (int64_t h = 0; h < a.Hkv; ++h) {
        rotate(kr + h * a.D * es, 1, kb + h * a.kv_hstride * es);
        std::memcpy(vb + h * a.kv_hstride * es, vr + h * a.D * es, static_cast<size_t>(a.D) * es);
      }
    }
  }
  detail::lap(StepOp::kRopeKv);
}

namespace {

// set_route_replay's state (step.h)
struct RouteReplay {
  const int32_t* ids = nullptr;
  int64_t layers = 0, rows = 0, k = 0, cursor = 0, errors = 0;
  int64_t* chosen = nullptr;
} g_replay;

// the replayed logits of B rows of E experts for a selection of k (0: the caller's); the layer of
// ids served, or -1 (an error counted)
int64_t replay_logits(DType dt, void* logits, int64_t B, int64_t E, int64_t k) {
  RouteReplay& r = g_replay;
  const int64_t l = r.cursor++;
  if (l >= r.layers || B > r.rows || (k > 0 && k != r.k)) {
    ++r.errors;
    return -1;
  }
  const int32_t* ids = r.ids + l * r.rows * r.k;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < r.k; ++j)
      if (ids[b * r.k + j] < 0 || ids[b * r.k + j] >= E) {
        ++r.errors;
        return -1;
      }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t e = 0; e < E; ++e) detail::store_elem(dt, logits, b * E + e, -1e4f);
    // graded, so the order of the chosen is defined; exact in bfloat16 and float16 for k <= 256
    for (int64_t j = 0; j < r.k; ++j)
      detail::store_elem(dt, logits, b * E + ids[b * r.k + j], 0.125f * static_cast<float>(r.k - j));
  }
  return l;
}

// dst[i] = src[i] in another dtype (the router's input: bfloat16 or float16 to float32 is exact)
void convert(DType from, const void* src, DType to, void* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) detail::store_elem(to, dst, i, detail::load_elem(from, src, i));
}

// a gated MLP on normed (a dense layer's, or a shared expert's) into m.out; the step trace's
// laps: gu after the gate/up linear and the activation, down after the down linear
void mlp_on(const GatedMlpArgs& mlp, const LayerPostArgs& a, int num_threads, StepOp gu, StepOp down) {
  GatedMlpArgs m = mlp;
  m.dtype = a.dtype;
  m.B = a.B;
  m.x = a.normed;
  gated_mlp_gate_up(m, num_threads);
  detail::lap(gu);
  gated_mlp_down(m, num_threads);
  detail::lap(down);
}

}  // namespace

const char* layer_decode_post(const LayerPostArgs& a, int num_threads, Isa attn_isa) {
  if (a.mla.has_weight()) {
    MlaDecodeArgs m = a.mla;
    m.out = a.attn.out;
    mla_decode(m, num_threads, attn_isa);
  } else if (a.attn.q != nullptr) {
    attention_decode(a.attn, num_threads, attn_isa);
  }
  detail::lap(StepOp::kAttn);
  MoeParams p = a.o_params;
  p.num_threads = num_threads;
  a.o->linear(a.attn.out, a.B, a.o_out, p);
  detail::lap(StepOp::kO);
  add_rms_norm(a.dtype, a.x, a.o_out, a.B, a.H, a.ln2_w, a.ln2_eps, a.sum, a.normed);
  detail::lap(StepOp::kAddNorm);
  if (a.router == nullptr && a.mlp.gate_up != nullptr) {  // a dense layer
    mlp_on(a.mlp, a, num_threads, StepOp::kMlpGateUp, StepOp::kMlpDown);
    add(a.dtype, a.sum, a.mlp.out, a.B * a.H, a.sum);
    detail::lap(StepOp::kAdd);
    return nullptr;
  }
  if (a.router != nullptr) {
    MoeParams r = a.router_params;
    r.num_threads = num_threads;
    const DType ldt = a.router_cast ? a.router_dtype : a.dtype;  // the logits'
    if (a.router_cast) convert(a.dtype, a.normed, ldt, a.router_in, a.B * a.H);
    a.router->linear(a.router_cast ? a.router_in : a.normed, a.B, a.logits, r);
    const int64_t replayed = g_replay.ids != nullptr ? replay_logits(ldt, a.logits, a.B, a.select.E, a.select.k) : -1;
    detail::lap(StepOp::kRouter);
    if (a.select.w != nullptr) {
      RouterSelectArgs s = a.select;
      s.dtype = ldt;
      s.logits = a.logits;
      s.B = a.B;
      router_select(s);
      if (replayed >= 0 && g_replay.chosen != nullptr)
        std::memcpy(g_replay.chosen + replayed * g_replay.rows * s.k, s.idx, static_cast<size_t>(a.B * s.k) * 8);
      detail::lap(StepOp::kSelect);
      if (a.experts != nullptr) {
        MoeParams e = a.experts_params;
        e.num_threads = a.experts_threads;
        e.topk_w_dtype = s.w_dtype;
        const char* name = a.experts->forward(a.normed, a.B, s.idx, 64, s.w, s.k, a.experts_out, e);
        detail::lap(StepOp::kExperts);
        if (a.shared_mlp.gate_up != nullptr) {
          mlp_on(a.shared_mlp, a, num_threads, StepOp::kSharedGateUp, StepOp::kSharedDown);
          if (a.shared_gate == nullptr) {  // added as it is
            add(a.dtype, a.experts_out, a.shared_mlp.out, a.B * a.H, a.experts_out);
          } else {
            MoeParams g = a.shared_gate_params;
            g.num_threads = num_threads;
            a.shared_gate->linear(a.normed, a.B, a.shared_logit, g);
            shared_combine(a.dtype, a.experts_out, a.shared_mlp.out, a.shared_logit, a.B, a.H, a.experts_out);
          }
          detail::lap(StepOp::kShared);
        }
        add(a.dtype, a.sum, a.experts_out, a.B * a.H, a.sum);
        detail::lap(StepOp::kAdd);
        // the layer's output predicts the next layers' experts better than its MoE input (tier.h)
        if (ExpertTier* t = a.experts->tier()) t->layer_done(a.experts->tier_layer(), a.sum, a.B, a.dtype, a.H);
        return name;
      }
    }
  }
  return nullptr;
}

namespace {

// The scratch of one step, carved from one buffer: the largest layer's sizes.
// A dense layer's MLP uses the shared expert's scratch (a layer has one or the other).
struct StepScratch {
  size_t h, qkv, qk_tmp, q, attn, o_out, normed, router_in, logits, w, idx, experts_out, shared_gu, shared_m,
      shared_out, shared_logit, x0, x1, total;
};

size_t take(size_t& at, size_t bytes) {
  const size_t here = at;
  at += (bytes + 63) / 64 * 64;
  return here;
}

StepScratch step_scratch(const DecodeLayer* layers, int64_t L, int64_t B) {
  int64_t H = 0, nq = 0, nkv = 0, E = 0, k = 0, I = 0;
  size_t es = 1, les = 1;  // the largest dtype of the layers, and of their logits
  bool cast = false;
  int64_t nqkv = 0, ntmp = 0, nattn = 0;  // the q/k/v output's, qk_tmp's and the heads' output's
  for (int64_t l = 0; l < L; ++l) {
    const LayerPreArgs& p = layers[l].pre;
    const LayerPostArgs& a = layers[l].post;
    es = std::max(es, dtype_size(p.dtype));
    les = std::max(les, dtype_size(a.router_cast ? a.router_dtype : p.dtype));
    cast |= a.router_cast;
    H = std::max(H, p.H);
    if (p.mla.rope != LatentRope::kNone) {  // latent attention (LayerPreArgs::mla)
      const LayerPreArgs::Latent& m = p.mla;
      const int64_t nqf = p.Hq * (m.Dn + m.Dr);
      nqkv = std::max(nqkv, (m.q_lora > 0 ? m.q_lora : nqf) + m.L + m.Dr);
      ntmp = std::max(ntmp, m.q_lora + nqf);
      nq = std::max(nq, nqf);
      nattn = std::max(nattn, p.Hq * a.mla.Dv);
    } else {
      nq = std::max(nq, p.Hq * p.D);
      nkv = std::max(nkv, p.Hkv * p.D);
      nqkv = std::max(nqkv, p.Hq * p.D + 2 * p.Hkv * p.D);
      ntmp = std::max(ntmp, p.Hq * p.D + p.Hkv * p.D);
      nattn = std::max(nattn, p.Hq * p.D);
    }
    E = std::max(E, a.select.E);
    k = std::max(k, a.select.k);
    if (a.shared_mlp.gate_up != nullptr) I = std::max(I, a.shared_mlp.I);
    if (a.mlp.gate_up != nullptr) I = std::max(I, a.mlp.I);
  }
  const size_t b = static_cast<size_t>(B);
  StepScratch s{};
  size_t at = 0;
  s.h = take(at, b * H * es);
  s.qkv = take(at, b * nqkv * es);
  s.qk_tmp = take(at, b * ntmp * es);
  s.q = take(at, b * nq * es);
  s.attn = take(at, b * nattn * es);
  s.o_out = take(at, b * H * es);
  s.normed = take(at, b * H * es);
  s.router_in = take(at, cast ? b * H * sizeof(float) : 0);
  s.logits = take(at, b * E * les);
  s.w = take(at, b * k * 4);
  s.idx = take(at, b * k * 8);
  s.experts_out = take(at, b * H * es);
  s.shared_gu = take(at, b * 2 * I * es);
  s.shared_m = take(at, b * I * es);
  s.shared_out = take(at, I ? b * H * es : 0);
  s.shared_logit = take(at, I ? b * es : 0);
  s.x0 = take(at, b * H * es);
  s.x1 = take(at, b * H * es);
  s.total = at;
  return s;
}

}  // namespace

size_t decode_layers_scratch(const DecodeLayer* layers, int64_t L, int64_t B) {
  return step_scratch(layers, L, B).total;
}

namespace {

// Layer d's first call of a step: its fixed arguments, the step's (B, x, the rotary tables, the
// query scale), its scratch regions and the cache position it writes (c). One place for
// decode_layers and decode_layer_pre.
LayerPreArgs pre_args(const DecodeLayer& d, const DecodeKV& c, const StepScratch& s, char* base, int64_t B,
                      const void* x, const void* cos, const void* sin, int64_t cos_bstride, const void* q_scale) {
  const size_t es = dtype_size(d.pre.dtype);
  LayerPreArgs p = d.pre;
  p.B = B;
  p.x = x;
  p.cos = cos;
  p.sin = sin;
  p.cos_bstride = cos_bstride;
  p.h = base + s.h;
  p.qkv_out = base + s.qkv;
  p.qk_tmp = base + s.qk_tmp;
  p.q = base + s.q;
  p.k = reinterpret_cast<char*>(c.k) + c.pos * c.sstride * es;
  p.v = reinterpret_cast<char*>(c.v) + c.pos * c.v_sstride * es;
  p.kv_bstride = c.bstride;
  p.kv_hstride = c.hstride;
  p.mla.v_bstride = c.v_bstride;
  if (p.mla.rope != LatentRope::kNone) p.mla.q_scale = q_scale;
  return p;
}

// Layer d's second call: the attention over positions [0, c.S) of the cache c (heads: when
// non-null, the heads' outputs are already there and the attention does not run), the rest as
// decode_layers and decode_layer_post describe. One place for both.
LayerPostArgs post_args(const DecodeLayer& d, const DecodeKV& c, const StepScratch& s, char* base, int64_t B,
                        const void* x, const uint8_t* mask, int64_t mask_bstride, void* sum, void* heads) {
  const size_t es = dtype_size(d.pre.dtype);
  LayerPostArgs a = d.post;
  a.B = B;
  a.attn.B = B;
  a.attn.out = heads != nullptr ? heads : base + s.attn;
  if (heads != nullptr) {  // attention_decode skips a null q; mla_decode runs only with a weight
    a.attn.q = nullptr;
    a.mla = MlaDecodeArgs{};
  } else if (d.pre.mla.rope != LatentRope::kNone) {  // the queries as latent_pre left them, the caches
    MlaDecodeArgs& m = a.mla;
    const int64_t hd = m.Dn + m.Dr;
    m.B = B;
    m.q_nope = base + s.q;
    m.q_rope = base + s.q + m.Dn * es;
    m.qn_strides[0] = m.qr_strides[0] = m.H * hd;
    m.qn_strides[1] = m.qr_strides[1] = hd;
    m.latent = reinterpret_cast<const void*>(c.k);
    m.c_strides[0] = c.bstride;
    m.c_strides[1] = c.sstride;
    m.k_rope = reinterpret_cast<const void*>(c.v);
    m.kr_strides[0] = c.v_bstride;
    m.kr_strides[1] = c.v_sstride;
    m.S = c.S;
    m.mask = mask;
    m.mask_bstride = mask_bstride;
  } else {
    a.attn.q = base + s.q;
    a.attn.k = reinterpret_cast<const void*>(c.k);
    a.attn.v = reinterpret_cast<const void*>(c.v);
    a.attn.S = c.S;
    a.attn.k_strides[0] = c.bstride;
    a.attn.k_strides[1] = c.hstride;
    a.attn.k_strides[2] = c.sstride;
    a.attn.v_strides[0] = c.v_bstride;
    a.attn.v_strides[1] = c.hstride;
    a.attn.v_strides[2] = c.v_sstride;
    a.attn.mask = mask;
    a.attn.mask_bstride = mask_bstride;
  }
  a.o_out = base + s.o_out;
  a.x = x;
  a.sum = sum;
  a.normed = base + s.normed;
  a.logits = base + s.logits;
  a.router_in = base + s.router_in;
  if (a.select.k > 0) {  // (k 0: the router's logits alone, its selection left to the caller)
    a.select.w = base + s.w;
    a.select.idx = reinterpret_cast<int64_t*>(base + s.idx);
  }
  a.experts_out = base + s.experts_out;
  if (a.shared_mlp.gate_up != nullptr) {
    a.shared_mlp.gu = base + s.shared_gu;
    a.shared_mlp.m = base + s.shared_m;
    a.shared_mlp.out = base + s.shared_out;
    a.shared_logit = base + s.shared_logit;
  }
  if (a.mlp.gate_up != nullptr) {
    a.mlp.gu = base + s.shared_gu;
    a.mlp.m = base + s.shared_m;
    a.mlp.out = base + s.shared_out;
  }
  return a;
}

// decode_layers on the calling thread (its regions on whichever threads the pool gives)
void step_through(const DecodeLayer* layers, const DecodeKV* kv, int64_t L, int64_t B, const void* x, const void* cos,
                  const void* sin, int64_t cos_bstride, const uint8_t* mask, int64_t mask_bstride, void* scratch,
                  void* out, const char** names, const void* norm_w, float norm_eps, void* normed,
                  const void* q_scale, const PackedExperts* head, const MoeParams* head_params, void* logits) {
  trace_start();
  const StepScratch s = step_scratch(layers, L, B);
  char* base = static_cast<char*>(scratch);
  const void* cur = x;
  for (int64_t l = 0; l < L; ++l) {
    trace_layer(static_cast<int32_t>(l));
    const DecodeLayer& d = layers[l];
    layer_decode_pre(pre_args(d, kv[l], s, base, B, cur, cos, sin, cos_bstride, q_scale), d.num_threads, d.attn_isa);
    void* sum = l == L - 1 ? out : base + (l % 2 == 0 ? s.x0 : s.x1);
    names[l] = layer_decode_post(post_args(d, kv[l], s, base, B, cur, mask, mask_bstride, sum, nullptr),
                                 d.num_threads, d.attn_isa);
    cur = sum;
  }
  if (norm_w != nullptr && L > 0) {
    trace_layer(-1);
    rms_norm(layers[L - 1].pre.dtype, out, B, layers[L - 1].pre.H, norm_w, norm_eps, normed);
    detail::lap(StepOp::kFinalNorm);
    if (head != nullptr && head_params != nullptr && logits != nullptr) {
      head->linear(normed, B, logits, *head_params);
      detail::lap(StepOp::kHead);
    }
  }
  trace_stop();
}

// The most threads a region of the step asks for (0: the default).
int step_threads(const DecodeLayer* layers, int64_t L, const MoeParams* head_params) {
  const int all = default_num_threads();
  auto of = [all](int n) { return n > 0 ? n : all; };
  int n = head_params != nullptr ? of(head_params->num_threads) : 1;
  for (int64_t l = 0; l < L; ++l) n = std::max({n, of(layers[l].num_threads), of(layers[l].post.experts_threads)});
  return n;
}

}  // namespace

// The whole step is one hosted call (ThreadPool::host): its regions run on OpenMP's team when
// torch's ops have left that team spinning, not on own workers competing with it for the cores.
void decode_layers(const DecodeLayer* layers, const DecodeKV* kv, int64_t L, int64_t B, const void* x, const void* cos,
                   const void* sin, int64_t cos_bstride, const uint8_t* mask, int64_t mask_bstride, void* scratch,
                   void* out, const char** names, const void* norm_w, float norm_eps, void* normed,
                   const void* q_scale, const PackedExperts* head, const MoeParams* head_params, void* logits) {
  ThreadPool::global().host(step_threads(layers, L, head_params), [&] {
    step_through(layers, kv, L, B, x, cos, sin, cos_bstride, mask, mask_bstride, scratch, out, names, norm_w, norm_eps,
                 normed, q_scale, head, head_params, logits);
  });
}

void set_route_replay(const int32_t* ids, int64_t layers, int64_t rows, int64_t k, int64_t* chosen) {
  g_replay = RouteReplay{ids, layers, rows, k, 0, 0, chosen};
}
int64_t route_replay_cursor() { return g_replay.cursor; }
void set_route_replay_cursor(int64_t layer) { g_replay.cursor = layer; }
int64_t route_replay_errors() { return g_replay.errors; }

size_t decode_layer_scratch(const DecodeLayer& d, int64_t B) { return step_scratch(&d, 1, B).total; }

DecodeRegions decode_layer_regions(const DecodeLayer& d, int64_t B) {
  const StepScratch s = step_scratch(&d, 1, B);
  return DecodeRegions{s.q, s.normed, s.logits, s.w, s.idx, s.total};
}

void decode_layer_pre(const DecodeLayer& d, const DecodeKV& kv, int64_t B, const void* x, const void* cos,
                      const void* sin, int64_t cos_bstride, const void* q_scale, void* scratch) {
  const StepScratch s = step_scratch(&d, 1, B);
  layer_decode_pre(pre_args(d, kv, s, static_cast<char*>(scratch), B, x, cos, sin, cos_bstride, q_scale),
                   d.num_threads, d.attn_isa);
}

const char* decode_layer_post(const DecodeLayer& d, const DecodeKV& kv, int64_t B, const void* x, const uint8_t* mask,
                              int64_t mask_bstride, void* scratch, void* sum, void* heads) {
  const StepScratch s = step_scratch(&d, 1, B);
  return layer_decode_post(post_args(d, kv, s, static_cast<char*>(scratch), B, x, mask, mask_bstride, sum, heads),
                           d.num_threads, d.attn_isa);
}

}  // namespace hina
