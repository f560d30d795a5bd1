// Thread-pool backends (own workers / the loaded GNU OpenMP runtime's team): every tid runs
// exactly once per region, nesting runs inline, a forked child runs inline, an OpenMP region
// of the caller's runs ours inline, and the MoE op gives bit-identical results on both.
// Linked with OpenMP so that a libgomp is loaded in this process, as it is under PyTorch.
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "hina_moe/experts.h"
#include "hina_moe/thread_pool.h"

using namespace hina;

// TSan builds: libgomp is not instrumented, so this test's own OpenMP regions get the fork and
// join edges OpenMP guarantees annotated, as the pool does for its own (thread_pool.cpp).
#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define OMP_FORK() __tsan_release(&g_omp_fork)
#define OMP_ENTER() __tsan_acquire(&g_omp_fork)
#define OMP_LEAVE() __tsan_release(&g_omp_join)
#define OMP_JOINED() __tsan_acquire(&g_omp_join)
#else
#define OMP_FORK() ((void)0)
#define OMP_ENTER() ((void)0)
#define OMP_LEAVE() ((void)0)
#define OMP_JOINED() ((void)0)
#endif

namespace {
[[maybe_unused]] char g_omp_fork, g_omp_join;
// What the test's own OpenMP regions touch lives at namespace scope: a region's shared locals go
// through an argument block the compiler fills at the pragma, after any annotation before it.
std::atomic<int> g_team{0}, g_in_omp{0}, g_bad{0};

// The runtime's own region (as torch's ops run one): how many threads its team has.
void omp_team_size() {
  OMP_FORK();
#pragma omp parallel num_threads(2)
  {
    OMP_ENTER();
#pragma omp single
    g_team = omp_get_num_threads();
    OMP_LEAVE();
  }
  OMP_JOINED();
}

// A pool region opened from inside an OpenMP region of the caller's (counts in g_in_omp, g_bad).
void pool_inside_omp() {
  g_in_omp = 0;
  g_bad = 0;
  OMP_FORK();
#pragma omp parallel num_threads(2)
  {
    OMP_ENTER();
    ThreadPool::global().run(2, [](int, int nt) {
      g_in_omp++;
      if (nt != 2) g_bad++;
    });
    OMP_LEAVE();
  }
  OMP_JOINED();
}
int g_pass = 0, g_fail = 0;
void report(bool ok, const std::string& what) {
  ok ? ++g_pass : ++g_fail;
  if (!ok) std::printf("FAIL %s\n", what.c_str());
}

// Each tid of an n-region exactly once, on distinct threads for tid 0 (the caller).
bool covers(int n) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  for (auto& h : hits) h = 0;
  std::atomic<int> wrong_n{0};
  ThreadPool::global().run(n, [&](int tid, int nt) {
    if (nt != n) wrong_n++;
    hits[static_cast<size_t>(tid)]++;
  });
  for (auto& h : hits)
    if (h != 1) return false;
  return wrong_n == 0;
}

std::vector<float> moe_run(const PackedExperts& pe, const std::vector<uint16_t>& x, int64_t T,
                           const std::vector<int32_t>& idx, const std::vector<float>& w, int K) {
  std::vector<uint16_t> out(static_cast<size_t>(T * pe.H()));
  MoeParams p;
  p.num_threads = 2;
  pe.forward(x.data(), T, idx.data(), 32, w.data(), K, out.data(), p);
  std::vector<float> f(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const uint32_t b = static_cast<uint32_t>(out[i]) << 16;
    std::memcpy(&f[i], &b, 4);
  }
  return f;
}
}  // namespace

int main() {
  ThreadPool& pool = ThreadPool::global();
  // Make sure the runtime is loaded and has run a region of its own (as torch's ops do).
  omp_team_size();
  const int team = g_team;
  report(team >= 1, "libgomp region ran");

  for (PoolBackend b : {PoolBackend::kOwn, PoolBackend::kOpenMP, PoolBackend::kAuto}) {
    pool.set_backend(b);
    const std::string name = pool.backend_name();
    const std::string tag = "backend " + std::to_string(static_cast<int>(b)) + " (" + name + ")";
    report((b == PoolBackend::kOwn) == (name == "own"), tag + ": name says which backend runs");
    if (b != PoolBackend::kOwn) report(name.rfind("openmp (", 0) == 0, tag + ": the loaded libgomp is found");
    for (int n : {2, 3, 7}) report(covers(n), tag + ": every tid once, n=" + std::to_string(n));
    // nested: a region inside a region runs inline on that thread
    std::atomic<int> inner{0};
    pool.run(2, [&](int, int) { pool.run(3, [&](int, int) { inner++; }); });
    report(inner == 6, tag + ": nested regions run inline");
    // from inside the caller's own OpenMP region: ours runs inline, no nested team
    pool_inside_omp();
    report(g_in_omp == 2 * team && g_bad == 0, tag + ": inside an OpenMP region, every tid runs inline");
    // a forked child runs regions inline (its copy of any pool has no threads)
    const pid_t pid = fork();
    if (pid == 0) _exit(covers(3) ? 0 : 1);
    int status = 0;
    waitpid(pid, &status, 0);
    report(WIFEXITED(status) && WEXITSTATUS(status) == 0, tag + ": forked child runs regions inline");
  }

  // host(): the regions of fn on OpenMP's team (own backend): every tid once, the team's
  // threads taking shares; not hosted on the openmp backend, nested, or in a forked child; an
  // exception from fn comes out after the join; a contended hosted call backs off.
  {
    pool.set_backend(PoolBackend::kOwn);
    const uint64_t calls0 = pool.hosted_calls(), guests0 = pool.guest_shares();
    bool all = true;
    for (int i = 0; i < 200; ++i)
      pool.host(2, [&] {
        for (int r = 0; r < 20; ++r) all = covers(2 + r % 3) && all;
      });
    report(all, "host: every tid once in 4000 regions of 200 hosted calls");
    report(pool.hosted_calls() > calls0, "host: calls ran hosted");
    // (those trivial regions' shares mostly go to the caller, which counts as contention and
    // backs off; here every call is hosted, and its region's thread 0 waits up to 200 ms for tid
    // 1 to run on another thread: OpenMP's, waking from its sleep, even under TSan)
    std::atomic<bool> other{false};
    for (int i = 0; i < 20; ++i) {
      pool.host_reset_for_test();
      pool.host(2, [&] {
        pool.run(2, [&](int tid, int) {
          if (tid == 1) {
            other = true;
            return;
          }
          const auto t0 = std::chrono::steady_clock::now();
          while (!other && std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(200)) {
          }
        });
        other = false;
      });
    }
    report(pool.guest_shares() > guests0, "host: OpenMP's thread took worker shares");
    uint64_t before = pool.hosted_calls();
    std::atomic<int> ran{0};
    pool.run(2, [&](int, int) { pool.host(2, [&] { ran++; }); });
    report(ran == 2 && pool.hosted_calls() == before, "host: inside a region, fn runs alone");
    pool.set_backend(PoolBackend::kOpenMP);
    pool.host(2, [&] { all = covers(3); });
    report(all && pool.hosted_calls() == before,
           "host: on the openmp backend, fn runs alone (its regions on the team)");
    pool.set_backend(PoolBackend::kOwn);
    bool caught = false;
    try {
      pool.host(2, [&] {
        covers(2);
        throw std::runtime_error("from the step");
      });
    } catch (const std::runtime_error& e) {
      caught = std::string(e.what()) == "from the step";
    }
    report(caught && covers(2), "host: fn's exception comes out after the join; the pool runs on");
    // a contended call: the next calls are not hosted, until the backoff ends
    int hosted_first = -1;
    for (int i = 0; i < ThreadPool::kHostBackoffMax + 2 && hosted_first < 0; ++i) {
      before = pool.hosted_calls();
      pool.host(2, [&] { covers(2); });
      if (pool.hosted_calls() > before) hosted_first = i;
    }
    // (a hosted call found slow for real may have started a backoff of its own: the flag waits
    // for the next hosted call)
    pool.host_contention_for_test();
    uint64_t backoffs = 0;
    for (int i = 0; i < ThreadPool::kHostBackoffMax + 2; ++i) {
      before = pool.hosted_calls();
      backoffs = pool.host_backoffs();
      pool.host(2, [&] { covers(2); });
      if (pool.hosted_calls() > before) break;
    }
    report(pool.host_backoffs() == backoffs + 1, "host: a contended call starts a backoff");
    before = pool.hosted_calls();
    int skipped = 0;
    while (skipped <= ThreadPool::kHostBackoffMax && pool.hosted_calls() == before) {
      pool.host(2, [&] { all = covers(2); });
      if (pool.hosted_calls() == before) ++skipped;
    }
    report(hosted_first >= 0 && skipped >= ThreadPool::kHostBackoffMin && skipped <= ThreadPool::kHostBackoffMax && all,
           "host: the next " + std::to_string(skipped) + " calls ran on the own workers, then hosted again");
    const pid_t pid = fork();
    if (pid == 0) {
      const uint64_t b = pool.hosted_calls();
      bool ok = false;
      pool.host(2, [&] { ok = covers(3); });
      _exit(ok && pool.hosted_calls() == b ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    report(WIFEXITED(status) && WEXITSTATUS(status) == 0, "host: a forked child runs fn alone");
    pool.set_backend(PoolBackend::kAuto);
  }

  // kMixed: a prefill-sized call's regions (inside a PrefillScope) on OpenMP's team, others on
  // the own workers; every tid once either way; no hosting inside a PrefillScope.
  {
    pool.set_backend(PoolBackend::kMixed);
    report(pool.backend_name().rfind("own, prefill-sized calls on openmp (", 0) == 0, "mixed: its name");
    std::atomic<int> in_team{0}, outside{0};
    pool.run(2, [&](int, int) { (omp_in_parallel() ? in_team : outside)++; });
    report(in_team == 0 && outside == 2 && covers(3), "mixed: a decode-sized call's regions on the own workers");
    {
      const ThreadPool::PrefillScope prefill(true);
      pool.run(2, [&](int, int) { (omp_in_parallel() ? in_team : outside)++; });
      report(in_team == 2 && covers(3), "mixed: a prefill-sized call's regions on OpenMP's team");
      const uint64_t before = pool.hosted_calls();
      pool.host(2, [&] { covers(2); });
      report(pool.hosted_calls() == before, "mixed: no hosted call inside a PrefillScope");
    }
    const ThreadPool::PrefillScope off(false);
    in_team = 0;
    pool.run(2, [&](int, int) { (omp_in_parallel() ? in_team : outside)++; });
    report(in_team == 0, "mixed: the scope ends with its object; PrefillScope(false) changes nothing");
    pool.set_backend(PoolBackend::kAuto);
  }

  // A busy thread competing for the cores: some workers start late or not at all before the
  // caller has run their shares (the own backend's claims); every tid still runs exactly once.
  {
    std::atomic<bool> stop{false};
    std::thread busy([&] {
      volatile uint64_t x = 0;
      while (!stop.load(std::memory_order_relaxed)) x = x + 1;
    });
    for (PoolBackend b : {PoolBackend::kOwn, PoolBackend::kOpenMP}) {
      pool.set_backend(b);
      bool all = true;
      for (int i = 0; i < 3000 && all; ++i) all = covers(2 + i % 3);
      report(all, "backend " + std::to_string(static_cast<int>(b)) + ": every tid once, 3000 regions beside a busy thread");
    }
    stop = true;
    busy.join();
  }

  // The op on both backends: bit-identical (the split never changes the summation order).
  const int64_t E = 12, H = 200, I = 136, T = 5, K = 3;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 0.05f);
  auto bf16 = [&](size_t n) {
    std::vector<uint16_t> v(n);
    for (auto& e : v) {
      const float f = nd(rng);
      uint32_t b;
      std::memcpy(&b, &f, 4);
      e = static_cast<uint16_t>(b >> 16);
    }
    return v;
  };
  const auto g = bf16(E * I * H), u = bf16(E * I * H), d = bf16(E * H * I), x = bf16(T * H);
  std::vector<int32_t> idx(T * K);
  std::vector<float> w(T * K, 0.3f);
  for (int64_t i = 0; i < T * K; ++i) idx[i] = static_cast<int32_t>((i * 5) % E);
  ExpertWeights ew;
  ew.dtype = DType::kBF16;
  ew.E = E;
  ew.H = H;
  ew.I = I;
  ew.gate = g.data();
  ew.up = u.data();
  ew.down = d.data();
  auto pe = PackedExperts::pack(ew, resolve_isa("auto"), 2);
  pool.set_backend(PoolBackend::kOwn);
  const auto a1 = moe_run(*pe, x, 1, idx, w, K), aT = moe_run(*pe, x, T, idx, w, K);
  pool.set_backend(PoolBackend::kOpenMP);
  const auto b1 = moe_run(*pe, x, 1, idx, w, K), bT = moe_run(*pe, x, T, idx, w, K);
  report(a1 == b1 && aT == bT, "MoE op: own and openmp backends bit-identical (decode and prefill)");
  pool.set_backend(PoolBackend::kAuto);

  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail == 0 ? 0 : 1;
}
