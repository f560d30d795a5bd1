// A quick measurement of this machine's memory read bandwidth, so that reports can state
// achieved GB/s next to what the machine can do (not next to a datasheet figure).
#pragma once

#include <cstddef>
#include <cstdint>

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

// The same read, on a buffer allocated and touched once, for benchmarks that pair every timed
// call with a probe: pass(bytes) reads the next `bytes` of the buffer (round robin over it, so
// with bytes <= size / 3 the slice read was last touched two passes ago, long out of the
// last-level cache when the buffer is far larger than it) and returns GB/s.
class BandwidthProbe {
 public:
  BandwidthProbe(size_t bytes, int threads);
  ~BandwidthProbe();
  BandwidthProbe(const BandwidthProbe&) = delete;
  BandwidthProbe& operator=(const BandwidthProbe&) = delete;
  double pass(size_t bytes);
  size_t size() const { return n_ * sizeof(uint64_t); }

 private:
  uint64_t* buf_ = nullptr;
  size_t n_ = 0;
  size_t pos_ = 0;
  int threads_ = 1;
};

}  // namespace hina
