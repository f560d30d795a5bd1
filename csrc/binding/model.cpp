// The model's part of the module: the checked ops (arrays in, their shapes and dtypes checked), the
// latent attention settings, and StepPlan (a decode step through L decoder layers in one call).
#include <nanobind/stl/array.h>

#include <array>

#include "binding/experts.h"

namespace hina_bind {

// A decode step through a model's decoder layers in one call (hina::decode_layers), for
// hi_na_moe.stack. Each layer's fixed arguments are set once (set_layer) and again only when one of
// them changes; the BoundForwards it was given are kept alive here.
class StepPlan {
 public:
  explicit StepPlan(int64_t L, bool partial = false)
      : layers_(static_cast<size_t>(L)), owners_(static_cast<size_t>(L)), partial_(partial) {
    if (L < 1) bad("StepPlan: need at least one layer");
    if (partial && L != 1) bad("StepPlan: a partial plan (partial=True) holds one layer, got " + std::to_string(L));
  }
  void set_layer(int64_t i, int dtype, int64_t H, uintptr_t ln1_w, float ln1_eps, nb::object qkv, int64_t Hq,
                 int64_t Hkv, int64_t D, int qk_norm, uintptr_t qn_w, uintptr_t kn_w, float qn_eps, float kn_eps,
                 float scale, const std::string& isa, nb::object o, uintptr_t ln2_w, float ln2_eps, nb::object router,
                 int64_t E, int sel_form, int64_t sel_k, bool sel_renorm, int sel_w_dtype, nb::object experts,
                 int experts_threads, int num_threads, nb::tuple shared, uintptr_t sinks, bool half_table,
                 bool interleaved_f32, int router_dtype, uintptr_t sel_bias, float norm_min, nb::tuple mlp,
                 int64_t sel_groups, int64_t sel_topk_group, float sel_scale, int64_t rot, float sel_eps,
                 nb::tuple mla, nb::object mla_w, int64_t mla_Dv) {
    if (i < 0 || i >= static_cast<int64_t>(layers_.size())) bad("StepPlan.set_layer: no layer " + std::to_string(i));
    if (shared.size() != 0 && shared.size() != 3 && shared.size() != 4)
      bad("StepPlan.set_layer: shared must be () or (gate_up, down, I[, gate]) of a shared expert");
    const bool dense = router.is_none();
    // (a partial plan's layer may leave its MLP block, the router's selection or the experts to
    // the caller: no router and no mlp, sel_k 0, experts None)
    if ((dense != (mlp.size() == 3) && !(partial_ && dense)) || (mlp.size() != 0 && mlp.size() != 3))
      bad("StepPlan.set_layer: a layer has a router and experts (mlp ()), or none and mlp (gate_up, down, I)");
    if (!partial_ && !dense && (experts.is_none() || sel_k < 1))
      bad("StepPlan.set_layer: a layer with a router needs its selection (sel_k >= 1) and experts");
    if (!experts.is_none() && sel_k < 1) bad("StepPlan.set_layer: experts need the router's selection (sel_k >= 1)");
    if (shared.size() != 0 && experts.is_none()) bad("StepPlan.set_layer: a shared expert runs with the experts");
    const auto& bq = nb::cast<const BoundForward&>(qkv);
    const auto& bo = nb::cast<const BoundForward&>(o);
    const auto dt = static_cast<hina::DType>(dtype);
    hina::DecodeLayer d{};
    d.pre = hina::LayerPreArgs{dt, 0, H, nullptr, reinterpret_cast<const void*>(ln1_w), ln1_eps, bq.packed(),
                               bq.params(), Hq, Hkv, D, qk_norm, reinterpret_cast<const void*>(qn_w),
                               reinterpret_cast<const void*>(kn_w), qn_eps, kn_eps};
    d.pre.half_table = half_table;
    d.pre.interleaved_f32 = interleaved_f32;
    d.pre.rot = rot;
    std::vector<nb::object> owners = {qkv, o};
    if (mla.size() != 0) {  // latent attention: its pre step and mla_decode (the rest set by decode_layers)
      latent_pre_args("StepPlan.set_layer", mla, &d.pre.mla, &owners);
      if (mla_Dv <= 0) bad("StepPlan.set_layer: latent attention needs mla_Dv > 0");
      hina::MlaDecodeArgs& m = d.post.mla;
      m.dtype = dt;
      m.H = Hq;
      m.Dn = d.pre.mla.Dn;
      m.Dr = d.pre.mla.Dr;
      m.L = d.pre.mla.L;
      m.Dv = mla_Dv;
      mla_weight("StepPlan.set_layer", mla_w, &m);  // kept alive by the caller (plan_args)
      m.scale = scale;
    }
    d.post.dtype = dt;
    d.post.H = H;
    d.post.attn.dtype = dt;
    d.post.attn.Hq = Hq;
    d.post.attn.Hkv = Hkv;
    d.post.attn.D = D;
    d.post.attn.scale = scale;
    d.post.attn.sinks = reinterpret_cast<const float*>(sinks);  // kept alive by the caller (plan_args)
    d.post.o = bo.packed();
    d.post.o_params = bo.params();
    d.post.ln2_w = reinterpret_cast<const void*>(ln2_w);
    d.post.ln2_eps = ln2_eps;
    auto gated_mlp = [](const nb::tuple& t) {  // (gate_up, down, I)
      const auto& bg = nb::cast<const BoundForward&>(t[0]);
      const auto& bd = nb::cast<const BoundForward&>(t[1]);
      hina::GatedMlpArgs m{};
      m.I = nb::cast<int64_t>(t[2]);
      m.gate_up = bg.packed();
      m.gate_up_params = bg.params();
      m.down = bd.packed();
      m.down_params = bd.params();
      return m;
    };
    if (dense && mlp.size() == 3) {
      d.post.mlp = gated_mlp(mlp);
      owners.push_back(mlp);
    } else if (!dense) {
      const auto& br = nb::cast<const BoundForward&>(router);
      d.post.router = br.packed();
      d.post.router_params = br.params();
      if (router_dtype >= 0 && router_dtype != dtype) {
        if (router_dtype > 2) bad("StepPlan.set_layer: router_dtype must be -1 or a dtype code (0, 1, 2)");
        d.post.router_cast = true;
        d.post.router_dtype = static_cast<hina::DType>(router_dtype);
      }
      if (E < 1) bad("StepPlan.set_layer: a router needs E >= 1 logits");
      d.post.select.E = E;
      d.post.select.k = sel_k;
      d.post.select.form = static_cast<hina::RouterForm>(sel_form);
      d.post.select.renorm = sel_renorm;
      d.post.select.w_dtype = static_cast<hina::DType>(sel_w_dtype);
      if (sel_k > 0) check_select("StepPlan.set_layer", sel_form, E, sel_k, sel_groups, sel_topk_group, sel_bias);
      d.post.select.sel_bias = reinterpret_cast<const float*>(sel_bias);  // kept alive by the caller (plan_args)
      d.post.select.norm_min = norm_min;
      d.post.select.groups = sel_groups;
      d.post.select.topk_group = sel_topk_group;
      d.post.select.scale = sel_scale;
      d.post.select.eps = sel_eps;
      if (!experts.is_none()) {
        const auto& be = nb::cast<const BoundForward&>(experts);
        d.post.experts = be.packed();
        d.post.experts_params = be.params();
        d.post.experts_threads = experts_threads;
        owners.push_back(std::move(experts));
      }
      owners.push_back(std::move(router));
      if (shared.size() >= 3) {
        d.post.shared_mlp = gated_mlp(shared);
        if (shared.size() == 4) {
          const auto& bs = nb::cast<const BoundForward&>(shared[3]);
          d.post.shared_gate = bs.packed();
          d.post.shared_gate_params = bs.params();
        }
        owners.push_back(shared);
      }
    }
    d.num_threads = num_threads;
    d.attn_isa = hina::resolve_isa(isa.c_str());
    layers_[static_cast<size_t>(i)] = d;
    owners_[static_cast<size_t>(i)] = std::move(owners);
  }
  // The causal LM's lm_head after the final norm (a BoundForward of an up-only block taking the
  // layers' hidden size, run on num_threads), or None for none.
  void set_head(nb::object head, int num_threads) {
    if (head.is_none()) {
      head_owner_ = nb::object();
      return;
    }
    const auto& bh = nb::cast<const BoundForward&>(head);
    if (!bh.packed()->up_only()) bad("StepPlan.set_head: the head is a linear block (pack_linear), not experts");
    if (num_threads < 0) bad("StepPlan.set_head: num_threads must be >= 0");
    head_params_ = bh.params();
    head_params_.num_threads = num_threads;
    head_ = bh.packed();
    head_owner_ = std::move(head);
  }
  size_t scratch_bytes(int64_t B) const { return hina::decode_layers_scratch(layers_.data(), size(), B); }
  nb::list run(int64_t B, uintptr_t x, uintptr_t cos, uintptr_t sin, int64_t cos_bstride, uintptr_t mask,
               int64_t mask_bstride, uintptr_t kv, uintptr_t scratch, uintptr_t out, uintptr_t norm_w, float norm_eps,
               uintptr_t normed, uintptr_t q_scale, uintptr_t logits) const {
    if (partial_) bad("StepPlan.run: a partial plan runs its layer's two calls apart (layer_pre, layer_post)");
    for (const auto& o : owners_)
      if (o.empty()) bad("StepPlan.run: a layer was never set");
    if (logits != 0) {
      if (!head_owner_.is_valid() || norm_w == 0 || normed == 0)
        bad("StepPlan.run: logits need a head (set_head) and the final norm");
      const hina::LayerPreArgs& last = layers_.back().pre;
      if (head_->H() != last.H || head_->dtype() != last.dtype)
        bad("StepPlan.run: the head takes " + std::to_string(head_->H()) + " inputs of its own dtype; the layers "
            "give " + std::to_string(last.H) + " of theirs");
    }
    std::vector<const char*> names(layers_.size(), nullptr);
    {
      nb::gil_scoped_release release;
      hina::decode_layers(layers_.data(), reinterpret_cast<const hina::DecodeKV*>(kv), size(), B,
                          reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(cos),
                          reinterpret_cast<const void*>(sin), cos_bstride, reinterpret_cast<const uint8_t*>(mask),
                          mask_bstride, reinterpret_cast<void*>(scratch),
                          reinterpret_cast<void*>(out), names.data(), reinterpret_cast<const void*>(norm_w),
                          norm_eps, reinterpret_cast<void*>(normed), reinterpret_cast<const void*>(q_scale),
                          logits != 0 ? head_ : nullptr, &head_params_, reinterpret_cast<void*>(logits));
    }
    nb::list l;
    for (const char* n : names) l.append(n == nullptr ? nb::none() : nb::object(nb::str(n)));
    return l;
  }
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // A partial plan's layer, its two calls apart (hina::decode_layer_pre / _post). kv: 9 int64
  // as run()'s per layer (the post call's may be another cache than the pre call's: the one the
  // cache's own update returned). scratch: its address and size, checked against
  // scratch_bytes(B) at every call, since the layer's parts decide the size.
  const hina::DecodeLayer& partial_layer(const char* fn, int64_t B, uintptr_t scratch, int64_t scratch_size) const {
    if (!partial_) bad(std::string("StepPlan.") + fn + ": only a partial plan (partial=True) runs a layer's calls apart");
    if (owners_[0].empty()) bad(std::string("StepPlan.") + fn + ": the layer was never set");
    if (B < 0) bad(std::string("StepPlan.") + fn + ": B must be >= 0");
    const size_t need = hina::decode_layer_scratch(layers_[0], B);
    if (scratch == 0 || scratch_size < 0 || static_cast<size_t>(scratch_size) < need)
      bad(std::string("StepPlan.") + fn + ": scratch of " + std::to_string(scratch_size) + " bytes, the layer needs " +
          std::to_string(need) + " for " + std::to_string(B) + " rows (scratch_bytes(B))");
    return layers_[0];
  }
  static hina::DecodeKV kv_of(const char* fn, const std::array<int64_t, 9>& kv) {
    hina::DecodeKV c{kv[0], kv[1], kv[2], kv[3], kv[4], kv[5], kv[6], kv[7], kv[8]};
    if (c.k == 0 || c.v == 0 || c.S < 0 || c.pos < 0)
      bad(std::string("StepPlan.") + fn + ": kv must be (k, v, bstride, hstride, sstride, S, pos, v_bstride, "
          "v_sstride) with non-null buffers");
    return c;
  }
  void layer_pre(int64_t B, uintptr_t x, uintptr_t cos, uintptr_t sin, int64_t cos_bstride,
                 const std::array<int64_t, 9>& kv, uintptr_t scratch, int64_t scratch_size, uintptr_t q_scale) const {
    const hina::DecodeLayer& d = partial_layer("layer_pre", B, scratch, scratch_size);
    const hina::DecodeKV c = kv_of("layer_pre", kv);
    nb::gil_scoped_release release;
    hina::decode_layer_pre(d, c, B, reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(cos),
                           reinterpret_cast<const void*>(sin), cos_bstride, reinterpret_cast<const void*>(q_scale),
                           reinterpret_cast<void*>(scratch));
  }
  nb::object layer_post(int64_t B, uintptr_t x, const std::array<int64_t, 9>& kv, uintptr_t mask,
                        int64_t mask_bstride, uintptr_t scratch, int64_t scratch_size, uintptr_t sum,
                        uintptr_t heads) const {
    const hina::DecodeLayer& d = partial_layer("layer_post", B, scratch, scratch_size);
    // (heads given: the attention ran outside and kv is not read)
    const hina::DecodeKV c = heads != 0 ? hina::DecodeKV{} : kv_of("layer_post", kv);
    const char* name;
    {
      nb::gil_scoped_release release;
      name = hina::decode_layer_post(d, c, B, reinterpret_cast<const void*>(x),
                                     reinterpret_cast<const uint8_t*>(mask), mask_bstride,
                                     reinterpret_cast<void*>(scratch), reinterpret_cast<void*>(sum),
                                     reinterpret_cast<void*>(heads));
    }
    if (name == nullptr) return nb::none();
    return nb::str(name);
  }
  nb::dict layer_regions(int64_t B) const {
    const hina::DecodeRegions r = hina::decode_layer_regions(layers_[0], B);
    nb::dict out;
    out["q"] = r.q;
    out["normed"] = r.normed;
    out["logits"] = r.logits;
    out["w"] = r.w;
    out["idx"] = r.idx;
    out["total"] = r.total;
    return out;
  }

 private:
  std::vector<hina::DecodeLayer> layers_;
  // per layer: its qkv, o, router, experts and shared-expert BoundForwards
  std::vector<std::vector<nb::object>> owners_;
  bool partial_ = false;  // one layer run in two calls apart (layer_pre, layer_post)
  nb::object head_owner_;  // the head's BoundForward (set_head), or invalid
  const hina::PackedExperts* head_ = nullptr;
  hina::MoeParams head_params_{};
};

void bind_model(nb::module_& m) {
  m.def("rms_norm",
        [](nb::handle x_obj, nb::handle w_obj, float eps, nb::handle out_obj) {
          const InArray x = array_arg<InArray>("x", x_obj);
          const InArray w = array_arg<InArray>("weight", w_obj);
          OutArray out = array_arg<OutArray>("out", out_obj);
          if (x.ndim() != 2) bad("x must have shape [rows, n], got " + shape_str(shape_of(x)));
          const int64_t rows = x.shape(0), n = x.shape(1);
          if (n < 1) bad("x must have n >= 1 values per row");
          check_array("x", x, {rows, n});
          check_array("weight", w, {n});
          check_array("out", out, {rows, n});
          const std::optional<hina::DType> dto = to_dtype(x.dtype());
          if (!dto) bad("x has dtype " + dtype_str(x.dtype()) + ", expected float32, bfloat16 or float16");
          const hina::DType dt = *dto;
          check_dtype("weight", w, x.dtype(), " (x's dtype)");
          check_dtype("out", out, x.dtype(), " (x's dtype)");
          if (!(eps >= 0.f)) bad("eps must be >= 0");
          const char* xb = static_cast<const char*>(x.data());
          const char* ob = static_cast<const char*>(out.data());
          const size_t bytes = static_cast<size_t>(rows * n) * hina::dtype_size(dt);
          if (rows > 0 && ob < xb + bytes && xb < ob + bytes) bad("out must not overlap x");
          hina::rms_norm(dt, x.data(), rows, n, w.data(), eps, out.data());
        },
        nb::arg("x").noconvert(), nb::arg("weight").noconvert(), nb::arg("eps"), nb::arg("out").noconvert(),
        "RMSNorm of the rows of x [rows, n] into out, with weight [n], all of one dtype (float32, "
        "bfloat16, float16): out = weight * round(x / sqrt(mean(x^2) + eps)), fp32 math, in the "
        "order of roundings of transformers' Llama-family RMSNorm (see csrc/moe/norm.cpp).");
  m.def("rope_rotate_half",
        [](nb::handle x_obj, nb::handle cos_obj, nb::handle sin_obj, nb::handle out_obj) {
          const InArray x = array_arg<InArray>("x", x_obj);
          const InArray c = array_arg<InArray>("cos", cos_obj);
          const InArray sn = array_arg<InArray>("sin", sin_obj);
          OutArray out = array_arg<OutArray>("out", out_obj);
          if (x.ndim() != 3) bad("x must have shape [B, heads, D], got " + shape_str(shape_of(x)));
          const int64_t B = x.shape(0), H = x.shape(1), D = x.shape(2);
          if (D % 2) bad("x's last dimension D must be even, got " + std::to_string(D));
          check_array("x", x, {B, H, D});
          check_array("cos", c, {B, D});
          check_array("sin", sn, {B, D});
          check_array("out", out, {B, H, D});
          const std::optional<hina::DType> dt = to_dtype(x.dtype());
          if (!dt) bad("x has dtype " + dtype_str(x.dtype()) + ", expected float32, bfloat16 or float16");
          check_dtype("cos", c, x.dtype(), " (x's dtype)");
          check_dtype("sin", sn, x.dtype(), " (x's dtype)");
          check_dtype("out", out, x.dtype(), " (x's dtype)");
          const char* xb = static_cast<const char*>(x.data());
          const char* ob = static_cast<const char*>(out.data());
          const size_t bytes = static_cast<size_t>(B * H * D) * hina::dtype_size(*dt);
          if (bytes > 0 && ob < xb + bytes && xb < ob + bytes) bad("out must not overlap x");
          hina::rope_rotate_half(*dt, x.data(), B, H, D, c.data(), sn.data(), out.data());
        },
        nb::arg("x").noconvert(), nb::arg("cos").noconvert(), nb::arg("sin").noconvert(), nb::arg("out").noconvert(),
        "Rotary embedding of x [B, heads, D] at one position per batch row (cos, sin [B, D]) into out, in "
        "transformers' rotate_half form: out = round(round(x * cos) + round(rotate_half(x) * sin)), each step "
        "rounded to the dtype as PyTorch's elementwise ops round it.");
  m.def("attention_decode",
        [](nb::handle q_obj, nb::handle k_obj, nb::handle v_obj, float scale, nb::handle out_obj, int num_threads,
           const std::string& isa, nb::handle mask_obj) {
          const InArray q = array_arg<InArray>("q", q_obj);
          const InArray k = array_arg<InArray>("k", k_obj);
          const InArray v = array_arg<InArray>("v", v_obj);
          OutArray out = array_arg<OutArray>("out", out_obj);
          if (q.ndim() != 3) bad("q must have shape [B, Hq, D], got " + shape_str(shape_of(q)));
          if (k.ndim() != 4) bad("k must have shape [B, Hkv, S, D], got " + shape_str(shape_of(k)));
          const int64_t B = q.shape(0), Hq = q.shape(1), D = q.shape(2);
          const int64_t Hkv = k.shape(1), S = k.shape(2);
          check_array("q", q, {B, Hq, D});
          check_array("out", out, {B, Hq, D});
          const std::vector<int64_t> kv_shape{B, Hkv, S, D};
          for (auto* a : {&k, &v}) {
            const char* name = a == &k ? "k" : "v";
            if (shape_of(*a) != kv_shape)
              bad(std::string(name) + " has shape " + shape_str(shape_of(*a)) + ", expected " + shape_str(kv_shape));
            if (a->device_type() != nb::device::cpu::value) bad(std::string(name) + " must be a CPU array");
            if (D > 1 && a->stride(3) != 1) bad(std::string(name) + "'s last dimension must be contiguous");
            for (int i = 0; i < 3; ++i)
              if (a->stride(i) < 0) bad(std::string(name) + " must not have negative strides");
          }
          if (Hkv < 1 || Hq % Hkv) bad("q's heads (" + std::to_string(Hq) + ") must be a multiple of k's (" +
                                       std::to_string(Hkv) + ")");
          if (S < 1) bad("k and v must hold at least one position");
          const std::optional<hina::DType> dt = to_dtype(q.dtype());
          if (!dt) bad("q has dtype " + dtype_str(q.dtype()) + ", expected float32, bfloat16 or float16");
          check_dtype("k", k, q.dtype(), " (q's dtype)");
          check_dtype("v", v, q.dtype(), " (q's dtype)");
          check_dtype("out", out, q.dtype(), " (q's dtype)");
          if (num_threads < 0) bad("num_threads must be >= 0");
          const hina::Isa tier = hina::resolve_isa(isa.c_str());
          hina::AttnDecodeArgs a{*dt, q.data(), k.data(), v.data(), out.data(), B, Hq, Hkv, S, D,
                                 {k.stride(0), k.stride(1), k.stride(2)}, {v.stride(0), v.stride(1), v.stride(2)},
                                 scale};
          std::optional<InArray> mask;
          if (!mask_obj.is_none()) {
            mask = array_arg<InArray>("mask", mask_obj);
            if (mask->ndim() != 2 || (mask->shape(0) != 1 && mask->shape(0) != B) || mask->shape(1) != S)
              bad("mask must have shape [B or 1, S] = [" + std::to_string(B) + ", " + std::to_string(S) + "], got " +
                  shape_str(shape_of(*mask)));
            if (mask->dtype() != nb::dtype<bool>()) bad("mask has dtype " + dtype_str(mask->dtype()) + ", expected bool");
            check_array("mask", *mask, {mask->shape(0), S});
            a.mask = static_cast<const uint8_t*>(mask->data());
            a.mask_bstride = mask->shape(0) == 1 ? 0 : S;
          }
          nb::gil_scoped_release release;
          hina::attention_decode(a, num_threads, tier);
        },
        nb::arg("q").noconvert(), nb::arg("k").noconvert(), nb::arg("v").noconvert(), nb::arg("scale"),
        nb::arg("out").noconvert(), nb::arg("num_threads") = 0, nb::arg("isa") = "auto",
        nb::arg("mask").noconvert().none() = nb::none(),
        "Attention of one query per (batch, head), q [B, Hq, D], over S keys and values k, v [B, Hkv, S, D] "
        "(any strides but a contiguous last dimension; query head h reads kv head h // (Hq // Hkv)), into out "
        "[B, Hq, D]: softmax(q . k * scale) . v in float32, rounded once to the dtype. mask: optional bool "
        "[B or 1, S], True for the keys attended to (the others are not read).");
  m.def("set_mla_bf16_dots", &hina::set_mla_bf16_dots, nb::arg("on"),
        "Whether mla_decode reads bfloat16 latent caches with AVX512-BF16 dot products where the CPU has them "
        "(the latent query and the probabilities rounded to bfloat16; on by default; off: float32 FMAs). "
        "Process-wide; for A/B measurements and tests.");
  m.def("mla_bf16_dots", &hina::mla_bf16_dots, "set_mla_bf16_dots's setting.");
  m.def("mla_quant_fits",
        [](const std::string& weights, int64_t group, int64_t L, int64_t Dn, int64_t Dv) {
          return hina::mla_quant_fits(parse_wformat(weights), group, L, Dn, Dv);
        },
        nb::arg("weights"), nb::arg("group"), nb::arg("L"), nb::arg("Dn"), nb::arg("Dv"),
        "Whether mla_decode reads a kv_b_proj of these sizes quantised as `weights` (int8, or int4 in groups of "
        "`group`) in its blocked form (MlaDecodeArgs::wq): Dn and Dv multiples of 4, int8 with L a multiple of 64, "
        "int4 groups of 32, 64 or 128 dividing L.");
  m.def("attention_prefill_supported",
        [](int64_t D, int64_t Hq, int64_t Hkv, const std::string& isa) {
          hina::AttnPrefillArgs a{};
          a.D = D, a.Hq = Hq, a.Hkv = Hkv;
          return hina::attention_prefill_supported(a, hina::resolve_isa(isa.c_str()));
        },
        "Whether attention_prefill_raw has a kernel for head size D and Hq/Hkv heads at tier isa on this CPU.");
  // routing replay (hina::set_route_replay), for hi_na_moe.fastpath.replay: benchmarks and tests only
  m.def("set_route_replay",
        [](uintptr_t ids, int64_t layers, int64_t rows, int64_t k, uintptr_t chosen) {
          if (ids != 0 && (layers < 1 || rows < 1 || k < 1))
            bad("set_route_replay: layers, rows and k must be >= 1 with ids set");
          hina::set_route_replay(reinterpret_cast<const int32_t*>(ids), layers, rows, k,
                                 reinterpret_cast<int64_t*>(chosen));
        },
        nb::arg("ids"), nb::arg("layers") = 0, nb::arg("rows") = 0, nb::arg("k") = 0, nb::arg("chosen") = 0,
        "Test-only routing replay: every router of layer_decode_post (the native decode step) takes the next "
        "layer of int32 ids [layers, rows, k] at address ids as its choice (graded logits: 0.125 (k - j) at the "
        "j-th id, -1e4 elsewhere); chosen non-zero: int64 [layers, rows, k] receives router_select's choice. "
        "Resets the cursor and the error count; ids 0 turns it off. UNCHECKED addresses, kept alive by the caller.");
  m.def("route_replay_cursor", &hina::route_replay_cursor, "The next layer of the replayed ids a router takes.");
  m.def("set_route_replay_cursor", &hina::set_route_replay_cursor, nb::arg("layer"),
        "Sets the next layer of the replayed ids (after a router that ran outside the native step).");
  m.def("route_replay_errors", &hina::route_replay_errors,
        "Router calls the replay could not serve since set_route_replay (they kept their own logits).");
  nb::class_<StepPlan>(m, "StepPlan",
      "A decode step through L decoder layers in one native call (decode_layers() in moe.h), for "
      "hi_na_moe.stack. set_layer(i, ...) fixes layer i's arguments (addresses of its norm weights, its "
      "BoundForwards: the q/k/v group, o_proj, the router's linear and the experts, and a shared expert's "
      "(gate/up group, down projection, intermediate size[, gate]: none, added as it is), or (); then the address of "
      "the attention's float32 sinks [Hq] or 0, kept alive by the caller, half_table: cos/sin rows of D/2 values, "
      "interleaved_f32: ERNIE's rotation on float32 cos/sin, router_dtype: the router's dtype code when it differs "
      "from the layer's (else -1), sel_bias: the address of a float32 score-correction bias [E] or 0 (kept alive "
      "by the caller) with norm_min (sel_groups, sel_topk_group, sel_scale, sel_eps: the grouped sigmoid form's; rot: partial rotary dims, 0: D), and mlp: () or, for a dense layer (router None), its gated MLP's (gate/up "
      "group, down projection, intermediate size)). run(B, x, cos, sin, "
      "cos_bstride, mask, mask_bstride, kv, scratch, out, norm_w=0, norm_eps=0, normed=0) runs the step (mask: 0, or bool bytes per batch row "
      "at mask + b * mask_bstride over the keys): kv the address of L x 7 int64 (k and v buffer addresses, "
      "batch/head/position element strides, the positions the attention reads, the position written), scratch of scratch_bytes(B) bytes; "
      "norm_w non-zero: also normed = rms_norm(out, norm_w, norm_eps), the stack's final norm; logits non-zero "
      "(with norm_w): also logits [B, out_features] = the head's linear of normed, the head a BoundForward of a "
      "pack_linear block of the layers' hidden size and dtype given to set_head(head, num_threads) (None: none), "
      "the causal LM's lm_head. "
      "UNCHECKED addresses: wrong ones crash. Returns the experts' kernel names per layer. "
      "StepPlan(1, partial=True): one decoder layer whose two calls run apart (layer_pre, layer_post; "
      "not run), for hi_na_moe.fastpath.layers; its layer may leave the MLP block (no router, mlp ()), "
      "the selection (sel_k 0) or the experts (None) to the caller.")
      .def(nb::init<int64_t, bool>(), nb::arg("layers"), nb::arg("partial") = false)
      .def("set_layer", &StepPlan::set_layer, nb::arg("i"), nb::arg("dtype"), nb::arg("H"), nb::arg("ln1_w"),
           nb::arg("ln1_eps"), nb::arg("qkv"), nb::arg("Hq"), nb::arg("Hkv"), nb::arg("D"), nb::arg("qk_norm"),
           nb::arg("qn_w"), nb::arg("kn_w"), nb::arg("qn_eps"), nb::arg("kn_eps"), nb::arg("scale"), nb::arg("isa"),
           nb::arg("o"), nb::arg("ln2_w"), nb::arg("ln2_eps"), nb::arg("router").none() = nb::none(),
           nb::arg("E") = 0, nb::arg("sel_form") = 0, nb::arg("sel_k") = 0, nb::arg("sel_renorm") = false,
           nb::arg("sel_w_dtype") = 0, nb::arg("experts").none() = nb::none(), nb::arg("experts_threads") = 0,
           nb::arg("num_threads") = 0, nb::arg("shared") = nb::tuple(), nb::arg("sinks") = 0,
           nb::arg("half_table") = false, nb::arg("interleaved_f32") = false, nb::arg("router_dtype") = -1,
           nb::arg("sel_bias") = 0, nb::arg("norm_min") = 0.0f, nb::arg("mlp") = nb::tuple(),
           nb::arg("sel_groups") = 1, nb::arg("sel_topk_group") = 1, nb::arg("sel_scale") = 1.0f,
           nb::arg("rot") = 0, nb::arg("sel_eps") = 1e-20f, nb::arg("mla") = nb::tuple(), nb::arg("mla_w") = nb::none(),
           nb::arg("mla_Dv") = 0)
      .def("scratch_bytes", &StepPlan::scratch_bytes, nb::arg("B"))
      .def("run", &StepPlan::run, nb::arg("B"), nb::arg("x"), nb::arg("cos"), nb::arg("sin"),
           nb::arg("cos_bstride"), nb::arg("mask"), nb::arg("mask_bstride"), nb::arg("kv"), nb::arg("scratch"),
           nb::arg("out"), nb::arg("norm_w") = 0, nb::arg("norm_eps") = 0.f, nb::arg("normed") = 0,
           nb::arg("q_scale") = 0, nb::arg("logits") = 0)
      .def("set_head", &StepPlan::set_head, nb::arg("head").none(), nb::arg("num_threads") = 0)
      .def("layer_pre", &StepPlan::layer_pre, nb::arg("B"), nb::arg("x"), nb::arg("cos"), nb::arg("sin"),
           nb::arg("cos_bstride"), nb::arg("kv"), nb::arg("scratch"), nb::arg("scratch_size"), nb::arg("q_scale") = 0,
           "A partial plan's layer, its first call (hina::decode_layer_pre): kv as run()'s 9 values of a layer, "
           "the position pos written; scratch of scratch_bytes(B) bytes (checked).")
      .def("layer_post", &StepPlan::layer_post, nb::arg("B"), nb::arg("x"), nb::arg("kv"), nb::arg("mask"),
           nb::arg("mask_bstride"), nb::arg("scratch"), nb::arg("scratch_size"), nb::arg("sum"), nb::arg("heads") = 0,
           "Its second call (hina::decode_layer_post) on the same scratch: the attention over kv's [0, S) (heads "
           "non-zero: the heads' outputs [B, Hq Dv] already there, kv unread), o_proj, sum = x + o and its norm, "
           "and what of the MLP block the layer was set with. Returns the experts' kernel name, or None.")
      .def("layer_regions", &StepPlan::layer_regions, nb::arg("B"),
           "Where a partial plan's calls leave, in the scratch of B rows, the queries, the normed sum, the "
           "router's logits and its selection's weights and indices: byte offsets (and the total).")
      .def("__len__", &StepPlan::size);
}

}  // namespace hina_bind
