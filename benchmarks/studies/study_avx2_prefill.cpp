// Question: How close do the avx2 tier's int4 / int8 prefill kernels come to the core's
//   vpmaddubsw rate, per expert-sized call and per dense-layer-sized call?
// Answered in benchmarks/log/whole-model.md, "The avx2 tier's prefill-512 by part, and its int4
//   tiles (2026-12-08)".
// Not part of the package: links the C++ tests' static core (build/cpp-tests/libhina_core.a).
// Single-threaded, weights of one call in L2/L3 (an expert of the Qwen3-30B-A3B shape: gate/up
// H 2048 -> I 768, 1.6 MB of int4; down I 768 -> H 2048), the kernel called back to back.
//
// Figures, as int8 multiply-adds a cycle at the clock measured by a chain of adds:
//   peak   8 independent chains of the tiles' step (ymm): vpmaddubsw + vpaddw (int4's int16
//          sums) and vpmaddubsw + vpmaddwd + vpaddd (int8's int32 sums): the integer-dot rate an
//          AVX2 core can reach with the vpmaddubsw form (32 products an instruction)
//   real   the package's avx2dot gate/up and down kernels (moe_qdot_avx2.cpp), int4 and int8,
//          for 32 rows (an expert's share of a 512-token prefill at top-8 of 128) and 512 rows
//          (a dense linear layer of the prefill)
//
// Build and run (after `cmake --build build/cpp-tests`):
//   g++ -O3 -std=c++17 -Icsrc -Icsrc/include -mavx2 -mfma -o /tmp/study_avx2_prefill \
//       benchmarks/studies/study_avx2_prefill.cpp build/cpp-tests/libhina_core.a -fopenmp
//   chrt -f 1 /tmp/study_avx2_prefill [panels a call, 0: all] [int4 group, default 32]
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "moe/kernel_api.h"
#include "study_clock.h"

namespace hina::detail {
bool get_qdot_kernels_avx2(WFormat wf, KernelImpl* k);
}

namespace {

using namespace hina;
using namespace hina::detail;
using study::Clock;
using study::clock_hz;
using study::seconds_since;

// Chains of the tiles' inner step in assembly (GCC kept an array of chains on the stack), 6
// independent ones, each on its own weight register (no product common to two chains):
// Int16 vpmaddubsw + vpaddw (int4's int16 block sums), else vpmaddubsw + vpmaddwd + vpaddd
// (int8's int32 sums).
template <bool Int16>
double peak_per_cycle(double hz) {
  const long n = 50000000;
  const auto t0 = Clock::now();
  for (long i = 0; i < n; ++i) {
    if constexpr (Int16)
      asm volatile(
          "vpmaddubsw %%ymm15, %%ymm0, %%ymm12\n\tvpaddw %%ymm12, %%ymm6, %%ymm6\n\t"
          "vpmaddubsw %%ymm15, %%ymm1, %%ymm13\n\tvpaddw %%ymm13, %%ymm7, %%ymm7\n\t"
          "vpmaddubsw %%ymm15, %%ymm2, %%ymm14\n\tvpaddw %%ymm14, %%ymm8, %%ymm8\n\t"
          "vpmaddubsw %%ymm15, %%ymm3, %%ymm12\n\tvpaddw %%ymm12, %%ymm9, %%ymm9\n\t"
          "vpmaddubsw %%ymm15, %%ymm4, %%ymm13\n\tvpaddw %%ymm13, %%ymm10, %%ymm10\n\t"
          "vpmaddubsw %%ymm15, %%ymm5, %%ymm14\n\tvpaddw %%ymm14, %%ymm11, %%ymm11\n\t" ::
              : "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14");
    else
      asm volatile(
          "vpmaddubsw %%ymm15, %%ymm0, %%ymm12\n\tvpmaddwd %%ymm5, %%ymm12, %%ymm12\n\tvpaddd %%ymm12, %%ymm6, %%ymm6\n\t"
          "vpmaddubsw %%ymm15, %%ymm1, %%ymm13\n\tvpmaddwd %%ymm5, %%ymm13, %%ymm13\n\tvpaddd %%ymm13, %%ymm7, %%ymm7\n\t"
          "vpmaddubsw %%ymm15, %%ymm2, %%ymm14\n\tvpmaddwd %%ymm5, %%ymm14, %%ymm14\n\tvpaddd %%ymm14, %%ymm8, %%ymm8\n\t"
          "vpmaddubsw %%ymm15, %%ymm3, %%ymm12\n\tvpmaddwd %%ymm5, %%ymm12, %%ymm12\n\tvpaddd %%ymm12, %%ymm9, %%ymm9\n\t"
          "vpmaddubsw %%ymm15, %%ymm4, %%ymm13\n\tvpmaddwd %%ymm5, %%ymm13, %%ymm13\n\tvpaddd %%ymm13, %%ymm10, %%ymm10\n\t"
          "vpmaddubsw %%ymm15, %%ymm0, %%ymm14\n\tvpmaddwd %%ymm5, %%ymm14, %%ymm14\n\tvpaddd %%ymm14, %%ymm11, %%ymm11\n\t" ::
              : "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14");
  }
  return static_cast<double>(n) * 6 * 32 / seconds_since(t0) / hz;
}

int64_t g_panels = 0;  // argv[1]: panels a call (0: the whole matrix)
int g_group = 32;      // argv[2]: int4 group (32, 64, 128)

struct Buf {
  std::vector<uint8_t> v;
  uint8_t* p;
  explicit Buf(size_t n) : v(n + 64) { p = v.data() + (64 - reinterpret_cast<uintptr_t>(v.data()) % 64) % 64; }
};

// Panels of format wf, K long, G matrices, with finite scales.
void fill_panels(uint8_t* w, WFormat wf, int64_t K, int G, int64_t P, int64_t pb) {
  for (int64_t i = 0; i < pb * P; ++i) w[i] = static_cast<uint8_t>(i * 37);
  for (int64_t p = 0; p < P; ++p) {
    float* f = reinterpret_cast<float*>(w + p * pb);
    for (int l = 0; l < 16 * G; ++l) f[l] = 0.01f;
    if (wf == WFormat::kInt4)
      for (int64_t g = 0; g < K / g_group; ++g) std::memset(w + p * pb + q4_scales_at(g, G, g_group), 0x13, 16 * G);
  }
}

void fill_rows(uint8_t* h, int64_t K, int rows) {
  const int64_t rb = qrow_bytes(K);
  for (int r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < K; ++k) h[r * rb + k] = static_cast<uint8_t>((k * 7 + r) % 200 - 100);
    float* s = reinterpret_cast<float*>(h + r * rb + K);
    int32_t* sum = reinterpret_cast<int32_t*>(h + r * rb + K + K / 8);
    for (int b = 0; b < K / 32; ++b) {
      s[b] = 0.01f;
      sum[b] = b;
    }
  }
}

// multiply-adds a cycle of the package's gate/up (H 2048 -> I 768, gated) or down (I 768 -> H 2048)
double real_per_cycle(WFormat wf, bool gateup, int rows, double hz) {
  Layout L{};
  L.dtype = DType::kBF16;
  L.kpack = 1;
  L.G = 2;
  L.H = L.Hk = L.Hn = 2048;
  L.I = L.In = L.Ik = 768;
  L.wfmt = wf;
  L.group = g_group;
  KernelImpl k;
  if (!get_qdot_kernels_avx2(wf, &k)) return 0;
  const int64_t K = gateup ? L.Hk : L.Ik, G = gateup ? 2 : 1;
  const int64_t N = g_panels ? g_panels * kPanelN : gateup ? L.In : L.Hn, P = N / kPanelN;
  const int64_t pb = gateup ? gu_panel_bytes(L) : down_panel_bytes(L);
  Buf w(static_cast<size_t>(pb * P));
  fill_panels(w.p, wf, K, static_cast<int>(G), P, pb);
  const int64_t rb = qrow_bytes(K);
  Buf x(static_cast<size_t>(rb * rows));
  fill_rows(x.p, K, rows);
  std::vector<const void*> xr(rows);
  for (int r = 0; r < rows; ++r) xr[r] = x.p + r * rb;
  std::vector<float> out(static_cast<size_t>(rows) * 2 * L.Hn);
  std::vector<float*> acc(rows);
  std::vector<float> wt(rows, 1.0f);
  for (int r = 0; r < rows; ++r) acc[r] = out.data() + r * L.Hn;
  ActParams ap{Act::kSilu, 1.0f, INFINITY, INFINITY, INFINITY, 0.0f};
  GateUpJob gj{};
  gj.w = w.p;
  gj.p0 = 0;
  gj.p1 = P;
  gj.x = xr.data();
  gj.nt = rows;
  gj.h = out.data();
  gj.h_stride = L.In;
  gj.L = &L;
  gj.act = &ap;
  DownJob dj{};
  dj.w = w.p;
  dj.p0 = 0;
  dj.p1 = P;
  dj.h = x.p;
  dj.h_stride = rb;
  dj.nt = rows;
  dj.wt = wt.data();
  dj.acc = acc.data();
  dj.L = &L;
  auto call = [&] {
    if (gateup) k.gateup(gj);
    else k.down(dj);
  };
  for (int i = 0; i < 5; ++i) call();
  const int reps = 4096 / rows + 8;
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) call();
    best = std::min(best, seconds_since(t0));
  }
  return static_cast<double>(reps) * rows * K * N * G / best / hz;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) g_panels = std::atoll(argv[1]);
  if (argc > 2) g_group = std::atoi(argv[2]);
  std::printf("int4 group %d\n", g_group);
  const double hz = clock_hz();
  std::printf("clock %.2f GHz (a chain of adds)\n", hz / 1e9);
  std::printf("peak: %.1f multiply-adds a cycle (vpmaddubsw + vpaddw chains), %.1f (vpmaddubsw + vpmaddwd + vpaddd)\n",
              peak_per_cycle<true>(hz), peak_per_cycle<false>(hz));
  for (WFormat wf : {WFormat::kInt4, WFormat::kInt8})
    for (bool gu : {true, false})
      for (int rows : {32, 512})
        std::printf("real %s %-6s %3d rows: %.1f multiply-adds a cycle\n", wf == WFormat::kInt4 ? "int4" : "int8",
                    gu ? "gateup" : "down", rows, real_per_cycle(wf, gu, rows, hz));
  return 0;
}
