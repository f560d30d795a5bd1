#include "hina_moe/bandwidth.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "hina_moe/cpu_features.h"
#include "moe/kernel_api.h"
#include "hina_moe/thread_pool.h"

namespace hina {

#if defined(HINA_HAVE_X86_KERNELS)
namespace detail {
uint64_t read_streams_avx512(const uint64_t* const* base, int streams, int64_t len);
uint64_t read_streams_avx2(const uint64_t* const* base, int streams, int64_t len);
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

namespace {

uint64_t* alloc_touched(size_t n, int threads) {
  // huge pages where the kernel grants them, as the packed weights get (alloc_weights)
  auto* buf = static_cast<uint64_t*>(detail::alloc_weights(n * sizeof(uint64_t)));
  // Touch every page (from the pool, so pages land where the readers run).
  ThreadPool::global().run(threads, [&](int tid, int nt) {
    int64_t b, e;
    split_range(static_cast<int64_t>(n), tid, nt, &b, &e);
    for (int64_t i = b; i < e; ++i) buf[i] = static_cast<uint64_t>(i);
  });
  return buf;
}

// One timed read of buf[0, n) with `threads` threads; GB/s.
double read_pass(const uint64_t* buf, size_t n, int threads) {
  // the widest loads the CPU has: a narrower loop than the kernels' reads slower than they do
  const bool use_avx512 = isa_supported(cpu_features(), Isa::kAvx512);
  const bool use_avx2 = !use_avx512 && isa_supported(cpu_features(), Isa::kAvx2);
  (void)use_avx512;
  (void)use_avx2;
  std::vector<uint64_t> sink(threads, 0);
  const auto t0 = std::chrono::steady_clock::now();
  // On OpenMP's team when a libgomp is loaded, whatever backend the kernels use: the probe is the
  // machine's bandwidth, and right after torch's ops (whose team keeps spinning) the own workers
  // may not get the second core (ThreadPool::run_on).
  ThreadPool::global().run_on(PoolBackend::kOpenMP, threads, [&](int tid, int nt) {
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
    if (use_avx2) {
      sink[tid] += detail::read_streams_avx2(base, kStreams, len);
      return;
    }
#endif
    sink[tid] += read_streams_generic(base, kStreams, len);
  });
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile uint64_t keep = 0;
  for (uint64_t s : sink) keep = keep + s;  // the sums must not be optimised away
  (void)keep;
  return static_cast<double>(n / (8 * 16) * (8 * 16) * sizeof(uint64_t)) / dt / 1e9;
}

}  // namespace

BandwidthResult measure_read_bandwidth(size_t bytes, int threads, int passes) {
  if (threads < 1 || passes < 1 || bytes < (1u << 20)) {
    throw std::invalid_argument("measure_read_bandwidth: need threads >= 1, passes >= 1, bytes >= 1 MiB");
  }
  const size_t n = bytes / sizeof(uint64_t);
  uint64_t* buf = alloc_touched(n, threads);
  std::vector<double> gbs;
  for (int p = 0; p < passes; ++p) gbs.push_back(read_pass(buf, n, threads));
  std::free(buf);
  std::sort(gbs.begin(), gbs.end());
  BandwidthResult r;
  r.best_gbs = gbs.back();
  r.median_gbs = gbs[gbs.size() / 2];
  r.bytes = n * sizeof(uint64_t);
  r.threads = threads;
  r.passes = passes;
  return r;
}

BandwidthProbe::BandwidthProbe(size_t bytes, int threads) : n_(bytes / sizeof(uint64_t)), threads_(threads) {
  if (threads < 1 || bytes < (3u << 20)) {
    throw std::invalid_argument("BandwidthProbe: need threads >= 1 and bytes >= 3 MiB");
  }
  buf_ = alloc_touched(n_, threads);
}

BandwidthProbe::~BandwidthProbe() { std::free(buf_); }

double BandwidthProbe::pass(size_t bytes) {
  const size_t want = bytes / sizeof(uint64_t);
  if (want < (1u << 17) || want > n_ / 3) {
    throw std::invalid_argument("BandwidthProbe: a read must be >= 1 MiB and <= a third of the buffer (" +
                                std::to_string(size()) + " bytes)");
  }
  if (pos_ + want > n_) pos_ = 0;
  const double gbs = read_pass(buf_ + pos_, want, threads_);
  pos_ += want;
  return gbs;
}

}  // namespace hina
