// Wall time and the core's clock, for the standalone kernel studies (study_qdot_rows.cpp,
// study_avx2_prefill.cpp): rates a cycle need the clock the core ran at, not its nominal one.
#pragma once

#include <chrono>

namespace study {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Hz, from a chain of dependent adds (one a cycle on every x86 core measured)
inline double clock_hz() {
  const long n = 200000000;
  long v = 0;
  const auto t0 = Clock::now();
  for (long i = 0; i < n; ++i) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(v));
  return n * 4 / seconds_since(t0);
}

}  // namespace study
