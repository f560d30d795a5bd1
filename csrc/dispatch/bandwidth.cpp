#include "hina_moe/bandwidth.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "hina_moe/thread_pool.h"

namespace hina {

BandwidthResult measure_read_bandwidth(size_t bytes, int threads, int passes) {
  if (threads < 1 || passes < 1 || bytes < (1u << 20)) {
    throw std::invalid_argument("measure_read_bandwidth: need threads >= 1, passes >= 1, bytes >= 1 MiB");
  }
  const size_t n = bytes / sizeof(uint64_t);
  auto* buf = static_cast<uint64_t*>(std::aligned_alloc(64, n * sizeof(uint64_t)));
  if (!buf) throw std::bad_alloc();
  // Touch every page (from the pool, so pages land where the readers run).
  ThreadPool::global().run(threads, [&](int tid, int nt) {
    int64_t b, e;
    split_range(static_cast<int64_t>(n), tid, nt, &b, &e);
    for (int64_t i = b; i < e; ++i) buf[i] = static_cast<uint64_t>(i);
  });
  std::vector<double> gbs;
  std::vector<uint64_t> sink(threads, 0);
  for (int p = 0; p < passes; ++p) {
    const auto t0 = std::chrono::steady_clock::now();
    ThreadPool::global().run(threads, [&](int tid, int nt) {
      int64_t b, e;
      split_range(static_cast<int64_t>(n / 8), tid, nt, &b, &e);
      uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = b * 8; i < e * 8; i += 8) {
        for (int j = 0; j < 8; ++j) acc[j] += buf[i + j];
      }
      uint64_t s = 0;
      for (int j = 0; j < 8; ++j) s += acc[j];
      sink[tid] += s;
    });
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gbs.push_back(static_cast<double>(n * sizeof(uint64_t)) / dt / 1e9);
  }
  std::free(buf);
  volatile uint64_t keep = 0;
  for (uint64_t s : sink) keep = keep + s;  // the sums must not be optimised away
  (void)keep;
  std::sort(gbs.begin(), gbs.end());
  BandwidthResult r;
  r.best_gbs = gbs.back();
  r.median_gbs = gbs[gbs.size() / 2];
  r.bytes = n * sizeof(uint64_t);
  r.threads = threads;
  r.passes = passes;
  return r;
}

}  // namespace hina
