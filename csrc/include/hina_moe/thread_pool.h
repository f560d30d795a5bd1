// The library's own thread pool. Persistent workers; a parallel region runs fn(tid, n) for
// tid in [0, n) with tid 0 on the calling thread. Idle workers spin briefly (kSpinMicros of
// `pause`) and then sleep on a condition variable: never spin forever, because on a shared
// machine a spin-barrier pool collapses as soon as another process is runnable.
// Not OpenMP, so it never fights torch's OpenMP pool for the same cores.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace hina {

class ThreadPool {
 public:
  static constexpr int64_t kSpinMicros = 80;

  // The process-wide pool (created on first use, grown on demand, never destroyed).
  static ThreadPool& global();

  // Runs fn(tid, n) for every tid in [0, n) and returns when all have finished. n <= 1, a call
  // from inside a region (nesting), or a call in a forked child (whose copy of the pool has no
  // threads) runs every tid inline on the caller. Regions are serialised.
  template <typename F>
  void run(int n, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run_impl(n, [](void* ctx, int tid, int nt) { (*static_cast<Fn*>(ctx))(tid, nt); },
             static_cast<void*>(&fn));
  }

  int num_workers() const { return static_cast<int>(workers_.size()); }

 private:
  using Call = void (*)(void*, int, int);
  ThreadPool();
  void run_impl(int n, Call call, void* ctx);
  void worker_loop(int id, uint64_t seen);
  void grow(int workers);

  std::mutex call_mu_;  // one region at a time
  std::mutex mu_;       // guards sleeping / waking
  std::condition_variable cv_work_, cv_done_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  Call call_ = nullptr;
  void* ctx_ = nullptr;
  int n_ = 0;
  long owner_pid_ = 0;  // process that owns the workers
};

// Splits [0, total) into n near-equal contiguous chunks; chunk `i` is [*begin, *end).
inline void split_range(int64_t total, int i, int n, int64_t* begin, int64_t* end) {
  const int64_t q = total / n, r = total % n;
  *begin = i * q + (i < r ? i : r);
  *end = *begin + q + (i < r ? 1 : 0);
}

}  // namespace hina
