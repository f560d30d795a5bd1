// The one file that knows Python. Everything below it is plain C++ with no Python or torch.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "hina_moe/bandwidth.h"
#include "hina_moe/cpu_features.h"
#include "hina_moe/moe.h"
#include "hina_moe/thread_pool.h"

namespace nb = nanobind;

namespace {

nb::dict features_dict() {
  const hina::CpuFeatures& f = hina::cpu_features();
  nb::dict d;
  d["arch"] = std::string(f.arch);
  d["vendor"] = std::string(f.vendor);
  d["brand"] = std::string(f.brand);
  nb::dict cpu;
#define HINA_FLAG(name) cpu[#name] = f.name
  HINA_FLAG(sse42); HINA_FLAG(avx); HINA_FLAG(avx2); HINA_FLAG(fma); HINA_FLAG(f16c);
  HINA_FLAG(avx512f); HINA_FLAG(avx512bw); HINA_FLAG(avx512vl); HINA_FLAG(avx512dq);
  HINA_FLAG(avx512vbmi); HINA_FLAG(avx512vnni); HINA_FLAG(avx512bf16); HINA_FLAG(avx512fp16); HINA_FLAG(avx_vnni);
  HINA_FLAG(amx_tile); HINA_FLAG(amx_bf16); HINA_FLAG(amx_int8); HINA_FLAG(neon); HINA_FLAG(sve);
#undef HINA_FLAG
  d["cpu"] = cpu;
  nb::dict os;
  os["xcr0"] = f.xcr0;
  os["avx"] = f.os_avx;
  os["avx512"] = f.os_avx512;
  os["amx"] = f.os_amx;
  os["amx_permission"] = f.amx_permission;
  d["os"] = os;
  return d;
}

hina::Isa parse_isa(const std::string& name) {
  hina::Isa isa;
  if (!hina::isa_from_name(name.c_str(), &isa)) {
    throw nb::value_error(("unknown ISA tier '" + name +
                           "'; expected one of generic, avx2, avx512, amx, neon").c_str());
  }
  return isa;
}

// ---- fused MoE experts ------------------------------------------------------------------------

// Inputs are taken as untyped, read-only ndarrays with .noconvert() (forward(): as the Python
// objects, converted by array_arg), then checked here, so a wrong dtype / layout / device
// raises a ValueError naming the argument instead of being silently copied or converted.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

constexpr nb::dlpack::dtype kBf16{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
constexpr nb::dlpack::dtype kF16{static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};

std::string dtype_str(nb::dlpack::dtype d) {
  using C = nb::dlpack::dtype_code;
  const std::string bits = std::to_string(d.bits);
  if (d.lanes == 1) {
    switch (static_cast<C>(d.code)) {
      case C::Int: return "int" + bits;
      case C::UInt: return "uint" + bits;
      case C::Float: return "float" + bits;
      case C::Bfloat: return "bfloat" + bits;
      case C::Complex: return "complex" + bits;
      case C::Bool: return "bool";
      default: break;
    }
  }
  return "dtype(code=" + std::to_string(d.code) + ", bits=" + bits + ", lanes=" + std::to_string(d.lanes) + ")";
}

std::optional<hina::DType> to_dtype(nb::dlpack::dtype d) {
  if (d == nb::dtype<float>()) return hina::DType::kF32;
  if (d == kBf16) return hina::DType::kBF16;
  if (d == kF16) return hina::DType::kF16;
  return std::nullopt;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

template <typename A>
std::vector<int64_t> shape_of(const A& a) {
  std::vector<int64_t> s(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<int64_t>(a.shape(i));
  return s;
}

[[noreturn]] void bad(const std::string& msg) { throw nb::value_error(msg.c_str()); }

// CPU, C-contiguous, expected shape (-1: any).
template <typename A>
void check_array(const char* name, const A& a, const std::vector<int64_t>& shape) {
  if (a.device_type() != nb::device::cpu::value)
    bad(std::string(name) + " must be a CPU array (got device type " + std::to_string(a.device_type()) + ")");
  const std::vector<int64_t> s = shape_of(a);
  bool ok = s.size() == shape.size();
  for (size_t i = 0; ok && i < s.size(); ++i) ok = shape[i] < 0 || s[i] == shape[i];
  if (!ok) {
    std::string want = "[";
    for (size_t i = 0; i < shape.size(); ++i)
      want += (i ? ", " : "") + (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
    bad(std::string(name) + " has shape " + shape_str(s) + ", expected " + want + "]");
  }
  int64_t numel = 1;
  for (int64_t d : s) numel *= d;
  if (numel == 0) return;  // an empty array has no layout to check (torch gives it any strides)
  int64_t expect = 1;
  for (size_t i = s.size(); i-- > 0;) {
    if (s[i] != 1 && a.stride(i) != expect)
      bad(std::string(name) + " must be C-contiguous (call .contiguous()); no silent copies are made");
    expect *= s[i];
  }
}

template <typename A>
void check_dtype(const char* name, const A& a, nb::dlpack::dtype want, const char* hint = "") {
  if (a.dtype() != want)
    bad(std::string(name) + " has dtype " + dtype_str(a.dtype()) + ", expected " + dtype_str(want) + hint);
}

std::string describe(nb::handle h) {
  std::string d = nb::type_name(h.type()).c_str();
  nb::object dev = nb::getattr(h, "device", nb::none());
  if (!dev.is_none()) d += " on device " + std::string(nb::str(dev).c_str());
  return d;
}

// One array argument of forward(), taken as the Python object so that what cannot be read
// as-is is an error naming the argument (never a silent copy or a wrong value):
// - torch's DLPack export ignores a tensor's lazy negation bit (torch._neg_view; what some
//   conj/neg views produce): its memory holds -x. Such tensors are refused (.resolve_neg()).
// - an object that is not a CPU array (a meta or GPU tensor, a list, a read-only `out`) is a
//   TypeError naming the argument, instead of nanobind's list of overloads.
template <typename Arr>
Arr array_arg(const char* name, nb::handle h) {
  nb::object is_neg = nb::getattr(h, "is_neg", nb::none());
  if (!is_neg.is_none() && PyCallable_Check(is_neg.ptr()) && nb::cast<bool>(is_neg()))
    bad(std::string(name) + " is a torch tensor with its negative bit set (a lazy negation view; its memory "
        "holds the negated values); call .resolve_neg() first");
  Arr a;
  if (!nb::try_cast(h, a, false)) {
    throw nb::type_error((std::string(name) + " must be a " +
                          (std::is_same_v<Arr, OutArray> ? "writable " : "") +
                          "CPU array (torch tensor, numpy array, or any DLPack / buffer-protocol array), got " +
                          describe(h)).c_str());
  }
  return a;
}

nb::dlpack::dtype nb_dtype(hina::DType dt) {
  switch (dt) {
    case hina::DType::kF32: return nb::dtype<float>();
    case hina::DType::kBF16: return kBf16;
    case hina::DType::kF16: return kF16;
  }
  return nb::dtype<float>();
}

// A fresh array that owns its memory (freed with the Python object); supports DLPack and the
// buffer protocol, so torch.from_dlpack / numpy accept it.
// A new array of elements of `elem_bytes` bytes described by `dt` (for DLPack), owning its memory.
nb::object new_raw_array(nb::dlpack::dtype dt, size_t elem_bytes, std::vector<size_t> shape, void** data) {
  size_t n = 1;
  for (size_t d : shape) n *= d;
  void* p = std::malloc(n * elem_bytes + 1);
  if (!p) throw std::bad_alloc();
  nb::capsule owner(p, [](void* q) noexcept { std::free(q); });
  *data = p;
  OutArray a(p, shape.size(), shape.data(), owner, nullptr, dt);
  return nb::cast(a, nb::rv_policy::reference);
}

nb::object new_array(hina::DType dt, std::vector<size_t> shape, void** data) {
  return new_raw_array(nb_dtype(dt), hina::dtype_size(dt), std::move(shape), data);
}

hina::WFormat parse_wformat(const std::string& name) {
  hina::WFormat f;
  if (!hina::wformat_from_name(name.c_str(), &f))
    bad("weights '" + name + "' is unknown; expected lossless, int8, int4 or lossless12");
  return f;
}

// Checks a set of expert arrays (E experts, or any E when E < 0) and fills `w`.
hina::ExpertWeights expert_weights(const std::optional<InArray>& gate, const InArray& up,
                                   const InArray& down, const std::optional<InArray>& gate_bias,
                                   const std::optional<InArray>& up_bias,
                                   const std::optional<InArray>& down_bias) {
  if (up.ndim() != 3) bad("up must have shape [E, I, H], got " + shape_str(shape_of(up)));
  const auto dt = to_dtype(up.dtype());
  if (!dt) bad("up has dtype " + dtype_str(up.dtype()) + "; supported: float32, bfloat16, float16");
  const int64_t E = up.shape(0), I = up.shape(1), H = up.shape(2);
  const nb::dlpack::dtype want = up.dtype();
  check_array("up", up, {E, I, H});
  if (gate) {
    check_array("gate", *gate, {E, I, H});
    check_dtype("gate", *gate, want);
  }
  check_array("down", down, {E, H, I});
  check_dtype("down", down, want);
  if (gate_bias) {
    if (!gate) bad("gate_bias given but gate is None");
    check_array("gate_bias", *gate_bias, {E, I});
    check_dtype("gate_bias", *gate_bias, want);
  }
  if (up_bias) { check_array("up_bias", *up_bias, {E, I}); check_dtype("up_bias", *up_bias, want); }
  if (down_bias) { check_array("down_bias", *down_bias, {E, H}); check_dtype("down_bias", *down_bias, want); }
  hina::ExpertWeights w;
  w.dtype = *dt;
  w.E = E;
  w.H = H;
  w.I = I;
  w.gate = gate ? gate->data() : nullptr;
  w.up = up.data();
  w.down = down.data();
  w.gate_bias = gate_bias ? gate_bias->data() : nullptr;
  w.up_bias = up_bias ? up_bias->data() : nullptr;
  w.down_bias = down_bias ? down_bias->data() : nullptr;
  return w;
}

using ByteArray = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using RoByteArray = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

hina::PackedHeader header_from_bytes(const nb::bytes& b) {
  hina::PackedHeader h;
  if (b.size() != sizeof(h))
    bad("packed header must be " + std::to_string(sizeof(h)) + " bytes, got " + std::to_string(b.size()));
  std::memcpy(&h, b.c_str(), sizeof(h));
  return h;
}

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
    if (x.ndim() != 2) bad("x must have shape [T, H], got " + shape_str(shape_of(x)));
    const int64_t T = x.shape(0);
    check_array("x", x, {T, pe.H()});
    check_dtype("x", x, wdt, " (the experts' dtype); convert x first");
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
    if (x.ndim() != 2) bad("x must have shape [T, in_features], got " + shape_str(shape_of(x)));
    const int64_t T = x.shape(0);
    check_array("x", x, {T, pe.H()});
    check_dtype("x", x, wdt, " (the layer's dtype); convert x first");
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

// Every field of a packed header, names as in moe.h (enums by name).
nb::dict header_dict(const hina::PackedHeader& h) {
  nb::dict d;
  d["magic"] = h.magic;
  d["version"] = h.version;
  d["dtype"] = h.dtype <= 2 ? std::string(hina::dtype_name(static_cast<hina::DType>(h.dtype))) : std::string("unknown");
  d["isa"] = h.isa <= 4 ? std::string(hina::isa_name(static_cast<hina::Isa>(h.isa))) : std::string("unknown");
  d["weights"] = h.wfmt <= 3 ? std::string(hina::wformat_name(static_cast<hina::WFormat>(h.wfmt))) : std::string("unknown");
  d["group_size"] = h.group;
  d["has_gate"] = h.has_gate != 0;
  d["up_only"] = h.up_only != 0;
  d["gate_bias"] = h.has_gate_bias != 0;
  d["up_bias"] = h.has_up_bias != 0;
  d["down_bias"] = h.has_down_bias != 0;
  d["E"] = h.E;
  d["H"] = h.H;
  d["I"] = h.I;
  d["panel_n"] = h.panel_n;
  d["kpack"] = h.kpack;
  d["k_align"] = h.k_align;
  d["Hk"] = h.Hk;
  d["In"] = h.In;
  d["Ik"] = h.Ik;
  d["Hn"] = h.Hn;
  d["nbytes"] = h.nbytes;
  return d;
}

hina::QDot parse_qdot(const std::string& name) {
  hina::QDot q;
  if (!hina::qdot_from_name(name.c_str(), &q)) bad("qdot '" + name + "' is unknown; expected auto, int or expand");
  return q;
}

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

}  // namespace

// The grouped sigmoid form's settings (RouterForm::kSigmoidGroupTopk), checked where Python hands
// them over: a wrong group count would read past a row.
static void check_select(const char* where, int form, int64_t E, int64_t k, int64_t groups, int64_t topk_group,
                         uintptr_t sel_bias) {
  if (form < 0 || form > 4)
    bad(std::string(where) + ": form must be 0 (softmax-topk), 1 (topk-softmax), 2 (sigmoid-group-topk), 3 "
        "(softmax-group-topk) or 4 (softmax-group-topk in the logits' dtype)");
  if (form < 2) return;
  if (groups < 1 || E % groups != 0 || E / groups < 2 || topk_group < 1 || topk_group > groups ||
      k > topk_group * (E / groups) || (form == 2 && sel_bias == 0))
    bad(std::string(where) + ": form " + std::to_string(form) + " needs groups dividing E into groups of at least "
        "2, 1 <= topk_group <= groups, k <= topk_group * E / groups (and form 2 a sel_bias) (got E " +
        std::to_string(E) + ", k " +
        std::to_string(k) + ", groups " + std::to_string(groups) + ", topk_group " + std::to_string(topk_group) +
        ")");
}

static hina::PoolBackend pool_backend_from(const std::string& name) {
  if (name == "auto") return hina::PoolBackend::kAuto;
  if (name == "own") return hina::PoolBackend::kOwn;
  if (name == "openmp") return hina::PoolBackend::kOpenMP;
  if (name == "mixed") return hina::PoolBackend::kMixed;
  throw nb::value_error(
      ("unknown thread-pool backend '" + name + "'; expected 'auto', 'own', 'openmp' or 'mixed'").c_str());
}

// Latent attention's kv_b_proj weight (MlaDecodeArgs::w or wq, m->L set) from hi_na_moe.mla's
// handle: the dense weight's address, or (format 1 int8 / 2 int4, codes, scales, group) of its
// RowQuant form. Addresses are not checked further: the caller keeps them alive.
static void mla_weight(const char* where, nb::handle h, hina::MlaDecodeArgs* m) {
  if (h.is_none()) bad(std::string(where) + ": latent attention needs kv_b_proj's weight");
  if (!nb::isinstance<nb::tuple>(h)) {
    m->w = reinterpret_cast<const void*>(nb::cast<uintptr_t>(h));
    m->wq = {};
    if (m->w == nullptr) bad(std::string(where) + ": latent attention needs kv_b_proj's weight");
    return;
  }
  const auto t = nb::borrow<nb::tuple>(h);
  if (t.size() != 4) bad(std::string(where) + ": a quantised latent weight is (format, codes, scales, group)");
  const int fmt = nb::cast<int>(t[0]);
  const auto codes = nb::cast<uintptr_t>(t[1]), scales = nb::cast<uintptr_t>(t[2]);
  const int64_t group = nb::cast<int64_t>(t[3]);
  if (fmt != 1 && fmt != 2) bad(std::string(where) + ": a latent weight's format is 1 (int8) or 2 (int4)");
  if (codes == 0 || scales == 0) bad(std::string(where) + ": a quantised latent weight needs codes and scales");
  if (!hina::mla_quant_fits(static_cast<hina::WFormat>(fmt), group, m->L, m->Dn, m->Dv))
    bad(std::string(where) + ": a quantised latent weight needs Dn and Dv multiples of 4 and int8 with L a multiple "
        "of 64 or int4 in groups of 32, 64 or 128 dividing L (got L " + std::to_string(m->L) + ", Dn " +
        std::to_string(m->Dn) + ", Dv " + std::to_string(m->Dv) + ", group " + std::to_string(group) + ")");
  m->w = nullptr;
  m->wq = {static_cast<hina::WFormat>(fmt), reinterpret_cast<const void*>(codes), reinterpret_cast<const void*>(scales),
           fmt == 2 ? group : 0};
}

// Latent attention's settings of layer_decode_pre (LayerPreArgs::mla) from the tuple hi_na_moe.layers
// hands over: (rope form 0 complex / 1 interleaved / 2 rotate_half, Dn, Dr, L, q_lora, q_b (a
// BoundForward, or None without q_lora), qa_w, qa_eps, kv_w, kv_eps); q_b is kept in `owners`.
static void latent_pre_args(const char* where, const nb::tuple& t, hina::LayerPreArgs::Latent* m,
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

// A decode step through a model's decoder layers in one call (hina::decode_layers), for
// hi_na_moe.stack. Each layer's fixed arguments are set once (set_layer) and again only when one of
// them changes; the BoundForwards it was given are kept alive here.
class StepPlan {
 public:
  explicit StepPlan(int64_t L) : layers_(static_cast<size_t>(L)), owners_(static_cast<size_t>(L)) {
    if (L < 1) bad("StepPlan: need at least one layer");
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
    if (dense != (mlp.size() == 3) || (mlp.size() != 0 && mlp.size() != 3))
      bad("StepPlan.set_layer: a layer has a router and experts (mlp ()), or none and mlp (gate_up, down, I)");
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
    if (dense) {
      d.post.mlp = gated_mlp(mlp);
      owners.push_back(mlp);
    } else {
      const auto& br = nb::cast<const BoundForward&>(router);
      const auto& be = nb::cast<const BoundForward&>(experts);
      d.post.router = br.packed();
      d.post.router_params = br.params();
      if (router_dtype >= 0 && router_dtype != dtype) {
        if (router_dtype > 2) bad("StepPlan.set_layer: router_dtype must be -1 or a dtype code (0, 1, 2)");
        d.post.router_cast = true;
        d.post.router_dtype = static_cast<hina::DType>(router_dtype);
      }
      d.post.select.E = E;
      d.post.select.k = sel_k;
      d.post.select.form = static_cast<hina::RouterForm>(sel_form);
      d.post.select.renorm = sel_renorm;
      d.post.select.w_dtype = static_cast<hina::DType>(sel_w_dtype);
      check_select("StepPlan.set_layer", sel_form, E, sel_k, sel_groups, sel_topk_group, sel_bias);
      d.post.select.sel_bias = reinterpret_cast<const float*>(sel_bias);  // kept alive by the caller (plan_args)
      d.post.select.norm_min = norm_min;
      d.post.select.groups = sel_groups;
      d.post.select.topk_group = sel_topk_group;
      d.post.select.scale = sel_scale;
      d.post.select.eps = sel_eps;
      d.post.experts = be.packed();
      d.post.experts_params = be.params();
      d.post.experts_threads = experts_threads;
      owners.push_back(std::move(router));
      owners.push_back(std::move(experts));
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

 private:
  std::vector<hina::DecodeLayer> layers_;
  // per layer: its qkv, o, router, experts and shared-expert BoundForwards
  std::vector<std::vector<nb::object>> owners_;
  nb::object head_owner_;  // the head's BoundForward (set_head), or invalid
  const hina::PackedExperts* head_ = nullptr;
  hina::MoeParams head_params_{};
};

NB_MODULE(_native, m) {
  m.doc() = "hi_na_moe native core (torch-free C++)";
  // PackedExperts live inside patched torch modules, which are often still referenced (module
  // globals, reference cycles) when the interpreter tears nanobind down; that is not a leak of
  // the binding, so the shutdown leak report would only be noise for users.
  nb::set_leak_warnings(false);
  m.def("cpu_features", &features_dict,
        "CPU features as reported by the processor and enabled by the OS.");
  m.def("best_isa", [] { return std::string(hina::isa_name(hina::best_isa(hina::cpu_features()))); },
        "The highest kernel tier this CPU and OS support.");
  m.def("isa_supported",
        [](const std::string& name) { return hina::isa_supported(hina::cpu_features(), parse_isa(name)); },
        nb::arg("name"), "Whether the named tier can run on this machine.");
  m.def("header_info", [](const nb::bytes& b) { return header_dict(header_from_bytes(b)); }, nb::arg("header"),
        "The fields of a packed header (bytes from PackedExperts.plan / .header) as a dict.");
  m.attr("PACKED_LAYOUT_VERSION") = hina::PackedHeader{}.version;
  m.def("kernel_table", &kernel_table, nb::arg("qdot") = "auto",
        "{'decode': {format: kernel}, 'prefill': {format: kernel}}: what isa='auto' runs; formats "
        "are the lossless dtypes and int8 / int4 (for a bfloat16 model, under `qdot`).");
  m.def("resolve_isa", [](const std::string& name) { return std::string(hina::isa_name(hina::resolve_isa(name.c_str()))); },
        nb::arg("name") = "auto",
        "The tier a PackedExperts(isa=name) would use: 'auto' is the best tier here unless the "
        "env var HINA_MOE_ISA names another; raises ValueError for a tier the CPU lacks.");
  m.attr("DEFAULT_PREFILL_MIN_TOKENS") = hina::kDefaultPrefillMinTokens;
  m.def("default_num_threads", &hina::default_num_threads,
        "Threads the op uses when num_threads=0 (CPUs in this process's affinity mask).");
  m.def("l12_prefetch", &hina::l12_prefetch,
        "Whether the lossless12 decode kernel prefetches its stream (not on AMD CPUs unless "
        "HINA_MOE_PREFETCH_BYTES is set).");
  m.def("prefetch_distance", &hina::prefetch_distance,
        "Bytes ahead of their weight stream the FMA and integer-dot kernels prefetch into L2, fixed when the "
        "library loaded: HINA_MOE_PREFETCH_BYTES if it held a multiple of 64 in [0, 65536], else 1024 on AMD "
        "CPUs and 4096 on others.");
  m.def("rows_prefetch_distance", &hina::rows_prefetch_distance, nb::arg("rows"),
        "The distance the int8 / int4 kernels prefetch at in a job of `rows` rows (batched decode, "
        "prefill): HINA_MOE_PREFETCH_BYTES if it was used, else prefetch_distance() for one row and on "
        "CPUs other than AMD; on AMD 0 (no software prefetch) for 2-3 rows and 16384 for 4 or more.");
  m.def("step_trace_compiled", &hina::step_trace_compiled,
        "Whether this build records decode_layers' timeline (a tuning build, HINA_PREFETCH_TUNING).");
  m.def("take_step_trace", [] {
          nb::list out;
          for (const auto& e : hina::take_step_trace())
            out.append(nb::make_tuple(e.layer, hina::step_op_name(e.op), e.t0, e.t1));
          return out;
        },
        "The ops decode_layers ran since the last call, as (layer, op, t0_ns, t1_ns) one after the other "
        "(layer -1: the final norm); empty unless step_trace_compiled().");
  m.def("set_pool_backend", [](const std::string& name) { hina::ThreadPool::global().set_backend(pool_backend_from(name)); },
        nb::arg("name"),
        "Process-wide: which threads run the kernels' parallel regions ('auto': the loaded "
        "libgomp's team when there is one, else the library's own workers; 'own'; 'openmp'; "
        "'mixed': the own workers, prefill-sized calls on the loaded libgomp's team).");
  m.def("set_pool_hosting", [](bool on) { hina::ThreadPool::global().set_hosting(on); }, nb::arg("on"),
        "Process-wide: whether a decode step through the layers (StepPlan.run) on the own or mixed backend "
        "runs its regions on the loaded libgomp's team, hosted (ThreadPool::host; default on).");
  m.def("pool_hosting", [] { return hina::ThreadPool::global().hosting(); });
  m.def("pool_stats", [] {
        const auto& p = hina::ThreadPool::global();
        nb::dict d;
        d["hosted_calls"] = p.hosted_calls();
        d["guest_shares"] = p.guest_shares();
        d["host_shares"] = p.host_shares();
        d["host_backoffs"] = p.host_backoffs();
        return d;
      },
      "Counts since start: hosted calls (decode steps whose regions ran on OpenMP's team), the "
      "worker shares that team's threads ran in them and those the calling thread ran itself, and "
      "the hosted calls that found the team held off its cores (the next calls then run on the own "
      "workers for a while).");
  m.def("_pool_host_contention_for_test", [] { hina::ThreadPool::global().host_contention_for_test(); },
        "Tests: the next hosted call counts as one that found OpenMP's team held off its cores.");
  m.def("_pool_host_reset_for_test", [] {
        nb::gil_scoped_release release;
        hina::ThreadPool::global().host_reset_for_test();
      },
      "Tests: ends a hosting backoff (the next decode step runs hosted again).");
  m.def("openmp_runtime", &hina::loaded_openmp_runtime,
        "Path of the GNU OpenMP runtime (libgomp) loaded in this process, '' if none.");
  m.def("pool_backend", [](std::optional<std::string> name) {
          return name ? hina::ThreadPool::backend_name(pool_backend_from(*name)) : hina::ThreadPool::global().backend_name();
        }, nb::arg("name") = nb::none(),
        "What parallel regions run on under backend `name` (default: the current one): 'own', "
        "'openmp (<libgomp path>)', or 'own (openmp requested, no libgomp loaded in this process)'.");

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

  nb::class_<hina::BandwidthProbe>(m, "BandwidthProbe",
                                   "A read-bandwidth probe on a buffer allocated and touched once: "
                                   "read(bytes) times one read of the buffer's next `bytes` (round "
                                   "robin) and returns GB/s. For pairing every timed call with a probe.")
      .def("__init__",
           [](hina::BandwidthProbe* self, size_t bytes, int threads) {
             if (threads <= 0) threads = hina::default_num_threads();
             nb::gil_scoped_release release;
             new (self) hina::BandwidthProbe(bytes, threads);
           },
           nb::arg("bytes") = size_t(1) << 30, nb::arg("threads") = 0)
      .def("read",
           [](hina::BandwidthProbe& self, size_t bytes) {
             nb::gil_scoped_release release;
             return self.pass(bytes);
           },
           nb::arg("bytes") = size_t(256) << 20)
      .def_prop_ro("size", &hina::BandwidthProbe::size);

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
  m.def("rms_norm_raw",
        [](uintptr_t x, int64_t rows, int64_t n, uintptr_t w, float eps, uintptr_t out, int dtype) {
          hina::rms_norm(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(x), rows, n,
                         reinterpret_cast<const void*>(w), eps, reinterpret_cast<void*>(out));
        },
        nb::arg("x"), nb::arg("rows"), nb::arg("n"), nb::arg("weight"), nb::arg("eps"), nb::arg("out"),
        nb::arg("dtype"),
        "rms_norm() with raw addresses and nothing checked (dtype: 0 float32, 1 bfloat16, 2 float16): "
        "for callers that checked the tensors themselves (hi_na_moe.dense). Wrong addresses crash.");
  m.def("add_raw",
        [](uintptr_t a, uintptr_t b, int64_t count, uintptr_t sum, int dtype) {
          hina::add(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(a),
                    reinterpret_cast<const void*>(b), count, reinterpret_cast<void*>(sum));
        },
        nb::arg("a"), nb::arg("b"), nb::arg("count"), nb::arg("sum"), nb::arg("dtype"),
        "sum = a + b over count values, each rounded once to the dtype as PyTorch adds two CPU tensors "
        "(dtype: 0 float32, 1 bfloat16, 2 float16). Raw addresses, nothing checked (hi_na_moe.layers). "
        "Wrong addresses crash.");
  m.def("gather_rows_raw",
        [](uintptr_t table, int64_t rows, int64_t row_bytes, uintptr_t ids, int64_t n, uintptr_t dst) {
          const auto* id = reinterpret_cast<const int64_t*>(ids);
          for (int64_t i = 0; i < n; ++i)
            if (id[i] < 0 || id[i] >= rows) return false;
          for (int64_t i = 0; i < n; ++i)
            std::memcpy(reinterpret_cast<uint8_t*>(dst) + i * row_bytes,
                        reinterpret_cast<const uint8_t*>(table) + id[i] * row_bytes, static_cast<size_t>(row_bytes));
          return true;
        },
        nb::arg("table"), nb::arg("rows"), nb::arg("row_bytes"), nb::arg("ids"), nb::arg("n"), nb::arg("dst"),
        "dst row i = table row ids[i] for n int64 ids, rows of row_bytes (an embedding lookup); False, with "
        "nothing written, when an id is outside [0, rows). Raw addresses, nothing else checked "
        "(hi_na_moe.stack). Wrong addresses crash.");
  m.def("add_rms_norm_raw",
        [](uintptr_t a, uintptr_t b, int64_t rows, int64_t n, uintptr_t w, float eps, uintptr_t sum, uintptr_t out,
           int dtype) {
          hina::add_rms_norm(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(a),
                             reinterpret_cast<const void*>(b), rows, n, reinterpret_cast<const void*>(w), eps,
                             reinterpret_cast<void*>(sum), reinterpret_cast<void*>(out));
        },
        nb::arg("a"), nb::arg("b"), nb::arg("rows"), nb::arg("n"), nb::arg("weight"), nb::arg("eps"), nb::arg("sum"),
        nb::arg("out"), nb::arg("dtype"),
        "A residual add and the RMSNorm after it: sum = a + b (add_raw), out = rms_norm(sum) (rms_norm_raw), "
        "the same bits as the two calls. Raw addresses, nothing checked (hi_na_moe.layers). Wrong addresses crash.");
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
  m.def("rope_rotate_half_raw",
        [](uintptr_t x, int64_t B, int64_t heads, int64_t D, uintptr_t cos, uintptr_t sin, uintptr_t out, int dtype,
           const std::string& isa, int num_threads, bool half_table, int64_t rot) {
          if (rot < 0 || rot > D || rot % 2 != 0) bad("rope_rotate_half: rot must be even and at most D (0: D)");
          const hina::Isa tier = hina::resolve_isa(isa.c_str());
          nb::gil_scoped_release release;
          hina::rope_rotate_half(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(x), B, heads, D,
                                 reinterpret_cast<const void*>(cos), reinterpret_cast<const void*>(sin),
                                 reinterpret_cast<void*>(out), tier, num_threads, half_table, rot);
        },
        nb::arg("x"), nb::arg("B"), nb::arg("heads"), nb::arg("D"), nb::arg("cos"), nb::arg("sin"), nb::arg("out"),
        nb::arg("dtype"), nb::arg("isa") = "generic", nb::arg("num_threads") = 1, nb::arg("half_table") = false,
        nb::arg("rot") = 0,
        "rope_rotate_half() with raw addresses and nothing checked (dtype: 0 float32, 1 bfloat16, 2 float16; "
        "half_table: cos and sin hold D/2 values per row, one angle for both halves, as GPT-OSS's; rot: partial "
        "rotary, the first rot values of each head rotated, the rest copied, tables of rot values a row), "
        "for hi_na_moe.attention, which checked the tensors itself; the same bits at every tier (bfloat16 "
        "vectorised at avx512/amx), rows split over num_threads (0: all) when there are many. Wrong addresses "
        "crash.");
  m.def("rope_interleaved_f32_raw",
        [](uintptr_t x, int64_t B, int64_t heads, int64_t D, uintptr_t cos, uintptr_t sin, int64_t table_bstride,
           uintptr_t out, int dtype, int num_threads) {
          nb::gil_scoped_release release;
          hina::rope_interleaved_f32(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(x), B, heads, D,
                                     reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
                                     table_bstride, reinterpret_cast<void*>(out), num_threads);
        },
        nb::arg("x"), nb::arg("B"), nb::arg("heads"), nb::arg("D"), nb::arg("cos"), nb::arg("sin"),
        nb::arg("table_bstride"), nb::arg("out"), nb::arg("dtype"), nb::arg("num_threads") = 1,
        "rope_interleaved_f32() (moe.h: ERNIE 4.5's interleaved pairs in float32, float32 tables of table_bstride "
        "values a row, the first D/2 read) with raw addresses and nothing checked (dtype: 0 float32, 1 bfloat16, "
        "2 float16), for hi_na_moe.attention, which checked the tensors itself. Wrong addresses crash.");
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
  m.def("attention_decode_raw",
        [](int dtype, uintptr_t q, int64_t B, int64_t Hq, int64_t Hkv, int64_t S, int64_t D, uintptr_t k,
           int64_t ks0, int64_t ks1, int64_t ks2, uintptr_t v, int64_t vs0, int64_t vs1, int64_t vs2, float scale,
           uintptr_t out, int num_threads, const std::string& isa, uintptr_t mask, int64_t mask_bstride,
           uintptr_t sinks) {
          hina::AttnDecodeArgs a{static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(q),
                                 reinterpret_cast<const void*>(k), reinterpret_cast<const void*>(v),
                                 reinterpret_cast<void*>(out), B, Hq, Hkv, S, D, {ks0, ks1, ks2}, {vs0, vs1, vs2},
                                 scale, reinterpret_cast<const uint8_t*>(mask), mask_bstride,
                                 reinterpret_cast<const float*>(sinks)};
          const hina::Isa tier = hina::resolve_isa(isa.c_str());
          nb::gil_scoped_release release;
          hina::attention_decode(a, num_threads, tier);
        },
        "attention_decode() with raw addresses and element strides, nothing checked (dtype: 0 float32, "
        "1 bfloat16, 2 float16; mask: 0 for none, else bool bytes at mask + b * mask_bstride; sinks: 0 for none, "
        "else Hq float32 sink logits), for "
        "hi_na_moe.attention, which checked the tensors itself. Wrong addresses crash.");
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
  m.def("mla_decode_raw",
        [](int dtype, uintptr_t q_nope, int64_t qn0, int64_t qn1, uintptr_t q_rope, int64_t qr0, int64_t qr1,
           nb::handle w, uintptr_t latent, int64_t c0, int64_t c1, uintptr_t k_rope, int64_t kr0, int64_t kr1,
           uintptr_t out, int64_t B, int64_t H, int64_t S, int64_t Dn, int64_t Dr, int64_t L, int64_t Dv, float scale,
           uintptr_t mask, int64_t mask_bstride, int num_threads, const std::string& isa) {
          hina::MlaDecodeArgs a{static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(q_nope),
                                reinterpret_cast<const void*>(q_rope), nullptr,
                                reinterpret_cast<const void*>(latent), reinterpret_cast<const void*>(k_rope),
                                reinterpret_cast<void*>(out), B, H, S, Dn, Dr, L, Dv, {qn0, qn1}, {qr0, qr1},
                                {c0, c1}, {kr0, kr1}, scale, reinterpret_cast<const uint8_t*>(mask), mask_bstride};
          mla_weight("mla_decode_raw", w, &a);
          const hina::Isa tier = hina::resolve_isa(isa.c_str());
          nb::gil_scoped_release release;
          hina::mla_decode(a, num_threads, tier);
        },
        "Decode attention of multi-head latent attention with kv_b_proj absorbed (hina::mla_decode): q_nope "
        "(b, h, d < Dn) at q_nope + b*qn0 + h*qn1 + d elements, q_rope likewise (rotated), w [H, Dn + Dv, L] "
        "contiguous (kv_b_proj's weight; its address, or (format 1 int8 / 2 int4, codes, scales, group) of "
        "its quantised form as unpack_row_quant gives it), latent (b, s, l) at latent + b*c0 + s*c1 + l, k_rope likewise, out "
        "[B, H, Dv] contiguous; dtype 0 float32, 1 bfloat16, 2 float16; mask 0 for none, else bool bytes at "
        "mask + b * mask_bstride. Raw addresses, nothing checked: for hi_na_moe.mla, which checked the tensors "
        "itself. Wrong addresses crash.");
  m.def("attention_prefill_raw",
        [](uintptr_t q, int64_t qs0, int64_t qs1, int64_t qs2, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
           int64_t S, int64_t D, uintptr_t k, int64_t ks0, int64_t ks1, int64_t ks2, uintptr_t v, int64_t vs0,
           int64_t vs1, int64_t vs2, float scale, uintptr_t out, int num_threads, const std::string& isa,
           uintptr_t mask, int64_t mask_bstride, int64_t mask_tstride, uintptr_t sinks) {
          hina::AttnPrefillArgs a{reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k),
                                  reinterpret_cast<const void*>(v), reinterpret_cast<void*>(out), B, T, Hq, Hkv, S, D,
                                  {qs0, qs1, qs2}, {ks0, ks1, ks2}, {vs0, vs1, vs2}, scale,
                                  reinterpret_cast<const uint8_t*>(mask), mask_bstride, mask_tstride,
                                  reinterpret_cast<const float*>(sinks)};
          const hina::Isa tier = hina::resolve_isa(isa.c_str());
          nb::gil_scoped_release release;
          return hina::attention_prefill(a, num_threads, tier);
        },
        "Prefill attention of bfloat16 q (row (b, t, h) at q + b*qs0 + t*qs1 + h*qs2 elements) over k, v "
        "[B, Hkv, S, D] (element strides, the last dimension contiguous) into out [B, T, Hq, D] contiguous; "
        "mask 0: causal from the first key (query t attends keys 0..t), else bool bytes at mask + b*mask_bstride "
        "+ t*mask_tstride + j; sinks 0 for none, else Hq float32 sink logits. Returns False, writing nothing, where the kernel does not apply (no AVX512-BF16, "
        "a tier below avx512, an unsupported D). Raw addresses, nothing checked: for hi_na_moe.attention, "
        "which checked the tensors itself. Wrong addresses crash.");
  m.def("attention_prefill_supported",
        [](int64_t D, int64_t Hq, int64_t Hkv, const std::string& isa) {
          hina::AttnPrefillArgs a{};
          a.D = D, a.Hq = Hq, a.Hkv = Hkv;
          return hina::attention_prefill_supported(a, hina::resolve_isa(isa.c_str()));
        },
        "Whether attention_prefill_raw has a kernel for head size D and Hq/Hkv heads at tier isa on this CPU.");
  m.def("layer_decode_pre_raw",
        [](int dtype, int64_t B, int64_t H, uintptr_t x, uintptr_t ln1_w, float ln1_eps, const BoundForward& qkv,
           int64_t Hq, int64_t Hkv, int64_t D, int qk_norm, uintptr_t qn_w, uintptr_t kn_w, float qn_eps, float kn_eps,
           uintptr_t cos, uintptr_t sin, int64_t cos_bstride, uintptr_t h, uintptr_t qkv_out, uintptr_t qk_tmp,
           uintptr_t q, uintptr_t k, uintptr_t v, int64_t kv_bstride, int64_t kv_hstride, int num_threads,
           bool half_table, bool interleaved_f32, int64_t rot, nb::tuple mla, int64_t mla_v_bstride,
           const std::string& isa) {
          hina::LayerPreArgs a{static_cast<hina::DType>(dtype), B, H, reinterpret_cast<const void*>(x),
                               reinterpret_cast<const void*>(ln1_w), ln1_eps, qkv.packed(), qkv.params(), Hq, Hkv, D,
                               qk_norm, reinterpret_cast<const void*>(qn_w), reinterpret_cast<const void*>(kn_w),
                               qn_eps, kn_eps, reinterpret_cast<const void*>(cos), reinterpret_cast<const void*>(sin),
                               cos_bstride, reinterpret_cast<void*>(h), reinterpret_cast<void*>(qkv_out),
                               reinterpret_cast<void*>(qk_tmp), reinterpret_cast<void*>(q), reinterpret_cast<void*>(k),
                               reinterpret_cast<void*>(v), kv_bstride, kv_hstride, half_table, interleaved_f32, rot};
          std::vector<nb::object> owners;
          if (mla.size() != 0) {
            latent_pre_args("layer_decode_pre_raw", mla, &a.mla, &owners);
            a.mla.v_bstride = mla_v_bstride;
          }
          const hina::Isa tier = hina::resolve_isa(isa.c_str());
          nb::gil_scoped_release release;
          hina::layer_decode_pre(a, num_threads, tier);
        },
        "layer_decode_pre() (moe.h) with raw addresses, nothing checked (dtype: 0 float32, 1 bfloat16, 2 float16; "
        "qkv: the BoundForward of an up-only block; kv_bstride/kv_hstride: the elements between k's and v's batch rows "
        "and heads; half_table: cos/sin rows of D/2 values; interleaved_f32: ERNIE's rotation on float32 cos/sin; rot: "
        "rope_rotate_half's partial rotary dims, 0: D; mla: latent attention's (rope, Dn, Dr, L, q_lora, q_b, qa_w, "
        "qa_eps, kv_w, kv_eps), k then the latent cache's slot and v the rope key's, mla_v_bstride v's elements between "
        "rows, qk_tmp [B, q_lora + Hq (Dn + Dr)], q [B, Hq, Dn + Dr]); isa: the rotary kernel's tier (the same bits at "
        "every tier). For hi_na_moe.layers, which checked the tensors. "
        "Wrong addresses crash.");
  m.def("layer_decode_post_raw",
        [](int dtype, int64_t B, int64_t H, uintptr_t q, int64_t Hq, int64_t Hkv, int64_t S, int64_t D, uintptr_t k,
           int64_t ks0, int64_t ks1, int64_t ks2, uintptr_t v, int64_t vs0, int64_t vs1, int64_t vs2, float scale,
           uintptr_t mask, int64_t mask_bstride, const std::string& isa, uintptr_t attn_out, const BoundForward& o,
           uintptr_t o_out, uintptr_t x, uintptr_t ln2_w, float ln2_eps, uintptr_t sum, uintptr_t normed,
           const BoundForward* router, uintptr_t logits, int num_threads, int sel_form, int64_t sel_E, int64_t sel_k,
           bool sel_renorm, int sel_w_dtype, uintptr_t sel_w, uintptr_t sel_idx, const BoundForward* experts,
           int experts_threads, uintptr_t experts_out, const BoundForward* shared_gu, const BoundForward* shared_down,
           int64_t shared_I, const BoundForward* shared_gate, uintptr_t shared_scratch_gu, uintptr_t shared_scratch_m,
           uintptr_t shared_out, uintptr_t shared_logit, uintptr_t sinks, int router_dtype, uintptr_t router_in,
           uintptr_t sel_bias, float norm_min, const BoundForward* mlp_gate_up, const BoundForward* mlp_down,
           int64_t mlp_I, uintptr_t mlp_gu, uintptr_t mlp_m, uintptr_t mlp_out, int64_t sel_groups,
           int64_t sel_topk_group, float sel_scale, float sel_eps, nb::tuple mla) -> nb::object {
          const auto dt = static_cast<hina::DType>(dtype);
          hina::LayerPostArgs a{dt, B, H,
                                hina::AttnDecodeArgs{dt, reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k),
                                                     reinterpret_cast<const void*>(v), reinterpret_cast<void*>(attn_out),
                                                     B, Hq, Hkv, S, D, {ks0, ks1, ks2}, {vs0, vs1, vs2}, scale,
                                                     reinterpret_cast<const uint8_t*>(mask), mask_bstride},
                                o.packed(), o.params(), reinterpret_cast<void*>(o_out), reinterpret_cast<const void*>(x),
                                reinterpret_cast<const void*>(ln2_w), ln2_eps, reinterpret_cast<void*>(sum),
                                reinterpret_cast<void*>(normed)};
          a.attn.sinks = reinterpret_cast<const float*>(sinks);
          if (mla.size() != 0) {  // latent attention: mla_decode on the queries latent_pre left in q
            if (mla.size() != 11)
              bad("layer_decode_post_raw: mla must be (w, Dn, Dr, L, Dv, latent, cs0, cs1, k_rope, krs0, krs1)");
            hina::MlaDecodeArgs& m = a.mla;
            auto at = [&](size_t i) { return nb::cast<int64_t>(mla[i]); };
            m.dtype = dt;
            m.B = B;
            m.H = Hq;
            m.S = S;
            m.Dn = at(1);
            m.Dr = at(2);
            m.L = at(3);
            m.Dv = at(4);
            mla_weight("layer_decode_post_raw", mla[0], &m);
            const int64_t hd = m.Dn + m.Dr;
            m.q_nope = reinterpret_cast<const void*>(q);
            m.q_rope = reinterpret_cast<const char*>(q) + m.Dn * static_cast<int64_t>(hina::dtype_size(dt));
            m.qn_strides[0] = m.qr_strides[0] = Hq * hd;
            m.qn_strides[1] = m.qr_strides[1] = hd;
            m.latent = reinterpret_cast<const void*>(static_cast<uintptr_t>(at(5)));
            m.c_strides[0] = at(6);
            m.c_strides[1] = at(7);
            m.k_rope = reinterpret_cast<const void*>(static_cast<uintptr_t>(at(8)));
            m.kr_strides[0] = at(9);
            m.kr_strides[1] = at(10);
            m.scale = scale;
            m.mask = reinterpret_cast<const uint8_t*>(mask);
            m.mask_bstride = mask_bstride;
          }
          if (router != nullptr) {
            a.router = router->packed();
            a.router_params = router->params();
            a.logits = reinterpret_cast<void*>(logits);
            if (router_dtype >= 0 && router_dtype != dtype) {
              if (router_dtype > 2 || router_in == 0)
                bad("layer_decode_post_raw: router_dtype must be a dtype code (0, 1, 2) with router_in scratch");
              a.router_cast = true;
              a.router_dtype = static_cast<hina::DType>(router_dtype);
              a.router_in = reinterpret_cast<void*>(router_in);
            }
            a.select.sel_bias = reinterpret_cast<const float*>(sel_bias);
            a.select.norm_min = norm_min;
            a.select.groups = sel_groups;
            a.select.topk_group = sel_topk_group;
            a.select.scale = sel_scale;
            a.select.eps = sel_eps;
            if (sel_w != 0) {
              check_select("layer_decode_post_raw", sel_form, sel_E, sel_k, sel_groups, sel_topk_group, sel_bias);
              a.select.E = sel_E;
              a.select.k = sel_k;
              a.select.form = static_cast<hina::RouterForm>(sel_form);
              a.select.renorm = sel_renorm;
              a.select.w_dtype = static_cast<hina::DType>(sel_w_dtype);
              a.select.w = reinterpret_cast<void*>(sel_w);
              a.select.idx = reinterpret_cast<int64_t*>(sel_idx);
              if (experts != nullptr) {
                a.experts = experts->packed();
                a.experts_params = experts->params();
                a.experts_threads = experts_threads;
                a.experts_out = reinterpret_cast<void*>(experts_out);
                if (shared_gu != nullptr) {
                  if (shared_down == nullptr) bad("layer_decode_post_raw: shared_gu needs shared_down");
                  a.shared_mlp = hina::GatedMlpArgs{dt, B, shared_I, shared_gu->packed(), shared_gu->params(),
                                                    shared_down->packed(), shared_down->params(), nullptr,
                                                    reinterpret_cast<void*>(shared_scratch_gu),
                                                    reinterpret_cast<void*>(shared_scratch_m),
                                                    reinterpret_cast<void*>(shared_out)};
                  if (shared_gate != nullptr) {  // (none: added as it is)
                    a.shared_gate = shared_gate->packed();
                    a.shared_gate_params = shared_gate->params();
                    a.shared_logit = reinterpret_cast<void*>(shared_logit);
                  }
                }
              }
            }
          } else if (mlp_gate_up != nullptr) {
            if (mlp_down == nullptr || mlp_gu == 0 || mlp_m == 0 || mlp_out == 0)
              bad("layer_decode_post_raw: mlp_gate_up needs mlp_down and the mlp_gu, mlp_m and mlp_out scratch");
            a.mlp = hina::GatedMlpArgs{dt, B, mlp_I, mlp_gate_up->packed(), mlp_gate_up->params(), mlp_down->packed(),
                                       mlp_down->params(), nullptr, reinterpret_cast<void*>(mlp_gu),
                                       reinterpret_cast<void*>(mlp_m), reinterpret_cast<void*>(mlp_out)};
          }
          const hina::Isa tier = hina::resolve_isa(isa.c_str());
          const char* name;
          {
            nb::gil_scoped_release release;
            name = hina::layer_decode_post(a, num_threads, tier);
          }
          if (name == nullptr) return nb::none();
          return nb::str(name);
        },
        nb::arg("dtype"), nb::arg("B"), nb::arg("H"), nb::arg("q"), nb::arg("Hq"), nb::arg("Hkv"), nb::arg("S"),
        nb::arg("D"), nb::arg("k"), nb::arg("ks0"), nb::arg("ks1"), nb::arg("ks2"), nb::arg("v"), nb::arg("vs0"),
        nb::arg("vs1"), nb::arg("vs2"), nb::arg("scale"), nb::arg("mask"), nb::arg("mask_bstride"), nb::arg("isa"),
        nb::arg("attn_out"), nb::arg("o"), nb::arg("o_out"), nb::arg("x"), nb::arg("ln2_w"), nb::arg("ln2_eps"),
        nb::arg("sum"), nb::arg("normed"), nb::arg("router").none(), nb::arg("logits"), nb::arg("num_threads"),
        nb::arg("sel_form") = 0, nb::arg("sel_E") = 0, nb::arg("sel_k") = 0, nb::arg("sel_renorm") = false, nb::arg("sel_w_dtype") = 0,
        nb::arg("sel_w") = 0, nb::arg("sel_idx") = 0, nb::arg("experts").none() = nb::none(),
        nb::arg("experts_threads") = 0, nb::arg("experts_out") = 0, nb::arg("shared_gu").none() = nb::none(),
        nb::arg("shared_down").none() = nb::none(), nb::arg("shared_I") = 0, nb::arg("shared_gate").none() = nb::none(),
        nb::arg("shared_scratch_gu") = 0, nb::arg("shared_scratch_m") = 0, nb::arg("shared_out") = 0,
        nb::arg("shared_logit") = 0, nb::arg("sinks") = 0, nb::arg("router_dtype") = -1, nb::arg("router_in") = 0,
        nb::arg("sel_bias") = 0, nb::arg("norm_min") = 0.f, nb::arg("mlp_gate_up").none() = nb::none(),
        nb::arg("mlp_down").none() = nb::none(), nb::arg("mlp_I") = 0, nb::arg("mlp_gu") = 0, nb::arg("mlp_m") = 0,
        nb::arg("mlp_out") = 0, nb::arg("sel_groups") = 1, nb::arg("sel_topk_group") = 1, nb::arg("sel_scale") = 1.0f,
        nb::arg("sel_eps") = 1e-20f, nb::arg("mla") = nb::tuple(),
        "layer_decode_post() (moe.h) with raw addresses, nothing checked (q = 0: the attention's heads are already "
        "in attn_out; sinks != 0: float32 [Hq], the heads' attention sinks; router None: no logits; sel_w != 0: the router's selection too, router_select() with "
        "sel_form 0 softmax-topk / 1 topk-softmax over sel_E logits into sel_w [B, sel_k] of dtype sel_w_dtype and int64 sel_idx; "
        "with it, experts (a BoundForward): the experts on that selection with experts_threads, scratch experts_out "
        "[B, H], added into sum; with shared_gu, shared_down (BoundForwards of a gated MLP's up-only blocks, I = "
        "shared_I) and shared_gate (of its 1-output gate, or None: added as it is), the shared expert combined into "
        "experts_out first, scratch shared_scratch_gu [B, 2 I], shared_scratch_m [B, I], shared_out [B, H], "
        "shared_logit [B]); router_dtype (a code other than dtype's, -1: dtype): the router's, normed converted "
        "to it in router_in [B, H] for its linear, the logits of it; sel_bias: float32 [sel_E], the top k of "
        "softmax + sel_bias choose and the renormalising sum is at least norm_min (sel_form 2: router_select's "
        "grouped sigmoid form with sel_groups, sel_topk_group, sel_scale and sel_eps); router None and mlp_gate_up, "
        "mlp_down (I = mlp_I): a dense layer, sum += its gated MLP on normed (scratch mlp_gu [B, 2 I], mlp_m "
        "[B, I], mlp_out [B, H]); mla (w, Dn, Dr, L, Dv, latent, cs0, cs1, k_rope, krs0, krs1): latent attention, "
        "mla_decode() over the latent and rope-key caches at those element strides (rows, positions) with q the "
        "queries layer_decode_pre_raw left [B, Hq, Dn + Dr], into attn_out [B, Hq Dv] (w as mla_decode_raw "
        "takes it: an address or a quantised form's tuple). For hi_na_moe.layers. Returns the experts' kernel name, or None. Wrong "
        "addresses crash.");
  m.def("gated_mlp_raw",
        [](int dtype, int64_t B, int64_t I, uintptr_t x, const BoundForward& gate_up, const BoundForward& down,
           uintptr_t gu, uintptr_t mid, uintptr_t out, int num_threads) {
          hina::GatedMlpArgs a{static_cast<hina::DType>(dtype), B, I, gate_up.packed(), gate_up.params(),
                               down.packed(), down.params(), reinterpret_cast<const void*>(x),
                               reinterpret_cast<void*>(gu), reinterpret_cast<void*>(mid), reinterpret_cast<void*>(out)};
          nb::gil_scoped_release release;
          hina::gated_mlp_decode(a, num_threads);
        },
        nb::arg("dtype"), nb::arg("B"), nb::arg("I"), nb::arg("x"), nb::arg("gate_up"), nb::arg("down"),
        nb::arg("gu"), nb::arg("mid"), nb::arg("out"), nb::arg("num_threads"),
        "gated_mlp_decode() (moe.h) with raw addresses, nothing checked: x [B, H], scratch gu [B, 2 I] and mid "
        "[B, I], out [B, H], all of dtype (0 float32, 1 bfloat16, 2 float16); gate_up and down: BoundForwards of "
        "up-only blocks. For hi_na_moe.mlp, which checked the tensors. Wrong addresses crash.");
  m.def("silu_mul_raw",
        [](int dtype, const std::string& isa, uintptr_t g, uintptr_t u, int64_t n, uintptr_t out) {
          if (dtype < 0 || dtype > 2 || n < 0) bad("silu_mul: dtype codes are 0, 1 or 2, and n >= 0");
          const hina::Isa tier = hina::resolve_isa(isa.c_str());
          hina::silu_mul(static_cast<hina::DType>(dtype), tier, reinterpret_cast<const void*>(g),
                         reinterpret_cast<const void*>(u), n, reinterpret_cast<void*>(out));
        },
        nb::arg("dtype"), nb::arg("isa"), nb::arg("g"), nb::arg("u"), nb::arg("n"), nb::arg("out"),
        "silu_mul() (moe.h) over n values at raw addresses (isa: the build, as for the kernels). Wrong addresses "
        "crash.");
  m.def("shared_combine_raw",
        [](int dtype, uintptr_t routed, uintptr_t shared, uintptr_t logit, int64_t B, int64_t H, uintptr_t out) {
          if (dtype < 0 || dtype > 2 || B < 0 || H < 0) bad("shared_combine: dtype codes are 0, 1 or 2, and B, H >= 0");
          hina::shared_combine(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(routed),
                               reinterpret_cast<const void*>(shared), reinterpret_cast<const void*>(logit), B, H,
                               reinterpret_cast<void*>(out));
        },
        nb::arg("dtype"), nb::arg("routed"), nb::arg("shared"), nb::arg("logit"), nb::arg("B"), nb::arg("H"),
        nb::arg("out"), "shared_combine() (moe.h) at raw addresses. Wrong addresses crash.");
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
      "UNCHECKED addresses: wrong ones crash. Returns the experts' kernel names per layer.")
      .def(nb::init<int64_t>(), nb::arg("layers"))
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
      .def("__len__", &StepPlan::size);
  m.def("router_select_raw",
        [](int dtype, uintptr_t logits, int64_t B, int64_t E, int64_t k, int form, bool renorm, int w_dtype,
           uintptr_t w, uintptr_t idx, uintptr_t sel_bias, float norm_min, int64_t groups, int64_t topk_group,
           float scale, float eps) {
          if (B < 0 || E < 1 || k < 1 || k > E) bad("router_select: need B >= 0 and 1 <= k <= E");
          check_select("router_select", form, E, k, groups, topk_group, sel_bias);
          if (dtype < 0 || dtype > 2 || w_dtype < 0 || w_dtype > 2) bad("router_select: dtype codes are 0, 1 or 2");
          hina::RouterSelectArgs a{static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(logits), B, E, k,
                                   static_cast<hina::RouterForm>(form), renorm, static_cast<hina::DType>(w_dtype),
                                   reinterpret_cast<void*>(w), reinterpret_cast<int64_t*>(idx)};
          a.sel_bias = reinterpret_cast<const float*>(sel_bias);
          a.norm_min = norm_min;
          a.groups = groups;
          a.topk_group = topk_group;
          a.scale = scale;
          a.eps = eps;
          hina::router_select(a);
        },
        nb::arg("dtype"), nb::arg("logits"), nb::arg("B"), nb::arg("E"), nb::arg("k"), nb::arg("form"),
        nb::arg("renorm"), nb::arg("w_dtype"), nb::arg("w"), nb::arg("idx"), nb::arg("sel_bias") = 0,
        nb::arg("norm_min") = 0.0f, nb::arg("groups") = 1, nb::arg("topk_group") = 1, nb::arg("scale") = 1.0f,
        nb::arg("eps") = 1e-20f,
        "router_select() (moe.h) with raw addresses, addresses unchecked (dtype codes: 0 float32, 1 bfloat16, "
        "2 float16; form 0 softmax-topk, 1 topk-softmax, 2 sigmoid-group-topk, 3 softmax-group-topk, 4 the same "
        "in the logits' dtype): logits [B, E] -> w [B, k] of "
        "w_dtype, int64 idx [B, k], the top-k's ties moved as torch.topk moves them; sel_bias != 0 (form 0): "
        "float32 [E] added to the probabilities to choose, the weights the probabilities, renorm over max(sum, "
        "norm_min); form 2 (DeepSeek-V3's): sigmoid scores plus sel_bias (required) choose within the topk_group "
        "best of `groups` expert groups, the weights the scores (renorm: over sum + eps) times scale; form 3 "
        "(DeepSeek-V2's): softmax, the experts outside the topk_group groups of largest maximum counted as 0, the "
        "top k of the probabilities times scale; form 4 (Mistral 4's): softmax in the logits' dtype, groups scored "
        "by their two largest probabilities, the top k of the kept, renorm over sum + eps and times scale, every "
        "step rounded to that dtype. For "
        "hi_na_moe.routers. Wrong addresses crash.");
  m.def("measure_read_bandwidth",
        [](size_t bytes, int threads, int passes) {
          hina::BandwidthResult r;
          if (threads <= 0) threads = hina::default_num_threads();
          {
            nb::gil_scoped_release release;
            r = hina::measure_read_bandwidth(bytes, threads, passes);
          }
          nb::dict d;
          d["best_gbs"] = r.best_gbs;
          d["median_gbs"] = r.median_gbs;
          d["bytes"] = r.bytes;
          d["threads"] = r.threads;
          d["passes"] = r.passes;
          return d;
        },
        nb::arg("bytes") = size_t(1) << 30, nb::arg("threads") = 0, nb::arg("passes") = 5,
        "Memory read bandwidth of this machine (GB/s) over a buffer of `bytes` (make it far larger "
        "than the last-level cache); threads=0 means default_num_threads().");
  m.attr("__build__") = std::string("compiler=") +
#if defined(__clang__)
      "clang " __clang_version__;
#elif defined(__GNUC__)
      "gcc " __VERSION__;
#else
      "unknown";
#endif
}
