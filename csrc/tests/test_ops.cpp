// The decode step's small ops: RMSNorm, residual add, silu_mul, a shared expert's gate, the gated
// MLP, every tier against the baseline build and double precision.
#include "tests/harness.h"

namespace tests_ops {

// rms_norm against a double-precision RMSNorm: within one rounding of h and one of the product.
void test_rms_norm() {
  if (!selected("rms_norm")) return;
  std::mt19937 rng(5);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t n : {1, 15, 16, 17, 128, 2048}) {
      const int64_t rows = 3;
      auto x = random_array(dt, rows * n, 1.0f, rng);
      const auto w = random_array(dt, n, 1.0f, rng);
      std::vector<uint8_t> out(static_cast<size_t>(rows * n) * dtype_size(dt), 0xff);
      rms_norm(dt, x.data(), rows, n, w.data(), 1e-6f, out.data());
      double worst = 0;
      for (int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (int64_t k = 0; k < n; ++k) ss += double(load_elem(dt, x.data(), r * n + k)) * load_elem(dt, x.data(), r * n + k);
        const double inv = 1.0 / std::sqrt(ss / double(n) + 1e-6);
        for (int64_t k = 0; k < n; ++k) {
          const double ref = double(load_elem(dt, w.data(), k)) * load_elem(dt, x.data(), r * n + k) * inv;
          const double got = load_elem(dt, out.data(), r * n + k);
          worst = std::max(worst, std::fabs(got - ref) / std::max(std::fabs(ref), 1e-30));
        }
      }
      // two roundings to the dtype (h, then w*h): 2 ulp relative, plus fp32 noise
      const double lim = dt == DType::kF32 ? 1e-6 : dt == DType::kBF16 ? 2.0 / 128 : 2.0 / 1024;
      note(std::string("rms_norm ") + dtype_name(dt), worst);
      report(worst <= lim, std::string("rms_norm ") + dtype_name(dt) + " n=" + std::to_string(n) + ": rel err " +
                               std::to_string(worst));
    }
  }
}

// add: each value a + b in fp32 (exact for two bf16/fp16 values, one rounding for fp32) rounded
// to the dtype; add_rms_norm: the same bits as add() then rms_norm(), also in place (sum == a).
void test_add_rms_norm() {
  if (!selected("add_rms_norm")) return;
  std::mt19937 rng(9);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const int64_t rows = 3, n = 2049;
    const size_t bytes = static_cast<size_t>(rows * n) * dtype_size(dt);
    const auto a = random_array(dt, rows * n, 4.0f, rng), b = random_array(dt, rows * n, 4.0f, rng);
    const auto w = random_array(dt, n, 1.0f, rng);
    std::vector<uint8_t> sum(bytes), want_sum(bytes), want(bytes), out(bytes, 0xff);
    for (int64_t i = 0; i < rows * n; ++i)
      store_elem(dt, want_sum.data(), i, load_elem(dt, a.data(), i) + load_elem(dt, b.data(), i));
    add(dt, a.data(), b.data(), rows * n, sum.data());
    report(sum == want_sum, std::string("add ") + dtype_name(dt) + ": a + b rounded once");
    rms_norm(dt, want_sum.data(), rows, n, w.data(), 1e-5f, want.data());
    add_rms_norm(dt, a.data(), b.data(), rows, n, w.data(), 1e-5f, sum.data(), out.data());
    report(sum == want_sum && out == want, std::string("add_rms_norm ") + dtype_name(dt) + ": add then rms_norm");
    auto inplace = a;
    std::fill(out.begin(), out.end(), 0xff);
    add_rms_norm(dt, inplace.data(), b.data(), rows, n, w.data(), 1e-5f, inplace.data(), out.data());
    report(inplace == want_sum && out == want, std::string("add_rms_norm ") + dtype_name(dt) + ": sum in place of a");
  }
}

// silu_mul on every tier against double precision (silu rounded to the dtype, then the product):
// within one rounding of each (fp32: a few ulps), extreme values and tails included; the
// generic build is the scalar formula. shared_combine against its steps in double; in place
// (out = routed) the same bits. gated_mlp_decode: the same bits as its three steps called one by
// one, with 1 and 2 threads.
void test_gated_mlp(const std::vector<Isa>& tiers) {
  if (!selected("gated_mlp")) return;
  std::mt19937 rng(13);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const int64_t n = 1000;
    auto g = random_array(dt, n, 6.0f, rng);
    const auto u = random_array(dt, n, 1.0f, rng);
    const float edge[] = {-100.0f, -88.5f, -87.5f, -20.0f, 0.0f, 20.0f, 100.0f};
    for (int i = 0; i < 7; ++i) store_elem(dt, g.data(), i, edge[i]);
    const double lim = dt == DType::kF32 ? 4e-7 : dt == DType::kBF16 ? 2.0 / 256 : 2.0 / 2048;
    for (Isa isa : tiers) {
      for (int64_t m : {int64_t{1}, int64_t{15}, int64_t{17}, n}) {
        std::vector<uint8_t> out(static_cast<size_t>(m) * dtype_size(dt), 0xff);
        silu_mul(dt, isa, g.data(), u.data(), m, out.data());
        double worst = 0;
        for (int64_t i = 0; i < m; ++i) {
          const double z = load_elem(dt, g.data(), i);
          const float a = detail::round_to(dt, static_cast<float>(z / (1.0 + std::exp(-z))));
          const double ref = detail::round_to(dt, a * load_elem(dt, u.data(), i));
          const double got = load_elem(dt, out.data(), i);
          // below the dtype's normal range an absolute step counts (float16's subnormals; an
          // e^z beyond float32's range makes the kernel's silu exactly 0 where double's is 1e-42)
          const double floor = dt == DType::kF16 ? 6e-8 : 1e-30;
          worst = std::max(worst, std::max(0.0, std::fabs(got - ref) - floor) / std::max(std::fabs(ref), 1e-37));
        }
        note(std::string("silu_mul ") + dtype_name(dt), worst);
        report(worst <= lim, std::string("silu_mul ") + dtype_name(dt) + " " + isa_name(isa) + " n=" +
                                 std::to_string(m) + ": rel err " + std::to_string(worst));
      }
    }
    const int64_t B = 3, H = 37;
    const auto routed = random_array(dt, B * H, 1.0f, rng), shared = random_array(dt, B * H, 2.0f, rng);
    auto logit = random_array(dt, B, 8.0f, rng);
    store_elem(dt, logit.data(), 0, -100.0f);
    std::vector<uint8_t> out(routed.size());
    shared_combine(dt, routed.data(), shared.data(), logit.data(), B, H, out.data());
    bool ok = true;
    for (int64_t b = 0; b < B; ++b) {
      const double z = load_elem(dt, logit.data(), b);
      const float s = detail::round_to(dt, static_cast<float>(1.0 / (1.0 + std::exp(-z))));
      for (int64_t j = 0; j < H; ++j) {
        const float p = detail::round_to(dt, s * load_elem(dt, shared.data(), b * H + j));
        const float want = detail::round_to(dt, load_elem(dt, routed.data(), b * H + j) + p);
        const double got = load_elem(dt, out.data(), b * H + j);
        ok = ok && std::fabs(got - want) <= (dt == DType::kF32 ? 1e-6 : 2.0 / 256) * std::max(std::fabs(double(want)), 1e-30);
      }
    }
    auto inplace = routed;
    shared_combine(dt, inplace.data(), shared.data(), logit.data(), B, H, inplace.data());
    report(ok && inplace == out, std::string("shared_combine ") + dtype_name(dt) + ": sigmoid, product, sum");

    const int64_t Hd = 48, I = 40, T = 2;
    const auto wgu = random_array(dt, 2 * I * Hd, 1.0f / std::sqrt(float(Hd)), rng);
    const auto wd = random_array(dt, Hd * I, 1.0f / std::sqrt(float(I)), rng);
    const auto x = random_array(dt, T * Hd, 1.0f, rng);
    const size_t es = dtype_size(dt);
    for (Isa isa : tiers) {
      auto gu = PackedExperts::pack_linear(dt, 2 * I, Hd, wgu.data(), nullptr, isa, 2);
      auto down = PackedExperts::pack_linear(dt, Hd, I, wd.data(), nullptr, isa, 2);
      std::vector<uint8_t> s_gu(static_cast<size_t>(T * 2 * I) * es), s_m(static_cast<size_t>(T * I) * es);
      std::vector<uint8_t> want(static_cast<size_t>(T * Hd) * es), got1(want.size(), 0xff), got2(want.size(), 0xfe);
      MoeParams p;
      p.num_threads = 1;
      gu->linear(x.data(), T, s_gu.data(), p);
      for (int64_t t = 0; t < T; ++t)
        silu_mul(dt, isa, s_gu.data() + static_cast<size_t>(t * 2 * I) * es,
                 s_gu.data() + static_cast<size_t>(t * 2 * I + I) * es, I, s_m.data() + static_cast<size_t>(t * I) * es);
      down->linear(s_m.data(), T, want.data(), p);
      for (int threads : {1, 2}) {
        std::vector<uint8_t> a(s_gu.size()), mid(s_m.size());
        GatedMlpArgs args{dt, T, I, gu.get(), MoeParams{}, down.get(), MoeParams{}, x.data(), a.data(), mid.data(),
                          threads == 1 ? got1.data() : got2.data()};
        gated_mlp_decode(args, threads);
      }
      report(got1 == want && got2 == want, std::string("gated_mlp_decode ") + dtype_name(dt) + " " + isa_name(isa) +
                                               ": its three steps, 1 and 2 threads");
    }
  }
}

}  // namespace tests_ops
