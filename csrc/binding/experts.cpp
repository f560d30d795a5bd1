// The experts' part of the module: packed headers, the kernel table, PackedExperts and BoundForward.
#include "binding/experts.h"

#include <array>

namespace hina_bind {

namespace {
nb::dict kernel_table(const std::string& qdot) {
  const hina::Isa isa = hina::resolve_isa("auto");
  const hina::QDot q = parse_qdot(qdot);
  nb::dict d;
  for (hina::MoePath path : {hina::MoePath::kDecode, hina::MoePath::kPrefill}) {
    nb::dict per;
    for (hina::DType dt : {hina::DType::kF32, hina::DType::kBF16, hina::DType::kF16})
      per[hina::dtype_name(dt)] = std::string(hina::moe_kernel_name(isa, dt, path));
    for (hina::WFormat f : {hina::WFormat::kInt8, hina::WFormat::kInt4})
      per[hina::wformat_name(f)] = std::string(hina::moe_kernel_name(isa, hina::DType::kBF16, path, f, q));
    per[hina::wformat_name(hina::WFormat::kLossless12)] =
        std::string(hina::moe_kernel_name(isa, hina::DType::kBF16, path, hina::WFormat::kLossless12));
    d[hina::path_name(path)] = per;
  }
  return d;
}
hina::RoutingTrim parse_trim(const std::string& mode, int64_t keep, float threshold, int64_t min_k, bool renorm) {
  hina::RoutingTrim t;
  if (mode == "full") t.mode = hina::RoutingTrim::Mode::kFull;
  else if (mode == "fixed") t.mode = hina::RoutingTrim::Mode::kFixed;
  else if (mode == "adaptive") t.mode = hina::RoutingTrim::Mode::kAdaptive;
  else bad("routing trim: mode is 'full', 'fixed' or 'adaptive', not '" + mode + "'");
  t.keep = keep;
  t.threshold = threshold;
  t.min_k = min_k;
  t.renorm = renorm;
  return t;
}

using IdxIn = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using WIn = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using IdxOut = nb::ndarray<int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using WOut = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
}  // namespace

void bind_experts(nb::module_& m) {
  m.def(
      "trim_routing",
      [](IdxIn idx, WIn w, IdxOut idx_out, WOut w_out, int64_t E, const std::string& mode, int64_t keep,
         float threshold, int64_t min_k, bool renorm) {
        const int64_t T = static_cast<int64_t>(idx.shape(0)), K = static_cast<int64_t>(idx.shape(1));
        for (const auto& shape : {std::array<size_t, 2>{w.shape(0), w.shape(1)},
                                  std::array<size_t, 2>{idx_out.shape(0), idx_out.shape(1)},
                                  std::array<size_t, 2>{w_out.shape(0), w_out.shape(1)}})
          if (static_cast<int64_t>(shape[0]) != T || static_cast<int64_t>(shape[1]) != K)
            bad("trim_routing: idx, w, idx_out and w_out must all be [T, K]");
        hina::RoutingTrim t = parse_trim(mode, keep, threshold, min_k, renorm);
        if (t.mode == hina::RoutingTrim::Mode::kFull) t.mode = hina::RoutingTrim::Mode::kFixed, t.keep = K;
        return hina::trim_routing(t, idx.data(), 64, w.data(), hina::DType::kF32, T, K, E, idx_out.data(),
                                  w_out.data());
      },
      nb::arg("idx"), nb::arg("w"), nb::arg("idx_out"), nb::arg("w_out"), nb::arg("E"), nb::arg("mode"),
      nb::arg("keep") = 0, nb::arg("threshold") = 0.0f, nb::arg("min_k") = 1, nb::arg("renorm") = false,
      "The routing trim PackedExperts.set_trim applies (RoutingTrim, hina_moe/experts.h) on int64 idx and "
      "float32 w [T, K], into idx_out / w_out; returns the slots kept. For tests against "
      "hi_na_moe.core.reference.trim_routing.");
  m.def("header_info", [](const nb::bytes& b) { return header_dict(header_from_bytes(b)); }, nb::arg("header"),
        "The fields of a packed header (bytes from PackedExperts.plan / .header) as a dict.");
  m.attr("PACKED_LAYOUT_VERSION") = hina::PackedHeader{}.version;
  m.def("kernel_table", &kernel_table, nb::arg("qdot") = "auto",
        "{'decode': {format: kernel}, 'prefill': {format: kernel}}: what isa='auto' runs; formats "
        "are the lossless dtypes and int8 / int4 (for a bfloat16 model, under `qdot`).");
  nb::class_<PyPackedExperts>(m, "PackedExperts",
      "Experts packed once into the layout the kernels stream (64-byte aligned panels of 16 "
      "output rows, gate and up interleaved), in the model's dtype (lossless: unpack() returns "
      "the exact inputs; weights='lossless12': bf16 in about 75 % of the bytes, exact too) or "
      "quantised (weights='int8' per output row, 'int4' per group of group_size).")
      .def(nb::init<std::optional<InArray>, InArray, InArray, std::optional<InArray>,
                    std::optional<InArray>, std::optional<InArray>, const std::string&, int,
                    const std::string&, int>(),
           nb::arg("gate").noconvert().none(), nb::arg("up").noconvert(), nb::arg("down").noconvert(),
           nb::arg("gate_bias").noconvert().none() = nb::none(),
           nb::arg("up_bias").noconvert().none() = nb::none(),
           nb::arg("down_bias").noconvert().none() = nb::none(), nb::arg("isa") = "auto",
           nb::arg("num_threads") = 0, nb::arg("weights") = "lossless", nb::arg("group_size") = 32,
           "gate/up: [E, I, H] (gate may be None), down: [E, H, I], biases [E, I] / [E, I] / "
           "[E, H]; C-contiguous CPU arrays of one dtype (float32, bfloat16, float16). "
           "isa: auto | generic | avx2 | avx512 | amx. weights: lossless | int8 | int4 | lossless12 "
           "(bfloat16 only; a ValueError ending \"store these weights as 'lossless'\" when a panel "
           "does not compress); group_size (int4): 32, 64 or 128.")
      .def_static("plan",
           [](const std::string& dtype, int64_t E, int64_t H, int64_t I, bool has_gate,
              bool gate_bias, bool up_bias, bool down_bias, const std::string& isa,
              const std::string& weights, int group_size, bool up_only) {
             hina::DType dt = hina::DType::kF32;
             bool known = false;
             for (hina::DType d : {hina::DType::kF32, hina::DType::kBF16, hina::DType::kF16})
               if (dtype == hina::dtype_name(d)) { dt = d; known = true; }
             if (!known) bad("dtype '" + dtype + "' is unknown; expected float32, bfloat16 or float16");
             const hina::PackedHeader h = hina::plan_packed(
                 dt, E, H, I, has_gate, gate_bias, up_bias, down_bias,
                 hina::resolve_isa(isa.c_str()), {parse_wformat(weights), group_size}, up_only);
             return nb::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
           },
           nb::arg("dtype"), nb::arg("E"), nb::arg("H"), nb::arg("I"), nb::arg("has_gate"),
           nb::arg("gate_bias") = false, nb::arg("up_bias") = false, nb::arg("down_bias") = false,
           nb::arg("isa") = "auto", nb::arg("weights") = "lossless", nb::arg("group_size") = 32,
           nb::arg("up_only") = false,
           "The header (bytes) a block of these experts has; block size: header_info(h)['nbytes']. "
           "up_only: a dense linear layer (E=1, no gate, I outputs, H inputs; see pack_linear).")
      .def_static("pack_linear",
           [](InArray weight, std::optional<InArray> bias, const std::string& isa, int num_threads,
              const std::string& weights, int group_size, bool paired) {
             if (weight.ndim() != 2) bad("weight must have shape [out_features, in_features], got " + shape_str(shape_of(weight)));
             const auto dt = to_dtype(weight.dtype());
             if (!dt) bad("weight has dtype " + dtype_str(weight.dtype()) + "; supported: float32, bfloat16, float16");
             const int64_t O = weight.shape(0), In = weight.shape(1);
             check_array("weight", weight, {O, In});
             if (bias) {
               check_array("bias", *bias, {O});
               check_dtype("bias", *bias, weight.dtype());
             }
             if (num_threads < 0) bad("num_threads must be >= 0");
             if (paired && O % 2 != 0)
               bad("paired needs an even number of output features, got " + std::to_string(O));
             const hina::Isa tier = hina::resolve_isa(isa.c_str());
             const hina::QuantSpec q{parse_wformat(weights), group_size};
             std::unique_ptr<hina::PackedExperts> pe;
             {
               nb::gil_scoped_release release;
               pe = hina::PackedExperts::pack_linear(*dt, O, In, weight.data(), bias ? bias->data() : nullptr,
                                                     tier, num_threads, q, paired);
             }
             return PyPackedExperts(std::move(pe), nb::none());
           },
           nb::arg("weight").noconvert(), nb::arg("bias").noconvert().none() = nb::none(),
           nb::arg("isa") = "auto", nb::arg("num_threads") = 0, nb::arg("weights") = "lossless",
           nb::arg("group_size") = 32, nb::arg("paired") = false,
           "A dense linear layer y = x weight^T (+ bias) packed for the same kernels (an up-only "
           "block: E=1, I = out_features, H = in_features); run it with linear(). weight "
           "[out_features, in_features], bias [out_features]: C-contiguous CPU arrays of one dtype. "
           "paired (even out_features): the two halves of the rows as the gate and up matrices of "
           "one gated expert (I = out_features / 2), the same outputs bit for bit, streamed with "
           "two rows per broadcast input. unpack() gives (None, weight, None, None, bias, None).")
      .def_static("create", &PyPackedExperts::create, nb::arg("header"),
           nb::arg("buffer").none() = nb::none(),
           "An empty block for `header`, living in `buffer` (a writable, 64-byte aligned uint8 "
           "array of exactly nbytes, kept alive by the result) or allocated; fill it with "
           "pack_experts().")
      .def_static("view", &PyPackedExperts::view, nb::arg("header"), nb::arg("buffer"),
           "A read-only PackedExperts over a block written earlier (buffer: uint8 array of "
           "nbytes, 64-byte aligned, kept alive by the result). Validates the header; raises "
           "ValueError naming what does not match.")
      .def_static("copy", &PyPackedExperts::copy_of, nb::arg("header"), nb::arg("buffer"),
           "Like view(), validated the same way, but the result owns a copy of the block in memory of its "
           "own (2 MiB-aligned with transparent huge pages requested when it is 4 MiB or more): buffer is "
           "read once and not kept. The kernels stream such a copy at one speed, where a file mapping's depends on "
           "the page cache's state (hi_na_moe.memory). GIL released.")
      .def("pack_experts", &PyPackedExperts::pack_experts, nb::arg("e0"),
           nb::arg("gate").noconvert().none(), nb::arg("up").noconvert(), nb::arg("down").noconvert(),
           nb::arg("gate_bias").noconvert().none() = nb::none(),
           nb::arg("up_bias").noconvert().none() = nb::none(),
           nb::arg("down_bias").noconvert().none() = nb::none(), nb::arg("num_threads") = 0,
           "Packs experts [e0, e0 + n) from arrays of n experts (shapes as in the constructor). "
           "GIL released.")
      .def_prop_ro("header", &PyPackedExperts::header_bytes, "The block's header (bytes).")
      .def_prop_ro("data",
           [](nb::handle self) {
             const PyPackedExperts& p = nb::cast<const PyPackedExperts&>(self);
             if (p.get().tier()) bad("this block's experts live in the memory tier: read its store entry");
             const size_t n = p.get().nbytes();
             return nb::ndarray<nb::numpy, const uint8_t, nb::ndim<1>>(
                 p.get().data(), {n}, self);
           },
           nb::rv_policy::reference_internal,
           "The packed block as a read-only uint8 numpy array (a view; keeps this alive).")
      .def_prop_ro("weights", [](const PyPackedExperts& p) { return std::string(hina::wformat_name(p.get().wformat())); })
      .def_prop_ro("group_size", [](const PyPackedExperts& p) { return static_cast<int>(p.get().header().group); })
      .def("forward", &PyPackedExperts::forward, nb::arg("x").noconvert(),
           nb::arg("topk_idx").noconvert(), nb::arg("topk_w").noconvert(), nb::arg("out").noconvert(),
           nb::arg("act") = "silu", nb::arg("alpha") = 1.702f, nb::arg("gate_limit") = INFINITY,
           nb::arg("up_limit") = INFINITY, nb::arg("post_act_limit") = INFINITY,
           nb::arg("up_offset") = 0.0f, nb::arg("weight_on_input") = false,
           nb::arg("num_threads") = 0, nb::arg("path") = "auto",
           nb::arg("prefill_min_tokens").none() = nb::none(), nb::arg("split") = "dynamic",
           nb::arg("qdot") = "auto",
           "out[T, H] = sum_k topk_w * expert(x) (see moe.h for the exact semantics). "
           "x, out: [T, H] in the experts' dtype; topk_idx: [T, K] int32/int64 (< 0: skip); "
           "topk_w: [T, K] float32, bfloat16 or float16. qdot (int8/int4 weights): 'int' = integer dot products "
           "with activations quantised per token (W8A8 / W4A8), 'expand' = weights expanded "
           "in registers (fp32 activations), 'auto' = the integer dot where the tier has a "
           "kernel for it (not the AMX prefill of bf16 models). Returns the name of the kernel "
           "that ran. GIL released.")
      .def("linear", &PyPackedExperts::linear, nb::arg("x").noconvert(), nb::arg("out").noconvert(),
           nb::arg("num_threads") = 0, nb::arg("path") = "auto",
           nb::arg("prefill_min_tokens").none() = nb::none(), nb::arg("qdot") = "auto",
           "out[T, out_features] = x[T, in_features] weight^T (+ bias), for a block made by "
           "pack_linear; x and out in the layer's dtype. fp32 accumulation, one rounding. "
           "Returns the name of the kernel that ran. GIL released.")
      .def_prop_ro("up_only", [](const PyPackedExperts& p) { return p.get().up_only(); },
                   "Whether this block is a dense linear layer (pack_linear) rather than experts.")
      .def("bind",
           [](nb::handle self, const std::string& act, float alpha, float gate_limit, float up_limit,
              float post_act_limit, float up_offset, bool weight_on_input, const std::string& qdot) {
             const PyPackedExperts& pp = nb::cast<const PyPackedExperts&>(self);
             return BoundForward(nb::borrow(self), &pp.get(),
                                 pp.params(act, alpha, gate_limit, up_limit, post_act_limit, up_offset,
                                           weight_on_input, qdot));
           },
           nb::arg("act") = "silu", nb::arg("alpha") = 1.702f, nb::arg("gate_limit") = INFINITY,
           nb::arg("up_limit") = INFINITY, nb::arg("post_act_limit") = INFINITY,
           nb::arg("up_offset") = 0.0f, nb::arg("weight_on_input") = false, nb::arg("qdot") = "auto",
           "A BoundForward: forward() with these parameters fixed (checked now), for callers that "
           "pass raw addresses (see BoundForward).")
      .def("unpack", &PyPackedExperts::unpack,
           "(gate, up, down, gate_bias, up_bias, down_bias): new arrays (None where absent), "
           "bit-identical to the packed inputs for weights='lossless' and 'lossless12', the dequantised weights "
           "(scale * q, in the model's dtype) for int8/int4. DLPack-capable: torch.from_dlpack.")
      .def("unpack_row_quant", &PyPackedExperts::unpack_row_quant,
           "(codes, scales) of a linear layer's int8 or int4 block, exactly the values its panels hold, in "
           "plain row order (moe.h's RowQuant): int8: codes int8 [out, in], scales float32 [out]; int4: codes "
           "uint8 [out, in / 2], group g of a row at bytes [g * group / 2, (g + 1) * group / 2), byte j holding "
           "q(g group + j) + 8 in its low nibble and q(g group + group/2 + j) + 8 in its high one, scales float32 "
           "[out, in / group]. W = scale * q. DLPack-capable.")
      .def(
          "set_trim",
          [](PyPackedExperts& p, const std::string& mode, int64_t keep, float threshold, int64_t min_k, bool renorm) {
            p.get_mut().set_trim(parse_trim(mode, keep, threshold, min_k, renorm));
          },
          nb::arg("mode"), nb::arg("keep") = 0, nb::arg("threshold") = 0.0f, nb::arg("min_k") = 1,
          nb::arg("renorm") = false,
          "Fewer experts a token than its router chose, on every later forward (RoutingTrim, "
          "hina_moe/experts.h): mode 'full' (none), 'fixed' (the `keep` largest weights) or 'adaptive' "
          "(weight >= threshold x an even share of the token's routing weight, and the min_k largest); renorm: the kept weights "
          "scaled to the sum of the token's weights.")
      .def_prop_ro("trim",
                   [](const PyPackedExperts& p) {
                     const hina::RoutingTrim& t = p.get().trim();
                     static const char* names[] = {"full", "fixed", "adaptive"};
                     return nb::make_tuple(names[static_cast<int>(t.mode)], t.keep, t.threshold, t.min_k, t.renorm);
                   },
                   "(mode, keep, threshold, min_k, renorm) of set_trim.")
      .def("routing_counts",
           [](PyPackedExperts& p, bool reset) {
             auto r = nb::make_tuple(p.get().routed_tokens(), p.get().routed_slots());
             if (reset) p.get_mut().reset_routing_counts();
             return r;
           },
           nb::arg("reset") = false,
           "(tokens, expert slots) forward() ran since the block was made or last reset: slots / tokens "
           "is the experts a token used, after the trim.")
      .def_prop_ro("nbytes", [](const PyPackedExperts& p) { return p.get().nbytes(); })
      .def_prop_ro("isa", [](const PyPackedExperts& p) { return std::string(hina::isa_name(p.get().isa())); })
      .def_prop_ro("dtype", [](const PyPackedExperts& p) { return std::string(hina::dtype_name(p.get().dtype())); })
      .def_prop_ro("E", [](const PyPackedExperts& p) { return p.get().E(); })
      .def_prop_ro("H", [](const PyPackedExperts& p) { return p.get().H(); })
      .def_prop_ro("I", [](const PyPackedExperts& p) { return p.get().I(); })
      .def_prop_ro("paired", [](const PyPackedExperts& p) { return p.get().paired(); },
                   "A dense linear layer packed paired (pack_linear's paired): I is half its outputs.")
      .def_prop_ro("out_features", [](const PyPackedExperts& p) { return p.get().out_features(); },
                   "A dense linear layer's outputs (2 I when paired); I for experts.")
      .def_prop_ro("has_gate", [](const PyPackedExperts& p) { return p.get().has_gate(); })
      .def_prop_ro("has_bias", [](const PyPackedExperts& p) {
        const auto& q = p.get();
        return q.has_gate_bias() || q.has_up_bias() || q.has_down_bias();
      })
      .def_prop_ro("layout", [](const PyPackedExperts& p) { return header_dict(p.get().header()); },
                   "The packed header's fields (as header_info gives them).")
      .def("kernel_name",
           [](const PyPackedExperts& p, const std::string& path, const std::string& qdot) {
             hina::MoePath mp;
             if (path == "decode") mp = hina::MoePath::kDecode;
             else if (path == "prefill") mp = hina::MoePath::kPrefill;
             else bad("path must be 'decode' or 'prefill'");
             return std::string(hina::moe_kernel_name(p.get().isa(), p.get().dtype(), mp, p.get().wformat(),
                                                      parse_qdot(qdot)));
           },
           nb::arg("path"), nb::arg("qdot") = "auto",
           "The kernel forward() runs on this path for these experts (and this qdot).")
      .def("__repr__", [](const PyPackedExperts& p) {
        const auto& q = p.get();
        return "PackedExperts(E=" + std::to_string(q.E()) + ", H=" + std::to_string(q.H()) +
               ", I=" + std::to_string(q.I()) + ", dtype=" + hina::dtype_name(q.dtype()) +
               ", isa=" + hina::isa_name(q.isa()) + ", weights=" + hina::wformat_name(q.wformat()) +
               (q.wformat() == hina::WFormat::kInt4 ? ", group_size=" + std::to_string(q.header().group) : std::string()) +
               ", has_gate=" + (q.has_gate() ? "True" : "False") +
               ", nbytes=" + std::to_string(q.nbytes()) + ")";
      });

  nb::class_<BoundForward>(m, "BoundForward",
      "PackedExperts.forward with its parameters bound (PackedExperts.bind), called as "
      "f(x, T, topk_idx, idx_bits, K, topk_w, w_dtype, out, num_threads) with the data "
      "addresses of C-contiguous x [T, H] and out [T, H] in the experts' dtype, topk_idx [T, K] "
      "int32/int64 (idx_bits 32/64) and topk_w [T, K] float32/bfloat16/float16 (w_dtype 0/1/2). "
      "UNCHECKED: nothing verifies the addresses, "
      "shapes or dtypes; a wrong one reads or writes arbitrary memory. For hi_na_moe.torch_ops, "
      "which checks them first; everything else calls forward(). Expert indices are checked "
      "(< E) as in forward(). Returns the kernel's name. GIL released.")
      .def("__call__", &BoundForward::call, nb::arg("x"), nb::arg("T"), nb::arg("topk_idx"),
           nb::arg("idx_bits"), nb::arg("K"), nb::arg("topk_w"), nb::arg("w_dtype"), nb::arg("out"),
           nb::arg("num_threads"))
      .def("linear", &BoundForward::linear, nb::arg("x"), nb::arg("T"), nb::arg("out"), nb::arg("num_threads"),
           "An up-only block's linear(): addresses of C-contiguous x [T, in_features] and out "
           "[T, out_features] in the layer's dtype. UNCHECKED, as __call__.");

}

}  // namespace hina_bind
