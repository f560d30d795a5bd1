// The C++ test runner (hina_tests): every ISA kernel this machine supports vs its generic twin,
// and the generic kernels vs a naive double-precision oracle computed from the unpacked weights.
// The tests live by concern in test_experts, test_quant, test_l12, test_ops and test_attention
// (harness.h: the shared helpers); this file runs them in one fixed order (seeds and --every
// depend on it).
//
// Build and run (from the repository root):
//   cmake -S . -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build build/cpp
//   ./build/cpp/hina_tests            # optional filter: ./build/cpp/hina_tests bf16
//   ./build/cpp/hina_tests --hardware-only  # no amx tier on software tiles where the CPU lacks AMX
//   ./build/cpp/hina_tests --every 3  # every 3rd (case, dtype, format) run only, rotating so each
//                                     # case still runs in some dtype/format (sanitizer runs in CI)
// Exits non-zero on any mismatch; the last line is "N passed, N failed".
#include "tests/harness.h"

#if defined(__x86_64__)
namespace hina::detail {
uint64_t read_streams_avx512(const uint64_t* const* base, int streams, int64_t len);
uint64_t read_streams_avx2(const uint64_t* const* base, int streams, int64_t len);
}  // namespace hina::detail
#endif

// the memory tier (test_tier.cpp): declared here, where it is run, not in harness.h
namespace tests_tier {
void test_tier(const std::vector<Isa>& tiers);
}  // namespace tests_tier

using namespace tests_attention;
using namespace tests_experts;
using namespace tests_l12;
using namespace tests_ops;
using namespace tests_quant;

// The read-bandwidth probe's vector loops read every 64-byte line of every stream: their XOR folds
// against a scalar model of the same fold (a loop that skipped lines would probe too high).
static void test_read_streams(const std::vector<Isa>& tiers) {
#if defined(__x86_64__)
  constexpr int kStreams = 16;
  for (int streams : {kStreams, 3}) {  // 3: the loops' odd-stream tails
    const int64_t len = 8 * 37;
    std::vector<uint64_t> buf(static_cast<size_t>(streams * len) + 8);
    std::mt19937_64 rng(7);
    for (auto& v : buf) v = rng();
    // 64-byte aligned streams, as the probe's buffer is
    uint64_t* base0 = buf.data();
    while (reinterpret_cast<uintptr_t>(base0) % 64) ++base0;
    const uint64_t* base[kStreams];
    for (int k = 0; k < streams; ++k) base[k] = base0 + k * len;
    uint64_t x[8] = {0};  // XOR of every line, lane by lane
    for (int k = 0; k < streams; ++k)
      for (int64_t i = 0; i < len; ++i) x[i % 8] ^= base[k][i];
    for (Isa isa : tiers) {
      uint64_t want = 0, got = 0;
      if (isa == Isa::kAvx512) {
        for (int j = 0; j < 8; ++j) want += x[j];
        got = detail::read_streams_avx512(base, streams, len);
      } else if (isa == Isa::kAvx2) {
        for (int j = 0; j < 4; ++j) want += x[j] ^ x[j + 4];
        got = detail::read_streams_avx2(base, streams, len);
      } else {
        continue;
      }
      report(got == want, std::string("read_streams ") + isa_name(isa) + " streams=" + std::to_string(streams));
    }
  }
#else
  (void)tiers;
#endif
}

// The Arm tiers' detection and refusals (aarch64; under qemu-user the -cpu model decides what
// the hwcaps say): the best tier is bf16 when the CPU reports asimddp, i8mm and bf16, else i8mm
// with asimddp and i8mm, else dotprod with asimddp, else neon; a tier the CPU lacks is refused
// naming what it has, and the names parse back.
static void test_arm_tiers() {
#if defined(__aarch64__)
  if (!selected("arm tiers")) return;
  const CpuFeatures& f = cpu_features();
  report(f.neon && std::strcmp(f.arch, "aarch64") == 0, "arm tiers: aarch64 with neon");
  report(best_isa(f) == (!f.asimddp ? Isa::kNeon : !f.i8mm ? Isa::kDotprod : f.bf16 ? Isa::kBf16 : Isa::kI8mm),
         std::string("arm tiers: best tier ") + isa_name(best_isa(f)) + " with asimddp=" + std::to_string(f.asimddp) +
             " i8mm=" + std::to_string(f.i8mm) + " bf16=" + std::to_string(f.bf16));
  for (Isa isa : {Isa::kNeon, Isa::kDotprod, Isa::kI8mm, Isa::kBf16}) {
    Isa back = Isa::kGeneric;
    report(isa_from_name(isa_name(isa), &back) && back == isa, std::string("arm tiers: name ") + isa_name(isa) + " parses back");
  }
  auto refusal = [](const char* name) {
    try {
      resolve_isa(name);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  report(resolve_isa("neon") == Isa::kNeon, "arm tiers: neon resolves");
  if (f.asimddp) {
    report(resolve_isa("dotprod") == Isa::kDotprod, "arm tiers: dotprod resolves with asimddp");
  } else {
    const std::string msg = refusal("dotprod");
    report(msg.find("'dotprod' is not supported") != std::string::npos && msg.find("asimddp=0") != std::string::npos,
           "arm tiers: dotprod refused without asimddp: " + msg);
  }
  if (f.asimddp && f.i8mm) {
    report(resolve_isa("i8mm") == Isa::kI8mm, "arm tiers: i8mm resolves with asimddp and i8mm");
  } else {
    const std::string msg = refusal("i8mm");
    report(msg.find("'i8mm' is not supported") != std::string::npos && msg.find("i8mm=0") != std::string::npos,
           "arm tiers: i8mm refused without i8mm: " + msg);
  }
  if (f.asimddp && f.i8mm && f.bf16) {
    report(resolve_isa("bf16") == Isa::kBf16, "arm tiers: bf16 resolves with asimddp, i8mm and bf16");
  } else {
    const std::string msg = refusal("bf16");
    report(msg.find("'bf16' is not supported") != std::string::npos && msg.find("bf16=0") != std::string::npos,
           "arm tiers: bf16 refused without bf16: " + msg);
  }
  const std::string msg = refusal("avx2");
  const char* have = !f.asimddp ? "tiers: generic, neon;"
                     : !f.i8mm  ? "tiers: generic, neon, dotprod;"
                     : f.bf16   ? "tiers: generic, neon, dotprod, i8mm, bf16;"
                                : "tiers: generic, neon, dotprod, i8mm;";
  report(msg.find("'avx2', a tier of x86-64 CPUs, is not supported") != std::string::npos &&
             msg.find(have) != std::string::npos,
         "arm tiers: avx2 refused as another architecture's, naming this CPU's tiers: " + msg);
#else
  // and on x86: an Arm tier is refused as another architecture's, not as one too high
  if (!selected("arm tiers")) return;
  std::string msg;
  try {
    resolve_isa("dotprod");
  } catch (const std::invalid_argument& e) {
    msg = e.what();
  }
  report(msg.find("'dotprod', a tier of aarch64 CPUs, is not supported") != std::string::npos &&
             msg.find("tiers: generic") != std::string::npos && msg.find("neon") == std::string::npos,
         "arm tiers: dotprod refused on x86 as another architecture's, naming this CPU's tiers: " + msg);
#endif
}

int main(int argc, char** argv) {
  for (int a = 1; a < argc; ++a) {
    if (std::strcmp(argv[a], "--every") == 0 && a + 1 < argc) {
      g_every = std::max(1, std::atoi(argv[++a]));
    } else if (std::strcmp(argv[a], "--hardware-only") == 0) {
      g_hardware_only = true;
    } else if (argv[a][0] == '-') {
      std::fprintf(stderr, "usage: %s [--every N] [--hardware-only] [filter]\n", argv[0]);
      return 2;
    } else {
      g_filter = argv[a];
    }
  }
  const CpuFeatures& f = cpu_features();
  // No AMX here but AVX-512: the amx tier's kernels run on software tiles (kernels/amx/tiles.h)
  // unless --hardware-only, so their code is checked on this machine too.
  const bool amx_sw = !isa_supported(f, Isa::kAmx) && isa_supported(f, Isa::kAvx512) &&
                      amx_software_tiles_built() && !g_hardware_only;
  if (amx_sw) use_amx_software_tiles(true);
  std::vector<Isa> tiers;
#if defined(__aarch64__)
  const Isa candidates[] = {Isa::kNeon, Isa::kDotprod, Isa::kI8mm, Isa::kBf16};  // (under qemu-user: the -cpu model's)
#else
  const Isa candidates[] = {Isa::kAvx2, Isa::kAvx512, Isa::kAmx};
#endif
  for (Isa isa : candidates) {
    if (isa_supported(f, isa)) tiers.push_back(isa);
    else std::printf("skip tier %s: not supported on this machine\n", isa_name(isa));
  }
  std::printf("cpu: %s; tiers:", f.brand[0] ? f.brand : f.arch);
  for (Isa isa : tiers) std::printf(" %s", isa_name(isa));
  std::printf(amx_sw ? " (amx on software tiles: this CPU has no AMX)\n" : "\n");
  uint32_t seed = 1;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const Case& c : kCases) test_case(dt, c, seed++, tiers);
    std::vector<Isa> all = tiers;
    all.insert(all.begin(), Isa::kGeneric);
    test_unpack_roundtrip(dt, all);
  }
  std::vector<Isa> all = tiers;
  all.insert(all.begin(), Isa::kGeneric);
  // Quantised formats: every case on fp32 (tight) and bf16 models, every format.
  for (const QFmt& q : kQFmts)
    for (DType dt : {DType::kF32, DType::kBF16})
      for (const Case& c : kCases) test_quant_case(dt, q, c, seed++, tiers);
  for (const QFmt& q : kQFmts)
    for (DType dt : {DType::kF32, DType::kBF16})
      for (const Case& c : kCases) test_qdot_case(dt, q, c, seed++, tiers);
  test_quant_act_row();
  test_qdot_selection(tiers);
  test_quant_packing(all);
  test_int4_layout(all);
  test_create_view();
  test_threads_deterministic(all);
  test_split_deterministic(all);
  test_errors();
  test_trim(all);
  test_linear(all);
  test_row_quant(all);
  test_paired_linear(all);
  test_qdot_int16_bound(all);
  test_qdot_rows();
  test_bf16dot_rows();
  test_bf16dot_exact();
  test_avx2_row_blocks();
  for (const Case& c : kCases) test_l12_case(c, seed++, all);
  test_l12_rows(all);
  test_l12_format(all);
  test_l12_linear(all);
  test_l12_errors();
  test_rms_norm();
  test_add_rms_norm();
  test_gated_mlp(all);
  test_attention_decode(tiers);
  test_mla_decode(tiers);
  test_latent_layer_step(tiers);
  test_attention_prefill(tiers);
  test_read_streams(tiers);
  test_arm_tiers();
  test_fork_child();
  tests_tier::test_tier(all);
  for (const auto& kv : g_worst)
    std::printf("worst %-48s %-9.3g (%d runs)\n", kv.first.c_str(), kv.second, g_compared[kv.first]);
  for (const auto& kv : g_min_sqnr) std::printf("lowest SQNR vs lossless %-30s %.1f dB\n", kv.first.c_str(), kv.second);
  if (g_every > 1) std::printf("--every %d: about 1 in %d of %ld per-case runs\n", g_every, g_every, g_case_runs);
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
