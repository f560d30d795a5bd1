// What every part of the binding shares: the argument checks (arrays, dtypes, shapes), the parsers
// of names (tiers, formats, qdot, pool backends), and the argument structs built from tuples.
// Header-only (inline): the binding is one module of a few translation units.
#pragma once

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

namespace hina_bind {

inline hina::Isa parse_isa(const std::string& name) {
  hina::Isa isa;
  if (!hina::isa_from_name(name.c_str(), &isa)) {
    throw nb::value_error(("unknown ISA tier '" + name +
                           "'; expected one of generic, avx2, avx512, amx, neon, dotprod, i8mm, bf16").c_str());
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

inline std::string dtype_str(nb::dlpack::dtype d) {
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

inline std::optional<hina::DType> to_dtype(nb::dlpack::dtype d) {
  if (d == nb::dtype<float>()) return hina::DType::kF32;
  if (d == kBf16) return hina::DType::kBF16;
  if (d == kF16) return hina::DType::kF16;
  return std::nullopt;
}

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

template <typename A>
inline std::vector<int64_t> shape_of(const A& a) {
  std::vector<int64_t> s(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<int64_t>(a.shape(i));
  return s;
}

[[noreturn]] inline void bad(const std::string& msg) { throw nb::value_error(msg.c_str()); }

// CPU, C-contiguous, expected shape (-1: any).
template <typename A>
inline void check_array(const char* name, const A& a, const std::vector<int64_t>& shape) {
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
inline void check_dtype(const char* name, const A& a, nb::dlpack::dtype want, const char* hint = "") {
  if (a.dtype() != want)
    bad(std::string(name) + " has dtype " + dtype_str(a.dtype()) + ", expected " + dtype_str(want) + hint);
}

inline std::string describe(nb::handle h) {
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

inline nb::dlpack::dtype nb_dtype(hina::DType dt) {
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
inline nb::object new_raw_array(nb::dlpack::dtype dt, size_t elem_bytes, std::vector<size_t> shape, void** data) {
  size_t n = 1;
  for (size_t d : shape) n *= d;
  void* p = std::malloc(n * elem_bytes + 1);
  if (!p) throw std::bad_alloc();
  nb::capsule owner(p, [](void* q) noexcept { std::free(q); });
  *data = p;
  OutArray a(p, shape.size(), shape.data(), owner, nullptr, dt);
  return nb::cast(a, nb::rv_policy::reference);
}

inline nb::object new_array(hina::DType dt, std::vector<size_t> shape, void** data) {
  return new_raw_array(nb_dtype(dt), hina::dtype_size(dt), std::move(shape), data);
}

inline hina::WFormat parse_wformat(const std::string& name) {
  hina::WFormat f;
  if (!hina::wformat_from_name(name.c_str(), &f))
    bad("weights '" + name + "' is unknown; expected lossless, int8, int4 or lossless12");
  return f;
}

// Checks a set of expert arrays (E experts, or any E when E < 0) and fills `w`.
inline hina::ExpertWeights expert_weights(const std::optional<InArray>& gate, const InArray& up,
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

inline hina::PackedHeader header_from_bytes(const nb::bytes& b) {
  hina::PackedHeader h;
  if (b.size() != sizeof(h))
    bad("packed header must be " + std::to_string(sizeof(h)) + " bytes, got " + std::to_string(b.size()));
  std::memcpy(&h, b.c_str(), sizeof(h));
  return h;
}

// Every field of a packed header, names as in moe.h (enums by name).
inline nb::dict header_dict(const hina::PackedHeader& h) {
  nb::dict d;
  d["magic"] = h.magic;
  d["version"] = h.version;
  d["dtype"] = h.dtype <= 2 ? std::string(hina::dtype_name(static_cast<hina::DType>(h.dtype))) : std::string("unknown");
  d["isa"] = std::string(hina::isa_name(static_cast<hina::Isa>(h.isa)));  // "unknown" for no tier
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
  d["gu_expert_bytes"] = h.gu_expert_bytes;
  d["down_expert_bytes"] = h.down_expert_bytes;
  d["nbytes"] = h.nbytes;
  return d;
}

// d[name] = value for each (name, value) pair of the arguments, in order.
inline void put_fields(nb::dict&) {}
template <class V, class... Rest>
void put_fields(nb::dict& d, const char* name, const V& value, const Rest&... rest) {
  d[name] = value;
  put_fields(d, rest...);
}

inline hina::QDot parse_qdot(const std::string& name) {
  hina::QDot q;
  if (!hina::qdot_from_name(name.c_str(), &q)) bad("qdot '" + name + "' is unknown; expected auto, int or expand");
  return q;
}

// The grouped sigmoid form's settings (RouterForm::kSigmoidGroupTopk), checked where Python hands
// them over: a wrong group count would read past a row.
inline void check_select(const char* where, int form, int64_t E, int64_t k, int64_t groups, int64_t topk_group,
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

inline hina::PoolBackend pool_backend_from(const std::string& name) {
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
inline void mla_weight(const char* where, nb::handle h, hina::MlaDecodeArgs* m) {
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

}  // namespace hina_bind
