// Every *_raw entry point: raw addresses from callers that checked their tensors themselves
// (hi_na_moe's decode engine), so a call costs no DLPack import.
//
// [NOTE] Checking mode. With HINA_CHECK_RAW=1 in the environment when the module loads (not a
// HINA_MOE_* name: hi_na_moe's configuration warns on those it does not know), or
// after set_raw_checks(True) (the tests turn it on: tests/conftest.py), every raw entry point
// checks its arguments before the call: dtype codes and sizes, that each range of memory the call
// reads or writes, computed from the sizes and strides it was given, is mapped memory of this
// process (mincore: one system call per 1 MiB of range), and that an output the op's contract
// (hina_moe/ops.h) keeps apart from an input does not overlap it. A wrong address or size then raises a
// ValueError naming the entry point, the argument and its range instead of crashing the process.
// What it cannot see: a range that overruns one tensor into other mapped memory (torch keeps no
// registry of its buffers that the core could ask).
// Off (the default) it costs one relaxed load per call.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <initializer_list>
#include <utility>

#include "binding/experts.h"

namespace hina_bind {

namespace {

std::atomic<bool> g_raw_checks{[] {
  const char* v = std::getenv("HINA_CHECK_RAW");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}()};

// Whether every page of [a, a + n) is mapped in this process (n > 0).
bool mapped(uintptr_t a, uint64_t n) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  constexpr uintptr_t kPagesPerCall = 256;
  unsigned char vec[kPagesPerCall];
  const uintptr_t end = a + n;
  for (uintptr_t p = a & ~(page - 1); p < end; p += kPagesPerCall * page) {
    const uintptr_t len = std::min<uintptr_t>(end - p, kPagesPerCall * page);
    if (mincore(reinterpret_cast<void*>(p), len, vec) != 0 && errno == ENOMEM) return false;
  }
  return true;
}

// The checks of one raw call; each is a no-op when the checking mode is off.
class RawCheck {
 public:
  explicit RawCheck(const char* fn) : fn_(fn), on_(g_raw_checks.load(std::memory_order_relaxed)) {}

  // A dtype code (0 float32, 1 bfloat16, 2 float16); returns its element size.
  size_t dtype(const char* name, int code) const {
    if (on_ && (code < 0 || code > 2))
      fail(std::string(name) + " = " + std::to_string(code) + " is not a dtype code (0 float32, 1 bfloat16, 2 float16)");
    return code == 0 ? 4 : 2;
  }
  // Sizes that must be >= 0.
  void sizes(std::initializer_list<std::pair<const char*, int64_t>> dims) const {
    if (!on_) return;
    for (const auto& [name, v] : dims)
      if (v < 0) fail(std::string(name) + " = " + std::to_string(v) + " is negative");
  }
  // `bytes` bytes at addr, read or written by the call (none: nothing to check).
  void bytes(const char* name, uintptr_t addr, int64_t bytes) const {
    if (!on_ || bytes <= 0) return;
    if (addr == 0) fail(std::string(name) + " is a null address for " + std::to_string(bytes) + " bytes");
    if (addr + static_cast<uint64_t>(bytes) < addr || !mapped(addr, static_cast<uint64_t>(bytes)))
      fail(std::string(name) + " = " + hex(addr) + " for " + std::to_string(bytes) +
           " bytes is not mapped memory of this process: the address, a size or a stride is wrong");
  }
  // A written range that the op's contract says may not overlap a range it reads.
  void disjoint(const char* out_name, uintptr_t out, int64_t out_bytes, const char* in_name, uintptr_t in,
                int64_t in_bytes) const {
    if (!on_ || out_bytes <= 0 || in_bytes <= 0) return;
    if (out < in + static_cast<uint64_t>(in_bytes) && in < out + static_cast<uint64_t>(out_bytes))
      fail(std::string(out_name) + " [" + hex(out) + ", +" + std::to_string(out_bytes) + ") overlaps " + in_name + " [" +
           hex(in) + ", +" + std::to_string(in_bytes) + "): the op writes " + out_name + " while it reads " + in_name);
  }
  // The same where 0 means "none" (an optional argument).
  void optional(const char* name, uintptr_t addr, int64_t bytes) const {
    if (addr != 0) this->bytes(name, addr, bytes);
  }
  // Elements of esz bytes at addr + sum_i idx_i * stride_i (element strides, 0 <= idx_i < n_i),
  // then `last` contiguous ones; nothing when a count is 0.
  void strided(const char* name, uintptr_t addr, size_t esz,
               std::initializer_list<std::pair<int64_t, int64_t>> counts_strides, int64_t last) const {
    if (!on_) return;
    int64_t lo = 0, hi = last;
    for (const auto& [n, stride] : counts_strides) {
      if (n <= 0) return;
      (stride < 0 ? lo : hi) += (n - 1) * stride;
    }
    if (last <= 0) return;
    bytes(name, addr + static_cast<uintptr_t>(lo * static_cast<int64_t>(esz)), (hi - lo) * static_cast<int64_t>(esz));
  }

 private:
  static std::string hex(uintptr_t a) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, a);
    return buf;
  }
  [[noreturn]] void fail(const std::string& what) const {
    bad(std::string(fn_) + ": " + what + " (raw-call checks are on: HINA_CHECK_RAW=1 or set_raw_checks(True))");
  }
  const char* fn_;
  bool on_;
};

}  // namespace

void bind_raw(nb::module_& m) {
  m.def("set_raw_checks", [](bool on) { g_raw_checks.store(on, std::memory_order_relaxed); }, nb::arg("on"),
        "Whether every *_raw entry point checks its arguments before the call (dtype codes, sizes, and that each "
        "range it reads or writes is mapped memory of this process), raising ValueError instead of crashing. "
        "Off by default; on when HINA_CHECK_RAW=1 is set as the module loads (the tests set it). Process-wide.");
  m.def("raw_checks", [] { return g_raw_checks.load(std::memory_order_relaxed); }, "set_raw_checks's setting.");
  m.def("rms_norm_raw",
        [](uintptr_t x, int64_t rows, int64_t n, uintptr_t w, float eps, uintptr_t out, int dtype) {
          {  // the checking mode
            const RawCheck c("rms_norm_raw");
            const int64_t es = static_cast<int64_t>(c.dtype("dtype", dtype));
            c.sizes({{"rows", rows}, {"n", n}});
            c.bytes("x", x, rows * n * es);
            c.bytes("weight", w, rows > 0 ? n * es : 0);
            c.bytes("out", out, rows * n * es);
            c.disjoint("out", out, rows * n * es, "x", x, rows * n * es);
          }
          hina::rms_norm(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(x), rows, n,
                         reinterpret_cast<const void*>(w), eps, reinterpret_cast<void*>(out));
        },
        nb::arg("x"), nb::arg("rows"), nb::arg("n"), nb::arg("weight"), nb::arg("eps"), nb::arg("out"),
        nb::arg("dtype"),
        "rms_norm() with raw addresses and nothing checked (dtype: 0 float32, 1 bfloat16, 2 float16): "
        "for callers that checked the tensors themselves (hi_na_moe.dense). Wrong addresses crash unless set_raw_checks(True).");
  m.def("add_raw",
        [](uintptr_t a, uintptr_t b, int64_t count, uintptr_t sum, int dtype) {
          {  // the checking mode
            const RawCheck c("add_raw");
            const int64_t es = static_cast<int64_t>(c.dtype("dtype", dtype));
            c.sizes({{"count", count}});
            c.bytes("a", a, count * es);
            c.bytes("b", b, count * es);
            c.bytes("sum", sum, count * es);
          }
          hina::add(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(a),
                    reinterpret_cast<const void*>(b), count, reinterpret_cast<void*>(sum));
        },
        nb::arg("a"), nb::arg("b"), nb::arg("count"), nb::arg("sum"), nb::arg("dtype"),
        "sum = a + b over count values, each rounded once to the dtype as PyTorch adds two CPU tensors "
        "(dtype: 0 float32, 1 bfloat16, 2 float16). Raw addresses, nothing checked (hi_na_moe.layers). "
        "Wrong addresses crash unless set_raw_checks(True).");
  m.def("gather_rows_raw",
        [](uintptr_t table, int64_t rows, int64_t row_bytes, uintptr_t ids, int64_t n, uintptr_t dst) {
          {  // the checking mode
            const RawCheck c("gather_rows_raw");
            c.sizes({{"rows", rows}, {"row_bytes", row_bytes}, {"n", n}});
            c.bytes("ids", ids, n * 8);
            c.bytes("table", table, n > 0 ? rows * row_bytes : 0);
            c.bytes("dst", dst, n * row_bytes);
          }
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
        "(hi_na_moe.stack). Wrong addresses crash unless set_raw_checks(True).");
  m.def("add_rms_norm_raw",
        [](uintptr_t a, uintptr_t b, int64_t rows, int64_t n, uintptr_t w, float eps, uintptr_t sum, uintptr_t out,
           int dtype) {
          {  // the checking mode
            const RawCheck c("add_rms_norm_raw");
            const int64_t es = static_cast<int64_t>(c.dtype("dtype", dtype));
            c.sizes({{"rows", rows}, {"n", n}});
            for (auto [name, addr] : {std::pair{"a", a}, {"b", b}, {"sum", sum}, {"out", out}})
              c.bytes(name, addr, rows * n * es);
            c.bytes("weight", w, rows > 0 ? n * es : 0);
            for (auto [name, addr] : {std::pair{"a", a}, {"b", b}, {"sum", sum}})
              c.disjoint("out", out, rows * n * es, name, addr, rows * n * es);
          }
          hina::add_rms_norm(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(a),
                             reinterpret_cast<const void*>(b), rows, n, reinterpret_cast<const void*>(w), eps,
                             reinterpret_cast<void*>(sum), reinterpret_cast<void*>(out));
        },
        nb::arg("a"), nb::arg("b"), nb::arg("rows"), nb::arg("n"), nb::arg("weight"), nb::arg("eps"), nb::arg("sum"),
        nb::arg("out"), nb::arg("dtype"),
        "A residual add and the RMSNorm after it: sum = a + b (add_raw), out = rms_norm(sum) (rms_norm_raw), "
        "the same bits as the two calls. Raw addresses, nothing checked (hi_na_moe.layers). Wrong addresses crash unless set_raw_checks(True).");
  m.def("rope_rotate_half_raw",
        [](uintptr_t x, int64_t B, int64_t heads, int64_t D, uintptr_t cos, uintptr_t sin, uintptr_t out, int dtype,
           const std::string& isa, int num_threads, bool half_table, int64_t rot) {
          if (rot < 0 || rot > D || rot % 2 != 0) bad("rope_rotate_half: rot must be even and at most D (0: D)");
          {  // the checking mode
            const RawCheck c("rope_rotate_half_raw");
            const int64_t es = static_cast<int64_t>(c.dtype("dtype", dtype));
            c.sizes({{"B", B}, {"heads", heads}, {"D", D}});
            const int64_t width = (rot > 0 ? rot : D) / (half_table ? 2 : 1);
            c.bytes("x", x, B * heads * D * es);
            c.bytes("out", out, B * heads * D * es);
            c.bytes("cos", cos, heads > 0 ? B * width * es : 0);
            c.bytes("sin", sin, heads > 0 ? B * width * es : 0);
            c.disjoint("out", out, B * heads * D * es, "x", x, B * heads * D * es);
          }
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
        "crash unless set_raw_checks(True).");
  m.def("rope_interleaved_f32_raw",
        [](uintptr_t x, int64_t B, int64_t heads, int64_t D, uintptr_t cos, uintptr_t sin, int64_t table_bstride,
           uintptr_t out, int dtype, int num_threads) {
          {  // the checking mode
            const RawCheck c("rope_interleaved_f32_raw");
            const int64_t es = static_cast<int64_t>(c.dtype("dtype", dtype));
            c.sizes({{"B", B}, {"heads", heads}, {"D", D}, {"table_bstride", table_bstride}});
            c.bytes("x", x, B * heads * D * es);
            c.bytes("out", out, B * heads * D * es);
            c.strided("cos", cos, 4, {{heads > 0 ? B : 0, table_bstride}}, D / 2);
            c.strided("sin", sin, 4, {{heads > 0 ? B : 0, table_bstride}}, D / 2);
            c.disjoint("out", out, B * heads * D * es, "x", x, B * heads * D * es);
          }
          nb::gil_scoped_release release;
          hina::rope_interleaved_f32(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(x), B, heads, D,
                                     reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
                                     table_bstride, reinterpret_cast<void*>(out), num_threads);
        },
        nb::arg("x"), nb::arg("B"), nb::arg("heads"), nb::arg("D"), nb::arg("cos"), nb::arg("sin"),
        nb::arg("table_bstride"), nb::arg("out"), nb::arg("dtype"), nb::arg("num_threads") = 1,
        "rope_interleaved_f32() (moe.h: ERNIE 4.5's interleaved pairs in float32, float32 tables of table_bstride "
        "values a row, the first D/2 read) with raw addresses and nothing checked (dtype: 0 float32, 1 bfloat16, "
        "2 float16), for hi_na_moe.attention, which checked the tensors itself. Wrong addresses crash unless set_raw_checks(True).");
  m.def("attention_decode_raw",
        [](int dtype, uintptr_t q, int64_t B, int64_t Hq, int64_t Hkv, int64_t S, int64_t D, uintptr_t k,
           int64_t ks0, int64_t ks1, int64_t ks2, uintptr_t v, int64_t vs0, int64_t vs1, int64_t vs2, float scale,
           uintptr_t out, int num_threads, const std::string& isa, uintptr_t mask, int64_t mask_bstride,
           uintptr_t sinks) {
          {  // the checking mode
            const RawCheck c("attention_decode_raw");
            const size_t es = c.dtype("dtype", dtype);
            c.sizes({{"B", B}, {"Hq", Hq}, {"Hkv", Hkv}, {"S", S}, {"D", D}});
            c.bytes("q", q, B * Hq * D * static_cast<int64_t>(es));
            c.bytes("out", out, B * Hq * D * static_cast<int64_t>(es));
            c.strided("k", k, es, {{B, ks0}, {Hkv, ks1}, {S, ks2}}, D);
            c.strided("v", v, es, {{B, vs0}, {Hkv, vs1}, {S, vs2}}, D);
            if (mask) c.strided("mask", mask, 1, {{B, mask_bstride}}, S);
            c.optional("sinks", sinks, Hq * 4);
          }
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
        "hi_na_moe.attention, which checked the tensors itself. Wrong addresses crash unless set_raw_checks(True).");
  m.def("mla_decode_raw",
        [](int dtype, uintptr_t q_nope, int64_t qn0, int64_t qn1, uintptr_t q_rope, int64_t qr0, int64_t qr1,
           nb::handle w, uintptr_t latent, int64_t c0, int64_t c1, uintptr_t k_rope, int64_t kr0, int64_t kr1,
           uintptr_t out, int64_t B, int64_t H, int64_t S, int64_t Dn, int64_t Dr, int64_t L, int64_t Dv, float scale,
           uintptr_t mask, int64_t mask_bstride, int num_threads, const std::string& isa) {
          {  // the checking mode
            const RawCheck c("mla_decode_raw");
            const size_t es = c.dtype("dtype", dtype);
            c.sizes({{"B", B}, {"H", H}, {"S", S}, {"Dn", Dn}, {"Dr", Dr}, {"L", L}, {"Dv", Dv}});
            c.strided("q_nope", q_nope, es, {{B, qn0}, {H, qn1}}, Dn);
            c.strided("q_rope", q_rope, es, {{B, qr0}, {H, qr1}}, Dr);
            c.strided("latent", latent, es, {{H > 0 ? B : 0, c0}, {S, c1}}, L);
            c.strided("k_rope", k_rope, es, {{H > 0 ? B : 0, kr0}, {S, kr1}}, Dr);
            c.bytes("out", out, B * H * Dv * static_cast<int64_t>(es));
            if (mask) c.strided("mask", mask, 1, {{B, mask_bstride}}, S);
          }
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
        "itself. Wrong addresses crash unless set_raw_checks(True).");
  m.def("attention_prefill_raw",
        [](uintptr_t q, int64_t qs0, int64_t qs1, int64_t qs2, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
           int64_t S, int64_t D, uintptr_t k, int64_t ks0, int64_t ks1, int64_t ks2, uintptr_t v, int64_t vs0,
           int64_t vs1, int64_t vs2, float scale, uintptr_t out, int num_threads, const std::string& isa,
           uintptr_t mask, int64_t mask_bstride, int64_t mask_tstride, uintptr_t sinks) {
          {  // the checking mode
            const RawCheck c("attention_prefill_raw");
            c.sizes({{"B", B}, {"T", T}, {"Hq", Hq}, {"Hkv", Hkv}, {"S", S}, {"D", D}});
            c.strided("q", q, 2, {{B, qs0}, {T, qs1}, {Hq, qs2}}, D);
            c.strided("k", k, 2, {{T > 0 ? B : 0, ks0}, {Hkv, ks1}, {S, ks2}}, D);
            c.strided("v", v, 2, {{T > 0 ? B : 0, vs0}, {Hkv, vs1}, {S, vs2}}, D);
            c.bytes("out", out, B * T * Hq * D * 2);
            if (mask) c.strided("mask", mask, 1, {{B, mask_bstride}, {T, mask_tstride}}, S);
            c.optional("sinks", sinks, Hq * 4);
          }
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
        "which checked the tensors itself. Wrong addresses crash unless set_raw_checks(True).");
  m.def("gated_mlp_raw",
        [](int dtype, int64_t B, int64_t I, uintptr_t x, const BoundForward& gate_up, const BoundForward& down,
           uintptr_t scratch, int64_t scratch_size, uintptr_t out, int num_threads) {
          const size_t es = dtype >= 0 && dtype <= 2 ? hina::dtype_size(static_cast<hina::DType>(dtype)) : 0;
          // (the scratch is carved here, so its size is checked in every mode: the caller only allocates it)
          if (es == 0 || B < 0 || I < 0) bad("gated_mlp_raw: dtype codes are 0, 1 or 2, and B, I >= 0");
          const int64_t need = B * 3 * I * static_cast<int64_t>(es);
          if (scratch_size < need)
            bad("gated_mlp_raw: scratch of " + std::to_string(scratch_size) + " bytes, " + std::to_string(B) +
                " rows of I = " + std::to_string(I) + " need " + std::to_string(need) + " (B * 3 * I elements)");
          {  // the checking mode
            const RawCheck c("gated_mlp_raw");
            const int64_t Hx = gate_up.packed()->header().H;
            c.bytes("x", x, B * Hx * static_cast<int64_t>(es));
            c.bytes("scratch", scratch, need);
            c.bytes("out", out, B * Hx * static_cast<int64_t>(es));
          }
          char* gu = reinterpret_cast<char*>(scratch);
          hina::GatedMlpArgs a{static_cast<hina::DType>(dtype), B, I, gate_up.packed(), gate_up.params(),
                               down.packed(), down.params(), reinterpret_cast<const void*>(x), gu,
                               gu + B * 2 * I * static_cast<int64_t>(es), reinterpret_cast<void*>(out)};
          nb::gil_scoped_release release;
          hina::gated_mlp_decode(a, num_threads);
        },
        nb::arg("dtype"), nb::arg("B"), nb::arg("I"), nb::arg("x"), nb::arg("gate_up"), nb::arg("down"),
        nb::arg("scratch"), nb::arg("scratch_size"), nb::arg("out"), nb::arg("num_threads"),
        "gated_mlp_decode() (moe.h) with raw addresses: x [B, H], out [B, H], all of dtype (0 float32, 1 bfloat16, "
        "2 float16); scratch of scratch_size >= B * 3 * I elements (checked); gate_up and down: BoundForwards of "
        "up-only blocks. For hi_na_moe.mlp, which checked the tensors. Wrong addresses crash unless set_raw_checks(True).");
  m.def("silu_mul_raw",
        [](int dtype, const std::string& isa, uintptr_t g, uintptr_t u, int64_t n, uintptr_t out) {
          if (dtype < 0 || dtype > 2 || n < 0) bad("silu_mul: dtype codes are 0, 1 or 2, and n >= 0");
          {  // the checking mode
            const RawCheck c("silu_mul_raw");
            const int64_t es = static_cast<int64_t>(c.dtype("dtype", dtype));
            for (auto [name, addr] : {std::pair{"g", g}, {"u", u}, {"out", out}}) c.bytes(name, addr, n * es);
          }
          const hina::Isa tier = hina::resolve_isa(isa.c_str());
          hina::silu_mul(static_cast<hina::DType>(dtype), tier, reinterpret_cast<const void*>(g),
                         reinterpret_cast<const void*>(u), n, reinterpret_cast<void*>(out));
        },
        nb::arg("dtype"), nb::arg("isa"), nb::arg("g"), nb::arg("u"), nb::arg("n"), nb::arg("out"),
        "silu_mul() (moe.h) over n values at raw addresses (isa: the build, as for the kernels). Wrong addresses "
        "crash unless set_raw_checks(True).");
  m.def("shared_combine_raw",
        [](int dtype, uintptr_t routed, uintptr_t shared, uintptr_t logit, int64_t B, int64_t H, uintptr_t out) {
          if (dtype < 0 || dtype > 2 || B < 0 || H < 0) bad("shared_combine: dtype codes are 0, 1 or 2, and B, H >= 0");
          {  // the checking mode
            const RawCheck c("shared_combine_raw");
            const int64_t es = static_cast<int64_t>(c.dtype("dtype", dtype));
            for (auto [name, addr] : {std::pair{"routed", routed}, {"shared", shared}, {"out", out}})
              c.bytes(name, addr, B * H * es);
            c.bytes("logit", logit, H > 0 ? B * es : 0);
          }
          hina::shared_combine(static_cast<hina::DType>(dtype), reinterpret_cast<const void*>(routed),
                               reinterpret_cast<const void*>(shared), reinterpret_cast<const void*>(logit), B, H,
                               reinterpret_cast<void*>(out));
        },
        nb::arg("dtype"), nb::arg("routed"), nb::arg("shared"), nb::arg("logit"), nb::arg("B"), nb::arg("H"),
        nb::arg("out"), "shared_combine() (moe.h) at raw addresses. Wrong addresses crash unless set_raw_checks(True).");
  m.def("router_select_raw",
        [](int dtype, uintptr_t logits, int64_t B, int64_t E, int64_t k, int form, bool renorm, int w_dtype,
           uintptr_t w, uintptr_t idx, uintptr_t sel_bias, float norm_min, int64_t groups, int64_t topk_group,
           float scale, float eps) {
          if (B < 0 || E < 1 || k < 1 || k > E) bad("router_select: need B >= 0 and 1 <= k <= E");
          check_select("router_select", form, E, k, groups, topk_group, sel_bias);
          if (dtype < 0 || dtype > 2 || w_dtype < 0 || w_dtype > 2) bad("router_select: dtype codes are 0, 1 or 2");
          {  // the checking mode
            const RawCheck c("router_select_raw");
            c.bytes("logits", logits, B * E * static_cast<int64_t>(c.dtype("dtype", dtype)));
            c.bytes("w", w, B * k * static_cast<int64_t>(c.dtype("w_dtype", w_dtype)));
            c.bytes("idx", idx, B * k * 8);
            c.optional("sel_bias", sel_bias, B > 0 ? E * 4 : 0);
          }
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
        "hi_na_moe.routers. Wrong addresses crash unless set_raw_checks(True).");
}

}  // namespace hina_bind
