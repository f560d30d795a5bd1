// Quantised weights: int8 / int4 against the contract written out again here, the integer-dot
// kernels against their generic emulation, the packed layout, linear layers and their row form.
#include "tests/harness.h"

#ifdef HINA_QDOT_VNNI_EMULATED_BUILT
namespace hina::detail {
bool get_qdot_kernels_avxvnni_emulated(WFormat wf, KernelImpl* k);  // csrc/tests/qdot_vnni_emulated.cpp
}  // namespace hina::detail
#endif

namespace tests_quant {

// The quantisation written out again from the contract in experts.h (independent of experts/packing.cpp):
// dequantised [N, K] matrices of every expert, in fp32.
std::vector<float> quantise_ref(DType dt, const std::vector<uint8_t>& src, int64_t E, int64_t N,
                                int64_t K, const QFmt& q) {
  std::vector<float> out(static_cast<size_t>(E * N * K));
  auto at = [&](int64_t row, int64_t k) { return k < K ? load_elem(dt, src.data(), row * K + k) : 0.0f; };
  for (int64_t row = 0; row < E * N; ++row) {
    if (q.fmt == WFormat::kInt8) {  // one scale a row: amax / 127, q = round(w / s)
      float amax = 0.0f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(at(row, k)));
      const float s = amax / 127.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float qv = s != 0.0f ? std::min(127.0f, std::max(-127.0f, std::nearbyint(at(row, k) / s))) : 0.0f;
        out[static_cast<size_t>(row * K + k)] = s * qv;
      }
      continue;
    }
    // int4: each group's signed extreme m; the row factor F = max |m| / 8; a group's scale is
    // F * (-1)^s 2^(-e / 8), e = 0..127, the sign -m's; e tried: e0 (nearest |m| / 8 / F in the
    // log domain), e0 + 1 .. e0 + 6, e0 - 1; the smallest squared error wins (ties: the earlier);
    // codes round(w / scale) (by the inverse) in -8..7.
    const int64_t ng = (K + q.group - 1) / q.group;
    std::vector<float> m(static_cast<size_t>(ng), 0.0f);
    float F = 0.0f;
    for (int64_t g = 0; g < ng; ++g) {
      for (int64_t k = g * q.group; k < (g + 1) * q.group; ++k)
        if (std::fabs(at(row, k)) > std::fabs(m[g])) m[g] = at(row, k);
      F = std::max(F, std::fabs(m[g]) / 8.0f);
    }
    for (int64_t g = 0; g < ng; ++g) {
      const double r = F > 0.0f ? std::fabs(m[g]) / 8.0f / F : 0.0;
      const int e0 = r > 0.0 ? static_cast<int>(std::min(127.0, std::max(0.0, std::nearbyint(-8.0 * std::log2(r))))) : 127;
      float s = 0.0f, inv = 0.0f, best = -1.0f;
      for (int i = 0; i < 8; ++i) {
        const int e = std::min(127, std::max(0, e0 + (i < 7 ? i : -1)));
        const float t = std::ldexp(static_cast<float>(std::exp2(-(e % 8) / 8.0)), -(e / 8)) * (m[g] > 0.0f ? -1.0f : 1.0f);
        const float d = F * t;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        float err = 0.0f;
        for (int64_t k = g * q.group; k < (g + 1) * q.group; ++k) {  // padding (k >= K) is 0: error 0
          const float qv = std::min(7.0f, std::max(-8.0f, std::nearbyint(at(row, k) * id)));
          const float e2 = at(row, k) - d * qv;
          err += e2 * e2;
        }
        if (best < 0.0f || err < best) { best = err; s = d; inv = id; }
      }
      for (int64_t k = g * q.group; k < std::min(K, (g + 1) * q.group); ++k)
        out[static_cast<size_t>(row * K + k)] = s * std::min(7.0f, std::max(-8.0f, std::nearbyint(at(row, k) * inv)));
    }
  }
  return out;
}

double sqnr_db(const std::vector<uint8_t>& src, DType dt, const std::vector<float>& deq) {
  double sig = 0, err = 0;
  for (size_t i = 0; i < deq.size(); ++i) {
    const double v = load_elem(dt, src.data(), static_cast<int64_t>(i));
    sig += v * v;
    err += (v - deq[i]) * (v - deq[i]);
  }
  return 10.0 * std::log10(sig / std::max(err, 1e-300));
}

void test_quant_case(DType dt, const QFmt& q, const Case& c, uint32_t seed, const std::vector<Isa>& tiers) {
  if (!sampled()) return;
  const std::string tag = std::string(q.name) + " " + dtype_short(dt) + " T" + std::to_string(c.T) +
                          " E" + std::to_string(c.E) + " K" + std::to_string(c.K) + " H" +
                          std::to_string(c.H) + " I" + std::to_string(c.I) + " " + act_name(c.act) +
                          " (" + c.why + ")";
  if (!selected(tag)) return;
  Problem p = make_problem(dt, c, seed);
  p.params.qdot = QDot::kExpand;  // the expansion kernels (fp32 activations); qdot: test_qdot_case
  const ExpertWeights w = weights_of(p);
  Deq dq;
  if (c.gated) dq.gate = quantise_ref(dt, p.gate, c.E, c.I, c.H, q);
  dq.up = quantise_ref(dt, p.up, c.E, c.I, c.H, q);
  dq.down = quantise_ref(dt, p.down, c.E, c.H, c.I, q);
  const std::vector<float> want = oracle(p, &dq);
  const double qtol = dt == DType::kF32 ? 2e-5 : tol(dt);

  auto gen = PackedExperts::pack(w, Isa::kGeneric, 1, {q.fmt, q.group});
  for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
    const char* name = nullptr;
    const std::vector<float> ref = run(*gen, p, path, 2, &name);
    const double e0 = rel_err(ref, want);
    report(e0 <= qtol, tag + " " + name + " vs emulated-quant oracle: rel err " + std::to_string(e0));
    note(std::string(name) + " vs oracle", e0);
    for (Isa isa : tiers) {
      auto pe = PackedExperts::pack(w, isa, 2, {q.fmt, q.group});
      const std::vector<float> got = run(*pe, p, path, 2, &name);
      const bool amx = isa == Isa::kAmx && path == MoePath::kPrefill && dt == DType::kBF16;
      if (amx) {  // the AMX kernels round w, x, h to bf16: compare with the generic twin
        detail::KernelImpl twin;
        detail::get_qkernels_generic(q.fmt, true, &twin);
        const std::vector<float> tw = run(*gen, p, path, 2, nullptr, &twin);
        const double et = rel_err(got, tw);
        report(et <= tol(dt), tag + " " + name + " vs generic amx twin: rel err " + std::to_string(et));
        note(std::string(name) + " vs generic amx twin", et);
        const double eo = rel_err(got, want);  // and stays near the exact result
        report(eo <= 4e-2, tag + " " + name + " vs oracle (bf16 tiles): rel err " + std::to_string(eo));
      } else {
        const double e = rel_err(got, ref);
        report(e <= qtol, tag + " " + name + " vs generic: rel err " + std::to_string(e));
        note(std::string(name) + " vs generic", e);
      }
    }
  }
}

// 10 log10(sum ref^2 / sum (got - ref)^2)
double out_sqnr_db(const std::vector<float>& got, const std::vector<float>& ref) {
  double sig = 0, err = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    sig += double(ref[i]) * ref[i];
    err += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
  }
  if (!(err == err)) return -1e9;
  return 10.0 * std::log10(std::max(sig, 1e-300) / std::max(err, 1e-300));
}

// Integer-dot kernels (qdot = int): every tier's kernel vs the generic emulation of the
// contract (exact integer sums: only the activation epilogue may differ), on both paths; the
// emulation vs the lossless model by output SQNR (weights and activations both quantised).
void test_qdot_case(DType dt, const QFmt& q, const Case& c, uint32_t seed, const std::vector<Isa>& tiers) {
  if (!sampled()) return;
  const std::string tag = std::string("qdot ") + q.name + " " + dtype_short(dt) + " T" + std::to_string(c.T) +
                          " E" + std::to_string(c.E) + " K" + std::to_string(c.K) + " H" +
                          std::to_string(c.H) + " I" + std::to_string(c.I) + " " + act_name(c.act) +
                          " (" + c.why + ")";
  if (!selected(tag)) return;
  Problem p = make_problem(dt, c, seed);
  const ExpertWeights w = weights_of(p);
  const std::vector<float> lossless = oracle(p);
  p.params.qdot = QDot::kInt;
  // fp32 models: the kernels match the emulation to a few ulp of fp32 unless an h element
  // crosses a rounding step of its block (then by one step: ~ 1 / (127 sqrt(I)) relative).
  const double dtol = dt == DType::kF32 ? 5e-5 : tol(dt);
  // uniform random weights and activations; int4 is limited by the weights (~ 20 dB).
  const double floor = q.fmt == WFormat::kInt8 ? 30.0 : 12.0;
  auto gen = PackedExperts::pack(w, Isa::kGeneric, 1, {q.fmt, q.group});
  std::vector<std::unique_ptr<PackedExperts>> packed;
  for (Isa isa : tiers) packed.push_back(PackedExperts::pack(w, isa, 2, {q.fmt, q.group}));
  for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
    const char* name = nullptr;
    const std::vector<float> ref = run(*gen, p, path, 2, &name);
    report(std::string(name).find("genericdot") != std::string::npos, tag + " generic tier runs " + name);
    const double db = out_sqnr_db(ref, lossless);
    const bool all_skipped = c.skip_every == 1;
    report(all_skipped || db >= floor, tag + " " + name + " vs lossless oracle: SQNR " + std::to_string(db) +
                                           " dB >= " + std::to_string(floor));
    // and the activation quantisation costs little next to the weights' own (expansion path)
    Problem pe = p;
    pe.params.qdot = QDot::kExpand;
    const double db_exp = out_sqnr_db(run(*gen, pe, path, 2, nullptr), lossless);
    const double loss = q.fmt == WFormat::kInt8 ? 7.5 : 1.0;  // W8A8: x and h noise ~ the weights'
    report(all_skipped || db >= db_exp - loss, tag + " " + name + " SQNR " + std::to_string(db) +
                                                   " dB within " + std::to_string(loss) + " dB of expansion's " + std::to_string(db_exp));
    if (!all_skipped) note(std::string(name) + " dB lost to act quant", db_exp - db);
    if (!all_skipped) {
      auto it = g_min_sqnr.find(name);
      if (it == g_min_sqnr.end() || db < it->second) g_min_sqnr[name] = db;
    }
    for (size_t i = 0; i < tiers.size(); ++i) {
      const std::vector<float> got = run(*packed[i], p, path, 2, &name);
      const double e = rel_err(got, ref);
      report(e <= dtol && std::string(name).find("_int") != std::string::npos &&
                 (std::string(name).find("dot") != std::string::npos || std::string(name).find("vnni") != std::string::npos ||
                  std::string(name).find("i8mm") != std::string::npos),
             tag + " " + name + " vs genericdot: rel err " + std::to_string(e));
      note(std::string(name) + " vs genericdot", e);
    }
    // every 256-bit build this CPU can run, whatever the selection prefers (avx2dot is what
    // AVX2 CPUs without AVX-VNNI run; this one may have AVX-VNNI)
    const CpuFeatures& f = cpu_features();
    struct Forced { const char* kname; bool (*get)(WFormat, detail::KernelImpl*); bool ok; };
    for (const Forced& fk : {Forced{"avx2dot", &detail::get_qdot_kernels_avx2, isa_supported(f, Isa::kAvx2)},
                             Forced{"avxvnni", &detail::get_qdot_kernels_avxvnni, isa_supported(f, Isa::kAvx2) && f.avx_vnni}}) {
      detail::KernelImpl k;
      if (!fk.ok || !fk.get(q.fmt, &k)) continue;
      const std::string kn = std::string("moe_") + path_name(path) + "_" + q.name + "_" + fk.kname + " (forced)";
      const std::vector<float> got = run(*gen, p, path, 2, nullptr, &k, kn.c_str());
      const double e = rel_err(got, ref);
      report(e <= dtol, tag + " " + kn + " vs genericdot: rel err " + std::to_string(e));
      note(kn + " vs genericdot", e);
    }
  }
}

// A row's output does not depend on the rows computed with it: on the avx2 tier (4-row prefill
// tiles, their 3-row remainders, 2- and 1-row blocks), T rows routed to one expert give, row for
// row and bit for bit, what each row gives alone, for bf16 weights (fp32 FMA tiles) and int8 /
// int4 (integer-dot tiles; activations are quantised per row); gated and up-only, with biases.
void test_avx2_row_blocks() {
  if (!selected("avx2 row blocks") || !isa_supported(cpu_features(), Isa::kAvx2)) return;
  struct F { WFormat wf; int group; const char* name; };
  uint32_t seed = 91;
  for (const F& f : {F{WFormat::kLossless, 64, "bf16"}, F{WFormat::kInt8, 64, "int8"}, F{WFormat::kInt4, 32, "int4g32"}})
    for (const int64_t T : {2, 3, 4, 5, 6, 7, 8, 9, 17, 33})
      for (const bool gated : {true, false}) {
        const Case c{T, 2, 1, 96, 48, gated, true, false, Act::kSilu, 0, 1, false, "avx2 row blocks"};
        Problem p = make_problem(DType::kBF16, c, seed++);
        p.params.qdot = QDot::kInt;
        auto pe = PackedExperts::pack(weights_of(p), Isa::kAvx2, 1, {f.wf, f.group});
        const char* name = nullptr;
        const std::vector<float> all = run(*pe, p, MoePath::kPrefill, 2, &name);
        bool same = true;
        const size_t row = static_cast<size_t>(c.H) * dtype_size(p.dt);
        for (int64_t t = 0; t < T; ++t) {
          Problem q = p;
          q.c.T = 1;
          q.x.assign(p.x.begin() + static_cast<std::ptrdiff_t>(t * row), p.x.begin() + static_cast<std::ptrdiff_t>((t + 1) * row));
          q.idx = {p.idx[static_cast<size_t>(t)]};
          q.w = {p.w[static_cast<size_t>(t)]};
          const std::vector<float> one = run(*pe, q, MoePath::kPrefill, 1, nullptr);
          same = same && std::memcmp(one.data(), all.data() + t * c.H, row / dtype_size(p.dt) * sizeof(float)) == 0;
        }
        report(same, std::string("avx2 row blocks: ") + name + (gated ? " gated" : " up-only") + " T=" + std::to_string(T) +
                         ": every row == the row alone, bit for bit");
      }
}

// Which kernel runs for each qdot setting (auto: integer dot where the tier has it, except the
// AMX prefill of bf16 models).
void test_qdot_selection(const std::vector<Isa>& tiers) {
  if (!selected("qdot selection")) return;
  const CpuFeatures& f = cpu_features();
  for (Isa isa : tiers) {
    for (WFormat wf : {WFormat::kInt8, WFormat::kInt4}) {
      const std::string fmt = wformat_name(wf);
      detail::KernelImpl probe;
      const bool arm = isa == Isa::kNeon || isa == Isa::kDotprod || isa == Isa::kI8mm || isa == Isa::kBf16;
      const bool avx2dot = !arm && detail::get_qdot_kernels_avx2(wf, &probe);
      // the Arm tiers have no expansion kernels of their own: quantised expansion runs the generic ones
      const std::string exp = isa == Isa::kAmx ? "avx512" : arm ? "generic" : isa_name(isa);
      const bool vnni = !arm && isa != Isa::kAvx2 && f.avx512vnni;
      const bool avxvnni = !arm && f.avx_vnni && detail::get_qdot_kernels_avxvnni(wf, &probe);
      const std::string dot = isa == Isa::kI8mm || isa == Isa::kBf16 ? "i8mm" : isa == Isa::kDotprod ? "dotprod" : isa == Isa::kNeon ? "neondot"
                              : vnni ? "avx512vnni" : avxvnni ? "avxvnni" : avx2dot ? "avx2dot" : "genericdot";
      const std::string adot = arm || vnni || avxvnni || avx2dot ? dot : exp;  // auto: expansion without a SIMD dot
      auto name = [&](DType dt, MoePath path, QDot qd) { return std::string(moe_kernel_name(isa, dt, path, wf, qd)); };
      report(name(DType::kBF16, MoePath::kDecode, QDot::kAuto) == "moe_decode_" + fmt + "_" + adot,
             "qdot selection: " + std::string(isa_name(isa)) + " " + fmt + " decode auto = " + name(DType::kBF16, MoePath::kDecode, QDot::kAuto));
      report(name(DType::kBF16, MoePath::kDecode, QDot::kExpand) == "moe_decode_" + fmt + "_" + exp,
             "qdot selection: " + std::string(isa_name(isa)) + " " + fmt + " decode expand = " + name(DType::kBF16, MoePath::kDecode, QDot::kExpand));
      const std::string pauto = isa == Isa::kAmx ? "amx" : adot;
      report(name(DType::kBF16, MoePath::kPrefill, QDot::kAuto) == "moe_prefill_" + fmt + "_" + pauto,
             "qdot selection: " + std::string(isa_name(isa)) + " " + fmt + " prefill auto = " + name(DType::kBF16, MoePath::kPrefill, QDot::kAuto));
      report(name(DType::kBF16, MoePath::kPrefill, QDot::kInt) == "moe_prefill_" + fmt + "_" + dot,
             "qdot selection: " + std::string(isa_name(isa)) + " " + fmt + " prefill int = " + name(DType::kBF16, MoePath::kPrefill, QDot::kInt));
      report(name(DType::kF32, MoePath::kPrefill, QDot::kAuto) == "moe_prefill_" + fmt + "_" + adot,
             "qdot selection: " + std::string(isa_name(isa)) + " " + fmt + " f32 prefill auto = " + name(DType::kF32, MoePath::kPrefill, QDot::kAuto));
    }
  }
  report(std::string(moe_kernel_name(Isa::kGeneric, DType::kBF16, MoePath::kDecode, WFormat::kInt8)) == "moe_decode_int8_generic",
         "qdot selection: generic auto = expansion");
  report(std::string(moe_kernel_name(Isa::kGeneric, DType::kBF16, MoePath::kDecode, WFormat::kInt4, QDot::kInt)) == "moe_decode_int4_genericdot",
         "qdot selection: generic int = genericdot");
  report(std::string(moe_kernel_name(Isa::kGeneric, DType::kBF16, MoePath::kDecode, WFormat::kLossless, QDot::kInt)) == "moe_decode_bf16_generic",
         "qdot selection: lossless ignores qdot");
}

// The activation quantisation against the contract written out again, on awkward values.
void test_quant_act_row() {
  if (!selected("quant_act_row")) return;
  std::vector<float> x(96, 0.0f);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (int i = 0; i < 32; ++i) x[i] = u(rng);
  // block 1: exact ties at 0.5 steps (127 / 127 scale = 1): 2.5 -> 2, 3.5 -> 4, -0.5 -> -0
  x[32] = 127.0f; x[33] = 2.5f; x[34] = 3.5f; x[35] = -0.5f; x[36] = -127.0f; x[37] = 1.5f;
  // block 2: all zero -> scale 0, q 0
  std::vector<uint8_t> row(static_cast<size_t>(detail::qrow_bytes(96)));
  detail::quant_act_row(x.data(), 96, row.data());
  const int8_t* q = reinterpret_cast<const int8_t*>(row.data());
  const float* sc = detail::qrow_scales(row.data(), 96);
  const int32_t* sums = detail::qrow_sums(row.data(), 96);
  bool ok = sc[1] == 1.0f && q[32] == 127 && q[33] == 2 && q[34] == 4 && q[35] == 0 && q[36] == -127 &&
            q[37] == 2 && sc[2] == 0.0f && sums[2] == 0;
  for (int b = 0; b < 3 && ok; ++b) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    int32_t tot = 0;
    for (int i = 0; i < 32; ++i) {
      const float s = amax / 127.0f;
      const int qi = s > 0 ? static_cast<int>(std::nearbyint(std::min(127.0f, std::max(-127.0f, x[b * 32 + i] / s)))) : 0;
      ok = ok && q[b * 32 + i] == qi;
      tot += qi;
    }
    ok = ok && sums[b] == tot && sc[b] == amax / 127.0f;
  }
  report(ok, "quant_act_row: blocks of 32, RNE ties, zero block, sums");
  // the portable and the AVX-512 builds write the same bytes (random rows, ties, NaN, inf, zeros)
  std::vector<float> y(32 * 40);
  for (size_t i = 0; i < y.size(); ++i) y[i] = u(rng) * (i % 97 == 0 ? 1e-30f : 1.0f);
  for (int i = 0; i < 32; ++i) y[32 + i] = 0.5f * static_cast<float>(i - 16);  // many exact ties
  y[70] = NAN;
  y[100] = INFINITY;
  for (int i = 0; i < 32; ++i) y[128 + i] = 0.0f;
  std::vector<uint8_t> a(static_cast<size_t>(detail::qrow_bytes(32 * 40))), bb(a.size());
  detail::quant_act_row_portable(y.data(), 32 * 40, a.data());
  bool same = true;
#if defined(__x86_64__)
  if (isa_supported(cpu_features(), Isa::kAvx512)) {
    detail::quant_act_row_avx512(y.data(), 32 * 40, bb.data());
    same = same && std::memcmp(a.data(), bb.data(), 32 * 40 * 5 / 4) == 0;
  }
  if (isa_supported(cpu_features(), Isa::kAvx2)) {
    std::fill(bb.begin(), bb.end(), 0x5A);
    detail::quant_act_row_avx2(y.data(), 32 * 40, bb.data());
    same = same && std::memcmp(a.data(), bb.data(), 32 * 40 * 5 / 4) == 0;
  }
#endif
  report(same, "quant_act_row: portable, AVX2 and AVX-512 builds write the same bytes");
  // and the portable build is the scalar definition above on all of them
  bool def = true;
  for (int b = 0; b < 40; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) {
      const float v = std::fabs(y[b * 32 + i]);
      amax = (v > amax || v != v) ? v : amax;
    }
    const float s = amax / 127.0f;
    int32_t tot = 0;
    for (int i = 0; i < 32; ++i) {
      float v = s > 0.0f ? y[b * 32 + i] / s : 0.0f;
      v = v == v ? std::min(127.0f, std::max(-127.0f, v)) : 0.0f;
      const int qi = static_cast<int>(std::nearbyint(v));
      def = def && reinterpret_cast<const int8_t*>(a.data())[b * 32 + i] == qi;
      tot += qi;
    }
    const float got_s = detail::qrow_scales(a.data(), 32 * 40)[b];
    def = def && (got_s == s || (got_s != got_s && s != s)) && detail::qrow_sums(a.data(), 32 * 40)[b] == tot;
  }
  report(def, "quant_act_row: every block is the definition (NaN, inf, tiny, ties)");
}

// Packing: the dequantised weights (unpack) equal the independent quantisation, and the
// quantisation error is what the format promises on random weights.
void test_quant_packing(const std::vector<Isa>& tiers) {
  if (!selected("quant packing")) return;
  for (const QFmt& q : kQFmts) {
    for (bool gated : {true, false}) {
      Case c{2, 3, 1, 200, 72, gated, true, false, Act::kSilu, 0, 0, false, "odd sizes"};
      const Problem p = make_problem(DType::kF32, c, 21);
      for (Isa isa : tiers) {
        auto pe = PackedExperts::pack(weights_of(p), isa, 2, {q.fmt, q.group});
        std::vector<float> g(p.up.size() / 4), u(p.up.size() / 4), d(p.down.size() / 4),
            bu(p.bu.size() / 4), bd(p.bd.size() / 4);
        pe->unpack(gated ? g.data() : nullptr, u.data(), d.data(), nullptr, bu.data(), bd.data());
        const std::vector<float> ru = quantise_ref(DType::kF32, p.up, c.E, c.I, c.H, q);
        const std::vector<float> rd = quantise_ref(DType::kF32, p.down, c.E, c.H, c.I, q);
        bool ok = u == ru && d == rd;
        if (gated) ok = ok && g == quantise_ref(DType::kF32, p.gate, c.E, c.I, c.H, q);
        // biases stay exact
        ok = ok && std::memcmp(bu.data(), p.bu.data(), p.bu.size()) == 0 &&
             std::memcmp(bd.data(), p.bd.data(), p.bd.size()) == 0;
        report(ok, std::string("quant packing ") + q.name + (gated ? " gated " : " no-gate ") +
                       isa_name(isa) + ": unpack == independent quantisation");
      }
      const double db = sqnr_db(p.up, DType::kF32, quantise_ref(DType::kF32, p.up, c.E, c.I, c.H, q));
      // Uniform weights: int8 gives ~ 6.02*8 - 1.25 - 4.8 ~ 42 dB, int4 ~ 20 dB.
      const double floor = q.fmt == WFormat::kInt8 ? 38.0 : 19.0;
      report(db >= floor, std::string("quant packing ") + q.name + " SQNR " + std::to_string(db) +
                              " dB >= " + std::to_string(floor));
    }
  }
}

// int4 layout v5, written out again from experts.h: a panel starts with its rows' fp32 factors (64
// bytes a matrix), then blocks of 64 scale-code bytes and the codes of their groups: two groups of
// a gate/up pair a block, four of a single matrix (down, dense linear layers); a count that is not
// a multiple ends with a block of the rest, its unused scale bytes zero. Checked on the planned
// sizes and, for a dense linear block, on where each row's factor, scale codes and codes sit in
// its bytes (against unpack_row_quant's plain rows; a scale = factor * (-1)^s 2^-(8a + b)/8).
void test_int4_layout(const std::vector<Isa>& tiers) {
  if (!selected("int4 layout")) return;
  std::mt19937 rng(47);
  for (const int group : {32, 64, 128})
    for (const int ng : {1, 2, 3, 4, 5}) {
      const int64_t K = int64_t(group) * ng, N = 17, panels = 2;
      const int64_t blk = 64 + 32 * int64_t(group);  // a block's bytes, either G
      const int64_t pair_panel = 128 + (ng + 1) / 2 * 64 + ng * 16 * int64_t(group);
      const int64_t single_panel = 64 + (ng + 3) / 4 * 64 + ng * 8 * int64_t(group);
      // gated experts: gate/up reduce over H = K, down over I = K (E 3, both 17 wide)
      const PackedHeader h = plan_packed(DType::kBF16, 3, N, K, true, false, false, false, Isa::kGeneric,
                                         {WFormat::kInt4, group});
      const PackedHeader hd = plan_packed(DType::kBF16, 3, K, N, true, false, false, false, Isa::kGeneric,
                                          {WFormat::kInt4, group});
      const auto a64 = [](int64_t b) { return (b + 63) / 64 * 64; };
      report(static_cast<int64_t>(hd.gu_expert_bytes) == a64(panels * pair_panel) &&
                 static_cast<int64_t>(h.down_expert_bytes) == a64(panels * single_panel),
             "int4 layout g" + std::to_string(group) + " x" + std::to_string(ng) +
                 " groups: gate/up and down panel sizes");
      auto w = random_array(DType::kF32, N * K, 1.0f, rng);
      // one row with a group 3000 times larger than the others: its small groups keep scales
      if (ng > 1) reinterpret_cast<float*>(w.data())[5 * K + 1] = 3000.0f;
      for (Isa isa : tiers) {
        auto pe = PackedExperts::pack_linear(DType::kF32, N, K, w.data(), nullptr, isa, 1, {WFormat::kInt4, group});
        std::vector<uint8_t> codes(static_cast<size_t>(N * K / 2));
        std::vector<float> scales(static_cast<size_t>(N * ng));
        pe->unpack_row_quant(codes.data(), scales.data());
        const uint8_t* bytes = static_cast<const uint8_t*>(pe->data());
        bool ok = static_cast<int64_t>(pe->header().gu_expert_bytes) == a64(panels * single_panel);
        for (int64_t row = 0; row < N; ++row) {
          const uint8_t* panel = bytes + row / 16 * single_panel;
          const int64_t n = row % 16;
          float factor;
          std::memcpy(&factor, panel + n * 4, 4);
          for (int64_t g = 0; g < ng; ++g) {
            const uint8_t* b = panel + 64 + g / 4 * blk;
            const uint8_t c = b[g % 4 * 16 + n];
            const int e = (c >> 4) * 8 + (c & 7);
            const float t = std::ldexp(static_cast<float>(std::exp2(-(e % 8) / 8.0)), -(e / 8)) * ((c & 8) ? -1.0f : 1.0f);
            ok = ok && factor * t == scales[static_cast<size_t>(row * ng + g)];
            if (row == 5 && g > 0)  // the group's own scale: |m| / 8 <= 1 / 8, give or take 2^(3/16)
              ok = ok && std::fabs(factor * t) < 0.125f * 1.14f && std::fabs(factor * t) > 0.0f;
            const uint8_t* cb = b + 64 + g % 4 * 8 * int64_t(group);
            for (int64_t k = 0; k < group; ++k) {
              const uint8_t byte = cb[(k / 8 * 16 + n) * 4 + k % 4];
              const int q = k % 8 < 4 ? byte & 15 : byte >> 4;
              const int64_t half = group / 2;
              const uint8_t rb = codes[static_cast<size_t>(row * K / 2 + g * half + k % half)];
              ok = ok && q == (k < half ? rb & 15 : rb >> 4);
            }
          }
          for (int64_t g = ng; g % 4 != 0; ++g)  // the last block's unused scale codes are zero
            ok = ok && panel[64 + g / 4 * blk + g % 4 * 16 + n] == 0;
        }
        report(ok, "int4 layout g" + std::to_string(group) + " x" + std::to_string(ng) + " groups " + isa_name(isa) +
                       ": a dense block's factors, scale codes and codes where experts.h says");
      }
    }
}



// The integer-dot kernels at the extremes of their int16 intermediates: weights and activations
// that quantise to the largest magnitudes, so the avx2dot kernel's vpmaddubsw pair sums reach
// 2 * 127 * 127 = 32258 (int8, one below saturation's 32767 by 509) and 2 * 15 * 127 (int4, with
// the low and high nibble sums added in int16: 7620; its prefill tiles add a 32-k block's 8 such
// products in int16: 30480). Every tier's integer dot == genericdot, bit for bit, and equal to
// the exact result; fp32 and bf16 models, one row (decode) and 5 rows (a 4-row tile + 1).
void test_qdot_int16_bound(const std::vector<Isa>& tiers) {
  if (!selected("qdot int16 bound")) return;
  constexpr int64_t O = 16, In = 64;
  for (WFormat wf : {WFormat::kInt8, WFormat::kInt4})
  for (DType dt : {DType::kF32, DType::kBF16}) {
    // int8: every weight -1 (q = -127 at s = 1/127); int4: -0.875 = d * 7 with d = -1/8 (nibble
    // 15) but the first of each 32-k group, 1 (q = -8, nibble 0, which sets d). x = 1: qx = 127.
    const bool i4 = wf == WFormat::kInt4;
    std::vector<float> wv(static_cast<size_t>(O * In), i4 ? -0.875f : -1.0f), xv(static_cast<size_t>(In), 1.0f);
    if (i4)
      for (int64_t o = 0; o < O; ++o)
        for (int64_t g = 0; g < In; g += 32) wv[static_cast<size_t>(o * In + g)] = 1.0f;
    const float exact = i4 ? -0.875f * (In - In / 32) + In / 32 : -1.0f * In;
    constexpr int64_t kRows = 5;
    std::vector<uint8_t> w(wv.size() * dtype_size(dt)), x(xv.size() * kRows * dtype_size(dt));
    for (size_t i = 0; i < wv.size(); ++i) store_elem(dt, w.data(), static_cast<int64_t>(i), wv[i]);
    for (int64_t i = 0; i < In * kRows; ++i) store_elem(dt, x.data(), i, xv[static_cast<size_t>(i % In)]);
    for (const int64_t rows : {int64_t{1}, kRows}) {
    const std::string tag = std::string("qdot int16 bound: ") + wformat_name(wf) + " " + dtype_short(dt) + " T=" +
                            std::to_string(rows) + " ";
    auto run_tier = [&](Isa isa, std::string* name) {
      auto pe = PackedExperts::pack_linear(dt, O, In, w.data(), nullptr, isa, 1, {wf, 32});
      std::vector<uint8_t> wq(w.size());
      pe->unpack(nullptr, wq.data(), nullptr, nullptr, nullptr, nullptr);
      bool same = true;  // the weights are exactly representable: the packing keeps them
      for (int64_t i = 0; i < O * In; ++i) same = same && load_elem(dt, wq.data(), i) == wv[static_cast<size_t>(i)];
      report(same, tag + isa_name(isa) + " packs the extreme weights exactly");
      std::vector<uint8_t> out(static_cast<size_t>(O * rows) * dtype_size(dt), 0xff);
      MoeParams p;
      p.num_threads = 1;
      p.qdot = QDot::kInt;
      p.path = rows > 1 ? MoePath::kPrefill : MoePath::kDecode;
      *name = pe->linear(x.data(), rows, out.data(), p);
      return out;
    };
    std::string gname, name;
    const std::vector<uint8_t> want = run_tier(Isa::kGeneric, &gname);
    bool all_exact = true;
    for (int64_t o = 0; o < O * rows; ++o) all_exact = all_exact && load_elem(dt, want.data(), o) == exact;
    report(all_exact, tag + gname + " = " + std::to_string(exact));
    for (Isa isa : tiers) {
      if (isa == Isa::kGeneric) continue;
      const std::vector<uint8_t> got = run_tier(isa, &name);
      report(got == want, tag + name + " == " + gname);
    }
    }
  }
}

// The 256-bit integer-dot kernels (each build this CPU can run, forced, whatever the selection
// prefers, and the avxvnni code with vpdpbusd emulated; on aarch64 neondot, dotprod and i8mm) vs genericdot at every row count an expert's rows can end in: 1..9 (4-row tiles and
// their 3-, 2- and 1-row remainders, decode's blocks; i8mm's row pairs and odd last row), 17, 33
// and 512; int8 and int4 in groups of 32 / 64 / 128; gated and up-only; all rows routed to one
// expert, so the kernels see exactly T rows; both paths. i8mm's SMMLA row pairs equal the dotprod
// build's rows, bit for bit (the same contract, int32 sums exact in both).
void test_qdot_rows() {
  if (!selected("qdot rows")) return;
  const CpuFeatures& f = cpu_features();
  struct Forced { const char* kname; bool (*get)(WFormat, detail::KernelImpl*); bool ok; };
  const Forced builds[] = {
      {"avx2dot", &detail::get_qdot_kernels_avx2, isa_supported(f, Isa::kAvx2)},
      {"avxvnni", &detail::get_qdot_kernels_avxvnni, isa_supported(f, Isa::kAvx2) && f.avx_vnni},
#ifdef HINA_QDOT_VNNI_EMULATED_BUILT  // the avxvnni code on any AVX2 CPU
      {"avxvnni-emulated", &detail::get_qdot_kernels_avxvnni_emulated, isa_supported(f, Isa::kAvx2)},
#endif
#if defined(__aarch64__)  // the Arm builds (kernels/neon/; one row at a time but i8mm's row pairs)
      {"neondot", &detail::get_qdot_kernels_neon, isa_supported(f, Isa::kNeon)},
      {"dotprod", &detail::get_qdot_kernels_dotprod, isa_supported(f, Isa::kDotprod)},
      {"i8mm", &detail::get_qdot_kernels_i8mm, isa_supported(f, Isa::kI8mm)},
#endif
  };
  uint32_t seed = 71;
  for (const QFmt& q : kQFmts)
    for (const int64_t T : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 512})
      for (const bool gated : {true, false}) {
        if (!gated && T != 3 && T != 6 && T != 33) continue;  // up-only: G = 1 tiles and remainders
        // H = 256: 8 activation blocks, 2..8 int4 groups; I = 80: 5 panels, down's k padded
        const Case c{T, 2, 1, 256, 80, gated, T % 2 == 1, false, Act::kSilu, 0, 1, false, "qdot rows"};
        Problem p = make_problem(DType::kF32, c, seed++);
        p.params.qdot = QDot::kInt;
        auto gen = PackedExperts::pack(weights_of(p), Isa::kGeneric, 1, {q.fmt, q.group});
        for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
          const std::vector<float> ref = run(*gen, p, path, 2, nullptr);
          std::vector<float> dotprod;  // the dotprod build's output (aarch64 with asimddp)
          for (const Forced& fk : builds) {
            detail::KernelImpl k;
            if (!fk.ok || !fk.get(q.fmt, &k)) continue;
            const std::string kn = std::string("moe_") + path_name(path) + "_" + q.name + "_" + fk.kname;
            const std::vector<float> got = run(*gen, p, path, 2, nullptr, &k, kn.c_str());
            const double e = rel_err(got, ref);
            const std::string tag = std::string("qdot rows: ") + kn + (gated ? " gated" : " up-only") + " T=" + std::to_string(T);
            report(e <= 5e-5, tag + " vs genericdot: rel err " + std::to_string(e));
            if (std::strcmp(fk.kname, "dotprod") == 0) dotprod = got;
            if (std::strcmp(fk.kname, "i8mm") == 0)
              report(!dotprod.empty() && std::memcmp(got.data(), dotprod.data(), got.size() * sizeof(float)) == 0,
                     tag + " == dotprod, bit for bit");
          }
        }
      }
}

// A paired linear layer (pack_linear's paired: the rows' two halves as one gated expert's gate and
// up matrices) gives the outputs of the plain up-only packing bit for bit, on every tier, decode
// and prefill paths, both quantised-kernel families, with and without a bias, with halves that
// end inside a panel; unpack() and unpack_row_quant() give the same weights; odd out_features
// and lossless formats are refused.
void test_paired_linear(const std::vector<Isa>& tiers) {
  if (!selected("paired_linear")) return;
  std::mt19937 rng(37);
  for (DType dt : {DType::kF32, DType::kBF16})
    for (const int group : {0, 32, 64})  // 0: int8
      for (const int64_t O : {int64_t{34}, int64_t{96}})
        for (const bool biased : {false, true}) {
          const WFormat wf = group ? WFormat::kInt4 : WFormat::kInt8;
          const QuantSpec q{wf, group ? group : 64};
          const int64_t In = 256, T = 5;
          const auto w = random_array(dt, O * In, 1.0f, rng);
          const auto b = random_array(dt, O, 1.0f, rng);
          const auto x = random_array(dt, T * In, 1.0f, rng);
          const std::string tag = std::string("paired linear ") + wformat_name(wf) +
                                  (group ? "/" + std::to_string(group) : "") + " " + dtype_short(dt) + " O=" +
                                  std::to_string(O) + (biased ? " biased " : " ");
          for (Isa isa : tiers) {
            auto plain = PackedExperts::pack_linear(dt, O, In, w.data(), biased ? b.data() : nullptr, isa, 1, q);
            auto pair = PackedExperts::pack_linear(dt, O, In, w.data(), biased ? b.data() : nullptr, isa, 1, q, true);
            bool ok = pair->paired() && pair->out_features() == O && pair->I() == O / 2 && !plain->paired();
            std::vector<uint8_t> wp(w.size()), wq(w.size()), bp(b.size()), bq(b.size());
            plain->unpack(nullptr, wp.data(), nullptr, nullptr, biased ? bp.data() : nullptr, nullptr);
            const size_t half = static_cast<size_t>(O / 2 * In) * dtype_size(dt);
            pair->unpack(wq.data(), wq.data() + half, nullptr, biased ? bq.data() : nullptr,
                         biased ? bq.data() + static_cast<size_t>(O / 2) * dtype_size(dt) : nullptr, nullptr);
            ok = ok && wp == wq && bp == bq;
            const size_t nc = static_cast<size_t>(group ? O * In / 2 : O * In);
            const size_t ns = static_cast<size_t>(group ? O * (In / group) * 4 : O * 4);
            std::vector<uint8_t> cp(nc), cq(nc), sp(ns), sq(ns);
            plain->unpack_row_quant(cp.data(), sp.data());
            pair->unpack_row_quant(cq.data(), sq.data());
            report(ok && cp == cq && sp == sq, tag + isa_name(isa) + ": the same weights (unpack, unpack_row_quant)");
            for (MoePath path : {MoePath::kDecode, MoePath::kPrefill})
              for (QDot qd : {QDot::kInt, QDot::kExpand})
                for (const int64_t rows : {int64_t{1}, T}) {
                  MoeParams p;
                  p.num_threads = 2;
                  p.path = path;
                  p.qdot = qd;
                  std::vector<uint8_t> a(static_cast<size_t>(rows * O) * dtype_size(dt), 0xaa), c(a.size(), 0x55);
                  const std::string name = plain->linear(x.data(), rows, a.data(), p);
                  pair->linear(x.data(), rows, c.data(), p);
                  report(a == c, tag + name + " T=" + std::to_string(rows) + ": paired == plain, bit for bit");
                }
          }
        }
  const auto w = random_array(DType::kF32, 15 * 64, 1.0f, rng);
  auto refused = [&](int64_t O, WFormat wf, const std::string& what) {
    bool threw = false;
    try {
      PackedExperts::pack_linear(DType::kF32, O, 64, w.data(), nullptr, Isa::kGeneric, 1, {wf, 64}, true);
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    report(threw, "paired linear refuses " + what);
  };
  refused(15, WFormat::kInt8, "an odd number of outputs");
  refused(14, WFormat::kLossless, "lossless weights");
}

// unpack_row_quant: an up-only int8 / int4 block's codes and scales in RowQuant's row order give
// back, as dtype(scale * code), exactly what unpack() dequantises, on every tier's layout (rows one
// past a panel, int4 groups of 32 / 64 / 128); a lossless block, an MoE block and int4 rows of
// partial groups are refused.
void test_row_quant(const std::vector<Isa>& tiers) {
  if (!selected("row_quant")) return;
  std::mt19937 rng(31);
  for (DType dt : {DType::kF32, DType::kBF16})
    for (Isa isa : tiers)
      for (const int group : {0, 32, 64, 128}) {  // 0: int8
        const WFormat wf = group ? WFormat::kInt4 : WFormat::kInt8;
        const int64_t O = 17, In = 256;
        const auto w = random_array(dt, O * In, 1.0f, rng);
        auto pe = PackedExperts::pack_linear(dt, O, In, w.data(), nullptr, isa, 1, {wf, group ? group : 64});
        std::vector<uint8_t> deq(w.size());
        pe->unpack(nullptr, deq.data(), nullptr, nullptr, nullptr, nullptr);
        std::vector<uint8_t> codes(static_cast<size_t>(group ? O * In / 2 : O * In));
        std::vector<uint8_t> scales(static_cast<size_t>(group ? O * (In / group) * 4 : O * 4));
        pe->unpack_row_quant(codes.data(), scales.data());
        std::vector<uint8_t> got(w.size());
        for (int64_t o = 0; o < O; ++o)
          for (int64_t k = 0; k < In; ++k) {  // RowQuant's plain rows
            float v;
            if (group) {
              const int64_t half = group / 2, j = k % group;
              const uint8_t b = codes[static_cast<size_t>(o * In / 2 + k / group * half + j % half)];
              const float sc = reinterpret_cast<const float*>(scales.data())[o * (In / group) + k / group];
              v = sc * static_cast<float>((j < half ? b & 15 : b >> 4) - 8);
            } else {
              v = reinterpret_cast<const float*>(scales.data())[o] *
                  static_cast<float>(static_cast<int8_t>(codes[static_cast<size_t>(o * In + k)]));
            }
            store_elem(dt, got.data(), o * In + k, v);
          }
        report(got == deq, std::string("unpack_row_quant ") + wformat_name(wf) + (group ? "/" + std::to_string(group) : "") +
                               " " + dtype_short(dt) + " " + isa_name(isa) + ": scale * code == unpack()");
      }
  const auto w = random_array(DType::kF32, 16 * 96, 1.0f, rng);
  std::vector<uint8_t> buf(16 * 96 * 4);
  auto expect_throw = [&](const PackedExperts& pe, const std::string& what) {
    bool threw = false;
    try {
      pe.unpack_row_quant(buf.data(), buf.data());
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    report(threw, "unpack_row_quant refuses " + what);
  };
  expect_throw(*PackedExperts::pack_linear(DType::kF32, 16, 96, w.data(), nullptr, Isa::kGeneric, 1), "a lossless block");
  const Problem moe = make_problem(DType::kF32, kCases[0], 5);
  expect_throw(*PackedExperts::pack(weights_of(moe), Isa::kGeneric, 1, {WFormat::kInt8, 64}), "an MoE block");
  expect_throw(*PackedExperts::pack_linear(DType::kF32, 16, 96, w.data(), nullptr, Isa::kGeneric, 1, {WFormat::kInt4, 64}),
               "int4 rows of 96 in groups of 64");
}

// Dense linear layers (pack_linear / linear): every tier vs a double-precision reference on the
// weights the block holds (lossless: the inputs; int8/int4: unpack()'s dequantised ones), decode
// (T = 1) and prefill shapes, widths one past a panel and a k block, with and without bias;
// forward() on such a block and linear() on experts are errors.
void test_linear(const std::vector<Isa>& tiers) {
  if (!selected("linear")) return;
  struct L { int64_t O, In, T; };
  const L shapes[] = {{17, 33, 1}, {33, 65, 5}, {129, 64, 17}, {16, 32, 1}};
  std::mt19937 rng(11);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (WFormat wf : {WFormat::kLossless, WFormat::kInt8, WFormat::kInt4}) {
      for (const L& l : shapes) {
        for (bool bias : {false, true}) {
          const auto w = random_array(dt, l.O * l.In, 1.0f / std::sqrt(float(l.In)), rng);
          const auto b = random_array(dt, l.O, 0.1f, rng);
          const auto x = random_array(dt, l.T * l.In, 1.0f, rng);
          for (Isa isa : tiers) {
            for (QDot qd : {QDot::kExpand, QDot::kInt}) {
              if (wf == WFormat::kLossless && qd == QDot::kInt) continue;
              auto pe = PackedExperts::pack_linear(dt, l.O, l.In, w.data(), bias ? b.data() : nullptr, isa, 2,
                                                   {wf, 64});
              std::vector<uint8_t> wq(w.size()), bq(b.size());
              pe->unpack(nullptr, wq.data(), nullptr, nullptr, bias ? bq.data() : nullptr, nullptr);
              std::vector<float> ref(static_cast<size_t>(l.T * l.O));
              for (int64_t t = 0; t < l.T; ++t)
                for (int64_t o = 0; o < l.O; ++o) {
                  double acc = bias ? load_elem(dt, bq.data(), o) : 0.0;
                  for (int64_t k = 0; k < l.In; ++k)
                    acc += double(load_elem(dt, wq.data(), o * l.In + k)) * load_elem(dt, x.data(), t * l.In + k);
                  ref[static_cast<size_t>(t * l.O + o)] = static_cast<float>(acc);
                }
              std::vector<uint8_t> out(static_cast<size_t>(l.T * l.O) * dtype_size(dt), 0xff);
              MoeParams p;
              p.num_threads = 2;
              p.qdot = qd;
              const std::string name = pe->linear(x.data(), l.T, out.data(), p);
              std::vector<float> got(ref.size());
              for (size_t i = 0; i < got.size(); ++i) got[i] = load_elem(dt, out.data(), static_cast<int64_t>(i));
              // the integer dot also quantises x per token (8 bits, blocks of 32)
              const bool qdot_kernel = name.find("dot") != std::string::npos || name.find("vnni") != std::string::npos ||
                                       name.find("i8mm") != std::string::npos;
              const double lim = qdot_kernel ? 3e-2 : tol(dt);
              const double err = rel_err(got, ref);
              note("linear " + name, err);
              report(err <= lim, "linear " + name + " O=" + std::to_string(l.O) + " In=" + std::to_string(l.In) +
                                     " T=" + std::to_string(l.T) + (bias ? " bias" : "") + ": err " + std::to_string(err));
            }
          }
        }
      }
    }
  }
  // each entry refuses the other kind of block
  const std::vector<float> w(32 * 16, 0.5f), x(2 * 32, 1.0f);
  auto lin = PackedExperts::pack_linear(DType::kF32, 16, 32, w.data(), nullptr, Isa::kGeneric, 1);
  std::vector<float> out(64);
  const int32_t idx[2] = {0, 0};
  const float tw[2] = {1.f, 1.f};
  bool threw = false;
  try { lin->forward(x.data(), 2, idx, 32, tw, 1, out.data(), MoeParams{}); } catch (const std::invalid_argument&) { threw = true; }
  report(threw, "forward() on a linear block raises");
  Case c{2, 4, 2, 32, 16, true, false, false, Act::kSilu, 0, 0, false, "linear errors"};
  Problem pr = make_problem(DType::kF32, c, 3);
  auto experts = PackedExperts::pack(weights_of(pr), Isa::kGeneric, 1);
  threw = false;
  try { experts->linear(x.data(), 2, out.data(), MoeParams{}); } catch (const std::invalid_argument&) { threw = true; }
  report(threw, "linear() on experts raises");
}

}  // namespace tests_quant
