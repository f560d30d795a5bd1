// The C++ test runner's shared pieces (hina_tests: test_main.cpp runs every test of test_experts,
// test_quant, test_l12, test_ops and test_attention in one fixed order): the pass/fail tally (report), the worst
// error per comparison (note), the case table, the random problems and the double-precision
// oracle of the experts op (the contract in hina_moe/experts.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__unix__)
#include <sys/wait.h>
#include <unistd.h>
#endif

#include "hina_moe/cpu_features.h"
#include "hina_moe/moe.h"
#include "moe/kernel_api.h"

using namespace hina;
using hina::detail::load_elem;
using hina::detail::store_elem;

extern int g_passed, g_failed;
extern const char* g_filter;
extern int g_every;           // --every N: run one in N of the per-case runs
extern bool g_hardware_only;  // --hardware-only: no amx tier on software tiles
extern long g_case_runs;      // per-case runs seen (selected or not), for --every
extern std::map<std::string, double> g_worst;     // kernel + comparison -> worst relative error seen
extern std::map<std::string, int> g_compared;     // kernel + comparison -> how many runs were compared
extern std::map<std::string, double> g_min_sqnr;  // integer-dot emulation -> lowest SQNR vs lossless

// Records `err` as a run of comparison `key` (the runner prints the worst of each at the end).
void note(const std::string& key, double err);
// One check: counted as passed, or printed as FAIL with `what`.
void report(bool ok, const std::string& what);
// Whether this per-case run is one of the every-N-th (the other tests always run).
bool sampled();
// Whether a test of this name runs under the command line's filter.
bool selected(const std::string& name);
bool ends_with(const std::string& s, const std::string& tail);

struct Case {
  int64_t T, E, K, H, I;
  bool gated = true, bias = false, woi = false;
  Act act = Act::kSilu;
  int skip_every = 0;     // every n-th slot gets idx -1
  int64_t used_experts = 0;  // > 0: route only to the first n experts (others get no rows)
  bool limits = false;    // GPT-OSS-style clamps and up_offset
  const char* why;
};

// Each shape says why it exists.
inline const Case kCases[] = {
    {1, 8, 2, 64, 32, true, false, false, Act::kSilu, 0, 0, false, "T=1: decode"},
    {7, 4, 2, 64, 48, true, false, false, Act::kSilu, 0, 0, false, "T < tile rows (16): AMX row padding"},
    {5, 6, 3, 100, 72, true, false, false, Act::kSilu, 0, 0, false, "H, I not multiples of 16/32/64: tails"},
    {3, 3, 2, 17, 9, true, true, false, Act::kSilu, 0, 0, false, "H, I below one panel / k-tile"},
    {9, 7, 2, 48, 40, true, false, false, Act::kSilu, 0, 0, false, "prime E"},
    {6, 5, 1, 64, 32, true, false, false, Act::kSilu, 0, 0, false, "K = 1"},
    {4, 4, 4, 64, 32, true, false, false, Act::kSilu, 0, 0, false, "K = E: every expert gets every token"},
    {6, 16, 2, 64, 32, true, false, false, Act::kSilu, 0, 3, false, "most experts get no tokens"},
    {8, 6, 3, 64, 48, true, false, false, Act::kSilu, 4, 0, false, "idx = -1 skips a slot"},
    {5, 4, 2, 32, 32, true, false, false, Act::kSilu, 1, 0, false, "every slot skipped: out = 0"},
    {257, 8, 2, 96, 80, true, false, false, Act::kSilu, 0, 0, false, "T = 257 prefill: 32-row blocks + tail"},
    {33, 2, 1, 64, 64, true, true, false, Act::kSilu, 0, 0, false, "rows per expert around 32: AMX block edge"},
    {40, 3, 1, 256, 256, true, false, false, Act::kSilu, 0, 0, false, "row bytes multiple of 512: padded x/h strides"},
    {6, 4, 2, 80, 48, true, false, false, Act::kGelu, 0, 0, false, "act gelu (erf)"},
    {6, 4, 2, 80, 48, true, false, false, Act::kGeluTanh, 0, 0, false, "act gelu_tanh"},
    {6, 4, 2, 80, 48, true, false, false, Act::kRelu, 0, 0, false, "act relu"},
    {6, 4, 2, 80, 48, true, false, false, Act::kRelu2, 0, 0, false, "act relu2"},
    {6, 4, 2, 80, 48, true, false, false, Act::kSigmoidAlpha, 0, 0, false, "act sigmoid_alpha"},
    {6, 4, 2, 80, 48, true, false, false, Act::kIdentity, 0, 0, false, "act identity"},
    {6, 4, 2, 80, 48, false, false, false, Act::kGelu, 0, 0, false, "no gate (h = act(up))"},
    {40, 4, 2, 64, 48, false, true, false, Act::kRelu2, 0, 0, false, "no gate + biases, prefill rows"},
    {6, 4, 2, 72, 56, true, true, false, Act::kSilu, 0, 0, false, "biases on gate, up, down"},
    {6, 4, 2, 72, 56, true, true, false, Act::kSigmoidAlpha, 0, 0, true, "GPT-OSS: limits, up_offset, biases"},
    {1, 4, 2, 33, 65, true, true, false, Act::kSilu, 0, 0, false, "T=1, H, I one past a 32-k activation block"},
    {5, 4, 2, 161, 97, true, false, false, Act::kGelu, 0, 0, false, "H, I one past a block, prefill rows"},
    {1, 4, 2, 72, 56, true, true, false, Act::kSigmoidAlpha, 0, 0, true, "T=1 decode, GPT-OSS clamped SwiGLU"},
    // One past a boundary of every tier (rows per expert made exact by routing to the first
    // expert(s) only): AMX A tiles of 16 rows and blocks of 32, AVX-512 4-row and AVX2 2-row
    // blocks; 16-row panels of H and I, 32-k tiles / activation blocks, int4 groups 64 and 128;
    // an odd number of H panels (the AMX down kernel takes panels in pairs).
    {17, 2, 1, 129, 17, true, false, false, Act::kSilu, 0, 1, false, "17 rows on one expert: an AMX tile + 1; H = 128+1, I = 16+1"},
    {33, 3, 2, 65, 33, true, true, false, Act::kSilu, 0, 2, false, "33 rows on each of 2 experts: a 32-row block + 1; H = 64+1, I = 32+1"},
    {65, 2, 1, 33, 129, true, false, false, Act::kGelu, 0, 1, false, "65 rows on one expert: two 32-row blocks + 1; H = 32+1 (3 H panels), I = 128+1"},
    {9, 3, 1, 49, 81, false, true, false, Act::kRelu2, 0, 1, false, "no gate, 9 rows on one expert (4-row and 2-row blocks + 1); H = 48+1, I = 80+1"},
    {1, 4, 2, 257, 129, true, false, false, Act::kSilu, 0, 0, false, "T=1 decode, H = 256+1 (17 H panels), I = 128+1"},
    {6, 4, 2, 64, 48, true, false, true, Act::kSilu, 0, 0, false, "weight_on_input (Llama 4)"},
    {48, 4, 1, 64, 48, true, false, true, Act::kSilu, 0, 0, false, "weight_on_input, prefill rows"},
};

inline const long kNumCases = static_cast<long>(sizeof(kCases) / sizeof(kCases[0]));

struct Problem {
  DType dt;
  Case c;
  std::vector<uint8_t> gate, up, down, bg, bu, bd, x;
  std::vector<int32_t> idx;
  std::vector<float> w;
  MoeParams params;
};

std::vector<uint8_t> random_array(DType dt, int64_t n, float scale, std::mt19937& rng);
Problem make_problem(DType dt, const Case& c, uint32_t seed);
ExpertWeights weights_of(const Problem& p);

// Dequantised weights (fp32) standing in for the problem's own, for the quantised formats.
struct Deq {
  std::vector<float> gate, up, down;
};

// Naive oracle straight from the semantics, double accumulation, h kept exact. With `dq`, the
// expert matrices are read from it (the emulated-quant reference).
std::vector<float> oracle(const Problem& p, const Deq* dq = nullptr);
// One forward of p at `path` on `threads` threads (the kernel's name in *name); with `twin`, those
// kernels through the driver instead of the block's own.
std::vector<float> run(const PackedExperts& pe, const Problem& p, MoePath path, int threads,
                       const char** name, const detail::KernelImpl* twin = nullptr,
                       const char* twin_name = "generic_amx_twin");
// max |a - b| / max(max |ref|, 1e-3)
double rel_err(const std::vector<float>& a, const std::vector<float>& ref);
// The oracle comparison's tolerance per dtype.
double tol(DType dt);

struct QFmt {
  WFormat fmt;
  int group;
  const char* name;
};
inline const QFmt kQFmts[] = {{WFormat::kInt8, 64, "int8"}, {WFormat::kInt4, 32, "int4g32"},
                       {WFormat::kInt4, 64, "int4g64"}, {WFormat::kInt4, 128, "int4g128"}};

// The tests, by file; test_main.cpp runs them.
namespace tests_experts {
void test_case(DType dt, const Case& c, uint32_t seed, const std::vector<Isa>& tiers);
void test_unpack_roundtrip(DType dt, const std::vector<Isa>& tiers);
void test_bf16dot_rows();
void test_bf16dot_exact();
void test_threads_deterministic(const std::vector<Isa>& tiers);
void test_split_deterministic(const std::vector<Isa>& tiers);
void test_fork_child();
void test_errors();
void test_trim(const std::vector<Isa>& tiers);
void test_create_view();
}  // namespace tests_experts
namespace tests_quant {
void test_quant_case(DType dt, const QFmt& q, const Case& c, uint32_t seed, const std::vector<Isa>& tiers);
void test_qdot_case(DType dt, const QFmt& q, const Case& c, uint32_t seed, const std::vector<Isa>& tiers);
void test_qdot_selection(const std::vector<Isa>& tiers);
void test_quant_act_row();
void test_quant_packing(const std::vector<Isa>& tiers);
void test_int4_layout(const std::vector<Isa>& tiers);
void test_qdot_int16_bound(const std::vector<Isa>& tiers);
void test_qdot_rows();
void test_avx2_row_blocks();
void test_paired_linear(const std::vector<Isa>& tiers);
void test_row_quant(const std::vector<Isa>& tiers);
void test_linear(const std::vector<Isa>& tiers);
}  // namespace tests_quant
namespace tests_l12 {
void test_l12_case(const Case& c, uint32_t seed, const std::vector<Isa>& tiers);
void test_l12_rows(const std::vector<Isa>& tiers);
void test_l12_format(const std::vector<Isa>& tiers);
void test_l12_linear(const std::vector<Isa>& tiers);
void test_l12_errors();
}  // namespace tests_l12
namespace tests_ops {
void test_rms_norm();
void test_add_rms_norm();
void test_gated_mlp(const std::vector<Isa>& tiers);
}  // namespace tests_ops
namespace tests_attention {
void test_latent_layer_step(const std::vector<Isa>& tiers);
void test_mla_decode(const std::vector<Isa>& tiers);
void test_attention_decode(const std::vector<Isa>& tiers);
void test_attention_prefill(const std::vector<Isa>& tiers);
}  // namespace tests_attention
