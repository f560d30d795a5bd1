#include "hina_moe/thread_pool.h"

#include <chrono>

#include "hina_moe/moe.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HINA_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define HINA_PAUSE() __asm__ __volatile__("yield")
#else
#define HINA_PAUSE() ((void)0)
#endif

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
static long current_pid() { return static_cast<long>(getpid()); }
#else
static long current_pid() { return 0; }
#endif

namespace hina {

namespace {
thread_local bool tls_in_region = false;

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

int default_num_threads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

ThreadPool::ThreadPool() : owner_pid_(current_pid()) {}

ThreadPool& ThreadPool::global() {
  // Leaked on purpose: joining threads during static destruction (interpreter exit) is fragile.
  static ThreadPool* pool = new ThreadPool();
  return *pool;
}

void ThreadPool::grow(int workers) {
  // Called with call_mu_ held and no region running, so gen_ is stable.
  while (static_cast<int>(workers_.size()) < workers) {
    const int id = static_cast<int>(workers_.size());
    workers_.emplace_back([this, id, g = gen_.load()] { worker_loop(id, g); });
  }
}

void ThreadPool::worker_loop(int id, uint64_t seen) {
  tls_in_region = true;  // a worker never opens a nested region of its own
  for (;;) {
    uint64_t g = gen_.load(std::memory_order_acquire);
    if (g == seen) {
      const int64_t t0 = now_us();
      for (int spins = 1; (g = gen_.load(std::memory_order_acquire)) == seen; ++spins) {
        HINA_PAUSE();
        if ((spins & 63) == 0 && now_us() - t0 > kSpinMicros) break;
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_work_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        g = gen_.load(std::memory_order_acquire);
      }
    }
    seen = g;
    if (id + 1 < n_) call_(ctx_, id + 1, n_);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_done_.notify_one();
    }
  }
}

void ThreadPool::run_impl(int n, Call call, void* ctx) {
  if (n <= 1 || tls_in_region || current_pid() != owner_pid_) {
    for (int i = 0; i < (n < 1 ? 1 : n); ++i) call(ctx, i, n < 1 ? 1 : n);
    return;
  }
  std::lock_guard<std::mutex> call_lk(call_mu_);
  grow(n - 1);
  call_ = call;
  ctx_ = ctx;
  n_ = n;
  // Every worker acknowledges every generation (also those with no share), so a worker can
  // never miss a generation or read the fields of the next one.
  pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lk(mu_);
    gen_.fetch_add(1, std::memory_order_release);
  }
  cv_work_.notify_all();

  tls_in_region = true;
  call(ctx, 0, n);
  tls_in_region = false;

  const int64_t t0 = now_us();
  for (int spins = 1; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    HINA_PAUSE();
    if ((spins & 63) == 0 && now_us() - t0 > kSpinMicros) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_done_.wait(lk, [&] { return pending_.load(std::memory_order_acquire) == 0; });
      break;
    }
  }
}

}  // namespace hina
