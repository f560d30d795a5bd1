#include "hina_moe/thread_pool.h"

#include <algorithm>
#include <chrono>

#include "hina_moe/types.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HINA_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define HINA_PAUSE() __asm__ __volatile__("yield")
#else
#define HINA_PAUSE() ((void)0)
#endif

#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#include <sched.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
static long current_pid() { return static_cast<long>(getpid()); }
#else
static long current_pid() { return 0; }
#endif

// ThreadSanitizer builds (HINA_SANITIZE=thread): libgomp is not instrumented, and its fork and
// join use raw futexes, so TSan cannot see that GOMP_parallel starts the team after the
// caller's writes and returns after every member's. Exactly those two edges (what OpenMP
// guarantees) are annotated, on two separate addresses so that no edge between team members is
// invented: our own code on the openmp backend is then checked like on the own backend.
#if defined(__SANITIZE_THREAD__)
#define HINA_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define HINA_TSAN 1
#endif
#endif
#if defined(HINA_TSAN)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define HINA_TSAN_ACQUIRE(p) __tsan_acquire(p)
#define HINA_TSAN_RELEASE(p) __tsan_release(p)
#else
#define HINA_TSAN_ACQUIRE(p) ((void)0)
#define HINA_TSAN_RELEASE(p) ((void)0)
#endif

namespace hina {

namespace {
thread_local bool tls_in_region = false;
thread_local bool tls_prefill = false;  // inside a PrefillScope

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
    slots_.push_back(std::make_unique<Slot>());
    slots_.back()->claimed.store(region_, std::memory_order_relaxed);
    slots_.back()->done.store(region_, std::memory_order_relaxed);
    Slot* slot = slots_.back().get();  // (not slots_[id] in the thread: the vector may grow meanwhile)
    workers_.emplace_back([this, id, slot, g = gen_.load()] { worker_loop(id, g, *slot); });
  }
}

void ThreadPool::worker_loop(int id, uint64_t seen, Slot& slot) {
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
    take_share(id, g, slot);
  }
}

bool ThreadPool::take_share(int id, uint64_t g, Slot& slot) {
  const uint64_t region = g >> kTidBits;
  const int n = static_cast<int>(g & ((uint64_t{1} << kTidBits) - 1));
  if (id + 1 >= n) return false;  // no share in this region
  // Take the share unless the caller already has (then the region may be long over, and
  // call_ and ctx_ are not read). A won claim keeps the caller in the region until done is set.
  uint64_t c = slot.claimed.load(std::memory_order_relaxed);
  if (c >= region || !slot.claimed.compare_exchange_strong(c, region, std::memory_order_acq_rel)) return false;
  call_(ctx_, id + 1, n);
  slot.done.store(region, std::memory_order_release);
  { std::lock_guard<std::mutex> lk(mu_); }  // the caller has either seen done or is asleep
  cv_done_.notify_all();
  return true;
}

// A guest (host()): OpenMP's thread id + 1 serving worker id's shares until the host ends. It
// waits as a worker does (spins briefly, then sleeps), on cv_guest_.
void ThreadPool::guest_loop(int id, Slot& slot) {
  const bool was = tls_in_region;
  tls_in_region = true;  // (the kernels it runs open no region of their own)
  uint64_t seen = 0;     // a region published before this thread arrived is still taken
  for (;;) {
    uint64_t g = gen_.load(std::memory_order_acquire);
    if (g == seen) {
      const int64_t t0 = now_us();
      for (int spins = 1; (g = gen_.load(std::memory_order_acquire)) == seen; ++spins) {
        if (host_end_.load(std::memory_order_acquire)) break;
        HINA_PAUSE();
        if ((spins & 63) == 0 && now_us() - t0 > kSpinMicros) break;
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_guest_.wait(lk, [&] {
          return host_end_.load(std::memory_order_acquire) || gen_.load(std::memory_order_acquire) != seen;
        });
        g = gen_.load(std::memory_order_acquire);
        if (g == seen) break;  // the host has ended
      }
    }
    seen = g;
    if (take_share(id, g, slot)) guest_shares_.fetch_add(1, std::memory_order_relaxed);
  }
  tls_in_region = was;
}

namespace {
// The loaded GNU OpenMP runtime's entry points (all null when there is none).
struct Gomp {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
  int (*in_parallel)() = nullptr;
  std::string path;
};

#if defined(__linux__)
int find_libgomp(struct dl_phdr_info* info, size_t, void* out) {
  const char* name = info->dlpi_name;
  const char* base = name ? std::strrchr(name, '/') : nullptr;
  base = base ? base + 1 : name;
  // libgomp.so.1, or a wheel's vendored copy such as libgomp-a34b3233.so.1
  if (base && std::strncmp(base, "libgomp", 7) == 0 && std::strstr(base, ".so")) {
    *static_cast<std::string*>(out) = name;
    return 1;
  }
  return 0;
}
#endif

// Looked up at every region until found (torch may be imported after our first region), then
// kept: a loaded libgomp is never unloaded while something uses it.
const Gomp* loaded_gomp() {
  static std::atomic<const Gomp*> found{nullptr};
  static std::atomic<int64_t> last_try_us{-1000000};
  if (const Gomp* g = found.load(std::memory_order_acquire)) return g;
#if defined(__linux__)
  const int64_t now = now_us();  // dl_iterate_phdr takes the loader lock: at most once a second
  if (now - last_try_us.load(std::memory_order_relaxed) < 1000000) return nullptr;
  last_try_us.store(now, std::memory_order_relaxed);
  std::string path;
  dl_iterate_phdr(find_libgomp, &path);
  if (path.empty()) return nullptr;
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!h) return nullptr;
  auto* g = new Gomp;  // leaked on purpose, like the pool
  g->parallel = reinterpret_cast<decltype(g->parallel)>(dlsym(h, "GOMP_parallel"));
  g->thread_num = reinterpret_cast<decltype(g->thread_num)>(dlsym(h, "omp_get_thread_num"));
  g->num_threads = reinterpret_cast<decltype(g->num_threads)>(dlsym(h, "omp_get_num_threads"));
  g->in_parallel = reinterpret_cast<decltype(g->in_parallel)>(dlsym(h, "omp_in_parallel"));
  g->path = path;
  if (!g->parallel || !g->thread_num || !g->num_threads || !g->in_parallel) {
    delete g;
    return nullptr;
  }
  const Gomp* expected = nullptr;
  if (!found.compare_exchange_strong(expected, g)) delete g;
  return found.load(std::memory_order_acquire);
#else
  return nullptr;
#endif
}

struct GompRegion {
  void (*call)(void*, int, int);
  void* ctx;
  int n;
  const Gomp* api;
  char fork, join;  // TSan builds: addresses of the two annotated edges
};

void gomp_region(void* p) {
  GompRegion& r = *static_cast<GompRegion*>(p);
  HINA_TSAN_ACQUIRE(&r.fork);
  // The runtime may give fewer threads than asked (OMP_THREAD_LIMIT, OMP_DYNAMIC): the team
  // then runs every tid anyway, round robin.
  const int tid = r.api->thread_num(), nt = r.api->num_threads();
  const bool was = tls_in_region;
  tls_in_region = true;
  for (int i = tid; i < r.n; i += nt) r.call(r.ctx, i, r.n);
  tls_in_region = was;
  HINA_TSAN_RELEASE(&r.join);
}
}  // namespace

std::string loaded_openmp_runtime() {
  const Gomp* g = loaded_gomp();
  return g ? g->path : std::string();
}

void ThreadPool::set_backend(PoolBackend b) { backend_.store(b, std::memory_order_relaxed); }

ThreadPool::PrefillScope::PrefillScope(bool on) : was_(tls_prefill) { tls_prefill = was_ || on; }
ThreadPool::PrefillScope::~PrefillScope() { tls_prefill = was_; }

std::string ThreadPool::backend_name(PoolBackend b) {
  if (b == PoolBackend::kOwn) return "own";
  if (b == PoolBackend::kMixed) {
    const Gomp* g = loaded_gomp();
    return g ? "own, prefill-sized calls on openmp (" + g->path + ")" : "own";
  }
  if (const Gomp* g = loaded_gomp()) return "openmp (" + g->path + ")";
  return b == PoolBackend::kOpenMP ? "own (openmp requested, no libgomp loaded in this process)" : "own";
}

void ThreadPool::run_impl(PoolBackend b, int n, Call call, void* ctx) {
  if (n <= 1 || tls_in_region || current_pid() != owner_pid_) {
    for (int i = 0; i < (n < 1 ? 1 : n); ++i) call(ctx, i, n < 1 ? 1 : n);
    return;
  }
  if (b == PoolBackend::kMixed) b = tls_prefill ? PoolBackend::kOpenMP : PoolBackend::kOwn;
  if (b != PoolBackend::kOwn) {
    if (const Gomp* g = loaded_gomp(); g && !g->in_parallel()) {
      GompRegion r{call, ctx, n, g, 0, 0};
      HINA_TSAN_RELEASE(&r.fork);
      g->parallel(&gomp_region, &r, static_cast<unsigned>(n), 0);
      HINA_TSAN_ACQUIRE(&r.join);
      return;
    }
  }
  std::lock_guard<std::mutex> call_lk(call_mu_);
  if (n >= (1 << kTidBits)) throw std::invalid_argument("ThreadPool::run: too many threads");
  grow(n - 1);
  const uint64_t region = ++region_;
  call_ = call;
  ctx_ = ctx;
  bool hosted;
  {
    std::lock_guard<std::mutex> lk(mu_);
    gen_.store(region << kTidBits | static_cast<uint64_t>(n), std::memory_order_release);
    hosted = hosted_;
  }
  (hosted ? cv_guest_ : cv_work_).notify_all();

  tls_in_region = true;
  call(ctx, 0, n);
  // The shares no worker has started yet run here (a worker the scheduler has not run, say
  // because another process holds its core); those the workers took are waited for.
  for (int w = 0; w + 1 < n; ++w) {
    Slot& s = *slots_[static_cast<size_t>(w)];
    uint64_t c = s.claimed.load(std::memory_order_relaxed);
    if (c < region && s.claimed.compare_exchange_strong(c, region, std::memory_order_acq_rel)) {
      call(ctx, w + 1, n);
      s.done.store(region, std::memory_order_relaxed);
      if (hosted) host_shares_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  tls_in_region = false;

  for (int w = 0; w + 1 < n; ++w) {
    Slot& s = *slots_[static_cast<size_t>(w)];
    const int64_t t0 = now_us();
    for (int spins = 1; s.done.load(std::memory_order_acquire) < region; ++spins) {
      HINA_PAUSE();
      if ((spins & 63) == 0 && now_us() - t0 > kSpinMicros) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_done_.wait(lk, [&] { return s.done.load(std::memory_order_acquire) >= region; });
        break;
      }
    }
  }
}

struct ThreadPool::HostCall {
  void (*fn)(void*);
  void* ctx;
  const Gomp* api;
  std::vector<Slot*> slots;  // worker w's (stable: slots are never freed)
  std::exception_ptr error;
  int64_t ended_us = 0;  // when thread 0 told the guests to leave
  char fork, join;  // TSan builds: addresses of the two annotated edges
};

void ThreadPool::host_body(void* p) {
  auto& h = *static_cast<HostCall*>(p);
  HINA_TSAN_ACQUIRE(&h.fork);
  ThreadPool& pool = global();
  const int tid = h.api->thread_num();
  if (tid == 0) {
    try {
      h.fn(h.ctx);
    } catch (...) {
      h.error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(pool.mu_);
      pool.hosted_ = false;
      pool.host_end_.store(true, std::memory_order_release);
    }
    h.ended_us = now_us();
    pool.cv_guest_.notify_all();
  } else if (static_cast<size_t>(tid) <= h.slots.size()) {
    pool.guest_loop(tid - 1, *h.slots[static_cast<size_t>(tid - 1)]);
  }
  HINA_TSAN_RELEASE(&h.join);
}

void ThreadPool::host_impl(int n, void (*fn)(void*), void* ctx) {
  const Gomp* g = nullptr;
  const PoolBackend b = backend();
  if (n <= 1 || tls_in_region || tls_prefill || current_pid() != owner_pid_ || !hosting() ||
      (b != PoolBackend::kOwn && b != PoolBackend::kMixed) ||
      this != &global() || !(g = loaded_gomp()) || g->in_parallel() || !host_mu_.try_lock()) {
    fn(ctx);
    return;
  }
  std::unique_lock<std::mutex> host_lk(host_mu_, std::adopt_lock);
  if (host_skip_ > 0) {  // backing off: the own workers (a test's flag waits for a hosted call)
    --host_skip_;
    host_lk.unlock();
    fn(ctx);
    return;
  }
  if (n >= (1 << kTidBits)) throw std::invalid_argument("ThreadPool::host: too many threads");
  const uint64_t guests0 = guest_shares(), host0 = host_shares();
  HostCall h{fn, ctx, g, {}, nullptr, 0, 0, 0};
  {
    std::lock_guard<std::mutex> call_lk(call_mu_);
    grow(n - 1);
    for (int w = 0; w + 1 < n; ++w) h.slots.push_back(slots_[static_cast<size_t>(w)].get());
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    hosted_ = true;
    host_end_.store(false, std::memory_order_relaxed);
  }
  HINA_TSAN_RELEASE(&h.fork);
  g->parallel(&ThreadPool::host_body, &h, static_cast<unsigned>(n), 0);
  HINA_TSAN_ACQUIRE(&h.join);
  const int64_t join_us = now_us() - h.ended_us;
  hosted_calls_.fetch_add(1, std::memory_order_relaxed);
  // Held off its cores? (the module comment in thread_pool.h)
  const uint64_t by_host = host_shares() - host0, shares = by_host + guest_shares() - guests0;
  const bool test = host_test_contended_.exchange(false, std::memory_order_relaxed);
  if (test || join_us > kHostJoinMicros || (shares >= 8 && 4 * by_host > shares)) {
    host_skip_ = host_backoff_;
    host_backoff_ = std::min(2 * host_backoff_, kHostBackoffMax);
    host_backoffs_.fetch_add(1, std::memory_order_relaxed);
  } else {  // (halved, not reset: under a competing process some hosted calls look clean)
    host_backoff_ = std::max(host_backoff_ / 2, kHostBackoffMin);
  }
  if (h.error) std::rethrow_exception(h.error);
}

}  // namespace hina
