// The experts' Python classes: PackedExperts (pack, forward, store views) and BoundForward (a
// forward with its parameters fixed, called with raw addresses by the decode engine).
#pragma once

#include "binding/common.h"

namespace hina_bind {

class PyPackedExperts {
 public:
  PyPackedExperts(std::optional<InArray> gate, InArray up, InArray down,
                  std::optional<InArray> gate_bias, std::optional<InArray> up_bias,
                  std::optional<InArray> down_bias, const std::string& isa_name, int num_threads,
                  const std::string& weights, int group_size) {
    const hina::ExpertWeights w = expert_weights(gate, up, down, gate_bias, up_bias, down_bias);
    if (num_threads < 0) bad("num_threads must be >= 0");
    const hina::Isa isa = hina::resolve_isa(isa_name.c_str());  // invalid_argument -> ValueError
    const hina::QuantSpec q{parse_wformat(weights), group_size};
    nb::gil_scoped_release release;
    pe_ = hina::PackedExperts::pack(w, isa, num_threads, q);
  }
  PyPackedExperts(std::unique_ptr<hina::PackedExperts> pe, nb::object keep)
      : pe_(std::move(pe)), keep_(std::move(keep)) {}

  // An empty block for `header`, in `buffer` (writable, e.g. a mmapped file) or allocated.
  static PyPackedExperts create(const nb::bytes& header, std::optional<ByteArray> buffer) {
    const hina::PackedHeader h = header_from_bytes(header);
    if (buffer && buffer->shape(0) != h.nbytes)
      bad("buffer has " + std::to_string(buffer->shape(0)) + " bytes; the header needs " + std::to_string(h.nbytes));
    auto pe = hina::PackedExperts::create(h, buffer ? buffer->data() : nullptr);
    return PyPackedExperts(std::move(pe), buffer ? nb::find(*buffer) : nb::none());
  }
  static PyPackedExperts copy_of(const nb::bytes& header, RoByteArray buffer) {
    const hina::PackedHeader h = header_from_bytes(header);
    std::unique_ptr<hina::PackedExperts> pe;
    {
      nb::gil_scoped_release release;
      pe = hina::PackedExperts::copy_of(h, buffer.data(), buffer.shape(0));
    }
    PyPackedExperts r(std::move(pe), nb::none());
    r.readonly_ = true;
    return r;
  }
  static PyPackedExperts view(const nb::bytes& header, RoByteArray buffer) {
    const hina::PackedHeader h = header_from_bytes(header);
    auto pe = hina::PackedExperts::view(h, buffer.data(), buffer.shape(0));
    PyPackedExperts r(std::move(pe), nb::find(buffer));
    r.readonly_ = true;
    return r;
  }

  void set_readonly() { readonly_ = true; }

  void pack_experts(int64_t e0, std::optional<InArray> gate, InArray up, InArray down,
                    std::optional<InArray> gate_bias, std::optional<InArray> up_bias,
                    std::optional<InArray> down_bias, int num_threads) {
    const hina::ExpertWeights w = expert_weights(gate, up, down, gate_bias, up_bias, down_bias);
    if (readonly_) bad("this block was loaded from one written earlier (PackedExperts.view or copy); it cannot be packed into");
    nb::gil_scoped_release release;
    pe_->pack_experts(e0, w, num_threads);  // invalid_argument -> ValueError
  }

  nb::bytes header_bytes() const {
    const hina::PackedHeader& h = pe_->header();
    return nb::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
  }

  bool readonly_ = false;

  std::string forward(nb::handle x_obj, nb::handle idx_obj, nb::handle w_obj, nb::handle out_obj,
                      const std::string& act, float alpha, float gate_limit, float up_limit,
                      float post_act_limit, float up_offset, bool weight_on_input,
                      int num_threads, const std::string& path,
                      std::optional<int> prefill_min_tokens, const std::string& split,
                      const std::string& qdot) const {
    const hina::PackedExperts& pe = *pe_;
    const nb::dlpack::dtype wdt = nb_dtype(pe.dtype());
    const InArray x = array_arg<InArray>("x", x_obj);
    const InArray topk_idx = array_arg<InArray>("topk_idx", idx_obj);
    const InArray topk_w = array_arg<InArray>("topk_w", w_obj);
    OutArray out = array_arg<OutArray>("out", out_obj);
    const int64_t T = input_rows(x, "H", "the experts'");
    if (topk_idx.ndim() != 2) bad("topk_idx must have shape [T, K], got " + shape_str(shape_of(topk_idx)));
    const int64_t K = topk_idx.shape(1);
    check_array("topk_idx", topk_idx, {T, K});
    int idx_bits = 0;
    if (topk_idx.dtype() == nb::dtype<int32_t>()) idx_bits = 32;
    else if (topk_idx.dtype() == nb::dtype<int64_t>()) idx_bits = 64;
    else bad("topk_idx has dtype " + dtype_str(topk_idx.dtype()) + ", expected int32 or int64");
    check_array("topk_w", topk_w, {T, K});
    const auto w_dt = to_dtype(topk_w.dtype());
    if (!w_dt) bad("topk_w has dtype " + dtype_str(topk_w.dtype()) + ", expected float32, bfloat16 or float16");
    check_array("out", out, {T, pe.H()});
    check_dtype("out", out, wdt, " (the experts' dtype)");

    hina::MoeParams p = params(act, alpha, gate_limit, up_limit, post_act_limit, up_offset, weight_on_input, qdot);
    set_run_options(p, num_threads, path, prefill_min_tokens);
    if (split == "static") p.static_split = true;
    else if (split != "dynamic") bad("split '" + split + "' is unknown; expected dynamic or static");
    p.topk_w_dtype = *w_dt;
    const char* name;
    {
      nb::gil_scoped_release release;
      name = pe.forward(x.data(), T, topk_idx.data(), idx_bits, topk_w.data(), K, out.data(), p);
    }
    return name;
  }

  std::string linear(nb::handle x_obj, nb::handle out_obj, int num_threads, const std::string& path,
                     std::optional<int> prefill_min_tokens, const std::string& qdot) const {
    const hina::PackedExperts& pe = *pe_;
    if (!pe.up_only()) bad("linear() runs blocks made by pack_linear; this block is MoE experts (use forward())");
    const nb::dlpack::dtype wdt = nb_dtype(pe.dtype());
    const InArray x = array_arg<InArray>("x", x_obj);
    OutArray out = array_arg<OutArray>("out", out_obj);
    const int64_t T = input_rows(x, "in_features", "the layer's");
    check_array("out", out, {T, pe.out_features()});
    check_dtype("out", out, wdt, " (the layer's dtype)");
    hina::MoeParams p;
    if (!hina::qdot_from_name(qdot.c_str(), &p.qdot)) bad("qdot '" + qdot + "' is unknown; expected auto, int or expand");
    set_run_options(p, num_threads, path, prefill_min_tokens);
    const char* name;
    {
      nb::gil_scoped_release release;
      name = pe.linear(x.data(), T, out.data(), p);
    }
    return name;
  }

  // forward()'s and linear()'s x [T, <cols>] in the block's dtype (whose: the block's kind, for the
  // message); returns T.
  int64_t input_rows(const InArray& x, const char* cols, const char* whose) const {
    if (x.ndim() != 2) bad(std::string("x must have shape [T, ") + cols + "], got " + shape_str(shape_of(x)));
    const int64_t T = x.shape(0);
    check_array("x", x, {T, pe_->H()});
    check_dtype("x", x, nb_dtype(pe_->dtype()), (std::string(" (") + whose + " dtype); convert x first").c_str());
    return T;
  }

  // forward()'s and linear()'s threads and path options, checked, into p.
  static void set_run_options(hina::MoeParams& p, int num_threads, const std::string& path,
                              std::optional<int> prefill_min_tokens) {
    if (num_threads < 0) bad("num_threads must be >= 0");
    p.num_threads = num_threads;
    if (path == "auto") p.path = hina::MoePath::kAuto;
    else if (path == "decode") p.path = hina::MoePath::kDecode;
    else if (path == "prefill") p.path = hina::MoePath::kPrefill;
    else bad("path '" + path + "' is unknown; expected auto, decode or prefill");
    if (prefill_min_tokens) {
      if (*prefill_min_tokens < 1) bad("prefill_min_tokens must be >= 1");
      p.prefill_min_tokens = *prefill_min_tokens;
    }
  }

  // The activation parameters and qdot of forward(), checked (also what bind() fixes).
  hina::MoeParams params(const std::string& act, float alpha, float gate_limit, float up_limit,
                         float post_act_limit, float up_offset, bool weight_on_input,
                         const std::string& qdot) const {
    hina::MoeParams p;
    if (!hina::act_from_name(act.c_str(), &p.act))
      bad("act '" + act + "' is unknown; expected silu, gelu, gelu_tanh, relu, relu2, sigmoid_alpha or identity");
    p.alpha = alpha;
    p.gate_limit = gate_limit;
    p.up_limit = up_limit;
    p.post_act_limit = post_act_limit;
    p.up_offset = up_offset;
    p.weight_on_input = weight_on_input;
    if (!hina::qdot_from_name(qdot.c_str(), &p.qdot)) bad("qdot '" + qdot + "' is unknown; expected auto, int or expand");
    return p;
  }

  nb::tuple unpack() const {
    const hina::PackedExperts& pe = *pe_;
    const hina::DType dt = pe.dtype();
    const size_t E = pe.E(), H = pe.H(), I = pe.I();
    void *g = nullptr, *u = nullptr, *d = nullptr, *bg = nullptr, *bu = nullptr, *bd = nullptr;
    if (pe.up_only()) {  // a linear layer: (None, weight [N, H], None, None, bias [N] or None, None)
      const size_t N = static_cast<size_t>(pe.out_features());
      nb::object ou = new_array(dt, {N, H}, &u);
      nb::object obu = pe.has_up_bias() ? new_array(dt, {N}, &bu) : nb::none();
      {
        nb::gil_scoped_release release;
        if (pe.paired()) {  // rows [0, I) the gate matrix, [I, 2 I) the up one
          const size_t es = hina::dtype_size(dt);
          pe.unpack(u, static_cast<uint8_t*>(u) + I * H * es, nullptr, bu,
                    bu ? static_cast<uint8_t*>(bu) + I * es : nullptr, nullptr);
        } else {
          pe.unpack(nullptr, u, nullptr, nullptr, bu, nullptr);
        }
      }
      return nb::make_tuple(nb::none(), ou, nb::none(), nb::none(), obu, nb::none());
    }
    nb::object og = pe.has_gate() ? new_array(dt, {E, I, H}, &g) : nb::none();
    nb::object ou = new_array(dt, {E, I, H}, &u);
    nb::object od = new_array(dt, {E, H, I}, &d);
    nb::object obg = pe.has_gate_bias() ? new_array(dt, {E, I}, &bg) : nb::none();
    nb::object obu = pe.has_up_bias() ? new_array(dt, {E, I}, &bu) : nb::none();
    nb::object obd = pe.has_down_bias() ? new_array(dt, {E, H}, &bd) : nb::none();
    {
      nb::gil_scoped_release release;
      pe.unpack(g, u, d, bg, bu, bd);
    }
    return nb::make_tuple(og, ou, od, obg, obu, obd);
  }

  // (codes, scales): an up-only int8 / int4 block's weight as RowQuant (moe.h); the block's checks
  // (PackedExperts::unpack_row_quant's) raise before anything is written
  nb::tuple unpack_row_quant() const {
    const hina::PackedExperts& pe = *pe_;
    const bool i4 = pe.wformat() == hina::WFormat::kInt4;
    const size_t I = static_cast<size_t>(pe.out_features()), H = pe.H(),
                 group = std::max<size_t>(pe.header().group, 1);
    void *c = nullptr, *sc = nullptr;
    nb::object codes = i4 ? new_raw_array(nb::dtype<uint8_t>(), 1, {I, H / 2}, &c)
                          : new_raw_array(nb::dtype<int8_t>(), 1, {I, H}, &c);
    nb::object scales = i4 ? new_raw_array(nb::dtype<float>(), 4, {I, H / group}, &sc)
                           : new_raw_array(nb::dtype<float>(), 4, {I}, &sc);
    {
      nb::gil_scoped_release release;
      pe.unpack_row_quant(c, sc);
    }
    return nb::make_tuple(codes, scales);
  }

  const hina::PackedExperts& get() const { return *pe_; }
  hina::PackedExperts& get_mut() { return *pe_; }

 private:
  std::unique_ptr<hina::PackedExperts> pe_;
  nb::object keep_;  // the Python buffer the block lives in (create/view), kept alive
};

// forward() with its parameters fixed, called with raw addresses: see BoundForward's doc string
// in the module definition. DLPack import of the four arrays is ~10 of the ~15 us a T=1
// forward() spends in the binding; a decode step calls this once per MoE layer.
class BoundForward {
 public:
  BoundForward(nb::object owner, const hina::PackedExperts* pe, hina::MoeParams p)
      : owner_(std::move(owner)), pe_(pe), p_(p) {}
  std::string call(uintptr_t x, int64_t T, uintptr_t idx, int idx_bits, int64_t K, uintptr_t w,
                   int w_dtype, uintptr_t out, int num_threads) const {
    // forward() refuses negative T, K, num_threads, other idx_bits and null addresses
    if (w_dtype < 0 || w_dtype > 2) bad("w_dtype must be 0 (float32), 1 (bfloat16) or 2 (float16)");
    hina::MoeParams p = p_;
    p.num_threads = num_threads;
    p.topk_w_dtype = static_cast<hina::DType>(w_dtype);
    const char* name;
    {
      nb::gil_scoped_release release;
      name = pe_->forward(reinterpret_cast<const void*>(x), T, reinterpret_cast<const void*>(idx), idx_bits,
                          reinterpret_cast<const void*>(w), K, reinterpret_cast<void*>(out), p);
    }
    return name;
  }
  // An up-only block's linear(): x [T, H] -> out [T, I], addresses unchecked as above.
  std::string linear(uintptr_t x, int64_t T, uintptr_t out, int num_threads) const {
    hina::MoeParams p = p_;
    p.num_threads = num_threads;
    const char* name;
    {
      nb::gil_scoped_release release;
      name = pe_->linear(reinterpret_cast<const void*>(x), T, reinterpret_cast<void*>(out), p);
    }
    return name;
  }

  const hina::PackedExperts* packed() const { return pe_; }
  const hina::MoeParams& params() const { return p_; }

 private:
  nb::object owner_;  // the PackedExperts object: keeps pe_ alive
  const hina::PackedExperts* pe_;
  hina::MoeParams p_;
};

// Latent attention's settings of layer_decode_pre (LayerPreArgs::mla) from the tuple hi_na_moe.layers
// hands over: (rope form 0 complex / 1 interleaved / 2 rotate_half, Dn, Dr, L, q_lora, q_b (a
// BoundForward, or None without q_lora), qa_w, qa_eps, kv_w, kv_eps); q_b is kept in `owners`.
inline void latent_pre_args(const char* where, const nb::tuple& t, hina::LayerPreArgs::Latent* m,
                            std::vector<nb::object>* owners) {
  if (t.size() != 10 && t.size() != 11)
    bad(std::string(where) + ": mla must be (rope, Dn, Dr, L, q_lora, q_b, qa_w, qa_eps, kv_w, kv_eps[, q_scale])");
  const int rope = nb::cast<int>(t[0]);
  if (rope < 0 || rope > 2) bad(std::string(where) + ": mla's rope form must be 0, 1 or 2");
  m->rope = static_cast<hina::LatentRope>(rope);
  m->Dn = nb::cast<int64_t>(t[1]);
  m->Dr = nb::cast<int64_t>(t[2]);
  m->L = nb::cast<int64_t>(t[3]);
  m->q_lora = nb::cast<int64_t>(t[4]);
  if (m->Dn < 0 || m->Dr <= 0 || m->Dr % 2 != 0 || m->L <= 0 || m->q_lora < 0)
    bad(std::string(where) + ": mla needs Dn >= 0, an even Dr > 0, L > 0 and q_lora >= 0");
  if ((m->q_lora > 0) == t[5].is_none())
    bad(std::string(where) + ": mla's q_b is a BoundForward with q_lora > 0 and None without");
  if (m->q_lora > 0) {
    const auto& bq = nb::cast<const BoundForward&>(t[5]);
    m->q_b = bq.packed();
    m->q_b_params = bq.params();
    owners->push_back(nb::borrow(t[5]));
  }
  m->qa_w = reinterpret_cast<const void*>(nb::cast<uintptr_t>(t[6]));
  m->qa_eps = nb::cast<float>(t[7]);
  m->kv_w = reinterpret_cast<const void*>(nb::cast<uintptr_t>(t[8]));
  m->kv_eps = nb::cast<float>(t[9]);
  if (t.size() == 11) m->q_scale = reinterpret_cast<const void*>(nb::cast<uintptr_t>(t[10]));
}

}  // namespace hina_bind
