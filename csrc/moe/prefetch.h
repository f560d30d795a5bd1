// Software prefetch of the weight stream, shared by the FMA and integer-dot kernels (avx2, avx512).
//
// Default: 2 KiB ahead into L2 (prefetcht1). History (benchmarks/bench_prefetch.py, interleaved
// in one process; RESULTS.md): against the first guess (1 KiB into L1) 4 KiB into L2 took an
// OLMoE-shaped decode op from 19.0 to 22.6 GB/s (session 5), and session 11 confirmed 4 KiB
// (2 KiB: -6 % at int4) on a machine reading 20-31 GB/s. On the same machine set up afresh
// (session 12), reading 31-45 GB/s, 4 KiB had become the worst of 0-2 KiB at every width: whole
// OLMoE steps 2 KiB against 4 KiB -10 % (int4), -16 % (lossless), -2 % (int8), Qwen int4 -8 %
// (bench_decode_breakdown.py --ab-prefetch); at op level 2 KiB is within 1 % of the best of
// 0-8 KiB for int4, int8 and bf16. The best distance depends on the machine's memory system.
//
// A build configured with -DHINA_PREFETCH_TUNING=ON reads HINA_PF (bytes ahead) and HINA_PFH
// (0: L1, 1: L2, 2: L3, 3: non-temporal) at the start of every kernel job instead, so benchmarks/bench_prefetch.py
// can compare settings round by round in one process. Never in a release build.
#pragma once

#include <immintrin.h>

#include <cstdlib>

namespace hina::detail::pf {

#ifdef HINA_PREFETCH_TUNING
inline int g_bytes = 2048;
inline int g_hint = 1;
inline int g_amx = 2;
inline void reload() {
  const char* b = std::getenv("HINA_PF");
  const char* h = std::getenv("HINA_PFH");
  g_bytes = b ? std::atoi(b) : 2048;
  g_hint = h ? std::atoi(h) : 1;
  const char* a = std::getenv("HINA_PFA");
  g_amx = a ? std::atoi(a) : 2;
}
inline int bytes() { return g_bytes; }
inline int amx_mode() { return g_amx; }
inline void line(const void* p) {
  const char* c = static_cast<const char*>(p);
  if (g_hint == 0) _mm_prefetch(c, _MM_HINT_T0);
  else if (g_hint == 1) _mm_prefetch(c, _MM_HINT_T1);
  else if (g_hint == 2) _mm_prefetch(c, _MM_HINT_T2);
  else _mm_prefetch(c, _MM_HINT_NTA);
}
#else
inline void reload() {}
constexpr int bytes() { return 2048; }
constexpr int amx_mode() { return 2; }
inline void line(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
#endif

}  // namespace hina::detail::pf
