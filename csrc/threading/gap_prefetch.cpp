// Gap prefetch (experiment, session 27): a background thread that issues software prefetches over
// a list of byte ranges, so that the weights the next native call reads start coming in while
// Python runs between two calls (the memory system is otherwise idle then). Prefetch
// instructions never fault, so a range freed meanwhile is harmless. Every parallel region stops
// it first (ThreadPool::run_impl): it never competes with a kernel for a core.
#include <atomic>
#include <cstdlib>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "hina_moe/thread_pool.h"

namespace hina {

namespace {
struct GapPrefetcher {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<uintptr_t, size_t>> job;  // under mu
  uint64_t posted = 0;                            // under mu
  std::atomic<uint64_t> stop_at{0};               // the posted job the thread must abandon
  std::atomic<uint64_t> lines{0};                 // lines prefetched, for the study
  std::thread th;

  GapPrefetcher() {
    th = std::thread([this] { loop(); });
    th.detach();
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      std::vector<std::pair<uintptr_t, size_t>> r;
      uint64_t id;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return posted != seen; });
        id = seen = posted;
        r.swap(job);
      }
      uint64_t n = 0;
      static const size_t cap = [] {
        const char* e = std::getenv("HINA_GAP_MB");
        return e ? static_cast<size_t>(std::atof(e) * 1048576.0) : ~size_t{0};
      }();
      static const int hint = [] {
        const char* e = std::getenv("HINA_GAP_HINT");
        return e ? std::atoi(e) : 2;
      }();
      size_t left = cap;
      for (const auto& [p, b] : r) {
        const size_t bytes = b < left ? b : left;
        left -= bytes;
        const uintptr_t end = p + bytes;
        for (uintptr_t a = p & ~uintptr_t{63}; a < end; a += 4096) {
          if (stop_at.load(std::memory_order_relaxed) >= id) goto done;
          const uintptr_t e = a + 4096 < end ? a + 4096 : end;
          if (hint == 3) {
            for (uintptr_t l = a; l < e; l += 64, ++n) __builtin_prefetch(reinterpret_cast<const void*>(l), 0, 3);
          } else if (hint == 1) {
            for (uintptr_t l = a; l < e; l += 64, ++n) __builtin_prefetch(reinterpret_cast<const void*>(l), 0, 1);
          } else {
            for (uintptr_t l = a; l < e; l += 64, ++n) __builtin_prefetch(reinterpret_cast<const void*>(l), 0, 2);
          }
        }
      }
    done:
      lines.fetch_add(n, std::memory_order_relaxed);
    }
  }
};

std::atomic<GapPrefetcher*> g_prefetcher{nullptr};
std::atomic<uint64_t> g_last_posted{0};
}  // namespace

void gap_prefetch(const std::vector<std::pair<uintptr_t, size_t>>& ranges) {
  static GapPrefetcher* gp = new GapPrefetcher();  // leaked on purpose, like the pool
  g_prefetcher.store(gp, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(gp->mu);
    gp->job = ranges;
    g_last_posted.store(++gp->posted, std::memory_order_relaxed);
  }
  gp->cv.notify_one();
}

void gap_prefetch_stop() {
  GapPrefetcher* gp = g_prefetcher.load(std::memory_order_acquire);
  if (gp) gp->stop_at.store(g_last_posted.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

uint64_t gap_prefetch_lines() {
  GapPrefetcher* gp = g_prefetcher.load(std::memory_order_acquire);
  return gp ? gp->lines.load(std::memory_order_relaxed) : 0;
}

}  // namespace hina
