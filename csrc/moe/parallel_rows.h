// The row split of the per-row vector ops (attention, latent attention, rope): contiguous ranges
// of rows over the library's pool, or one thread when the call is too small to wake it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "hina_moe/thread_pool.h"
#include "hina_moe/types.h"

namespace hina::detail {

// Below this many multiply-adds one thread does the work: waking the pool costs more.
constexpr int64_t kParallelMacs = 1 << 16;

// part(r0, r1) over rows [0, rows), split over the pool (num_threads <= 0: every hardware
// thread) when the call's `macs` multiply-adds are enough work.
template <class F>
void parallel_rows(int64_t rows, int64_t macs, int num_threads, const F& part) {
  if (num_threads <= 0) num_threads = default_num_threads();
  const int n = static_cast<int>(std::min<int64_t>({num_threads, rows, std::max<int64_t>(1, macs / kParallelMacs)}));
  if (n <= 1) return part(0, rows);
  ThreadPool::global().run(n, [&](int tid, int nt) { part(rows * tid / nt, rows * (tid + 1) / nt); });
}

}  // namespace hina::detail
