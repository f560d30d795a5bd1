// The memory tier (hina_moe/tier.h): slot pool, I/O threads, eviction, prediction.
#include "hina_moe/tier.h"
#include "hina_moe/ops.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <unordered_set>

#include "moe/kernel_api.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include "hina_moe/cpu_features.h"
#endif

namespace hina {

// ---- CRC-32C ----------------------------------------------------------------------------------
namespace {
struct Crc32cTable {
  uint32_t t[8][256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};
const Crc32cTable& crc_table() {
  static const Crc32cTable tab;
  return tab;
}

uint32_t crc32c_table(const uint8_t* p, size_t n, uint32_t c) {
  const auto& t = crc_table().t;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= c;  // (little-endian: the CRC's low byte meets the first byte)
    c = t[7][v & 0xff] ^ t[6][(v >> 8) & 0xff] ^ t[5][(v >> 16) & 0xff] ^ t[4][(v >> 24) & 0xff] ^
        t[3][(v >> 32) & 0xff] ^ t[2][(v >> 40) & 0xff] ^ t[1][(v >> 48) & 0xff] ^ t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return c;
}

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const uint8_t* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
#endif
}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__) || defined(_M_X64)
  static const bool hw = cpu_features().sse42;
  c = hw ? crc32c_sse42(p, n, c) : crc32c_table(p, n, c);
#else
  c = crc32c_table(p, n, c);
#endif
  return ~c;
}

// ---- names ------------------------------------------------------------------------------------
const char* eviction_name(EvictionPolicy p) {
  switch (p) {
    case EvictionPolicy::kLru: return "lru";
    case EvictionPolicy::kLru2: return "lru-2";
    case EvictionPolicy::kFreqDecay: return "freq-decay";
    case EvictionPolicy::kLfu: return "lfu";
  }
  return "?";
}
bool eviction_from_name(const char* name, EvictionPolicy* out) {
  for (EvictionPolicy p : {EvictionPolicy::kLru, EvictionPolicy::kLru2, EvictionPolicy::kFreqDecay, EvictionPolicy::kLfu})
    if (std::strcmp(name, eviction_name(p)) == 0) {
      *out = p;
      return true;
    }
  return false;
}

// ---- state --------------------------------------------------------------------------------------
namespace {
constexpr size_t kAlign = 4096;
constexpr size_t kPredictDepth = 4;  // predicted reads queued per I/O thread, at most
// Refine's experts beyond a router's top-k, one and two layers ahead (layer_done). Layer l+j's
// router on layer l's output through layer l+j's pre-router norm, on the trained E64 model's
// routing (top-8 of 64, all 28,672 held-out tokens; benchmarks/log/memory-tier.md, "The expert
// pool's policy and read prediction on real routing", 2026-12-07): top-8 + 4 one layer ahead
// recalls 83.8-96.2 % of each layer's choice, + 8 two layers ahead 84.4 and 89.7 %, the fewest
// extras that reach 80 % in every layer (+ 2: 78.7 % in layer 2; + 4 two ahead: 76.2 %).
constexpr int kRefineExtra[2] = {4, 8};
size_t a4k(uint64_t n) { return static_cast<size_t>((n + kAlign - 1) / kAlign * kAlign); }
enum : uint8_t { kEmpty = 0, kLoading = 1, kReady = 2 };
std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}
}  // namespace

struct ExpertTier::Layer {
  std::string path;
  int fd = -1, fd_direct = -1;
  std::string io_note;  // why buffered, when it is
  int64_t E = 0;
  uint64_t gu_off = 0, gu_bytes = 0, dn_off = 0, dn_bytes = 0;
  std::vector<uint32_t> crc_gu, crc_dn;
  std::vector<int64_t> slot_of;      // the slot holding (or loading) expert e, or -1
  std::vector<uint8_t> queued;       // a read of e is queued
  std::vector<uint64_t> pred_mark;   // e was predicted for this layer's acquire number pred_mark[e]
  // A read ahead of e was evicted before any use, and e has not been used since: prediction does
  // not read it again until it is. Routers keep predicting the same wrong experts while the hidden
  // state changes little, and a policy that ranks a never-used expert last (lfu, lru-2,
  // freq-decay) evicts it at once, so each token read it again: on OLMoE-1B-7B int4 with half the
  // experts held, freq-decay read 3-5x lru's bytes a token at the same hit rate and decoded
  // 1.3-1.4x slower (benchmarks/log/memory-tier.md, 2026-12-07).
  std::vector<uint8_t> wasted;
  std::vector<std::string> failed;   // a demanded read of e failed twice: the message
  // The policy's record of each expert's uses, kept while it is out of the pool as well: LFU counts
  // every use since the start, LRU-2 the second-to-last use and freq-decay the decayed count of
  // every use, as their definitions (and core/cache_policy.py's simulator, whose replays chose the
  // policy) say. Forgetting them at eviction made a returning expert look brand new: on the E64
  // trained model's routing with 10 % of its experts held, freq-decay hit 5.5 % of accesses, not
  // the simulator's 24.6 %, and LFU 4.1 %, not 23.0 % (benchmarks/log/memory-tier.md, 2026-12-07).
  std::vector<uint64_t> use_last, use_prev;  // use clock of the last two uses (0: none)
  std::vector<uint64_t> uses;                // kLfu: uses so far
  std::vector<double> decay;                 // kFreqDecay: log2 of sum 2^(t_use / half_life)
  uint64_t acquires = 0;
  std::vector<float> rw;  // router [E, rH] in fp32, for prediction (empty: none)
  int64_t rH = 0;
  const float* rbias = nullptr;
  int rk = 0;
  std::vector<float> nw;  // the router's input RMSNorm weight [rH] in fp32, for refine (empty: none)
  float neps = 0;
  bool behind = false;  // demanded reads were queued or under way at this layer's last acquire
  TierLayerStats st;
};

struct ExpertTier::Slot {
  int layer = -1;
  int32_t expert = -1;
  uint8_t state = kEmpty;
  int pins = 0;
  bool prefetched = false, used = false;
  uint64_t loaded = 0;       // the acquire tick its read was queued at
  uint64_t last = 0;         // the acquire tick of its last use (0: none)
  uint64_t loaded_use = 0;   // the use clock when its read started (orders a predicted read not used yet)
  uint8_t* base = nullptr;
  void clear() {  // empty again; its memory stays
    uint8_t* b = base;
    *this = Slot{};
    base = b;
  }
};

size_t ExpertTier::slot_bytes_for(uint64_t gu_bytes, uint64_t down_bytes) {
  return a4k(gu_bytes + kAlign) + a4k(down_bytes + kAlign);
}

ExpertTier::ExpertTier(const TierOptions& opt) : opt_(opt) {
  if (opt_.num_slots < 1) throw std::invalid_argument("memory tier: num_slots must be >= 1");
  if (opt_.slot_bytes < 2 * kAlign || opt_.slot_bytes % kAlign)
    throw std::invalid_argument("memory tier: slot_bytes must be a multiple of 4096 (ExpertTier.slot_bytes_for)");
  if (opt_.io_threads < 1 || opt_.io_threads > 64) throw std::invalid_argument("memory tier: io_threads must be in 1..64");
  if (opt_.prediction_window < 0 || opt_.prediction_extra < 0)
    throw std::invalid_argument("memory tier: prediction_window and prediction_extra must be >= 0");
  if (!(opt_.decay_half_life > 0)) throw std::invalid_argument("memory tier: decay_half_life must be > 0");
  pool_bytes_ = opt_.slot_bytes * static_cast<size_t>(opt_.num_slots);
  void* p = mmap(nullptr, pool_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw TierError("memory tier: cannot map " + std::to_string(pool_bytes_) + " bytes for its slots: " +
                    std::strerror(errno));
#ifdef MADV_HUGEPAGE
  if (pool_bytes_ >= (4u << 20)) madvise(p, pool_bytes_, MADV_HUGEPAGE);
#endif
  pool_ = static_cast<uint8_t*>(p);
  slots_.resize(static_cast<size_t>(opt_.num_slots));
  for (int64_t s = 0; s < opt_.num_slots; ++s) slots_[s].base = pool_ + static_cast<size_t>(s) * opt_.slot_bytes;
  for (int i = 0; i < opt_.io_threads; ++i) threads_.emplace_back([this] { worker(); });
}

ExpertTier::~ExpertTier() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  cv_done_.notify_all();
  for (auto& t : threads_) t.join();
  for (auto& L : layers_) {
    if (L->fd >= 0) close(L->fd);
    if (L->fd_direct >= 0) close(L->fd_direct);
  }
  if (pool_) munmap(pool_, pool_bytes_);
}

int ExpertTier::add_layer(const std::string& path, int64_t E, uint64_t gu_offset, uint64_t gu_bytes,
                          uint64_t down_offset, uint64_t down_bytes, const std::vector<uint32_t>& crc_gu,
                          const std::vector<uint32_t>& crc_down) {
  if (E < 1) throw std::invalid_argument("memory tier: a layer needs E >= 1 experts");
  if (static_cast<int64_t>(crc_gu.size()) != E || static_cast<int64_t>(crc_down.size()) != E)
    throw std::invalid_argument("memory tier: one CRC per expert for gate/up and for down");
  if (gu_offset % 64 || down_offset % 64 || gu_bytes % 64 || down_bytes % 64)
    throw std::invalid_argument("memory tier: expert regions must start at file offsets that are 64-byte multiples and be "
                                "64-byte multiples long (the kernels' alignment); got gate/up at " +
                                std::to_string(gu_offset) + " + e x " + std::to_string(gu_bytes) + ", down at " +
                                std::to_string(down_offset) + " + e x " + std::to_string(down_bytes));
  if (slot_bytes_for(gu_bytes, down_bytes) > opt_.slot_bytes)
    throw std::invalid_argument("memory tier: this layer's experts (" + std::to_string(gu_bytes + down_bytes) +
                                " bytes) do not fit a slot of " + std::to_string(opt_.slot_bytes) + " bytes");
  auto L = std::make_unique<Layer>();
  L->path = path;
  L->E = E;
  L->gu_off = gu_offset;
  L->gu_bytes = gu_bytes;
  L->dn_off = down_offset;
  L->dn_bytes = down_bytes;
  L->crc_gu = crc_gu;
  L->crc_dn = crc_down;
  L->fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (L->fd < 0) throw TierError("memory tier: cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (fstat(L->fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(L->fd);
    throw TierError("memory tier: " + path + " is not a regular file");
  }
  const uint64_t need = std::max(gu_offset + gu_bytes * E, down_offset + down_bytes * E);
  if (static_cast<uint64_t>(st.st_size) < need) {
    close(L->fd);
    throw TierError("memory tier: " + path + " is truncated: " + std::to_string(st.st_size) + " bytes, its experts end at " +
                    std::to_string(need));
  }
  if (opt_.direct_io) {
    L->fd_direct = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (L->fd_direct < 0) L->io_note = std::string("buffered reads: O_DIRECT refused (") + std::strerror(errno) + ")";
  } else {
    L->io_note = "buffered reads: direct_io off";
  }
  L->slot_of.assign(static_cast<size_t>(E), -1);
  L->queued.assign(static_cast<size_t>(E), 0);
  L->pred_mark.assign(static_cast<size_t>(E), 0);
  L->wasted.assign(static_cast<size_t>(E), 0);
  L->failed.assign(static_cast<size_t>(E), std::string());
  L->use_last.assign(static_cast<size_t>(E), 0);
  L->use_prev.assign(static_cast<size_t>(E), 0);
  L->uses.assign(static_cast<size_t>(E), 0);
  L->decay.assign(static_cast<size_t>(E), 0.0);
  std::lock_guard<std::mutex> lk(mu_);
  layers_.push_back(std::move(L));
  st_.layers.emplace_back();
  return static_cast<int>(layers_.size()) - 1;
}

int ExpertTier::num_layers() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int>(layers_.size());
}
int64_t ExpertTier::experts(int layer) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) throw std::invalid_argument("memory tier: no layer " + std::to_string(layer));
  return layers_[layer]->E;
}

std::string ExpertTier::io_mode(int layer) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) throw std::invalid_argument("memory tier: no layer " + std::to_string(layer));
  const Layer& L = *layers_[layer];
  return L.fd_direct >= 0 ? std::string("O_DIRECT") : L.io_note;
}

void ExpertTier::set_router(int layer, const void* w, DType dt, int64_t H, const float* bias, int k) {
  std::lock_guard<std::mutex> lk(mu_);
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) throw std::invalid_argument("memory tier: no layer " + std::to_string(layer));
  if (k < 1 || H < 1) throw std::invalid_argument("memory tier: a router needs k >= 1 and H >= 1");
  Layer& L = *layers_[layer];
  // converted once: prediction then runs a plain fp32 dot product per expert (E x H per row and
  // layer ahead, microseconds), where converting on every call would cost as much as the reads' issue
  L.rw.resize(static_cast<size_t>(L.E * H));
  for (int64_t i = 0; i < L.E * H; ++i) L.rw[i] = detail::load_elem(dt, w, i);
  L.rH = H;
  L.rbias = bias;
  L.rk = std::min<int>(k, static_cast<int>(L.E));
}

void ExpertTier::set_norm(int layer, const void* w, DType dt, int64_t H, float eps) {
  std::lock_guard<std::mutex> lk(mu_);
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) throw std::invalid_argument("memory tier: no layer " + std::to_string(layer));
  if (H < 1 || !(eps >= 0)) throw std::invalid_argument("memory tier: a norm needs H >= 1 and eps >= 0");
  Layer& L = *layers_[layer];
  if (L.rw.empty() || H != L.rH)
    throw std::invalid_argument("memory tier: layer " + std::to_string(layer) + "'s norm weight has " + std::to_string(H) +
                                " values, its router's hidden size is " + std::to_string(L.rH) +
                                (L.rw.empty() ? " (no router: set_router first)" : ""));
  L.nw.resize(static_cast<size_t>(H));
  for (int64_t i = 0; i < H; ++i) L.nw[i] = detail::load_elem(dt, w, i);
  L.neps = eps;
}

// ---- policy -------------------------------------------------------------------------------------
// The victim is the slot of the smallest (key, tie): ties go to the least recent use, counted by
// the use clock (one tick per expert use, in the order an acquire lists them), so that experts of
// one acquire never tie and the choice does not depend on which slot an expert happens to sit in.
std::pair<double, uint64_t> ExpertTier::score(const Slot& s) const {
  if (!s.used) {  // a predicted read not used yet: by when its read started (LRU), else first out
    const double k = opt_.policy == EvictionPolicy::kLru ? static_cast<double>(s.loaded_use) : -HUGE_VAL;
    return {k, s.loaded_use};
  }
  const Layer& L = *layers_[s.layer];
  const uint64_t last = L.use_last[s.expert];
  switch (opt_.policy) {
    case EvictionPolicy::kLru: return {static_cast<double>(last), 0};
    case EvictionPolicy::kLru2:  // used once: infinitely old
      return {L.use_prev[s.expert] ? static_cast<double>(L.use_prev[s.expert]) : -1.0, last};
    case EvictionPolicy::kLfu: return {static_cast<double>(L.uses[s.expert]), last};
    case EvictionPolicy::kFreqDecay: return {L.decay[s.expert], last};
  }
  return {0, 0};
}

int64_t ExpertTier::pick_victim(bool for_prefetch) {
  // A predicted read not used yet is kept for the layers it was predicted for (window + 1
  // acquires); a demanded read may take it when nothing else is free, a predicted one never.
  // A predicted read never takes a slot something used or read in this very acquire holds.
  const uint64_t keep = static_cast<uint64_t>(opt_.prediction_window) + 1;
  for (int pass = 0; pass < (for_prefetch ? 1 : 2); ++pass) {
    int64_t best = -1;
    std::pair<double, uint64_t> best_score{0, 0};
    for (int64_t s = 0; s < static_cast<int64_t>(slots_.size()); ++s) {
      const Slot& sl = slots_[s];
      if (sl.state == kEmpty) return s;
      if (sl.state == kLoading || sl.pins > 0) continue;
      if (pass == 0 && sl.prefetched && !sl.used && sl.loaded + keep > tick_) continue;
      if (for_prefetch && std::max(sl.last, sl.loaded) >= tick_) continue;
      const auto sc = score(sl);
      if (best < 0 || sc < best_score) {
        best = s;
        best_score = sc;
      }
    }
    if (best >= 0) return best;
  }
  return -1;
}

void ExpertTier::evict(int64_t s) {
  Slot& sl = slots_[s];
  if (sl.layer >= 0) {
    layers_[sl.layer]->slot_of[sl.expert] = -1;
    ++st_.evictions;
    if (sl.prefetched && !sl.used) {
      ++st_.prefetch_unused;
      layers_[sl.layer]->wasted[sl.expert] = 1;
    }
  }
  sl.clear();
}

// ---- reads --------------------------------------------------------------------------------------
bool ExpertTier::read_expert(int64_t slot, const Layer& L, int32_t e, std::string* err) {
  uint8_t* base = slots_[slot].base;
  const size_t gu_region = a4k(L.gu_bytes + kAlign);
  struct Part {
    uint64_t off, len;
    uint8_t* region;
    uint32_t crc;
    const char* what;
  } parts[2] = {{L.gu_off + L.gu_bytes * static_cast<uint64_t>(e), L.gu_bytes, base, L.crc_gu[e], "gate/up"},
                {L.dn_off + L.dn_bytes * static_cast<uint64_t>(e), L.dn_bytes, base + gu_region, L.crc_dn[e], "down"}};
  for (const Part& p : parts) {
    if (p.len == 0) continue;
    const uint64_t lead = p.off % kAlign;
    uint8_t* dst = p.region + lead;
    const bool direct = L.fd_direct >= 0;
    const uint64_t start = direct ? p.off - lead : p.off;
    const size_t want = direct ? a4k(lead + p.len) : static_cast<size_t>(p.len);
    uint8_t* into = direct ? p.region : dst;
    const size_t need = direct ? static_cast<size_t>(lead + p.len) : static_cast<size_t>(p.len);
    size_t got = 0;
    const int64_t n = ++read_count_;
    int e_no = 0;
    if (opt_.fault_eio_every > 0 && n % opt_.fault_eio_every == 0) {
      e_no = EIO;
    } else {
      while (got < want) {
        const ssize_t r = pread(direct ? L.fd_direct : L.fd, into + got, want - got, static_cast<off_t>(start + got));
        if (r < 0) {
          if (errno == EINTR) continue;
          e_no = errno;
          break;
        }
        if (r == 0) break;  // end of file
        got += static_cast<size_t>(r);
        if (direct && got >= need) break;
      }
      if (opt_.fault_short_every > 0 && n % opt_.fault_short_every == 0 && got > 0) got = need - 1;
    }
    const std::string where = "expert " + std::to_string(e) + "'s " + p.what + " panels (" + L.path + ", bytes " +
                              std::to_string(p.off) + ".." + std::to_string(p.off + p.len) + ")";
    if (e_no != 0) {
      *err = where + ": read error: " + std::strerror(e_no);
      return false;
    }
    if (got < need) {
      *err = where + ": short read, " + std::to_string(got < lead ? 0 : got - (direct ? lead : 0)) + " of " +
             std::to_string(p.len) + " bytes (the file was truncated or changed while in use)";
      return false;
    }
    if (!direct) posix_fadvise(L.fd, static_cast<off_t>(p.off), static_cast<off_t>(p.len), POSIX_FADV_DONTNEED);
    if (opt_.fault_flip_every > 0 && n % opt_.fault_flip_every == 0) dst[p.len / 2] ^= 0x01;
    const uint32_t c = crc32c(dst, static_cast<size_t>(p.len));
    if (c != p.crc) {
      *err = where + ": checksum mismatch (CRC-32C " + hex32(c) + ", recorded " + hex32(p.crc) +
             "): the store entry is corrupt; clear it (hi-na-moe cache clear) and load again";
      return false;
    }
  }
  return true;
}

void ExpertTier::enqueue(int layer, int32_t e, bool demand, int distance) {
  Layer& L = *layers_[layer];
  if (L.queued[e] && !demand) return;
  L.queued[e] = 1;
  Request r{layer, e, demand, distance, tick_};
  if (demand) {
    demand_q_.push_back(r);
  } else {
    // nearer layers first; among one distance, the order of prediction
    auto it = std::find_if(predict_q_.begin(), predict_q_.end(), [&](const Request& q) { return q.distance > distance; });
    predict_q_.insert(it, r);
    ++st_.prefetch_issued;
    // A queue deeper than the I/O threads can read before the layers it predicts for run only
    // takes the disk's time from demanded reads (its reads would arrive late, or be dropped
    // unstarted): the farthest predictions go first.
    const size_t cap = static_cast<size_t>(opt_.io_threads) * kPredictDepth;
    while (predict_q_.size() > cap) {
      const Request& last = predict_q_.back();
      layers_[last.layer]->queued[last.expert] = 0;
      predict_q_.pop_back();
      ++st_.prefetch_dropped;
    }
  }
}

bool ExpertTier::take_request(Request* r, std::unique_lock<std::mutex>& lk) {
  for (;;) {
    if (stop_) return false;
    if (!demand_q_.empty()) {
      *r = demand_q_.front();
      demand_q_.pop_front();
      return true;
    }
    if (!predict_q_.empty()) {
      *r = predict_q_.front();
      predict_q_.pop_front();
      return true;
    }
    cv_work_.wait(lk);
  }
}

void ExpertTier::worker() {
  std::unique_lock<std::mutex> lk(mu_);
  Request r{};
  while (take_request(&r, lk)) {
    Layer& L = *layers_[r.layer];
    L.queued[r.expert] = 0;
    if (L.slot_of[r.expert] >= 0) {  // resident or loading already
      // (not for a demanded read with one acquire at a time, which drops this layer's
      // predicted reads first; if it were, only the live call may pin)
      if (r.demand && r.seq == active_seq_) ++slots_[L.slot_of[r.expert]].pins;
      cv_done_.notify_all();  // (a request settled without a read: drain() may be waiting for it)
      continue;
    }
    int64_t s = pick_victim(!r.demand);
    if (r.demand) {
      while (s < 0 && !stop_) {
        cv_done_.wait(lk);
        s = pick_victim(false);
      }
      if (stop_) return;
    } else if (s < 0) {
      ++st_.prefetch_dropped;
      cv_done_.notify_all();
      continue;
    }
    evict(s);
    Slot& sl = slots_[s];
    sl.layer = r.layer;
    sl.expert = r.expert;
    sl.state = kLoading;
    sl.pins = r.demand && r.seq == active_seq_ ? 1 : 0;  // (a call that failed meanwhile pins nothing)
    sl.prefetched = !r.demand;
    sl.loaded = r.seq;
    sl.loaded_use = uses_;
    L.slot_of[r.expert] = s;
    ++busy_;
    if (r.demand) ++busy_demand_;
    lk.unlock();
    std::string err;
    const auto t0 = std::chrono::steady_clock::now();
    bool ok = read_expert(s, L, r.expert, &err);
    int retried = 0;
    if (!ok) {
      retried = 1;
      std::string err2;
      ok = read_expert(s, L, r.expert, &err2);
      if (!ok) err = err2 + " (read twice)";
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    lk.lock();
    --busy_;
    if (r.demand) --busy_demand_;
    st_.read_s += dt;
    st_.retries += static_cast<uint64_t>(retried);
    // the call this read was demanded for may have failed and returned meanwhile: then nothing
    // waits for it (its pin, if any, is dropped) and an error is nobody's to see
    const bool live = r.seq == active_seq_;
    if (r.demand && !live) sl.pins = 0;
    if (ok) {
      ++st_.reads;
      st_.bytes_read += L.gu_bytes + L.dn_bytes;
      sl.state = kReady;
    } else {
      L.slot_of[r.expert] = -1;
      const bool pinned = sl.pins > 0;  // by the live call (an in-flight predicted read it waits for)
      sl.clear();
      if ((r.demand && live) || pinned)
        L.failed[r.expert] = "hi_na_moe memory tier: layer " + std::to_string(r.layer) + ", " + err;
    }
    cv_done_.notify_all();
  }
}

// ---- prediction ---------------------------------------------------------------------------------
uint64_t ExpertTier::predict_layer(int target, int distance, const float* x, int64_t T, int64_t H, int extra) {
  Layer& N = *layers_[target];
  const int want = std::min<int>(N.rk + extra, static_cast<int>(N.E));
  std::vector<int32_t> picked;
  std::vector<float> logits(static_cast<size_t>(N.E));
  std::vector<int32_t> order(static_cast<size_t>(N.E));
  for (int64_t t = 0; t < T; ++t) {
    const float* xf = x + t * H;
    for (int64_t e = 0; e < N.E; ++e) {
      const float* wr = N.rw.data() + e * H;
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight partial sums: the compiler's vectors (baseline flags)
      int64_t h = 0;
      for (; h + 8 <= H; h += 8)
        for (int j = 0; j < 8; ++j) part[j] += wr[h + j] * xf[h + j];
      float acc = 0.0f;
      for (; h < H; ++h) acc += wr[h] * xf[h];
      for (int j = 0; j < 8; ++j) acc += part[j];
      logits[e] = acc + (N.rbias ? N.rbias[e] : 0.0f);
    }
    for (int64_t e = 0; e < N.E; ++e) order[e] = static_cast<int32_t>(e);
    std::partial_sort(order.begin(), order.begin() + want, order.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    picked.insert(picked.end(), order.begin(), order.begin() + want);
  }
  uint64_t fresh = 0;
  std::lock_guard<std::mutex> lk(mu_);
  for (int32_t e : picked) {
    if (N.pred_mark[e] == N.acquires + 1) continue;  // (predicted for that acquire already: counted once)
    N.pred_mark[e] = N.acquires + 1;
    ++fresh;
    ++N.st.predicted;
    ++st_.predicted;
    if (N.slot_of[e] >= 0) continue;
    if (N.wasted[e] && opt_.skip_unused_reads) {
      ++st_.prefetch_skipped;
      continue;
    }
    enqueue(target, e, false, distance);
  }
  return fresh;
}

void ExpertTier::queue_prediction(int layer, const void* x, int64_t T, DType dt, int64_t H) {
  if (opt_.prediction_window <= 0 || x == nullptr || T < 1 || T > opt_.prediction_max_rows) return;
  std::vector<float> xf(static_cast<size_t>(T * H));
  for (int64_t i = 0; i < T * H; ++i) xf[i] = detail::load_elem(dt, x, i);
  const int nl = static_cast<int>(layers_.size());
  // When this call's demanded reads are still queued or under way, the disk is behind the
  // kernels: a wrong guess then costs a demanded read its bandwidth, so only the next layer's
  // top-k are read ahead. Measured on OLMoE-1B-7B int4, scope="all", 25 % of the experts held
  // (benchmarks/log/memory-tier.md, 2026-12-07): steps of 168 ms without prediction, 197 ms
  // with top-k + 4 two layers ahead, 164 ms with top-k one layer ahead.
  bool behind;
  {
    std::lock_guard<std::mutex> lk(mu_);
    behind = !demand_q_.empty() || busy_demand_ > 0;
  }
  const int window = behind ? std::min(1, opt_.prediction_window) : opt_.prediction_window;
  const int extra = behind ? 0 : opt_.prediction_extra;
  for (int j = 1; j <= window && layer + j < nl; ++j) {
    const Layer& N = *layers_[layer + j];
    if (N.rw.empty() || N.rH != H) continue;
    predict_layer(layer + j, j, xf.data(), T, H, extra);
  }
  cv_work_.notify_all();
}

void ExpertTier::layer_done(int layer, const void* residual, int64_t T, DType dt, int64_t H) {
  if (!opt_.refine || opt_.prediction_window <= 0 || residual == nullptr || T < 1 || T > opt_.prediction_max_rows) return;
  try {
    bool behind;
    int nl;
    {
      std::lock_guard<std::mutex> lk(mu_);
      nl = static_cast<int>(layers_.size());
      if (layer < 0 || layer >= nl) return;
      behind = layers_[layer]->behind;
    }
    // The rule of queue_prediction: when layer l's acquire found the disk behind, only the next
    // layer's top-k (its reads are done by now, but the disk is likely to be behind again).
    const int window = std::min({behind ? 1 : opt_.prediction_window, 2, nl - 1 - layer});
    std::vector<float> x, xn;  // (converted for the first layer refine reaches: none, no work in the step)
    uint64_t fresh = 0;
    for (int j = 1; j <= window; ++j) {
      const Layer& N = *layers_[layer + j];
      if (N.rw.empty() || N.nw.empty() || N.rH != H) continue;
      if (x.empty()) {
        x.resize(static_cast<size_t>(T * H));
        xn.resize(x.size());
        for (int64_t i = 0; i < T * H; ++i) x[i] = detail::load_elem(dt, residual, i);
      }
      rms_norm(DType::kF32, x.data(), T, H, N.nw.data(), N.neps, xn.data());
      fresh += predict_layer(layer + j, j, xn.data(), T, H, behind ? 0 : kRefineExtra[j - 1]);
    }
    std::lock_guard<std::mutex> lk(mu_);
    st_.refined += fresh;
  } catch (...) {
    // prediction only ever saves time; a failure there must not fail the step
  }
  cv_work_.notify_all();
}

void ExpertTier::prefetch(int layer, const int32_t* experts, int n) {
  std::lock_guard<std::mutex> lk(mu_);
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) throw std::invalid_argument("memory tier: no layer " + std::to_string(layer));
  Layer& L = *layers_[layer];
  for (int i = 0; i < n; ++i) {
    if (experts[i] < 0 || experts[i] >= L.E) throw std::invalid_argument("memory tier: expert " + std::to_string(experts[i]) + " out of range");
    if (L.slot_of[experts[i]] < 0) enqueue(layer, experts[i], false, opt_.prediction_window + 1);
  }
  cv_work_.notify_all();
}

void ExpertTier::warm(const int32_t* layers, const int32_t* ids, int n) {
  std::vector<const void*> gu, dn;
  for (int i = 0; i < n;) {
    const int layer = layers[i];
    int j = i;
    while (j < n && layers[j] == layer && j - i < opt_.num_slots) ++j;
    gu.assign(static_cast<size_t>(experts(layer)), nullptr);  // (throws on a bad layer)
    dn.assign(gu.size(), nullptr);
    acquire(layer, ids + i, j - i, nullptr, 0, DType::kF32, 0, gu.data(), dn.data());
    release(layer, ids + i, j - i);
    i = j;
  }
}

// ---- acquire / release --------------------------------------------------------------------------
void ExpertTier::acquire(int layer, const int32_t* experts, int n, const void* x, int64_t T, DType dt, int64_t H,
                         const void** gu, const void** dn) {
  if (n > opt_.num_slots)
    throw std::invalid_argument("memory tier: " + std::to_string(n) + " experts in one call, the pool holds " +
                                std::to_string(opt_.num_slots));
  step_mu_.lock();
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lk(mu_);
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) {
    lk.unlock();
    step_mu_.unlock();
    throw std::invalid_argument("memory tier: no layer " + std::to_string(layer));
  }
  Layer& L = *layers_[layer];
  for (int i = 0; i < n; ++i) {
    if (experts[i] < 0 || experts[i] >= L.E) {
      lk.unlock();
      step_mu_.unlock();
      throw std::invalid_argument("memory tier: expert " + std::to_string(experts[i]) + " of layer " +
                                  std::to_string(layer) + " out of range (E = " + std::to_string(L.E) + ")");
    }
  }
  ++tick_;
  active_seq_ = tick_;
  ++L.acquires;
  ++st_.acquires;
  // predicted reads of this layer that have not started are dropped: its routing is known now
  for (auto it = predict_q_.begin(); it != predict_q_.end();) {
    if (it->layer == layer) {
      L.queued[it->expert] = 0;
      ++st_.prefetch_dropped;
      it = predict_q_.erase(it);
    } else {
      ++it;
    }
  }
  const double hl = opt_.decay_half_life;
  for (int i = 0; i < n; ++i) {
    const int32_t e = experts[i];
    L.failed[e].clear();
    ++L.st.demanded;
    ++st_.demanded;
    if (L.pred_mark[e] == L.acquires) {
      ++L.st.predicted_used;
      ++st_.predicted_used;
    }
    const int64_t s = L.slot_of[e];
    if (s >= 0) {
      Slot& sl = slots_[s];
      if (sl.state == kReady) {
        ++L.st.hits;
        ++st_.hits;
      } else {
        ++st_.inflight_hits;
        ++L.st.misses;
        ++st_.misses;
      }
      ++sl.pins;
    } else {
      ++L.st.misses;
      ++st_.misses;
      enqueue(layer, e, true, 0);
    }
  }
  L.behind = !demand_q_.empty() || busy_demand_ > 0;
  cv_work_.notify_all();
  lk.unlock();
  try {
    queue_prediction(layer, x, T, dt, H);
  } catch (...) {
    // prediction only ever saves time; a failure there must not fail the step
  }
  lk.lock();
  std::string error;
  for (;;) {
    bool all = true;
    for (int i = 0; i < n && error.empty(); ++i) {
      const int32_t e = experts[i];
      if (!L.failed[e].empty()) {
        error = L.failed[e];
      } else {
        const int64_t s = L.slot_of[e];
        if (s < 0 || slots_[s].state != kReady) all = false;
      }
    }
    if (all || !error.empty()) break;
    cv_done_.wait(lk);
  }
  if (!error.empty()) {
    // give back everything this call holds or asked for: its queued reads are dropped, reads
    // under way finish unpinned (the worker sees active_seq_ changed)
    for (auto it = demand_q_.begin(); it != demand_q_.end();) {
      if (it->seq == active_seq_) {
        layers_[it->layer]->queued[it->expert] = 0;
        it = demand_q_.erase(it);
      } else {
        ++it;
      }
    }
    for (int i = 0; i < n; ++i) {
      const int64_t s = L.slot_of[experts[i]];
      if (s >= 0 && slots_[s].pins > 0) --slots_[s].pins;
    }
    active_seq_ = 0;
    st_.io_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cv_done_.notify_all();
    lk.unlock();
    step_mu_.unlock();
    throw TierError(error);
  }
  const size_t gu_region = a4k(L.gu_bytes + kAlign);
  for (int i = 0; i < n; ++i) {
    const int32_t e = experts[i];
    Slot& sl = slots_[L.slot_of[e]];
    // a use: the policy's clocks
    sl.last = tick_;
    sl.used = true;
    L.wasted[e] = 0;
    L.use_prev[e] = L.use_last[e];
    L.use_last[e] = ++uses_;
    if (opt_.policy == EvictionPolicy::kFreqDecay) {
      const double v = static_cast<double>(tick_) / hl;  // log2 of the sum of 2^(t / half_life)
      const double hi = std::max(L.decay[e], v), lo = std::min(L.decay[e], v);
      L.decay[e] = L.uses[e] == 0 ? v : hi + std::log2(1 + std::exp2(lo - hi));
    }
    ++L.uses[e];
    gu[e] = sl.base + (L.gu_off + L.gu_bytes * static_cast<uint64_t>(e)) % kAlign;
    dn[e] = sl.base + gu_region + (L.dn_off + L.dn_bytes * static_cast<uint64_t>(e)) % kAlign;
  }
  st_.io_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // the lock is held until release() (tier.h: one acquire..release span at a time)
}

void ExpertTier::release(int layer, const int32_t* experts, int n) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    active_seq_ = 0;
    Layer& L = *layers_[layer];
    for (int i = 0; i < n; ++i) {
      const int64_t s = L.slot_of[experts[i]];
      if (s >= 0 && slots_[s].pins > 0) --slots_[s].pins;
    }
  }
  cv_done_.notify_all();
  step_mu_.unlock();
}

void ExpertTier::drain() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!(demand_q_.empty() && predict_q_.empty() && busy_ == 0)) cv_done_.wait(lk);
}

TierStats ExpertTier::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  TierStats s = st_;
  for (size_t i = 0; i < layers_.size(); ++i) s.layers[i] = layers_[i]->st;
  return s;
}

void ExpertTier::reset_stats() {
  std::lock_guard<std::mutex> lk(mu_);
  st_ = TierStats{};
  st_.layers.resize(layers_.size());
  for (auto& L : layers_) L->st = TierLayerStats{};
}

void ExpertTier::forget_uses() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& L : layers_) {
    std::fill(L->use_last.begin(), L->use_last.end(), 0);
    std::fill(L->use_prev.begin(), L->use_prev.end(), 0);
    std::fill(L->uses.begin(), L->uses.end(), 0);
    std::fill(L->decay.begin(), L->decay.end(), 0.0);
    std::fill(L->wasted.begin(), L->wasted.end(), 0);
  }
}

std::vector<int32_t> ExpertTier::resident(int layer) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) throw std::invalid_argument("memory tier: no layer " + std::to_string(layer));
  std::vector<int32_t> out;
  const Layer& L = *layers_[layer];
  for (int64_t e = 0; e < L.E; ++e)
    if (L.slot_of[e] >= 0 && slots_[L.slot_of[e]].state == kReady) out.push_back(static_cast<int32_t>(e));
  return out;
}

}  // namespace hina
