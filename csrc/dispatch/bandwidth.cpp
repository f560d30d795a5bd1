#include "hina_moe/bandwidth.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "hina_moe/cpu_features.h"
#include "hina_moe/thread_pool.h"

namespace hina {

#if defined(HINA_HAVE_X86_KERNELS)
namespace detail {
uint64_t read_streams_avx512(const uint64_t* const* base, int streams, int64_t len);
}
#endif

namespace {
uint64_t read_streams_generic(const uint64_t* const* base, int streams, int64_t len) {
  uint64_t acc[16] = {0};
  for (int64_t i = 0; i < len; i += 8) {
    for (int k = 0; k < streams; ++k) {
      const uint64_t* p = base[k] + i;
      acc[k] += (p[0] ^ p[1]) + (p[2] ^ p[3]) + (p[4] ^ p[5]) + (p[6] ^ p[7]);
    }
  }
  uint64_t s = 0;
  for (int k = 0; k < streams; ++k) s += acc[k];
  return s;
}
}  // namespace

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
  const bool use_avx512 = isa_supported(cpu_features(), Isa::kAvx512);
  (void)use_avx512;
  std::vector<double> gbs;
  std::vector<uint64_t> sink(threads, 0);
  for (int p = 0; p < passes; ++p) {
    const auto t0 = std::chrono::steady_clock::now();
    ThreadPool::global().run(threads, [&](int tid, int nt) {
      // Each thread reads its slice as kStreams interleaved sequential streams: one stream per
      // core leaves the memory system idle between prefetches (measured: ~half the bandwidth).
      constexpr int kStreams = 16;
      int64_t b, e;
      split_range(static_cast<int64_t>(n / (8 * kStreams)), tid, nt, &b, &e);
      const int64_t len = (e - b) * 8;  // elements per stream
      const uint64_t* base[kStreams];
      for (int k = 0; k < kStreams; ++k) base[k] = buf + b * 8 * kStreams + k * len;
#if defined(HINA_HAVE_X86_KERNELS)
      if (use_avx512) {
        sink[tid] += detail::read_streams_avx512(base, kStreams, len);
        return;
      }
#endif
      sink[tid] += read_streams_generic(base, kStreams, len);
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
