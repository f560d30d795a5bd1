// The experts op on lossless weights: every tier against the oracle and its generic twin, pack and
// unpack, deterministic threads and splits, a forked child, errors, blocks built in caller memory.
#if defined(__unix__)
#include <sys/wait.h>
#include <unistd.h>
#endif

#include <cfenv>

#include "tests/harness.h"

namespace tests_experts {

void test_case(DType dt, const Case& c, uint32_t seed, const std::vector<Isa>& tiers) {
  if (!sampled()) return;
  const std::string tag = std::string(dtype_short(dt)) + " T" + std::to_string(c.T) + " E" +
                          std::to_string(c.E) + " K" + std::to_string(c.K) + " H" +
                          std::to_string(c.H) + " I" + std::to_string(c.I) + " " + act_name(c.act) +
                          " (" + c.why + ")";
  if (!selected(tag)) return;
  const Problem p = make_problem(dt, c, seed);
  const ExpertWeights w = weights_of(p);
  const std::vector<float> want = oracle(p);

  auto gen = PackedExperts::pack(w, Isa::kGeneric, 1);
  for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
    const char* name = nullptr;
    const std::vector<float> ref = run(*gen, p, path, 2, &name);
    const double e0 = rel_err(ref, want);
    report(e0 <= tol(dt), tag + " " + name + " vs oracle: rel err " + std::to_string(e0));
    note(std::string(name) + " vs oracle", e0);
    for (Isa isa : tiers) {
      auto pe = PackedExperts::pack(w, isa, 2);
      const std::vector<float> got = run(*pe, p, path, 2, &name);
      const double e = rel_err(got, ref);
      report(e <= tol(dt), tag + " " + name + " vs generic: rel err " + std::to_string(e));
      note(std::string(name) + " vs generic", e);
      // the Arm tiers run their own FMA kernels for every lossless dtype (not the generic ones),
      // tier bf16 its BFDOT / BFMMLA kernels for bf16 models
      if (isa == Isa::kNeon || isa == Isa::kDotprod || isa == Isa::kI8mm || isa == Isa::kBf16) {
        const bool bfdot = isa == Isa::kBf16 && dt == DType::kBF16;
        report(ends_with(name, bfdot ? "_neonbf16" : "_neon"),
               tag + " " + isa_name(isa) + " runs the " + (bfdot ? "neonbf16" : "neon") + " kernels: " + name);
      }
      // the bf16-tile (AMX) and bf16-dot kernels round x and h to bf16: also against the twin
      // that rounds where they do; the dot kernels at 2e-3 (x86's measured <= 4e-5 on the AMD EPYC
      // of 2026-11-30, a3f9ea6: summation order and denormals only; Arm's BFDOT also rounds to odd,
      // test_bf16dot_rows), the AMX one at the plain tolerance
      const bool dot = ends_with(name, "_avx512bf16") || ends_with(name, "_neonbf16");
      if (dot || ends_with(name, "_amx")) {
        detail::KernelImpl twin;
        detail::get_kernels_generic(dt, true, &twin);
        const std::vector<float> tw = run(*gen, p, path, 2, nullptr, &twin);
        const double et = rel_err(got, tw);
        report(et <= (dot ? 2e-3 : tol(dt)), tag + " " + name + " vs generic amx twin: rel err " + std::to_string(et));
        note(std::string(name) + " vs generic amx twin", et);
      }
    }
  }
}

void test_unpack_roundtrip(DType dt, const std::vector<Isa>& tiers) {
  const std::string tag = std::string("unpack roundtrip ") + dtype_short(dt);
  if (!selected(tag)) return;
  for (bool gated : {true, false}) {
    Case c{2, 3, 1, 37, 21, gated, true, false, Act::kSilu, 0, 0, false, "odd sizes"};
    const Problem p = make_problem(dt, c, 7);
    for (Isa isa : tiers) {
      auto pe = PackedExperts::pack(weights_of(p), isa, 2);
      std::vector<uint8_t> g(p.up.size()), u(p.up.size()), d(p.down.size()), bg(p.bu.size()),
          bu(p.bu.size()), bd(p.bd.size());
      pe->unpack(gated ? g.data() : nullptr, u.data(), d.data(), gated ? bg.data() : nullptr,
                 bu.data(), bd.data());
      bool ok = u == p.up && d == p.down && bu == p.bu && bd == p.bd;
      if (gated) ok = ok && g == p.gate && bg == p.bg;
      report(ok, tag + (gated ? " gated " : " no-gate ") + isa_name(isa));
    }
  }
}

// Tier bf16's kernels (aarch64 CPUs with bf16; forced, on both paths) at every row count an
// expert's rows can end in: 1..9 (two BFMMLA pairs, a pair and a BFDOT row, a pair, a row), 17,
// 33, 512; gated and up-only; all rows on one expert. Against the generic AMX twin (x, h in bf16
// where these round them) at the x86 bf16 dot kernel's 2e-3: BFDOT / BFMMLA round each pair's sum
// and each accumulation to odd (within 1 ulp, where the twin's FMAs are within 1/2 a k) and flush
// denormals (Arm ARM, BFDotAdd), so the twin is a bound, not an equality. What must be exact: each
// row's output alone (T = 1: BFDOT) equals its output in a block of T (BFMMLA pairs), bit for bit,
// as both add the k pairs of a column in the same order.
void test_bf16dot_rows() {
#if defined(__aarch64__)
  if (!selected("bf16dot rows")) return;
  if (!isa_supported(cpu_features(), Isa::kBf16)) {
    std::printf("skip bf16dot rows: tier bf16 not supported on this machine\n");
    return;
  }
  detail::KernelImpl k, twin;
  report(detail::get_kernels_neonbf16(DType::kBF16, &k) && !detail::get_kernels_neonbf16(DType::kF32, &twin) &&
             !detail::get_kernels_neonbf16(DType::kF16, &twin),
         "bf16dot rows: the neonbf16 kernels take bf16 models only");
  detail::get_kernels_generic(DType::kBF16, true, &twin);
  uint32_t seed = 91;
  for (const int64_t T : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 512})
    for (const bool gated : {true, false}) {
      if (!gated && T != 3 && T != 6 && T != 33) continue;  // up-only: G = 1 pairs and remainders
      // H = 161: Hk = 192 (k padding); I = 80: 5 panels, down's k padded to 96
      const Case c{T, 2, 1, 161, 80, gated, T % 2 == 1, false, Act::kSilu, 0, 1, false, "bf16dot rows"};
      const Problem p = make_problem(DType::kBF16, c, seed++);
      auto gen = PackedExperts::pack(weights_of(p), Isa::kGeneric, 1);
      for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
        const std::string kn = std::string("moe_") + path_name(path) + "_bf16_neonbf16";
        const std::string tag = "bf16dot rows: " + kn + (gated ? " gated" : " up-only") + " T=" + std::to_string(T);
        const std::vector<float> got = run(*gen, p, path, 2, nullptr, &k, kn.c_str());
        const double e = rel_err(got, run(*gen, p, path, 2, nullptr, &twin));
        report(e <= 2e-3, tag + " vs generic amx twin: rel err " + std::to_string(e));
        note("neonbf16 rows vs generic amx twin", e);
        if (T == 1 || T > 33) continue;
        bool same = true;
        for (int64_t t = 0; t < T && same; ++t) {
          Problem p1 = p;
          p1.c.T = 1;
          const size_t rb = static_cast<size_t>(c.H) * 2;
          p1.x.assign(p.x.begin() + t * rb, p.x.begin() + (t + 1) * rb);
          p1.idx.assign(1, p.idx[t]);
          p1.w.assign(1, p.w[t]);
          const std::vector<float> one = run(*gen, p1, path, 1, nullptr, &k, kn.c_str());
          same = std::memcmp(one.data(), got.data() + t * c.H, one.size() * sizeof(float)) == 0;
        }
        report(same, tag + ": every row alone (BFDOT) == in the block (BFMMLA pairs), bit for bit");
      }
    }
#endif
}

#if defined(__aarch64__)
// The Arm ARM's BFDotAdd (FEAT_EBF16 absent or FPCR.EBF = 0, as Linux starts a process):
// addend + (a0 b0 + a1 b1), the products exact in fp32 (8-bit significands), the pair sum and the
// accumulation each rounded to odd (truncate, then set the last bit when inexact), denormal
// inputs and results flushed to zero. Written from the pseudo-code, not from the kernels.
static float ftz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }
static float add_odd(float a, float b) {
  const int mode = std::fegetround();
  std::fesetround(FE_TOWARDZERO);
  std::feclearexcept(FE_INEXACT);
  volatile float va = ftz(a), vb = ftz(b);
  volatile float s = va + vb;
  const bool inexact = std::fetestexcept(FE_INEXACT) != 0;
  std::fesetround(mode);
  float r = s;
  uint32_t u;
  std::memcpy(&u, &r, 4);
  if (inexact) u |= 1u;
  std::memcpy(&r, &u, 4);
  return ftz(r);
}
static float bfdot_add(float acc, uint16_t a0, uint16_t a1, uint16_t b0, uint16_t b1) {
  auto mul = [](uint16_t a, uint16_t b) {
    return ftz(static_cast<float>(double(ftz(detail::bf16_to_f32(a))) * ftz(detail::bf16_to_f32(b))));
  };
  return add_odd(acc, add_odd(mul(a0, b0), mul(a1, b1)));
}
// Column n of matrix gi of a bf16 panel ([Kp/2][G][16][2]) dotted with row x by that chain.
static float bfdot_column(const uint16_t* panel, int64_t Kp, int G, int gi, int64_t n, const uint16_t* x) {
  float s = 0.0f;
  for (int64_t kk = 0; kk < Kp; kk += 2) {
    const int64_t e = (((kk / 2) * G + gi) * detail::kPanelN + n) * 2;
    s = bfdot_add(s, x[kk], x[kk + 1], panel[e], panel[e + 1]);
  }
  return s;
}
#endif

// Tier bf16's kernels called directly (not through the driver, whose bf16 output would hide the
// last bits) against bfdot_add above, bit for bit: down's fp32 sums (routing weight 1, no bias:
// acc = fma(1, y, 0)) and gate/up's bf16 h (silu, gated; identity, up-only) at 1..9 rows, the
// row blocks of BFMMLA pairs and BFDOT rows. Under qemu-user this checks the kernels' order of
// operations against the Arm ARM's arithmetic as qemu implements it; on Arm hardware, the hardware's.
void test_bf16dot_exact() {
#if defined(__aarch64__)
  if (!selected("bf16dot exact")) return;
  if (!isa_supported(cpu_features(), Isa::kBf16)) {
    std::printf("skip bf16dot exact: tier bf16 not supported on this machine\n");
    return;
  }
  detail::KernelImpl k;
  detail::get_kernels_neonbf16(DType::kBF16, &k);
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto bf = [&](float scale) { return detail::f32_to_bf16(scale * nd(rng)); };
  constexpr int64_t H = 48, I = 40, Hk = 96, Ik = 64, In = 48, Hn = 48;  // (I: 3 panels, the last partial)
  for (int64_t T = 1; T <= 9; ++T) {
    // down: panels bf16 [Ik/2][16][2], element (k, n) at ((k / 2) * 16 + n) * 2 + k % 2
    {
      const detail::Layout L{DType::kBF16, 2, 1, H, I, Hk, In, Ik, Hn};
      const int64_t pe = detail::down_panel_bytes(L) / 2;
      std::vector<uint16_t> w(static_cast<size_t>(pe * (Hn / detail::kPanelN))), h(static_cast<size_t>(T * Ik));
      for (auto& v : w) v = bf(0.2f);
      for (auto& v : h) v = bf(1.0f);
      std::vector<float> acc(static_cast<size_t>(T * Hn), 0.0f), wt(static_cast<size_t>(T), 1.0f);
      std::vector<float*> rows(static_cast<size_t>(T));
      for (int64_t r = 0; r < T; ++r) rows[r] = acc.data() + r * Hn;
      detail::DownJob j{};
      j.w = w.data();
      j.p0 = 0;
      j.p1 = Hn / detail::kPanelN;
      j.h = h.data();
      j.h_stride = Ik;
      j.nt = T;
      j.wt = wt.data();
      j.acc = rows.data();
      j.L = &L;
      k.down(j);
      bool same = true;
      for (int64_t r = 0; r < T; ++r)
        for (int64_t c = 0; c < H; ++c) {
          const float y = bfdot_column(w.data() + (c / detail::kPanelN) * pe, Ik, 1, 0, c % detail::kPanelN, &h[r * Ik]);
          const float want = std::fma(1.0f, y, 0.0f);
          same = same && std::memcmp(&want, &acc[r * Hn + c], 4) == 0;
        }
      report(same, "bf16dot exact: down T=" + std::to_string(T) + " == the Arm ARM's BFDotAdd chain, bit for bit");
    }
    // gate/up: panels bf16 [Hk/2][G][16][2]
    for (const bool gated : {true, false}) {
      const int G = gated ? 2 : 1;
      const detail::Layout L{DType::kBF16, 2, G, H, I, Hk, In, Ik, Hn};
      const int64_t pe = detail::gu_panel_bytes(L) / 2;
      std::vector<uint16_t> w(static_cast<size_t>(pe * (In / detail::kPanelN))), x(static_cast<size_t>(T * Hk));
      for (auto& v : w) v = bf(0.2f);
      for (auto& v : x) v = bf(1.0f);
      std::vector<const void*> xr(static_cast<size_t>(T));
      for (int64_t r = 0; r < T; ++r) xr[r] = x.data() + r * Hk;
      std::vector<uint16_t> h(static_cast<size_t>(T * In), 0xffff);
      const detail::ActParams act{gated ? Act::kSilu : Act::kIdentity, 1.0f, INFINITY, INFINITY, INFINITY, 0.0f};
      detail::GateUpJob j{};
      j.w = w.data();
      j.p0 = 0;
      j.p1 = In / detail::kPanelN;
      j.x = xr.data();
      j.x_stride = Hk;
      j.nt = T;
      j.h = h.data();
      j.h_stride = In;
      j.L = &L;
      j.act = &act;
      k.gateup(j);
      bool same = true;
      for (int64_t r = 0; r < T; ++r)
        for (int64_t c = 0; c < In; ++c) {
          const uint16_t* wp = w.data() + (c / detail::kPanelN) * pe;
          float s[2];
          for (int gi = 0; gi < G; ++gi) s[gi] = bfdot_column(wp, Hk, G, gi, c % detail::kPanelN, &x[r * Hk]);
          const float hv = c < I ? detail::h_scalar(act, gated, s[0], s[G - 1]) : 0.0f;
          same = same && h[r * In + c] == detail::f32_to_bf16(hv);
        }
      report(same, std::string("bf16dot exact: gate/up ") + (gated ? "gated" : "up-only") + " T=" + std::to_string(T) +
                       " == the Arm ARM's BFDotAdd chain, bit for bit");
    }
  }
#endif
}

void test_threads_deterministic(const std::vector<Isa>& tiers) {
  if (!selected("threads")) return;
  Case c{19, 6, 2, 80, 48, true, true, false, Act::kSilu, 0, 0, false, "thread counts"};
  const Problem p = make_problem(DType::kF32, c, 11);
  for (Isa isa : tiers) {
    auto pe = PackedExperts::pack(weights_of(p), isa, 1);
    for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
      const std::vector<float> r1 = run(*pe, p, path, 1, nullptr);
      for (int th : {2, 3, 5}) {
        const std::vector<float> rn = run(*pe, p, path, th, nullptr);
        report(std::memcmp(r1.data(), rn.data(), r1.size() * 4) == 0,
               std::string("threads ") + std::to_string(th) + " bit-identical to 1, " + isa_name(isa) +
                   " " + path_name(path));
      }
    }
  }
}

// The dynamic split (default) and the static split give bit-identical results, for every tier,
// format and path: the split only changes which thread computes an item, never the order.
void test_split_deterministic(const std::vector<Isa>& tiers) {
  if (!selected("split")) return;
  Case c{23, 7, 3, 96, 80, true, true, false, Act::kSilu, 0, 0, false, "split"};
  Problem p = make_problem(DType::kBF16, c, 13);
  for (Isa isa : tiers) {
    for (const QuantSpec q : {QuantSpec{WFormat::kLossless, 64}, QuantSpec{WFormat::kInt8, 64},
                              QuantSpec{WFormat::kInt4, 32}}) {
      auto pe = PackedExperts::pack(weights_of(p), isa, 2, q);
      for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
        p.params.static_split = true;
        const std::vector<float> a = run(*pe, p, path, 2, nullptr);
        p.params.static_split = false;
        for (int th : {2, 3}) {
          const std::vector<float> b = run(*pe, p, path, th, nullptr);
          report(std::memcmp(a.data(), b.data(), a.size() * 4) == 0,
                 std::string("split: dynamic == static, ") + isa_name(isa) + " " + wformat_name(q.fmt) + " " +
                     path_name(path) + " threads " + std::to_string(th));
        }
      }
    }
  }
}

// A forked child has a copy of the pool without its threads: regions must run inline there
// instead of waiting forever for workers that do not exist.
void test_fork_child() {
#if defined(__unix__)
  if (!selected("fork")) return;
  Case c{9, 5, 2, 48, 40, true, false, false, Act::kSilu, 0, 0, false, "fork"};
  const Problem p = make_problem(DType::kF32, c, 5);
  auto pe = PackedExperts::pack(weights_of(p), Isa::kGeneric, 2);
  const std::vector<float> parent = run(*pe, p, MoePath::kDecode, 2, nullptr);  // pool now has threads
  const pid_t pid = fork();
  if (pid == 0) {
    const std::vector<float> child = run(*pe, p, MoePath::kDecode, 2, nullptr);
    _exit(child == parent ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  report(WIFEXITED(status) && WEXITSTATUS(status) == 0, "forked child runs the op (inline pool)");
#endif
}

void test_errors() {
  if (!selected("errors")) return;
  Case c{2, 4, 2, 32, 16, true, false, false, Act::kSilu, 0, 0, false, "errors"};
  Problem p = make_problem(DType::kF32, c, 3);
  auto pe = PackedExperts::pack(weights_of(p), Isa::kGeneric, 1);
  p.idx[3] = 4;  // == E
  bool threw = false;
  std::string msg;
  try {
    run(*pe, p, MoePath::kAuto, 1, nullptr);
  } catch (const std::invalid_argument& e) {
    threw = true;
    msg = e.what();
  }
  report(threw && msg.find("topk_idx[1, 1] = 4") != std::string::npos, "idx >= E raises: " + msg);
  // int64 indices give the same result as int32.
  Problem q = make_problem(DType::kF32, c, 3);
  std::vector<int64_t> idx64(q.idx.begin(), q.idx.end());
  std::vector<float> o32(static_cast<size_t>(c.T * c.H)), o64(o32.size());
  pe->forward(q.x.data(), c.T, q.idx.data(), 32, q.w.data(), c.K, o32.data(), q.params);
  pe->forward(q.x.data(), c.T, idx64.data(), 64, q.w.data(), c.K, o64.data(), q.params);
  report(o32 == o64, "int64 topk_idx == int32 topk_idx");
}


// RoutingTrim: rows worked by hand (as tests/test_trim.py's oracle test), and a trimmed block's
// outputs equal the untrimmed block's on the trimmed routing, bit for bit, on both paths.
void test_trim(const std::vector<Isa>& tiers) {
  if (!selected("trim")) return;
  const int64_t idx[] = {4, 7, 1, 9, 2, 3, -1, 5, 0, 1, 2, 3};
  const float w[] = {0.1f, 0.5f, 0.3f, 0.1f, 0.2f, 0.2f, 0.9f, 0.05f, 0.25f, 0.25f, 0.25f, 0.25f};
  int64_t oi[12];
  float ow[12];
  RoutingTrim t;
  t.mode = RoutingTrim::Mode::kAdaptive;
  t.threshold = 0.5f;
  int64_t kept = trim_routing(t, idx, 64, w, DType::kF32, 3, 4, 10, oi, ow);
  const std::vector<int64_t> want_a = {-1, 7, 1, -1, 2, 3, -1, -1, 0, 1, 2, 3};
  report(kept == 8 && std::vector<int64_t>(oi, oi + 12) == want_a, "trim adaptive 0.5 keeps the hand-worked slots");
  t.mode = RoutingTrim::Mode::kFixed;
  t.keep = 1;
  t.renorm = true;
  kept = trim_routing(t, idx, 64, w, DType::kF32, 3, 4, 10, oi, ow);
  const std::vector<int64_t> want_f = {-1, 7, -1, -1, 2, -1, -1, -1, 0, -1, -1, -1};
  report(kept == 3 && std::vector<int64_t>(oi, oi + 12) == want_f && ow[1] == 0.5f * (1.0f / 0.5f) &&
             ow[4] == 0.2f * ((0.2f + 0.2f + 0.05f) / 0.2f),
         "trim fixed 1 keeps the largest (equal weights: the earlier slot) and renormalises");
  bool threw = false;
  try {
    trim_routing(t, idx, 64, w, DType::kF32, 3, 4, 9, oi, ow);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  report(threw, "trim refuses an index >= E");

  Case c{9, 8, 5, 64, 48, true, false, false, Act::kSilu, 0, 0, false, "trim"};
  const Problem p = make_problem(DType::kBF16, c, 11);
  for (Isa isa : tiers) {
    for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
      auto trimmed = PackedExperts::pack(weights_of(p), isa, 2);
      auto plain = PackedExperts::pack(weights_of(p), isa, 2);
      RoutingTrim a;
      a.mode = RoutingTrim::Mode::kAdaptive;
      a.threshold = 0.6f;
      a.renorm = true;
      trimmed->set_trim(a);
      const std::vector<float> got = run(*trimmed, p, path, 2, nullptr);
      std::vector<int64_t> ti(p.idx.size());
      std::vector<float> tw(p.w.size());
      const int64_t k = trim_routing(a, p.idx.data(), 32, p.w.data(), DType::kF32, c.T, c.K, c.E, ti.data(), tw.data());
      Problem q = p;
      for (size_t i = 0; i < ti.size(); ++i) q.idx[i] = static_cast<int32_t>(ti[i]);
      q.w = tw;
      const std::vector<float> want = run(*plain, q, path, 2, nullptr);
      report(got == want && k < c.T * c.K && trimmed->routed_tokens() == c.T && trimmed->routed_slots() == k,
             std::string("trimmed block == block on the trimmed routing, ") + isa_name(isa) + " " + path_name(path));
    }
  }
}

// The block can be built expert by expert into caller memory, and viewed read-only again.
void test_create_view() {
  if (!selected("create/view")) return;
  Case c{5, 6, 2, 96, 40, true, true, false, Act::kSilu, 0, 0, false, "stream"};
  const Problem p = make_problem(DType::kBF16, c, 9);
  const ExpertWeights w = weights_of(p);
  for (const QFmt& q : {QFmt{WFormat::kLossless, 64, "lossless"}, kQFmts[0], kQFmts[2]}) {
    auto whole = PackedExperts::pack(w, Isa::kGeneric, 2, {q.fmt, q.group});
    const PackedHeader h = whole->header();
    void* mem = nullptr;
    if (posix_memalign(&mem, 64, h.nbytes) != 0) std::abort();
    std::memset(mem, 0x5A, h.nbytes);
    {
      auto pe = PackedExperts::create(h, mem);
      for (int64_t e = 0; e < c.E; ++e) {
        ExpertWeights we = w;
        we.E = 1;
        const size_t esz = dtype_size(w.dtype);
        auto sl = [&](const void* base, int64_t n) {
          return base ? static_cast<const uint8_t*>(base) + static_cast<size_t>(e * n) * esz : nullptr;
        };
        we.gate = sl(w.gate, c.I * c.H);
        we.up = sl(w.up, c.I * c.H);
        we.down = sl(w.down, c.H * c.I);
        we.gate_bias = sl(w.gate_bias, c.I);
        we.up_bias = sl(w.up_bias, c.I);
        we.down_bias = sl(w.down_bias, c.H);
        pe->pack_experts(e, we, 1);
      }
    }
    // Padding bytes are left as they were: compare what the kernels read through forward().
    auto v = PackedExperts::view(h, mem, h.nbytes);
    const char* n1 = nullptr;
    const std::vector<float> a = run(*whole, p, MoePath::kDecode, 2, &n1);
    const std::vector<float> b = run(*v, p, MoePath::kDecode, 2, nullptr);
    report(a == b, std::string("create/view ") + q.name + ": expert-by-expert pack == pack");
    bool threw = false;
    try { PackedExperts::view(h, mem, h.nbytes - 64); } catch (const std::invalid_argument&) { threw = true; }
    report(threw, std::string("create/view ") + q.name + ": size mismatch refused");
    PackedHeader bad = h;
    bad.version = 1;
    threw = false;
    try { PackedExperts::view(bad, mem, h.nbytes); } catch (const std::invalid_argument&) { threw = true; }
    report(threw, std::string("create/view ") + q.name + ": old layout version refused");
    bad = h;
    bad.Hk += 32;
    threw = false;
    try { PackedExperts::view(bad, mem, h.nbytes); } catch (const std::invalid_argument&) { threw = true; }
    report(threw, std::string("create/view ") + q.name + ": inconsistent header refused");
    std::free(mem);
  }
  // Shapes whose byte counts would wrap: found by the fuzz driver (a store header with E = 2^60,
  // H 160, I 129, int4, nbytes 0 was accepted with an empty block); now refused by the planner.
  for (const int64_t big : {int64_t{1} << 60, int64_t{1} << 31, INT64_MAX}) {
    for (int dim = 0; dim < 3; ++dim) {
      bool refused = false;
      try {
        plan_packed(DType::kF16, dim == 0 ? big : 2, dim == 1 ? big : 160, dim == 2 ? big : 129, true,
                    false, false, false, Isa::kGeneric, {WFormat::kInt4, 32});
      } catch (const std::invalid_argument&) { refused = true; }
      report(refused, "create/view: " + std::string(dim == 0 ? "E" : dim == 1 ? "H" : "I") + " = " +
                          std::to_string(big) + " refused by plan_packed");
    }
  }
  {  // E within int32 but the block beyond 2^62 bytes
    bool refused = false;
    try { plan_packed(DType::kF32, INT32_MAX, INT32_MAX, INT32_MAX, true, true, true, true, Isa::kGeneric, {}); }
    catch (const std::invalid_argument& e) { refused = std::string(e.what()).find("2^62") != std::string::npos; }
    report(refused, "create/view: a block over 2^62 bytes refused");
  }
  {  // the fuzzer's input itself: a header that wraps to nbytes 0, with an empty block
    PackedHeader h = plan_packed(DType::kF16, 1, 160, 129, true, false, false, false, Isa::kGeneric, {WFormat::kInt4, 32});
    h.E = int64_t{1} << 60;
    h.nbytes = 0;
    alignas(64) static uint8_t empty[64];
    bool refused = false;
    try { PackedExperts::view(h, empty, 0); } catch (const std::invalid_argument&) { refused = true; }
    report(refused, "create/view: header with E = 2^60 and nbytes 0 (wrapped) refused");
  }
  bool threw = false;
  try { plan_packed(DType::kBF16, 2, 64, 64, true, false, false, false, Isa::kGeneric, {WFormat::kInt4, 48}); }
  catch (const std::invalid_argument& e) { threw = std::string(e.what()).find("32, 64 or 128") != std::string::npos; }
  report(threw, "create/view: int4 group 48 refused with the allowed sizes");
}

}  // namespace tests_experts
