// Software prefetch of the weight stream, shared by the FMA and integer-dot kernels (avx2, avx512).
//
// Default: 4 KiB ahead into L2 (prefetcht1). Measured against the first guess (1 KiB into L1)
// on an OLMoE-shaped decode step, interleaved in one process: 19.0 -> 22.6 GB/s (+19 %); 3-8 KiB
// into L2 or L3 are within 3 % of each other (benchmarks/bench_prefetch.py, RESULTS.md
// "Software prefetch distance"). The L2 streamer stops at every 4 KiB page boundary; a
// prefetch a page ahead keeps the stream going across pages.
//
// A build configured with -DHINA_PREFETCH_TUNING=ON reads HINA_PF (bytes ahead) and HINA_PFH
// (0: L1, 1: L2, 2: L3, 3: non-temporal) at the start of every kernel job instead, so benchmarks/bench_prefetch.py
// can compare settings round by round in one process. Never in a release build.
#pragma once

#include <immintrin.h>

#include <cstdlib>

namespace hina::detail::pf {

#ifdef HINA_PREFETCH_TUNING
inline int g_bytes = 4096;
inline int g_hint = 1;
inline int g_amx = 2;
inline void reload() {
  const char* b = std::getenv("HINA_PF");
  const char* h = std::getenv("HINA_PFH");
  g_bytes = b ? std::atoi(b) : 4096;
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
constexpr int bytes() { return 4096; }
constexpr int amx_mode() { return 2; }
inline void line(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
#endif

}  // namespace hina::detail::pf
