// Parallel regions: fn(tid, n) for tid in [0, n), tid 0 on the calling thread, on one of two
// backends (set_backend):
// - own: the library's persistent workers. Idle workers spin briefly (kSpinMicros of `pause`)
//   and then sleep on a condition variable: never spin forever, because on a shared machine a
//   spin-barrier pool collapses as soon as another process is runnable. Nor does the caller
//   wait for a worker that has not started: each worker's share (tid) is claimed, by the worker
//   when it wakes or by the caller once its own share is done, whichever comes first, so a
//   worker descheduled by another process costs its share's time on the caller, not the wait
//   until the scheduler runs it again (a decode step under a competing process: 2.4-2.7x
//   the speed it has on OpenMP's team; benchmarks/log/, 2026-12-02, d21e2e4).
// - openmp: the team of the GNU OpenMP runtime (libgomp) already loaded in the process, e.g.
//   by PyTorch, entered through its stable ABI entry point GOMP_parallel (found with dlopen
//   RTLD_NOLOAD on the loaded library; nothing is linked). When PyTorch's OpenMP workers have
//   just run an op they keep spinning for a while; with the own backend those spinners and our
//   workers fight for the same cores (a decode step measured 1.3-1.6x slower right after a
//   torch matmul), while on the openmp backend the spinning workers are the ones that pick up
//   our region (ratio 0.99-1.01). benchmarks/RESULTS.md, "Thread pool backends".
// kAuto (the default) is openmp when a libgomp is loaded, own otherwise. Either way a call from
// inside a region (ours or an OpenMP one) or in a forked child runs inline on the caller.
// On the own backend a caller may also host() a span of regions (a whole decode step): one
// OpenMP region around it whose threads serve the own workers' shares (see host()).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace hina {

// kMixed: the own workers, but the regions of a prefill-sized call (inside a PrefillScope: the
// experts' and linear layers' calls and the prefill attention of kMixedTeamRows tokens or more)
// on the loaded libgomp's team, as kOpenMP. Why: a prefill interleaves torch's ops with the
// kernels' regions, and torch's OpenMP thread, which spins for milliseconds after each of them,
// shares the second core with own workers woken meanwhile; a prefill's regions are long beside
// one join each. Qwen1.5-MoE 4L int4 prefill-512 1.09x the own workers' speed, 1.05x beside a
// competing process (benchmarks/bench_prefill_pool.py). Decode-sized regions stay on the own
// workers (and a decode step is hosted, host()).
enum class PoolBackend : int { kAuto = 0, kOwn = 1, kOpenMP = 2, kMixed = 3 };

class ThreadPool {
 public:
  static constexpr int64_t kSpinMicros = 80;

  // Process-wide choice of backend (thread-safe; takes effect at the next region). kOpenMP
  // without a loaded libgomp falls back to the own workers, and backend_name() says so.
  void set_backend(PoolBackend b);
  PoolBackend backend() const { return backend_.load(std::memory_order_relaxed); }
  // What regions run on under backend b: "own", "openmp (<path of the libgomp>)", or
  // "own (openmp requested, no libgomp loaded in this process)"; no argument: the current one.
  static std::string backend_name(PoolBackend b);
  std::string backend_name() const { return backend_name(backend()); }

  // The process-wide pool (created on first use, grown on demand, never destroyed).
  static ThreadPool& global();

  // Runs fn(tid, n) for every tid in [0, n) and returns when all have finished. n <= 1, a call
  // from inside a region (nesting), or a call in a forked child (whose copy of the pool has no
  // threads) runs every tid inline on the caller. Regions are serialised.
  template <typename F>
  void run(int n, F&& fn) {
    run_on(backend(), n, std::forward<F>(fn));
  }
  // While alive on a thread, the regions that thread opens are those of a prefill-sized call
  // (kMixed puts them on OpenMP's team). Nests; a no-op when `on` is false.
  class PrefillScope {
   public:
    explicit PrefillScope(bool on);
    ~PrefillScope();
    PrefillScope(const PrefillScope&) = delete;
    PrefillScope& operator=(const PrefillScope&) = delete;

   private:
    bool was_;
  };
  // The same on backend b rather than the process-wide choice (the read-bandwidth probe's passes
  // run on OpenMP's team, the fastest readers right after torch's ops, whatever the kernels use).
  template <typename F>
  void run_on(PoolBackend b, int n, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run_impl(b, n, [](void* ctx, int tid, int nt) { (*static_cast<Fn*>(ctx))(tid, nt); },
             static_cast<void*>(&fn));
  }

  // Runs fn() on the calling thread while the threads of one region of the loaded OpenMP runtime
  // (GOMP_parallel, n threads) serve the parallel regions fn opens (on the own backend) in place
  // of the own workers: each team thread takes worker shares as an own worker does (the same
  // claims: a share its thread has not started is still run by the caller), and the own
  // workers are not woken meanwhile. Why: after a torch op ran in parallel, its OpenMP thread
  // keeps spinning on the second core for several milliseconds (7.5 on the EPYC of
  // benchmarks/RESULTS.md), and own workers woken meanwhile share that core with it: under
  // transformers' generate(), whose logits copy and argmax run in parallel between two decode
  // steps, a Qwen1.5-MoE 4L int4 step took 1.1 ms longer on the own workers. A hosted call
  // costs one join of OpenMP's team at its end, not one per region (the openmp backend's
  // collapse under a competing process). fn() runs alone (not hosted) when n <= 1, the backend
  // is neither own nor mixed, inside a PrefillScope, no libgomp is loaded, hosting is off
  // (set_hosting), the caller is inside a region or OpenMP's parallel region, another call is
  // hosted, or in a forked child; and
  // while backing off: a hosted call that found the team's threads held off their cores (the
  // caller ran more than a quarter of the worker shares, or waited over kHostJoinMicros for
  // the team to join: another process competes for the cores, and OpenMP's threads, which
  // spin for milliseconds after each region, then cost more than they serve) makes the next
  // kHostBackoffMin calls run on the own workers, that length doubling (up to kHostBackoffMax)
  // at each such call and halving at each clean one. An exception from fn() is rethrown here
  // after the team has joined.
  template <typename F>
  void host(int n, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    host_impl(n, [](void* ctx) { (*static_cast<Fn*>(ctx))(); }, static_cast<void*>(&fn));
  }
  static constexpr int64_t kHostJoinMicros = 300;
  static constexpr int kHostBackoffMin = 64, kHostBackoffMax = 4096;
  void set_hosting(bool on) { hosting_on_.store(on, std::memory_order_relaxed); }
  bool hosting() const { return hosting_on_.load(std::memory_order_relaxed); }
  // calls host() ran hosted, and worker shares OpenMP's threads ran in them (since start)
  uint64_t hosted_calls() const { return hosted_calls_.load(std::memory_order_relaxed); }
  uint64_t guest_shares() const { return guest_shares_.load(std::memory_order_relaxed); }
  // of the worker shares of hosted calls, those the caller ran itself; and the hosted calls
  // that started a backoff
  uint64_t host_shares() const { return host_shares_.load(std::memory_order_relaxed); }
  uint64_t host_backoffs() const { return host_backoffs_.load(std::memory_order_relaxed); }
  // Tests: makes the next hosted call count as one that found the team held off its cores; and
  // ends any backoff (its length back to kHostBackoffMin).
  void host_contention_for_test() { host_test_contended_.store(true, std::memory_order_relaxed); }
  void host_reset_for_test() {
    std::lock_guard<std::mutex> lk(host_mu_);
    host_skip_ = 0;
    host_backoff_ = kHostBackoffMin;
  }

  int num_workers() const { return static_cast<int>(workers_.size()); }

 private:
  using Call = void (*)(void*, int, int);
  ThreadPool();
  void run_impl(PoolBackend b, int n, Call call, void* ctx);
  void grow(int workers);

  // Worker w's share of a region is tid w + 1. claimed: the last region (generation) whose share
  // someone took, the worker or the caller (compare-exchange: one of them); done: the last
  // region whose share is finished (stored by whichever ran it).
  struct alignas(64) Slot {
    std::atomic<uint64_t> claimed{0};
    std::atomic<uint64_t> done{0};
  };
  static constexpr int kTidBits = 16;  // gen_ = region << kTidBits | n

  void worker_loop(int id, uint64_t seen, Slot& slot);
  // host(): fn on the caller as OpenMP's thread 0, the team's other threads as guests
  struct HostCall;
  void host_impl(int n, void (*fn)(void*), void* ctx);
  static void host_body(void* h);
  void guest_loop(int id, Slot& slot);
  // Runs the share of region g (gen_'s value) that worker id holds, if nobody has claimed it.
  bool take_share(int id, uint64_t g, Slot& slot);

  std::atomic<PoolBackend> backend_{PoolBackend::kAuto};
  std::mutex call_mu_;  // one region at a time (own backend)
  std::mutex mu_;       // guards sleeping / waking
  std::condition_variable cv_work_, cv_done_;
  std::vector<std::thread> workers_;
  std::vector<std::unique_ptr<Slot>> slots_;  // one per worker (grown with them, never shrunk)
  std::atomic<uint64_t> gen_{0};
  uint64_t region_ = 0;  // the last region published (under call_mu_)
  Call call_ = nullptr;  // the current region's; read by a worker only after it claimed its share
  void* ctx_ = nullptr;
  long owner_pid_ = 0;  // process that owns the workers
  // host(): one hosted call at a time; while hosted_ (under mu_) regions wake the guests
  // (cv_guest_), not the own workers; host_end_ tells the guests to leave
  std::mutex host_mu_;
  bool hosted_ = false;
  std::atomic<bool> host_end_{false};
  std::condition_variable cv_guest_;
  std::atomic<bool> hosting_on_{true};
  std::atomic<uint64_t> hosted_calls_{0}, guest_shares_{0}, host_shares_{0}, host_backoffs_{0};
  std::atomic<bool> host_test_contended_{false};
  int host_skip_ = 0;                 // calls left to run unhosted (under host_mu_)
  int host_backoff_ = kHostBackoffMin;  // the next backoff's length (under host_mu_)
};

// Path of the GNU OpenMP runtime loaded in this process ("" when there is none).
std::string loaded_openmp_runtime();

// Splits [0, total) into n near-equal contiguous chunks; chunk `i` is [*begin, *end).
inline void split_range(int64_t total, int i, int n, int64_t* begin, int64_t* end) {
  const int64_t q = total / n, r = total % n;
  *begin = i * q + (i < r ? i : r);
  *end = *begin + q + (i < r ? 1 : 0);
}

}  // namespace hina
