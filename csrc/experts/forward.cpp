// The experts op's forward: routing metadata, input rows, the two parallel regions, output
// conversion (packing: packing.cpp; which kernels: dispatch/select.cpp). Compiled at the baseline
// flags with -ffp-contract=off; only calls into an ISA translation unit after runtime dispatch.
//
// One forward = two parallel regions on the library's pool:
//   1. gate/up + activation: every thread owns a contiguous range of I panels and runs it for
//      every active expert, so each thread streams its own slice of each expert's weights;
//   2. down + routing weight + scatter-add + output conversion: every thread owns a range of H
//      panels of the fp32 accumulator, so no two threads ever add into the same element and the
//      sum over experts runs in ascending expert order (deterministic for any thread count).
// By default (MoeParams::static_split false) both regions are split dynamically instead:
// threads claim work items from a shared counter (region 1: (active expert, chunk of I
// panels), expert-major; region 2: chunks of H panels, each run over all experts in ascending
// order), so a thread that runs slower (memory contention, a vCPU taken by another process,
// torch's OpenMP workers still spinning on its core) ends up with less of the work instead of
// holding everyone up. Every output element is still produced by one item in one fixed order:
// results do not depend on the split (tested bit-identical).
// An item's chunk is sized in bytes, not panels: each expert's piece of it is about
// kItemBytes of contiguous panels, at most 1 / (2 x threads) of the region's panels (a quarter
// at 2 threads, an eighth at 4), so that every thread has items to take and to share. A thread
// streams its item's pieces one after the other, and the hardware prefetchers ramp up again at
// each piece. The old cap of 8 panels made int4's down pieces 64 KiB (8 KiB panels) and its
// q/k/v and o_proj pieces 128 KiB: on an AMD Zen 5 whole OLMoE int4 decode steps took 4-7 %
// less time with 1 MiB pieces (int8 2-4 %, lossless12 1-2 %), under a competing process too,
// and 35 % more with 32 KiB ones (benchmarks/log/, 2026-12-04, 12f9408).
#include <cmath>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>


#include "hina_moe/experts.h"
#include "hina_moe/tier.h"
#include "hina_moe/thread_pool.h"
#include "moe/kernel_api.h"
#include "dispatch/select.h"
#include "moe/prefetch.h"
#include "moe/step_trace.h"

namespace hina {

using namespace detail;

namespace detail::pf {
namespace {
// HINA_MOE_PREFETCH_BYTES when it holds a multiple of 64 in [0, 65536], else -1.
int env_prefetch_bytes() {
  if (const char* env = std::getenv("HINA_MOE_PREFETCH_BYTES")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v >= 0 && v <= 65536 && v % 64 == 0) return static_cast<int>(v);
  }
  return -1;
}
bool amd() { return std::strcmp(cpu_features().vendor, "AuthenticAMD") == 0; }
}  // namespace

int load_prefetch_distance() {
  static const int bytes = [] {
    const int env = env_prefetch_bytes();
    return env >= 0 ? env : amd() ? 1024 : 4096;
  }();
  return bytes;
}
int load_rows_prefetch(bool many) {
  static const int few = [] {
    const int env = env_prefetch_bytes();
    return env >= 0 ? env : amd() ? 0 : load_prefetch_distance();
  }();
  static const int lots = [] {
    const int env = env_prefetch_bytes();
    return env >= 0 ? env : amd() ? 16384 : load_prefetch_distance();
  }();
  return many ? lots : few;
}
bool load_l12_prefetch() {
  return std::getenv("HINA_MOE_PREFETCH_BYTES") != nullptr || !amd();
}
}  // namespace detail::pf

bool l12_prefetch() { return detail::pf::l12_prefetch(); }

namespace {
// The dynamic split's piece of one expert (header comment); a build with HINA_PREFETCH_TUNING
// reads HINA_ITEM_BYTES at every forward instead, for benchmarks to compare sizes (0: pieces of
// 8 panels whatever their bytes, the rule before, for A/B in one process).
constexpr int64_t kItemBytes = 1 << 20;
int64_t dynamic_item_bytes() {
#ifdef HINA_PREFETCH_TUNING
  if (const char* b = std::getenv("HINA_ITEM_BYTES")) return std::max<int64_t>(0, std::atoll(b));
#endif
  return kItemBytes;
}
}  // namespace

int prefetch_distance() { return detail::pf::bytes(); }
int rows_prefetch_distance(int64_t rows) { return detail::pf::ahead(rows); }

namespace {

struct Scratch {
  AlignedBuf xbuf, hbuf, hqbuf, acc;
  std::vector<int64_t> counts, offsets, cursor;
  std::vector<int32_t> active, row_token;
  std::vector<float> row_w, row_wt;
  std::vector<const void*> xrows;
  std::vector<float*> accrows;
};
thread_local Scratch tls_scratch;

template <typename IdxT>
void check_and_count(const IdxT* idx, int64_t T, int64_t K, int64_t E, std::vector<int64_t>& counts) {
  counts.assign(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < T * K; ++s) {
    const int64_t e = static_cast<int64_t>(idx[s]);
    if (e < 0) continue;
    if (e >= E) {
      throw std::invalid_argument("topk_idx[" + std::to_string(s / K) + ", " +
                                  std::to_string(s % K) + "] = " + std::to_string(e) +
                                  " is out of range: the experts have E = " + std::to_string(E) +
                                  " (negative indices mean 'skip this slot')");
    }
    ++counts[static_cast<size_t>(e)];
  }
}

template <typename IdxT>
void fill_rows(const IdxT* idx, const void* topk_w, DType w_dt, int64_t T, int64_t K, Scratch& s) {
  s.cursor.assign(s.offsets.begin(), s.offsets.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = static_cast<int64_t>(idx[t * K + k]);
      if (e < 0) continue;
      const int64_t r = s.cursor[static_cast<size_t>(e)]++;
      s.row_token[static_cast<size_t>(r)] = static_cast<int32_t>(t);
      s.row_w[static_cast<size_t>(r)] = load_elem(w_dt, topk_w, t * K + k);
    }
  }
}

}  // namespace

const char* PackedExperts::forward(const void* x, int64_t T, const void* topk_idx, int idx_bits,
                                   const void* topk_w, int64_t K, void* out,
                                   const MoeParams& p) const {
  // Path choice needs the routing counts, so forward_with does the routing and calls back here
  // through `select` below; keep a single implementation.
  if (up_only()) throw std::invalid_argument("this block is a dense linear layer (up-only): run it with linear()");
  if (idx_bits != 32 && idx_bits != 64) throw std::invalid_argument("topk_idx must be int32 or int64");
  if (T < 0 || K < 0) throw std::invalid_argument("T and K must be >= 0");
  if (trim_.mode != RoutingTrim::Mode::kFull && T * K > 0) {
    if (!topk_idx || !topk_w) throw std::invalid_argument("null pointer argument");
    // (per thread, as the scratch: a decode step calls this every layer; forward_selected and
    // what it calls never come back here)
    thread_local std::vector<int64_t> idx;
    thread_local std::vector<float> w;
    idx.resize(static_cast<size_t>(T * K));
    w.resize(static_cast<size_t>(T * K));
    const int64_t kept = trim_routing(trim_, topk_idx, idx_bits, topk_w, p.topk_w_dtype, T, K, hdr_.E, idx.data(), w.data());
    routed_tokens_.fetch_add(T, std::memory_order_relaxed);
    routed_slots_.fetch_add(kept, std::memory_order_relaxed);
    MoeParams q = p;
    q.topk_w_dtype = DType::kF32;
    return forward_selected(x, T, idx.data(), 64, w.data(), K, out, q);
  }
  if (T * K > 0 && topk_idx) {
    int64_t used = 0;
    if (idx_bits == 32) {
      for (int64_t i = 0; i < T * K; ++i) used += static_cast<const int32_t*>(topk_idx)[i] >= 0;
    } else {
      for (int64_t i = 0; i < T * K; ++i) used += static_cast<const int64_t*>(topk_idx)[i] >= 0;
    }
    routed_slots_.fetch_add(used, std::memory_order_relaxed);
  }
  routed_tokens_.fetch_add(T, std::memory_order_relaxed);
  return forward_selected(x, T, topk_idx, idx_bits, topk_w, K, out, p);
}

void PackedExperts::set_trim(const RoutingTrim& t) {
  if (t.mode == RoutingTrim::Mode::kFixed && t.keep < 1)
    throw std::invalid_argument("routing trim: a fixed top-k keeps at least 1 expert (keep = " + std::to_string(t.keep) + ")");
  if (t.mode == RoutingTrim::Mode::kAdaptive && (!(t.threshold >= 0.0f && std::isfinite(t.threshold)) || t.min_k < 1))
    throw std::invalid_argument("routing trim: adaptive needs a finite threshold >= 0 and min_k >= 1 (threshold = " +
                                std::to_string(t.threshold) + ", min_k = " + std::to_string(t.min_k) + ")");
  if (up_only()) throw std::invalid_argument("routing trim: this block is a dense linear layer (up-only): it has no routing");
  trim_ = t;
}

const char* PackedExperts::forward_selected(const void* x, int64_t T, const void* topk_idx, int idx_bits,
                                            const void* topk_w, int64_t K, void* out, const MoeParams& p) const {
  if (tier_) return forward_tiered(x, T, topk_idx, idx_bits, topk_w, K, out, p);
  MoePath path = p.path;
  if (path == MoePath::kAuto) {
    path = T >= p.prefill_min_tokens ? MoePath::kPrefill : MoePath::kDecode;
  }
  const Selected sel = select_kernels(isa(), dtype(), path, wformat(), p.qdot);
  return forward_with(*this, sel.k, moe_kernel_name(isa(), dtype(), path, wformat(), p.qdot), x, T,
                      topk_idx, idx_bits, topk_w, K, out, p);
}

const char* PackedExperts::forward_tiered(const void* x, int64_t T, const void* topk_idx, int idx_bits,
                                          const void* topk_w, int64_t K, void* out, const MoeParams& p) const {
  // The path of the whole call, fixed for every piece: a row's values then do not depend on
  // which other rows share its piece (tested against the all-in-memory block).
  MoeParams pp = p;
  if (pp.path == MoePath::kAuto) pp.path = T >= p.prefill_min_tokens ? MoePath::kPrefill : MoePath::kDecode;
  const Selected sel = select_kernels(isa(), dtype(), pp.path, wformat(), pp.qdot);
  const char* name = moe_kernel_name(isa(), dtype(), pp.path, wformat(), pp.qdot);
  const int64_t E = hdr_.E, cap = tier_->num_slots();
  if (K > cap)
    throw std::invalid_argument("memory tier: a token routes to " + std::to_string(K) + " experts, the pool holds " +
                                std::to_string(cap) + " (raise memory_limit)");
  auto idx_at = [&](int64_t i) -> int64_t {
    return idx_bits == 32 ? static_cast<const int32_t*>(topk_idx)[i] : static_cast<const int64_t*>(topk_idx)[i];
  };
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t e = idx_at(i);
    if (e >= E) throw std::invalid_argument("expert index " + std::to_string(e) + " >= E = " + std::to_string(E));
  }
  const size_t es = dtype_size(dtype()), ws = dtype_size(p.topk_w_dtype);
  thread_local std::vector<uint8_t> seen;  // (per thread: a decode step calls this every layer)
  thread_local std::vector<int32_t> experts;
  seen.resize(static_cast<size_t>(E));
  int64_t t0 = 0;
  while (t0 < T || (T == 0 && t0 == 0)) {
    // rows [t0, t1) whose experts fit the pool together
    experts.clear();
    std::fill(seen.begin(), seen.end(), 0);
    int64_t t1 = t0;
    for (; t1 < T; ++t1) {
      int64_t fresh = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = idx_at(t1 * K + k);
        if (e >= 0 && !seen[e]) ++fresh;
      }
      if (static_cast<int64_t>(experts.size()) + fresh > cap) break;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = idx_at(t1 * K + k);
        if (e >= 0 && !seen[e]) {
          seen[e] = 1;
          experts.push_back(static_cast<int32_t>(e));
        }
      }
    }
    const int64_t n = t1 - t0;
    tier_->acquire(tier_layer_, experts.data(), static_cast<int>(experts.size()),
                   static_cast<const uint8_t*>(x) + t0 * hdr_.H * es, n, dtype(), hdr_.H, tier_gu_.data(), tier_dn_.data());
    struct Release {
      ExpertTier* t;
      int layer;
      const std::vector<int32_t>& ex;
      ~Release() { t->release(layer, ex.data(), static_cast<int>(ex.size())); }
    } rel{tier_.get(), tier_layer_, experts};
    forward_with(*this, sel.k, name, static_cast<const uint8_t*>(x) + t0 * hdr_.H * es, n,
                 static_cast<const uint8_t*>(topk_idx) + t0 * K * (idx_bits / 8), idx_bits,
                 static_cast<const uint8_t*>(topk_w) + t0 * K * ws, K, static_cast<uint8_t*>(out) + t0 * hdr_.H * es, pp);
    if (T == 0) break;
    t0 = t1;
  }
  return name;
}

const char* PackedExperts::linear(const void* x, int64_t T, void* out, const MoeParams& p) const {
  if (!up_only()) throw std::invalid_argument("linear() runs up-only blocks (pack_linear); this block is MoE experts");
  if (T < 0) throw std::invalid_argument("T must be >= 0");
  MoeParams lp = p;
  lp.act = Act::kIdentity;
  lp.alpha = 1.0f;
  lp.gate_limit = lp.up_limit = lp.post_act_limit = INFINITY;
  lp.up_offset = 0.0f;
  lp.weight_on_input = false;
  lp.topk_w_dtype = DType::kF32;
  MoePath path = lp.path;
  if (path == MoePath::kAuto) path = T >= lp.prefill_min_tokens ? MoePath::kPrefill : MoePath::kDecode;
  // every token routed to the one expert with weight 1 (the weight is not read: no down pass)
  thread_local std::vector<int32_t> zeros;
  thread_local std::vector<float> ones;
  if (static_cast<int64_t>(zeros.size()) < T) {
    zeros.assign(static_cast<size_t>(T), 0);
    ones.assign(static_cast<size_t>(T), 1.0f);
  }
  const Selected sel = select_kernels(isa(), dtype(), path, wformat(), lp.qdot);
  return forward_with(*this, sel.k, moe_kernel_name(isa(), dtype(), path, wformat(), lp.qdot), x, T,
                      zeros.data(), 32, ones.data(), 1, out, lp);
}

namespace detail {

// f(r0, r1) over rows [0, n), split over the threads when the rows hold enough elements
// (n * per_row) to be worth a parallel region.
template <class F>
void for_rows(ThreadPool& pool, int nthreads, int64_t n, int64_t per_row, F&& f) {
  if (n * per_row < (1 << 16) || nthreads < 2) {
    f(int64_t{0}, n);
    return;
  }
  pool.run(nthreads, [&](int tid, int nt) {
    int64_t r0, r1;
    split_range(n, tid, nt, &r0, &r1);
    f(r0, r1);
  });
}


const char* forward_with(const PackedExperts& pe, const KernelImpl& kern, const char* name,
                         const void* x, int64_t T, const void* topk_idx, int idx_bits,
                         const void* topk_w, int64_t K, void* out, const MoeParams& p) {
  const PackedHeader& hd = pe.header();
  const DType dt = pe.dtype();
  const int64_t E = hd.E;
  if (idx_bits != 32 && idx_bits != 64) throw std::invalid_argument("topk_idx must be int32 or int64");
  if (T < 0 || K < 0) throw std::invalid_argument("T and K must be >= 0");
  if (p.num_threads < 0) throw std::invalid_argument("num_threads must be >= 0");
  if (p.prefill_min_tokens < 1) throw std::invalid_argument("prefill_min_tokens must be >= 1");
  if (T == 0) return name;
  if (!x || !out || (K > 0 && (!topk_idx || !topk_w))) throw std::invalid_argument("null pointer argument");
  // a prefill-sized call (PoolBackend::kMixed puts its regions on OpenMP's team)
  const ThreadPool::PrefillScope prefill(T >= kMixedTeamRows);

  Scratch& s = tls_scratch;
  // Routing metadata: rows grouped per expert, in token order inside an expert.
  if (idx_bits == 32) check_and_count(static_cast<const int32_t*>(topk_idx), T, K, E, s.counts);
  else check_and_count(static_cast<const int64_t*>(topk_idx), T, K, E, s.counts);
  s.offsets.assign(static_cast<size_t>(E) + 1, 0);
  s.active.clear();
  for (int64_t e = 0; e < E; ++e) {
    s.offsets[e + 1] = s.offsets[e] + s.counts[e];
    if (s.counts[e] > 0) s.active.push_back(static_cast<int32_t>(e));
  }
  const int64_t S = s.offsets[E];
  s.row_token.resize(static_cast<size_t>(S));
  s.row_w.resize(static_cast<size_t>(S));
  if (idx_bits == 32) fill_rows(static_cast<const int32_t*>(topk_idx), topk_w, p.topk_w_dtype, T, K, s);
  else fill_rows(static_cast<const int64_t*>(topk_idx), topk_w, p.topk_w_dtype, T, K, s);

  Layout L{dt, hd.kpack, hd.has_gate ? 2 : 1, hd.H, hd.I, hd.Hk, hd.In, hd.Ik, hd.Hn,
           pe.wformat(), hd.group};
  ActParams ap{p.act, p.alpha, p.gate_limit, p.up_limit, p.post_act_limit, p.up_offset};
  const int nthreads = p.num_threads > 0 ? p.num_threads : default_num_threads();
  ThreadPool& pool = ThreadPool::global();
  const int64_t H = hd.H, Hk = hd.Hk, Ik = hd.Ik, Hn = hd.Hn, In = hd.In;
  const size_t esz = dtype_size(dt);
  const bool woi = p.weight_on_input;

  // ---- x rows in the kernel's input format, zero-padded to Hk ----
  // fp32 kernels: one row per token (per routed row with weight_on_input, whose rows differ);
  // bf16 (AMX) kernels: one row per routed row, contiguous in grouped order (A tiles).
  const bool per_row = kern.x_bf16 || woi;
  const int64_t nx = per_row ? S : T;
  // Tile loads read 16 rows at the row stride: a stride that is a multiple of 512 bytes maps
  // the rows onto few L1 sets (4 KiB aliasing), so such strides get one extra cache line.
  auto padded = [](int64_t n, size_t esz) { return (n * static_cast<int64_t>(esz)) % 512 == 0 ? n + 64 / static_cast<int64_t>(esz) : n; };
  const int64_t xs = kern.x_bf16 ? padded(Hk, 2) : Hk;
  const size_t xrow_bytes = kern.qdot ? static_cast<size_t>(qrow_bytes(Hk))
                                      : static_cast<size_t>(xs) * (kern.x_bf16 ? 2 : 4);
  uint8_t* xbuf = static_cast<uint8_t*>(
      s.xbuf.get(xrow_bytes * static_cast<size_t>(nx + kern.row_slack)));
  if (kern.row_slack) std::memset(xbuf + xrow_bytes * nx, 0, xrow_bytes * kern.row_slack);
  auto prep_x = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = per_row ? s.row_token[r] : r;
      const float scale = woi ? s.row_w[r] : 1.0f;
      const uint8_t* src = static_cast<const uint8_t*>(x) + static_cast<size_t>(t * H) * esz;
      uint8_t* dst = xbuf + xrow_bytes * static_cast<size_t>(r);
      if (kern.x_bf16) {
        uint16_t* d = reinterpret_cast<uint16_t*>(dst);
        if (woi) {
          for (int64_t c = 0; c < H; ++c) d[c] = f32_to_bf16(scale * load_elem(dt, src, c));
        } else if (dt == DType::kBF16) {
          std::memcpy(d, src, static_cast<size_t>(H) * 2);
        } else {
          for (int64_t c = 0; c < H; ++c) d[c] = f32_to_bf16(load_elem(dt, src, c));
        }
        std::memset(d + H, 0, static_cast<size_t>(xs - H) * 2);
      } else {
        // integer-dot kernels: the fp32 row goes through a per-thread buffer into quant_act_row
        thread_local std::vector<float> qtmp;
        if (kern.qdot) qtmp.resize(static_cast<size_t>(Hk));
        float* d = kern.qdot ? qtmp.data() : reinterpret_cast<float*>(dst);
        if (woi) {
          for (int64_t c = 0; c < H; ++c) d[c] = round_to(dt, scale * load_elem(dt, src, c));
        } else {
          for (int64_t c = 0; c < H; ++c) d[c] = load_elem(dt, src, c);
        }
        std::memset(d + H, 0, static_cast<size_t>(Hk - H) * 4);
        if (kern.qdot) quant_act_row(d, Hk, dst);
      }
    }
  };
  for_rows(pool, nthreads, nx, H, prep_x);
  s.xrows.resize(static_cast<size_t>(S));
  for (int64_t r = 0; r < S; ++r)
    s.xrows[r] = xbuf + xrow_bytes * static_cast<size_t>(per_row ? r : s.row_token[r]);

  // ---- h rows [S][Ik]: kernels write [0, In); the k-padding [In, Ik) must read as zero ----
  // (a paired up-only block: rows of 2 In, its up half from In)
  const size_t hesz = kern.h_bf16 ? 2 : 4;
  const bool paired = hd.up_only && hd.has_gate;
  const int64_t hw = paired ? 2 * In : Ik;
  const int64_t hs = kern.h_bf16 ? padded(hw, 2) : hw;  // h row stride
  uint8_t* hbuf = static_cast<uint8_t*>(
      s.hbuf.get(hesz * static_cast<size_t>(hs) * static_cast<size_t>(S + kern.row_slack)));
  if (hs > In && !paired)  // (a paired block's kernels write its whole rows; no down pass reads them)
    for (int64_t r = 0; r < S; ++r)
      std::memset(hbuf + hesz * static_cast<size_t>(r * hs + In), 0, hesz * static_cast<size_t>(hs - In));
  if (kern.row_slack)
    std::memset(hbuf + hesz * static_cast<size_t>(S * hs), 0, hesz * static_cast<size_t>(kern.row_slack * hs));

  float* acc = static_cast<float*>(s.acc.get(sizeof(float) * static_cast<size_t>(T * Hn)));
  s.accrows.resize(static_cast<size_t>(S));
  s.row_wt.resize(static_cast<size_t>(S));
  for (int64_t r = 0; r < S; ++r) {
    s.accrows[r] = acc + s.row_token[r] * Hn;
    s.row_wt[r] = woi ? 1.0f : s.row_w[r];
  }

  // the step trace's parts of an experts' call (moe/step_trace.h; not of linear()'s up-only blocks)
  auto mark = [&](StepOp op) {
    if (!hd.up_only) lap(op);
  };
  mark(StepOp::kExpertsPrep);
  // Dynamic split (see the header comment): pieces of about kItemBytes, at most np / (2 x
  // threads) panels.
  const bool dyn = !p.static_split && nthreads > 1;
  const int64_t item_bytes = dynamic_item_bytes();
  auto chunk_of = [item_bytes, nthreads](int64_t np, int64_t panel_bytes) {
    const int64_t want = item_bytes > 0 ? item_bytes / panel_bytes : 8;
    const int64_t parts = 2 * static_cast<int64_t>(nthreads);
    return std::clamp<int64_t>(want, 1, std::max<int64_t>(1, (np + parts - 1) / parts));
  };

  // ---- region 1: gate/up + activation ----
  // Every job carries the first panel of the job its thread runs next (w_next); kernels that
  // prefetch it (KernelImpl::uses_w_next, AMX) get the dynamic split's next item claimed ahead.
  const int64_t gu_pb = gu_panel_bytes(L), dn_pb = down_panel_bytes(L);
  auto gu_panel = [&](int32_t e, int64_t p) {
    return static_cast<const uint8_t*>(pe.gate_up_expert(e)) + p * gu_pb;
  };
  auto gateup_expert = [&](int32_t e, int64_t p0, int64_t p1, const void* w_next) {
    const int64_t r0 = s.offsets[e];
    GateUpJob j;
    j.w = pe.gate_up_expert(e);
    j.bias_g = pe.bias_g() ? pe.bias_g() + e * In : nullptr;
    j.bias_u = pe.bias_u() ? pe.bias_u() + e * In : nullptr;
    j.p0 = p0;
    j.p1 = p1;
    j.x = s.xrows.data() + r0;
    j.x_stride = xs;
    j.nt = s.counts[e];
    j.h = hbuf + hesz * static_cast<size_t>(r0 * hs);
    j.h_stride = hs;
    j.L = &L;
    j.act = &ap;
    j.w_next = w_next;
    j.pair = paired ? In : 0;
    kern.gateup(j);
  };
  if (S > 0 && dyn) {
    const int64_t np = In / kPanelN, chunk = chunk_of(np, gu_pb), nchunks = (np + chunk - 1) / chunk;
    const int64_t items = nchunks * static_cast<int64_t>(s.active.size());
    auto item_expert = [&](int64_t it) { return s.active[static_cast<size_t>(it / nchunks)]; };
    std::atomic<int64_t> next{0};
    pool.run(nthreads, [&](int, int) {
      // kernels that prefetch w_next claim their next item before running the current one;
      // the others claim as they go (a thread then holds no item another could take)
      const bool ahead = kern.uses_w_next;
      for (int64_t it = next.fetch_add(1, std::memory_order_relaxed); it < items;) {
        const int64_t nx = ahead ? next.fetch_add(1, std::memory_order_relaxed) : items;
        const int64_t p0 = (it % nchunks) * chunk;
        gateup_expert(item_expert(it), p0, std::min(np, p0 + chunk),
                      nx < items ? gu_panel(item_expert(nx), (nx % nchunks) * chunk) : nullptr);
        it = ahead ? nx : next.fetch_add(1, std::memory_order_relaxed);
      }
    });
  } else if (S > 0) {
    pool.run(nthreads, [&](int tid, int n) {
      int64_t p0, p1;
      split_range(In / kPanelN, tid, n, &p0, &p1);
      if (p0 == p1) return;
      for (size_t a = 0; a < s.active.size(); ++a)
        gateup_expert(s.active[a], p0, p1, a + 1 < s.active.size() ? gu_panel(s.active[a + 1], p0) : nullptr);
    });
  }

  mark(StepOp::kExpertsGateUp);
  // ---- up-only blocks (linear layers, via linear()): h rows are the output ----
  // E = 1 and K = 1, so routed row r is token r; h already holds x W^T + b (identity act).
  if (hd.up_only) {
    const int64_t I = hd.I, halves = paired ? 2 : 1, N = halves * I;  // a paired block: [gate | up] rows
    if (kern.h_bf16 && dt != DType::kBF16) throw std::logic_error("bf16 h rows for a non-bf16 block");
    auto emit = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t half = 0; half < halves; ++half) {
          uint8_t* dst = static_cast<uint8_t*>(out) + static_cast<size_t>(r * N + half * I) * esz;
          const uint8_t* src = hbuf + hesz * static_cast<size_t>(r * hs + half * In);
          if (kern.h_bf16) std::memcpy(dst, src, static_cast<size_t>(I) * 2);  // rounded once, by the kernel
          else store_row(dt, dst, reinterpret_cast<const float*>(src), I);
        }
    };
    for_rows(pool, nthreads, S, N, emit);
    return name;
  }

  // ---- integer-dot kernels: h rows quantised for down (rows are independent) ----
  const int64_t hq_bytes = kern.qdot ? qrow_bytes(Ik) : 0;
  uint8_t* hq = kern.qdot ? static_cast<uint8_t*>(s.hqbuf.get(static_cast<size_t>(S * hq_bytes))) : nullptr;
  if (kern.qdot && S > 0) {
    auto quant_h = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        quant_act_row(reinterpret_cast<const float*>(hbuf) + r * hs, Ik, hq + r * hq_bytes);
    };
    for_rows(pool, nthreads, S, Ik, quant_h);
  }
  mark(StepOp::kExpertsQuantH);

  // ---- region 2: down + weight + scatter-add + conversion to x's dtype ----
  // H panels [p0, p1) of every token's output, all experts in ascending order.
  auto down_panels = [&](int64_t p0, int64_t p1) {
    const int64_t c0 = p0 * kPanelN, c1 = p1 * kPanelN;
    for (int64_t t = 0; t < T; ++t) std::memset(acc + t * Hn + c0, 0, sizeof(float) * (c1 - c0));
    for (size_t a = 0; a < s.active.size(); ++a) {
      const int32_t e = s.active[a];
      const int64_t r0 = s.offsets[e];
      DownJob j;
      j.w = pe.down_expert(e);
      j.bias = pe.bias_d() ? pe.bias_d() + e * Hn : nullptr;
      j.p0 = p0;
      j.p1 = p1;
      if (kern.qdot) {
        j.h = hq + r0 * hq_bytes;
        j.h_stride = hq_bytes;
      } else {
        j.h = hbuf + hesz * static_cast<size_t>(r0 * hs);
        j.h_stride = hs;
      }
      j.nt = s.counts[e];
      j.wt = s.row_wt.data() + r0;
      j.acc = s.accrows.data() + r0;
      j.L = &L;
      if (a + 1 < s.active.size())
        j.w_next = static_cast<const uint8_t*>(pe.down_expert(s.active[a + 1])) + p0 * dn_pb;
      kern.down(j);
    }
    const int64_t ce = std::min(c1, H);
    for (int64_t t = 0; t < T; ++t) {
      const float* a = acc + t * Hn;
      store_row(dt, static_cast<uint8_t*>(out) + static_cast<size_t>(t * H + c0) * esz, a + c0, ce - c0);
    }
  };
  if (dyn) {
    const int64_t np = Hn / kPanelN, chunk = chunk_of(np, dn_pb), items = (np + chunk - 1) / chunk;
    std::atomic<int64_t> next{0};
    pool.run(nthreads, [&](int, int) {
      for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;)
        down_panels(it * chunk, std::min(np, (it + 1) * chunk));
    });
  } else {
    pool.run(nthreads, [&](int tid, int n) {
      int64_t p0, p1;
      split_range(Hn / kPanelN, tid, n, &p0, &p1);
      if (p0 != p1) down_panels(p0, p1);
    });
  }
  mark(StepOp::kExpertsDown);
  return name;
}

}  // namespace detail
}  // namespace hina
