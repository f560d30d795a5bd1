// The memory tier (hina_moe/tier.h): CRC-32C against its definition, tiered blocks against the
// all-in-memory block bit for bit, the eviction order of each policy, concurrent forwards on one
// tier (for the TSan build), and injected read faults. Small on purpose: the runner also runs
// under ASan+UBSan in CI and under TSan in `dev.sh sanitize`.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "hina_moe/tier.h"
#include "tests/harness.h"

namespace tests_tier {

namespace {

constexpr int64_t kE = 8, kH = 64, kI = 32;
constexpr uint64_t kLead = 4096;  // where the first block starts in the store file

// CRC-32C straight from its definition (reflected polynomial 0x82F63B78, register and result
// inverted), one bit at a time: the oracle for crc32c()'s SSE4.2 and table paths alike.
uint32_t crc_bitwise(const uint8_t* p, size_t n, uint32_t crc = 0) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}

// The store files that exist now (removed before a hang ends the process).
std::mutex g_files_mu;
std::vector<std::string> g_files;

// A tier call that hangs cannot be cancelled, nor its tier destroyed: a FAIL line, the store
// files removed, and the runner ends.
[[noreturn]] void fail_hung(const std::string& what) {
  std::printf("FAIL %s\n", what.c_str());
  std::fflush(stdout);
  std::lock_guard<std::mutex> files(g_files_mu);
  for (const auto& f : g_files) unlink(f.c_str());
  std::_Exit(1);
}

// A store file under /tmp, removed when the test is done (also when it fails).
struct StoreFile {
  std::string path;
  int fd = -1;
  StoreFile() {
    char tmpl[] = "/tmp/hina_tier_test_XXXXXX";
    fd = mkstemp(tmpl);
    if (fd < 0) throw std::runtime_error(std::string("mkstemp /tmp/hina_tier_test_XXXXXX: ") + std::strerror(errno));
    path = tmpl;
    std::lock_guard<std::mutex> lk(g_files_mu);
    g_files.push_back(path);
  }
  ~StoreFile() {
    if (fd >= 0) close(fd);
    unlink(path.c_str());
    std::lock_guard<std::mutex> lk(g_files_mu);
    g_files.erase(std::find(g_files.begin(), g_files.end(), path));
  }
  StoreFile(const StoreFile&) = delete;
  StoreFile& operator=(const StoreFile&) = delete;
  void write_at(const void* data, size_t n, uint64_t off) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      const ssize_t w = pwrite(fd, p, n, static_cast<off_t>(off));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw std::runtime_error("pwrite " + path + ": " + std::strerror(errno));
      p += w;
      n -= static_cast<size_t>(w);
      off += static_cast<uint64_t>(w);
    }
  }
};

// One packed block written into a store file at `off`, with what add_layer and tiered() take.
struct Stored {
  const PackedExperts* pe;
  uint64_t off;
  std::vector<uint32_t> crc_gu, crc_dn;
  const uint8_t* bias;
  size_t bias_bytes;
};

Stored store_block(StoreFile& f, const PackedExperts& pe, uint64_t off) {
  const PackedHeader& h = pe.header();
  const uint8_t* b = static_cast<const uint8_t*>(pe.data());
  f.write_at(b, h.nbytes, off);
  Stored s{&pe, off, {}, {}, nullptr, 0};
  const uint64_t gu = h.gu_expert_bytes, dn = h.down_expert_bytes, E = static_cast<uint64_t>(h.E);
  for (uint64_t e = 0; e < E; ++e) {
    s.crc_gu.push_back(crc32c(b + e * gu, gu));
    s.crc_dn.push_back(crc32c(b + E * gu + e * dn, dn));
  }
  s.bias = b + E * (gu + dn);
  s.bias_bytes = static_cast<size_t>(h.nbytes - E * (gu + dn));
  return s;
}

TierOptions options_for(const PackedHeader& h, int64_t slots, int io_threads) {
  TierOptions o;
  o.slot_bytes = ExpertTier::slot_bytes_for(h.gu_expert_bytes, h.down_expert_bytes);
  o.num_slots = slots;
  o.io_threads = io_threads;
  return o;
}

int add_layer(ExpertTier& t, const StoreFile& f, const Stored& s) {
  const PackedHeader& h = s.pe->header();
  return t.add_layer(f.path, h.E, s.off, h.gu_expert_bytes, s.off + h.E * h.gu_expert_bytes, h.down_expert_bytes,
                     s.crc_gu, s.crc_dn);
}

// The raw output bytes of one forward (out filled with `fill` first, so rows left unwritten show).
std::vector<uint8_t> forward_bytes(const PackedExperts& pe, const Problem& p, const MoeParams& mp, uint8_t fill) {
  std::vector<uint8_t> out(static_cast<size_t>(p.c.T * pe.H()) * dtype_size(pe.dtype()), fill);
  pe.forward(p.x.data(), p.c.T, p.idx.data(), 32, p.w.data(), p.c.K, out.data(), mp);
  return out;
}

int64_t distinct_experts(const Problem& p) {
  std::vector<int32_t> v;
  for (int32_t e : p.idx)
    if (e >= 0) v.push_back(e);
  std::sort(v.begin(), v.end());
  return std::unique(v.begin(), v.end()) - v.begin();
}

std::string str(const std::vector<int32_t>& v) {
  std::string s = "{";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "}";
}

// Runs f, turning an unexpected exception into a FAIL of `name` (the other tier tests still run).
template <class F>
void guarded(const std::string& name, F f) {
  if (!selected(name)) return;
  try {
    f();
  } catch (const std::exception& e) {
    report(false, name + ": unexpected exception: " + e.what());
  }
}

// ---- 1. CRC-32C ---------------------------------------------------------------------------------
void test_crc32c() {
  const char* v = "123456789";
  report(crc32c(v, 9) == 0xE3069283u, "tier crc32c(\"123456789\") == 0xE3069283 (the standard check value)");
  report(crc_bitwise(reinterpret_cast<const uint8_t*>(v), 9) == 0xE3069283u, "tier crc32c: the bitwise oracle's check value");
  report(crc32c(v, 0) == 0 && crc32c(v, 0, 0x12345678u) == 0x12345678u, "tier crc32c of no bytes returns the crc given");
  // crc32c() picks one path per CPU (SSE4.2 here, the table elsewhere); the bitwise oracle holds
  // either to the definition. Odd lengths and offsets: the 8-byte loop's tails and unaligned loads.
  std::mt19937 rng(42);
  std::vector<uint8_t> buf(4096 + 64);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  bool all = true;
  std::string bad;
  for (size_t n : {1, 3, 7, 9, 15, 17, 63, 65, 255, 1001, 4095}) {
    for (size_t at : {0, 1, 5}) {
      const uint32_t got = crc32c(buf.data() + at, n), want = crc_bitwise(buf.data() + at, n);
      if (got != want && all) {
        all = false;
        bad = "n " + std::to_string(n) + " at " + std::to_string(at);
      }
      // continued: crc32c(a + b) == crc32c(b, crc32c(a)) at every split
      for (size_t cut : {size_t{0}, n / 3, n / 2 + 1, n}) {
        if (cut > n) continue;
        const uint32_t split = crc32c(buf.data() + at + cut, n - cut, crc32c(buf.data() + at, cut));
        if (split != got && all) {
          all = false;
          bad = "split of n " + std::to_string(n) + " at " + std::to_string(cut);
        }
      }
    }
  }
  report(all, "tier crc32c == bitwise CRC-32C and continues across splits (odd lengths, unaligned)" +
                  (bad.empty() ? std::string() : ": first mismatch " + bad));
}

// ---- 2. tiered block == in-memory block ---------------------------------------------------------
void test_tiered_forward(const std::vector<Isa>& tiers) {
  // the same seed gives the same weights for both T (make_problem draws them before x and idx)
  const Case c1{1, kE, 2, kH, kI, true, true, false, Act::kSilu, 0, 0, false, "tier decode"};
  const Case c5{5, kE, 2, kH, kI, true, true, false, Act::kSilu, 0, 0, false, "tier pieces"};
  const Problem p1 = make_problem(DType::kBF16, c1, 21);
  const Problem p5 = make_problem(DType::kBF16, c5, 21);
  Problem p5s = p5;  // a skipped slot (idx -1) in the pieces
  p5s.idx[3] = -1;
  // 5 tokens over more experts than the pool's 3 slots: the call must run in pieces
  report(distinct_experts(p5) > 3 && distinct_experts(p5s) > 3,
         "tier forward: T=5 routes to " + std::to_string(distinct_experts(p5)) + " experts (> 3 slots)");
  for (Isa isa : tiers) {
    for (const QuantSpec q : {QuantSpec{WFormat::kLossless, 64}, QuantSpec{WFormat::kInt4, 32}}) {
      auto pe = PackedExperts::pack(weights_of(p5), isa, 2, q);
      StoreFile f;
      std::vector<uint8_t> junk(kLead);
      std::mt19937 rng(5);
      for (auto& b : junk) b = static_cast<uint8_t>(rng());
      f.write_at(junk.data(), junk.size(), 0);
      const Stored s = store_block(f, *pe, kLead);
      for (bool direct : {true, false}) {
        const std::string tag = std::string("tier forward ") + isa_name(isa) + " bf16 " + wformat_name(q.fmt) +
                                (direct ? " direct_io" : " buffered");
        TierOptions o = options_for(pe->header(), 3, 2);
        o.direct_io = direct;
        auto tier = std::make_shared<ExpertTier>(o);
        const int layer = add_layer(*tier, f, s);
        const std::string mode = tier->io_mode(layer);
        report(direct ? (mode == "O_DIRECT" || mode.rfind("buffered reads: O_DIRECT refused", 0) == 0)
                      : mode == "buffered reads: direct_io off",
               tag + ": io_mode '" + mode + "'");
        auto tp = PackedExperts::tiered(pe->header(), tier, layer, s.bias, s.bias_bytes);
        struct Run {
          const Problem* p;
          MoePath path;
          const char* what;
        };
        for (const Run& r : {Run{&p1, MoePath::kAuto, "T=1 K=2"}, Run{&p5, MoePath::kAuto, "T=5 K=2 (pieces)"},
                             Run{&p5, MoePath::kDecode, "T=5 K=2 decode path (pieces)"},
                             Run{&p5s, MoePath::kAuto, "T=5 K=2, a slot skipped (pieces)"}}) {
          MoeParams mp = r.p->params;
          mp.path = r.path;
          mp.num_threads = 2;
          const auto want = forward_bytes(*pe, *r.p, mp, 0xCD);
          const uint64_t acquires0 = tier->stats().acquires;
          const auto got = forward_bytes(*tp, *r.p, mp, 0xAB);
          const uint64_t acquires = tier->stats().acquires - acquires0;
          report(got == want, tag + " " + r.what + ": tiered == in-memory, bit for bit");
          if (r.p->c.T > 1) report(acquires >= 2, tag + " " + r.what + ": " + std::to_string(acquires) + " acquires");
        }
        if (isa == tiers.front() && q.fmt == WFormat::kLossless && direct) {
          // bad input is refused with what is wrong
          std::string msg;
          try {
            PackedExperts::tiered(pe->header(), tier, layer, s.bias, s.bias_bytes - 64);
          } catch (const std::invalid_argument& e) {
            msg = e.what();
          }
          report(msg.find("bias region") != std::string::npos, tag + ": a wrong bias size is refused: " + msg);
          Case c4 = c1;
          c4.K = 4;  // a token on 4 experts, the pool holds 3
          const Problem p4 = make_problem(DType::kBF16, c4, 22);
          msg.clear();
          try {
            forward_bytes(*tp, p4, p4.params, 0);
          } catch (const std::invalid_argument& e) {
            msg = e.what();
          }
          report(msg.find("routes to 4 experts, the pool holds 3") != std::string::npos,
                 tag + ": K above the pool's slots is refused: " + msg);
        }
        const TierStats st = tier->stats();
        report(st.reads == st.misses - st.inflight_hits && st.retries == 0 &&
                   st.bytes_read == st.reads * (pe->header().gu_expert_bytes + pe->header().down_expert_bytes),
               tag + ": reads " + std::to_string(st.reads) + " == misses " + std::to_string(st.misses) + ", bytes_read " +
                   std::to_string(st.bytes_read));
      }
    }
  }
}

// ---- 3. eviction order --------------------------------------------------------------------------
// One acquire..release of a single expert; its panels must be the block's bytes.
bool use(ExpertTier& t, const PackedExperts& pe, int32_t e) {
  std::vector<const void*> gu(kE, nullptr), dn(kE, nullptr);
  t.acquire(0, &e, 1, nullptr, 0, pe.dtype(), pe.H(), gu.data(), dn.data());
  const PackedHeader& h = pe.header();
  const uint8_t* b = static_cast<const uint8_t*>(pe.data());
  const bool same = std::memcmp(gu[e], b + e * h.gu_expert_bytes, h.gu_expert_bytes) == 0 &&
                    std::memcmp(dn[e], b + h.E * h.gu_expert_bytes + e * h.down_expert_bytes, h.down_expert_bytes) == 0;
  t.release(0, &e, 1);
  return same;
}

void test_eviction() {
  const Case c{1, kE, 2, kH, kI, true, false, false, Act::kSilu, 0, 0, false, "tier eviction"};
  const Problem p = make_problem(DType::kBF16, c, 31);
  auto pe = PackedExperts::pack(weights_of(p), resolve_isa("auto"), 1);
  StoreFile f;
  const Stored s = store_block(f, *pe, kLead);
  // Two slots, one expert an acquire, no prediction: each miss past the second evicts the slot
  // of the lowest score (tier.cpp's score(); ticks count acquires from 1). By hand:
  //   lru        [0 1 0 2]: 2 evicts 1 (last use 2 < 3); then 1 evicts 0 (3 < 4)
  //   lru-2      [0 0 1 2]: 0's uses 1, 2 and 1's use 3: the second-last use is 1 for 0, none
  //              (0) for 1, so 1 goes (lru evicts 0, last 2 < 3)
  //   lfu        [0 0 0 1 1 2]: 0 used 3 times, 1 twice, so 1 goes (lru and lru-2 evict 0:
  //              last 3 < 5, second-last 2 < 4)
  //   freq-decay [0 0 0 1 2], score log2 sum 2^(t / half_life): half-life 64, 0 scores
  //              log2(2^(1/64) + 2^(2/64) + 2^(3/64)) = 1.63 and 1 scores 4/64, so 1 goes;
  //              half-life 0.5, 0 scores log2(2^2 + 2^4 + 2^6) = 6.39 and 1 scores 8, so 0 goes (as lru)
  //   [0 0 1 2 1 3]: 2 evicts 1, 1 evicts 2, then 3 must choose between 0 (uses 1, 2) and 1
  //              (uses 3, 5, the first before it was evicted). An expert's uses count while it is
  //              out of the pool, so 0 goes under lfu (2 uses each, 0's last older), lru-2
  //              (second-last use 1 < 3) and freq-decay (2^(1/64) + 2^(2/64) < 2^(3/64) + 2^(5/64));
  //              forgetting them at eviction made 1 look new and evicted it instead
  struct Seq {
    EvictionPolicy policy;
    double half_life;
    std::vector<int32_t> uses;
    std::vector<int32_t> resident;
    uint64_t hits;
  };
  const Seq seqs[] = {
      {EvictionPolicy::kLru, 64, {0, 1, 0, 2}, {0, 2}, 1},
      {EvictionPolicy::kLru, 64, {0, 1, 0, 2, 1}, {1, 2}, 1},
      {EvictionPolicy::kLru, 64, {0, 0, 1, 2}, {1, 2}, 1},
      {EvictionPolicy::kLru2, 64, {0, 0, 1, 2}, {0, 2}, 1},
      {EvictionPolicy::kLru, 64, {0, 0, 0, 1, 1, 2}, {1, 2}, 3},
      {EvictionPolicy::kLru2, 64, {0, 0, 0, 1, 1, 2}, {1, 2}, 3},
      {EvictionPolicy::kLfu, 64, {0, 0, 0, 1, 1, 2}, {0, 2}, 3},
      {EvictionPolicy::kLru, 64, {0, 0, 0, 1, 2}, {1, 2}, 2},
      {EvictionPolicy::kFreqDecay, 64, {0, 0, 0, 1, 2}, {0, 2}, 2},
      {EvictionPolicy::kFreqDecay, 0.5, {0, 0, 0, 1, 2}, {1, 2}, 2},
      {EvictionPolicy::kLfu, 64, {0, 0, 1, 2, 1, 3}, {1, 3}, 1},
      {EvictionPolicy::kLru2, 64, {0, 0, 1, 2, 1, 3}, {1, 3}, 1},
      {EvictionPolicy::kFreqDecay, 64, {0, 0, 1, 2, 1, 3}, {1, 3}, 1},
      {EvictionPolicy::kLru, 64, {0, 0, 1, 2, 1, 3}, {1, 3}, 2},
  };
  for (const Seq& q : seqs) {
    TierOptions o = options_for(pe->header(), 2, 1);
    o.prediction_window = 0;
    o.policy = q.policy;
    o.decay_half_life = q.half_life;
    ExpertTier t(o);
    add_layer(t, f, s);
    bool bytes_ok = true;
    for (int32_t e : q.uses) bytes_ok = use(t, *pe, e) && bytes_ok;
    const TierStats st = t.stats();
    const std::vector<int32_t> res = t.resident(0);
    const uint64_t misses = q.uses.size() - q.hits;
    char hl[32] = "";
    if (q.policy == EvictionPolicy::kFreqDecay) std::snprintf(hl, sizeof hl, " half-life %g", q.half_life);
    const std::string tag = std::string("tier eviction ") + eviction_name(q.policy) + hl + " " + str(q.uses);
    report(res == q.resident, tag + ": resident " + str(res) + ", expected " + str(q.resident));
    report(st.hits == q.hits && st.misses == misses && st.evictions == misses - 2 && st.layers[0].hits == q.hits,
           tag + ": hits " + std::to_string(st.hits) + " misses " + std::to_string(st.misses) + " evictions " +
               std::to_string(st.evictions) + ", expected " + std::to_string(q.hits) + " " + std::to_string(misses) +
               " " + std::to_string(misses - 2));
    report(bytes_ok, tag + ": the acquired panels are the block's bytes");
  }
}

// warm() reads in order as demanded reads (the last the most recently used); drain() returns after
// the I/O threads settle a predicted read without reading it (dropped: no slot a prediction may take).
void test_warm_and_drain() {
  const Case c{1, kE, 2, kH, kI, true, false, false, Act::kSilu, 0, 0, false, "tier warm"};
  const Problem p = make_problem(DType::kBF16, c, 37);
  auto pe = PackedExperts::pack(weights_of(p), resolve_isa("auto"), 1);
  StoreFile f;
  const Stored s = store_block(f, *pe, kLead);
  TierOptions o = options_for(pe->header(), 2, 2);
  o.prediction_window = 0;
  ExpertTier t(o);
  add_layer(t, f, s);
  const int32_t layers[] = {0, 0, 0};
  const int32_t ids[] = {1, 4, 6};
  t.warm(layers, ids, 3);  // 6 evicts 1, the least recently used
  report(t.resident(0) == std::vector<int32_t>({4, 6}), "tier warm: resident " + str(t.resident(0)));
  // both slots used by the last acquire: a prediction finds no slot and is dropped
  std::vector<const void*> gu(kE, nullptr), dn(kE, nullptr);
  const int32_t both[] = {4, 6};
  t.acquire(0, both, 2, nullptr, 0, pe->dtype(), pe->H(), gu.data(), dn.data());
  t.release(0, both, 2);
  t.reset_stats();
  const int32_t seven = 7;
  t.prefetch(0, &seven, 1);
  std::atomic<bool> done{false};
  std::thread waiter([&] {
    t.drain();
    done = true;
  });
  for (int i = 0; i < 2000 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const bool returned = done.load();
  if (!returned) t.prefetch(0, &seven, 0);  // (nothing wakes it: the watchdog ends the run)
  waiter.join();
  report(returned && t.stats().prefetch_dropped == 1 && t.resident(0) == std::vector<int32_t>({4, 6}),
         "tier drain returns after a dropped prediction");
}

// ---- 4. concurrent forwards on one tier ---------------------------------------------------------
void test_concurrent() {
  // two layers in one file, each a block of its own weights; prediction on (layer 0 predicts 1)
  const Case cw{3, kE, 2, kH, kI, true, true, false, Act::kSilu, 0, 0, false, "tier threads"};
  const Problem w0 = make_problem(DType::kBF16, cw, 41), w1 = make_problem(DType::kBF16, cw, 42);
  std::unique_ptr<PackedExperts> pe[2] = {PackedExperts::pack(weights_of(w0), resolve_isa("auto"), 1),
                                          PackedExperts::pack(weights_of(w1), resolve_isa("auto"), 1)};
  StoreFile f;
  const uint64_t off1 = kLead + (pe[0]->nbytes() + 4095) / 4096 * 4096;
  const Stored s[2] = {store_block(f, *pe[0], kLead), store_block(f, *pe[1], off1)};
  TierOptions o = options_for(pe[0]->header(), 4, 2);
  o.prediction_window = 1;
  auto tier = std::make_shared<ExpertTier>(o);
  std::unique_ptr<PackedExperts> tp[2];
  std::mt19937 rng(43);
  std::vector<uint8_t> router[2];
  for (int l = 0; l < 2; ++l) {
    const int layer = add_layer(*tier, f, s[l]);
    router[l] = random_array(DType::kBF16, kE * kH, 1.0f, rng);
    tier->set_router(layer, router[l].data(), DType::kBF16, kH, nullptr, 2);
    tp[l] = PackedExperts::tiered(pe[l]->header(), tier, layer, s[l].bias, s[l].bias_bytes);
  }
  // per thread and layer an input of its own (T = 1 and 3: both predict, 3 may need pieces)
  constexpr int kCalls = 20;
  std::vector<Problem> in;  // [thread * 2 + layer]
  std::vector<uint8_t> want[2][2];
  MoeParams mp = w0.params;
  mp.num_threads = 2;
  for (int th = 0; th < 2; ++th)
    for (int l = 0; l < 2; ++l) {
      Case c = cw;
      c.T = th == 0 ? 1 : 3;
      in.push_back(make_problem(DType::kBF16, c, static_cast<uint32_t>(50 + 2 * th + l)));
      want[th][l] = forward_bytes(*pe[l], in.back(), mp, 0xCD);
    }
  int mismatches[2] = {0, 0};
  std::string errors[2];
  std::thread t[2];
  for (int th = 0; th < 2; ++th)
    t[th] = std::thread([&, th] {
      try {
        for (int i = 0; i < kCalls; ++i) {
          const int l = (i + th) % 2;
          if (forward_bytes(*tp[l], in[th * 2 + l], mp, 0xAB) != want[th][l]) ++mismatches[th];
        }
      } catch (const std::exception& e) {
        errors[th] = e.what();
      }
    });
  for (auto& x : t) x.join();
  for (int th = 0; th < 2; ++th)
    report(mismatches[th] == 0 && errors[th].empty(),
           "tier threads: thread " + std::to_string(th) + ", " + std::to_string(kCalls) + " forwards on two layers: " +
               std::to_string(mismatches[th]) + " differ from in-memory" + (errors[th].empty() ? "" : "; " + errors[th]));
  tier->drain();
  const TierStats st = tier->stats();
  report(st.acquires >= 2 * kCalls && st.predicted > 0 && st.retries == 0,
         "tier threads: acquires " + std::to_string(st.acquires) + ", predicted " + std::to_string(st.predicted) +
             ", prefetch issued " + std::to_string(st.prefetch_issued));
}

// ---- 5. faults ----------------------------------------------------------------------------------
// Whether f throws a TierError whose message holds every one of `parts` (the message in *msg).
template <class F>
bool throws_tier_error(F f, const std::vector<std::string>& parts, std::string* msg) {
  try {
    f();
  } catch (const TierError& e) {
    *msg = e.what();
    for (const auto& s : parts)
      if (msg->find(s) == std::string::npos) return false;
    return true;
  } catch (const std::exception& e) {
    *msg = std::string("not a TierError: ") + e.what();
    return false;
  }
  *msg = "no exception";
  return false;
}

void test_faults() {
  const Case c1{1, kE, 2, kH, kI, true, true, false, Act::kSilu, 0, 0, false, "tier faults"};
  const Case c5{5, kE, 2, kH, kI, true, true, false, Act::kSilu, 0, 0, false, "tier faults pieces"};
  const Problem p1 = make_problem(DType::kBF16, c1, 61), p5 = make_problem(DType::kBF16, c5, 61);
  auto pe = PackedExperts::pack(weights_of(p5), resolve_isa("auto"), 1);
  StoreFile f;
  const Stored s = store_block(f, *pe, kLead);
  MoeParams mp = p5.params;
  mp.num_threads = 2;
  std::string msg;
  {  // every read has a byte flipped: the retry fails too, and the error names the checksum
    TierOptions o = options_for(pe->header(), 3, 2);
    o.fault_flip_every = 1;
    auto tier = std::make_shared<ExpertTier>(o);
    const int layer = add_layer(*tier, f, s);
    auto tp = PackedExperts::tiered(pe->header(), tier, layer, s.bias, s.bias_bytes);
    const std::vector<std::string> parts = {"checksum mismatch", "layer 0", "expert ", f.path, "(read twice)"};
    report(throws_tier_error([&] { forward_bytes(*tp, p1, mp, 0); }, parts, &msg),
           "tier faults: flipped byte -> TierError naming the checksum, file, layer and expert: " + msg);
    // the failed call let go of the step lock and its pins: the next one runs (and fails the same way)
    report(throws_tier_error([&] { forward_bytes(*tp, p5, mp, 0); }, parts, &msg),
           "tier faults: the call after a failure runs (no stuck lock): " + msg);
    tier->drain();
    report(tier->resident(layer).empty() && tier->stats().reads == 0 && tier->stats().retries > 0,
           "tier faults: nothing that failed its checksum is resident");
  }
  // One I/O thread, so reads are numbered in a fixed order (an expert is two reads, gate/up then
  // down; an attempt stops at its first bad one). fault_short_every = 3: reads 3, 6, 9, ... are
  // cut short; the retry of a cut read n is reads n+1 and n+2, never cut, so every expert
  // arrives, some on the second try.
  {
    TierOptions o = options_for(pe->header(), 3, 1);
    o.fault_short_every = 3;
    o.prediction_window = 0;
    auto tier = std::make_shared<ExpertTier>(o);
    const int layer = add_layer(*tier, f, s);
    auto tp = PackedExperts::tiered(pe->header(), tier, layer, s.bias, s.bias_bytes);
    bool same = false;
    try {
      same = forward_bytes(*tp, p5, mp, 0xAB) == forward_bytes(*pe, p5, mp, 0xCD);
      msg.clear();
    } catch (const std::exception& e) {
      msg = e.what();
    }
    const TierStats st = tier->stats();
    report(same && st.retries > 0, "tier faults: short reads retried (" + std::to_string(st.retries) +
                                       " retries, " + std::to_string(st.reads) + " reads), T=5 == in-memory" +
                                       (msg.empty() ? "" : ": " + msg));
  }
  // Two fault kinds at once, one I/O thread, one expert a call. An attempt stops at its first
  // bad read, so with reads 4, 8, ... bad one way and 5, 10, ... the other: expert 0 takes reads
  // 1-2 (clean); expert 1 reads 3, 4 (bad), retried as 5 (bad): fails twice, with the second
  // attempt's error; expert 2 reads 6-7 (clean); expert 0 again is resident (no read). A good
  // call after a failed one works.
  struct Mix {
    int64_t TierOptions::*every4;
    int64_t TierOptions::*every5;
    const char* name;
    const char* error;  // what the second attempt (read 5) reports
  };
  for (const Mix& m : {Mix{&TierOptions::fault_short_every, &TierOptions::fault_flip_every, "short 4, flip 5", "checksum mismatch"},
                       Mix{&TierOptions::fault_flip_every, &TierOptions::fault_eio_every, "flip 4, eio 5", "read error"}}) {
    TierOptions o = options_for(pe->header(), 3, 1);
    o.*m.every4 = 4;
    o.*m.every5 = 5;
    o.prediction_window = 0;
    auto tier = std::make_shared<ExpertTier>(o);
    const int layer = add_layer(*tier, f, s);
    auto tp = PackedExperts::tiered(pe->header(), tier, layer, s.bias, s.bias_bytes);
    const std::string tag = std::string("tier faults ") + m.name;
    Case ck = c1;
    ck.K = 1;
    Problem pk = make_problem(DType::kBF16, ck, 62);
    auto call = [&](int32_t e) {
      pk.idx[0] = e;
      return forward_bytes(*tp, pk, mp, 0xAB) == forward_bytes(*pe, pk, mp, 0xCD);
    };
    bool ok0 = false, ok2 = false, ok0b = false;
    try {
      ok0 = call(0);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    report(ok0, tag + ": expert 0 (clean reads) == in-memory");
    const bool threw = throws_tier_error([&] { call(1); }, {m.error, "expert 1's gate/up", "(read twice)"}, &msg);
    report(threw, tag + ": expert 1 fails twice -> TierError: " + msg);
    try {
      ok2 = call(2);
      ok0b = call(0);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    report(ok2 && ok0b, tag + ": the calls after the failure (expert 2 read, expert 0 resident) == in-memory");
    const TierStats st = tier->stats();
    report(st.reads == 2 && st.retries == 1 && st.hits == 1,
           tag + ": reads " + std::to_string(st.reads) + " retries " + std::to_string(st.retries) + " hits " +
               std::to_string(st.hits) + ", expected 2 1 1");
  }
  // A failed call gives back every slot it asked for. Expert 1 corrupt on disk, one I/O thread,
  // 4 slots, a call for {1, 0, 2, 3}: 1 fails twice, the thread takes 0, and the call returns its
  // TierError while the reads of 2 and 3 are still queued. Before 7138447 the thread then read
  // them pinned for a call that was gone: two slots pinned for good, and the next call of four
  // other experts waited forever for a slot.
  {
    StoreFile bad;
    const Stored sb = store_block(bad, *pe, kLead);
    const std::vector<uint8_t> junk(64, 0x77);
    bad.write_at(junk.data(), junk.size(), kLead + 1 * pe->header().gu_expert_bytes + 128);
    TierOptions o = options_for(pe->header(), 4, 1);
    o.prediction_window = 0;
    ExpertTier t(o);
    add_layer(t, bad, sb);
    std::vector<const void*> gu(kE, nullptr), dn(kE, nullptr);
    const int32_t first[4] = {1, 0, 2, 3}, second[4] = {4, 5, 6, 7};
    const bool threw = throws_tier_error([&] {
      t.acquire(0, first, 4, nullptr, 0, pe->dtype(), pe->H(), gu.data(), dn.data());
      t.release(0, first, 4);
    }, {"checksum mismatch", "expert 1's gate/up"}, &msg);
    report(threw, "tier faults: expert 1 corrupt on disk -> TierError: " + msg);
    t.drain();
    auto next = std::async(std::launch::async, [&] {
      t.acquire(0, second, 4, nullptr, 0, pe->dtype(), pe->H(), gu.data(), dn.data());
      const PackedHeader& h = pe->header();
      const uint8_t* b = static_cast<const uint8_t*>(pe->data());
      bool same = true;
      for (int32_t e : second)
        same = same && std::memcmp(gu[e], b + e * h.gu_expert_bytes, h.gu_expert_bytes) == 0 &&
               std::memcmp(dn[e], b + h.E * h.gu_expert_bytes + e * h.down_expert_bytes, h.down_expert_bytes) == 0;
      t.release(0, second, 4);
      return same;
    });
    if (next.wait_for(std::chrono::seconds(60)) != std::future_status::ready)
      fail_hung("tier faults: after a failed call for 4 experts, a call for 4 others still waits for slots after 60 s "
                "(the failed call left slots pinned)");
    report(next.get(), "tier faults: after a failed call, a call for 4 other experts gets all 4 slots, the right bytes");
  }
}

// The tier's threads wait on each other: a bug there hangs rather than fails. Past this, the
// runner stops with a FAIL line instead of running into the CI job's limit.
class Watchdog {
 public:
  explicit Watchdog(int seconds) {
    t_ = std::thread([this, seconds] {
      std::unique_lock<std::mutex> lk(m_);
      if (!cv_.wait_for(lk, std::chrono::seconds(seconds), [this] { return done_; }))
        fail_hung("tier tests not done within " + std::to_string(seconds) + " s: a hang in the memory tier");
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lk(m_);
      done_ = true;
    }
    cv_.notify_all();
    t_.join();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread t_;
};

}  // namespace

void test_tier(const std::vector<Isa>& tiers) {
  Watchdog dog(300);
  guarded("tier crc32c", test_crc32c);
  guarded("tier forward", [&] { test_tiered_forward(tiers); });
  guarded("tier eviction", test_eviction);
  guarded("tier warm", test_warm_and_drain);
  guarded("tier threads", test_concurrent);
  guarded("tier faults", test_faults);
}

}  // namespace tests_tier
