// A quick measurement of this machine's memory read bandwidth, so that reports can state
// achieved GB/s next to what the machine can do (not next to a datasheet figure).
#pragma once

#include <cstddef>

namespace hina {

struct BandwidthResult {
  double best_gbs = 0;    // best pass (least disturbed by other tenants)
  double median_gbs = 0;  // median pass
  size_t bytes = 0;       // buffer size read per pass
  int threads = 0;
  int passes = 0;
};

// Reads a freshly allocated `bytes` buffer (make it far larger than the last-level cache)
// `passes` times with `threads` threads of the library's pool; each thread streams its own
// contiguous slice. Baseline-ISA C++ with independent accumulators (the compiler vectorises it).
BandwidthResult measure_read_bandwidth(size_t bytes, int threads, int passes);

}  // namespace hina
