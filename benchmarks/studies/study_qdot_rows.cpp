// Question: How fast can integer-dot chains run for calls of several rows on this core?
// Answered in benchmarks/log/batched.md, "Batched decode: the int8 / int4 kernels' prefetch for several rows on AMD, batches of up to 256 sequences, against transformers and llama.cpp (2026-12-05)".
// How close the AVX-512 VNNI integer-dot kernels come to the core's vpdpbusd rate when several
// rows share a weight pass (batched decode, prefill), single-threaded, weights in L2.
// Not part of the package: links the C++ tests' static core (build/cpp-tests/libhina_core.a).
//
// Three figures, as vpdpbusd (zmm) instructions a cycle at the clock measured by a chain of adds:
//   peak      12 independent vpdpbusd chains: the core's rate (1 a cycle on the Zen 4 of 2026-12-05, 94e9811)
//   real      the package's int4 / int8 `down` kernel (moe_qdot_avx512vnni.cpp) on 64 panels of
//             K = 2048 (1.1 / 2.1 MB: L2 and L3) for 1, 3, 15 and 63 rows
//   loop      a copy of the int4 inner loop (3 rows a pass, two chains a row, the int32 -> fp32
//             epilogue every 32 k), and the same loop without that epilogue: what the epilogue costs
//
// Build and run (after `cmake --build build/cpp-tests`):
//   g++ -O3 -std=c++17 -Icsrc -Icsrc/include -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
//       -o /tmp/study_qdot_rows benchmarks/studies/study_qdot_rows.cpp build/cpp-tests/libhina_core.a -fopenmp
//   chrt -f 1 /tmp/study_qdot_rows
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "moe/kernel_api.h"
#include "study_clock.h"

namespace hina::detail {
bool get_qdot_kernels_avx512vnni(WFormat wf, KernelImpl* k);
}

namespace {

using namespace hina;
using namespace hina::detail;
using study::Clock;
using study::clock_hz;
using study::seconds_since;

double peak_per_cycle(double hz) {
  __m512i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  __m512i w = _mm512_set1_epi8(3);
  const __m512i x = _mm512_set1_epi8(1);
  const long n = 100000000;
  const auto t0 = Clock::now();
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < 12; ++c) a[c] = _mm512_dpbusd_epi32(a[c], w, x);
    asm volatile("" : "+v"(w));
  }
  const double s = seconds_since(t0);
  __m512i t = a[0];
  for (int c = 1; c < 12; ++c) t = _mm512_add_epi32(t, a[c]);
  volatile int sink = _mm512_reduce_add_epi32(t);
  (void)sink;
  return n * 12 / s / hz;
}

// The package's down kernel for format wf on `rows` quantised rows: vpdpbusd a cycle.
double real_per_cycle(WFormat wf, int rows, double hz) {
  const int64_t K = 2048, P = 64;
  Layout L{};
  L.dtype = DType::kBF16;
  L.kpack = 1;
  L.G = 1;
  L.H = L.Hk = 1024;
  L.I = L.In = L.Ik = K;
  L.Hn = P * kPanelN;
  L.wfmt = wf;
  L.group = 64;
  const int64_t pb = down_panel_bytes(L);
  std::vector<uint8_t> wbuf(pb * P + 64);
  uint8_t* w = wbuf.data() + (64 - reinterpret_cast<uintptr_t>(wbuf.data()) % 64) % 64;
  for (int64_t i = 0; i < pb * P; ++i) w[i] = static_cast<uint8_t>(i * 37);
  for (int64_t p = 0; p < P; ++p) {  // finite scales: bf16 (int4 groups) or fp32 (int8 rows)
    if (wf == WFormat::kInt4) {
      for (int64_t g = 0; g < K / 64; ++g) {
        uint16_t* s = reinterpret_cast<uint16_t*>(w + p * pb + q4_scales_at(g, 1, 64));
        for (int l = 0; l < 16; ++l) s[l] = 0x3c00;
      }
    } else {
      float* s = reinterpret_cast<float*>(w + p * pb);
      for (int l = 0; l < 16; ++l) s[l] = 0.01f;
    }
  }
  const int64_t rb = qrow_bytes(K);
  std::vector<uint8_t> hbuf(rb * rows + 64);
  uint8_t* h = hbuf.data() + (64 - reinterpret_cast<uintptr_t>(hbuf.data()) % 64) % 64;
  for (int r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < K; ++k) h[r * rb + k] = static_cast<uint8_t>((k * 7 + r) % 100 - 50);
    float* s = reinterpret_cast<float*>(h + r * rb + K);
    int32_t* sum = reinterpret_cast<int32_t*>(h + r * rb + K + K / 8);
    for (int b = 0; b < K / 32; ++b) {
      s[b] = 0.01f;
      sum[b] = b;
    }
  }
  std::vector<float> accbuf(rows * L.Hn);
  std::vector<float*> acc(rows);
  std::vector<float> wt(rows, 1.0f);
  for (int r = 0; r < rows; ++r) acc[r] = accbuf.data() + r * L.Hn;
  KernelImpl k;
  if (!get_qdot_kernels_avx512vnni(wf, &k)) return 0;
  DownJob j{};
  j.w = w;
  j.p0 = 0;
  j.p1 = P;
  j.h = h;
  j.h_stride = rb;
  j.nt = rows;
  j.wt = wt.data();
  j.acc = acc.data();
  j.L = &L;
  for (int i = 0; i < 20; ++i) k.down(j);
  const int reps = 12800 / rows + 100;
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) k.down(j);
  const double s = seconds_since(t0);
  return static_cast<double>(reps) * P * rows * (K / 4) / s / hz;  // a vpdpbusd: 16 outputs x 4 k
}

// A copy of the int4 loop on one panel: NT rows, two chains a row; Epilogue false leaves out the
// int32 -> fp32 conversion and the two FMAs a 32-k block (the sums stay integers).
alignas(64) uint8_t g_codes[8][2048 / 8 * 64];
alignas(64) int8_t g_x[15][2048];
float g_s[15][64];
int32_t g_sum[15][64];
alignas(64) float g_d[32][16];

template <int NT, bool Epilogue>
__attribute__((noinline)) void loop_panel(const uint8_t* w, int r0, __m512* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0f), m4h = _mm512_set1_epi8(static_cast<char>(0xf0));
  __m512 y[NT];
  __m512i keep[NT];
  for (int r = 0; r < NT; ++r) {
    y[r] = _mm512_setzero_ps();
    keep[r] = _mm512_setzero_si512();
  }
  for (int k0 = 0; k0 < 2048; k0 += 64) {
    __m512 bg[NT];
    for (int r = 0; r < NT; ++r) bg[r] = _mm512_setzero_ps();
    for (int kb = k0; kb < k0 + 64; kb += 32) {
      __m512i ai[NT], ah[NT];
      for (int r = 0; r < NT; ++r) {
        ai[r] = Epilogue ? _mm512_set1_epi32(-8 * g_sum[r0 + r][kb / 32]) : keep[r];
        ah[r] = _mm512_setzero_si512();
      }
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o, w += 64) {
        const __m512i v = _mm512_load_si512(w);
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(v, m4h);
        for (int r = 0; r < NT; ++r) {
          int32_t a, b;
          std::memcpy(&a, g_x[r0 + r] + kb + o * 8, 4);
          std::memcpy(&b, g_x[r0 + r] + kb + o * 8 + 4, 4);
          ai[r] = _mm512_dpbusd_epi32(ai[r], lo, _mm512_set1_epi32(a));
          ah[r] = _mm512_dpbusd_epi32(ah[r], hi, _mm512_set1_epi32(b));
        }
      }
      for (int r = 0; r < NT; ++r) {
        if (!Epilogue) {
          keep[r] = _mm512_add_epi32(ai[r], ah[r]);
          continue;
        }
        const __m512i s = _mm512_add_epi32(ai[r], _mm512_srai_epi32(ah[r], 4));
        bg[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(g_s[r0 + r][kb / 32]), bg[r]);
      }
    }
    if (Epilogue)
      for (int r = 0; r < NT; ++r) y[r] = _mm512_fmadd_ps(bg[r], _mm512_load_ps(g_d[k0 / 64]), y[r]);
  }
  for (int r = 0; r < NT; ++r) out[r] = Epilogue ? y[r] : _mm512_cvtepi32_ps(keep[r]);
}

template <bool Epilogue>
double loop_per_cycle(double hz) {
  for (int p = 0; p < 8; ++p)
    for (size_t i = 0; i < sizeof(g_codes[0]); ++i) g_codes[p][i] = static_cast<uint8_t>(i * 37 + p);
  for (int r = 0; r < 15; ++r)
    for (int k = 0; k < 2048; ++k) g_x[r][k] = static_cast<int8_t>((k * 7 + r) % 100 - 50);
  for (int r = 0; r < 15; ++r)
    for (int b = 0; b < 64; ++b) {
      g_s[r][b] = 0.01f;
      g_sum[r][b] = b;
    }
  for (int g = 0; g < 32; ++g)
    for (int l = 0; l < 16; ++l) g_d[g][l] = 0.5f;
  __m512 out[3];
  const int reps = 3000;
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i)
    for (int p = 0; p < 8; ++p)
      for (int r0 = 0; r0 < 15; r0 += 3) {
        loop_panel<3, Epilogue>(g_codes[p], r0, out);
        asm volatile("" ::: "memory");
      }
  return static_cast<double>(reps) * 8 * 15 * 2 * (2048 / 8) / seconds_since(t0) / hz;
}

}  // namespace

int main() {
  const double hz = clock_hz();
  std::printf("clock %.2f GHz (a chain of adds)\n", hz / 1e9);
  std::printf("peak: %.3f vpdpbusd a cycle\n", peak_per_cycle(hz));
  for (WFormat wf : {WFormat::kInt4, WFormat::kInt8})
    for (int rows : {1, 3, 15, 63})
      std::printf("real %s down, %2d rows: %.3f vpdpbusd a cycle\n", wf == WFormat::kInt4 ? "int4" : "int8", rows,
                  real_per_cycle(wf, rows, hz));
  std::printf("int4 loop copy, 3 rows a pass: %.3f with the epilogue, %.3f without\n", loop_per_cycle<true>(hz),
              loop_per_cycle<false>(hz));
  return 0;
}
