// The memory tier: experts of models larger than the memory they may use. Torch-free C++ API.
//
// A tier holds a fixed pool of expert slots in memory of its own and reads the rest from the
// packed-expert store's files on demand. A block loaded "tiered" (PackedExperts::tiered) keeps
// only its header and biases; its experts' panels live in slots. PackedExperts::forward asks the
// tier for the experts its rows route to (acquire), which reads the missing ones (each expert is
// two reads: its gate/up panels and its down panels, contiguous in the store's block) and pins
// them until the kernels are done (release). Kernels never touch the store's files.
//
// Reads are issued by the tier's I/O threads (pread; O_DIRECT when the file system takes it, so
// the page cache does not hold a second copy of what the slots hold), several in flight. Every
// expert read is checked against the CRC-32C recorded for it when the block was registered: a
// short read, an I/O error or a checksum mismatch is read once more, and then a TierError that
// names the file, the layer and the expert; nothing unchecked is ever computed with.
//
// Prediction: with routers registered (set_router), acquire() of layer l first applies the
// routers of layers l+1 .. l+window to layer l's input rows and queues reads of their top
// experts (top-k + `extra`), nearer layers first; while demanded reads are still outstanding
// (the disk is behind), only the next layer's top-k. A demanded read always goes first; a
// predicted read not yet started when its layer is acquired is dropped, never waited for.
// Refine: with the next layers' pre-router RMSNorms registered too (set_norm), layer_done() of
// layer l applies them and the routers of l+1 and l+2 to layer l's output (the residual stream
// after its MoE add), which predicts them better than layer l's MoE input, and queues their top
// experts in the same way.
//
// Concurrency: one acquire..release span at a time (the tier's step lock): concurrent forwards
// on tiered blocks take turns, so pinned slots of two calls can never wait on each other. The
// I/O threads run beside them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hina_moe/types.h"

namespace hina {

// CRC-32C (Castagnoli) of n bytes, continuing from `crc` (0 to start): SSE4.2 / Armv8 CRC
// instructions where the CPU has them, a table otherwise (same values).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

class TierError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class EvictionPolicy : int { kLru = 0, kLru2 = 1, kFreqDecay = 2, kLfu = 3 };
const char* eviction_name(EvictionPolicy p);  // "lru" | "lru-2" | "freq-decay" | "lfu"
bool eviction_from_name(const char* name, EvictionPolicy* out);

struct TierOptions {
  size_t slot_bytes = 0;    // from ExpertTier::slot_bytes_for() of the largest layer
  int64_t num_slots = 0;    // >= the most experts one token routes to in a layer
  int io_threads = 4;
  bool direct_io = true;    // try O_DIRECT (falls back to buffered reads per file, and says so)
  EvictionPolicy policy = EvictionPolicy::kLru;
  double decay_half_life = 64;  // kFreqDecay: acquires after which a count weighs half
  int prediction_window = 2;    // layers ahead; 0: no prediction
  int prediction_extra = 2;     // experts predicted beyond a router's top-k
  int prediction_max_rows = 8;  // calls with more rows predict nothing (a prefill reads most experts)
  bool skip_unused_reads = true;  // no read ahead of an expert whose last one went unused, until it is used
  bool refine = true;             // layer_done() predicts again from each layer's output
  // test-only fault injection: every n-th region read (1-based over the tier's life; an expert
  // is two, gate/up then down) is cut short / fails with EIO / has one byte flipped after the
  // read; 0: never.
  int64_t fault_short_every = 0, fault_eio_every = 0, fault_flip_every = 0;
};

struct TierLayerStats {
  uint64_t hits = 0, misses = 0;           // demanded experts resident / not at acquire
  uint64_t predicted = 0, predicted_used = 0;  // predictions made for this layer; of them demanded
  uint64_t demanded = 0;                   // distinct experts demanded (summed over acquires)
};

struct TierStats {
  uint64_t acquires = 0, hits = 0, misses = 0, inflight_hits = 0;  // inflight: a predicted read already under way
  uint64_t reads = 0, bytes_read = 0, retries = 0;
  uint64_t prefetch_issued = 0, prefetch_dropped = 0, prefetch_unused = 0;  // unused: evicted before any use
  uint64_t prefetch_skipped = 0;  // predicted, not read: its last read ahead went unused and it has not been used since
  uint64_t predicted = 0, predicted_used = 0, demanded = 0;
  uint64_t refined = 0;  // of predicted: made by layer_done(), the acquire-time prediction had not
  uint64_t evictions = 0;
  double io_wait_s = 0, read_s = 0;  // time acquire() waited for reads; time the I/O threads spent reading
  std::vector<TierLayerStats> layers;
};

class ExpertTier {
 public:
  explicit ExpertTier(const TierOptions& opt);
  ~ExpertTier();
  ExpertTier(const ExpertTier&) = delete;
  ExpertTier& operator=(const ExpertTier&) = delete;

  // Bytes of one slot for experts of these sizes (gate/up and down regions, each with room for
  // the 4096-byte alignment O_DIRECT reads need).
  static size_t slot_bytes_for(uint64_t gu_bytes, uint64_t down_bytes);

  // Registers a layer's experts in a store file: expert e's gate/up panels are gu_bytes at
  // gu_offset + e * gu_bytes, its down panels down_bytes at down_offset + e * down_bytes (file
  // offsets); crc_gu / crc_down: CRC-32C of each, E values each. Returns the layer id (0, 1, ...
  // in registration order, which is the order prediction counts "next" layers in). The file is
  // opened here (and checked to hold those bytes); throws TierError naming it.
  int add_layer(const std::string& path, int64_t E, uint64_t gu_offset, uint64_t gu_bytes, uint64_t down_offset,
                uint64_t down_bytes, const std::vector<uint32_t>& crc_gu, const std::vector<uint32_t>& crc_down);
  int num_layers() const;
  int64_t experts(int layer) const;

  // The router of `layer`, for prediction: logits = W x (+ bias), W [E, H] in `dt`, row-major
  // (copied, as fp32); bias (E floats) caller-owned and kept alive. k: the experts a token
  // routes to. Without one, no prediction reads for that layer.
  void set_router(int layer, const void* w, DType dt, int64_t H, const float* bias, int k);
  // The RMSNorm in front of `layer`'s router (x / sqrt(mean(x^2) + eps) * w; w [H] in dt, copied
  // as fp32; after set_router, of its H), for refine. Without one, layer_done() predicts nothing
  // for that layer.
  void set_norm(int layer, const void* w, DType dt, int64_t H, float eps);
  // Layer `layer` is done: residual [T, H] in dt is its output. Queues predicted reads of the
  // next layers' experts from it (refine: tier.h's header comment); never blocks on a read, and
  // never throws (prediction only ever saves time). Nothing with refine off, no window, or more
  // than prediction_max_rows rows.
  void layer_done(int layer, const void* residual, int64_t T, DType dt, int64_t H);

  // Makes experts[0..n) of `layer` resident and pinned (reading the missing ones, predicted
  // reads first queued for the next layers from x [T, H] in dt when x is given) and writes their
  // gate/up and down pointers into gu[e] / dn[e] (arrays of experts(layer) entries; other
  // entries untouched). Blocks until all are resident. Holds the step lock until release().
  // Throws TierError (a read that failed twice, a bad expert id) after releasing everything.
  void acquire(int layer, const int32_t* experts, int n, const void* x, int64_t T, DType dt, int64_t H,
               const void** gu, const void** dn);
  void release(int layer, const int32_t* experts, int n);
  // Queues reads of these experts as predicted ones.
  void prefetch(int layer, const int32_t* experts, int n);
  // Reads (layers[i], experts[i]) for i in [0, n) into the pool in that order, as demanded reads
  // would (evicting by the policy; each run of one layer acquired and released), so that the
  // last ones are the most recently used: a frequency prior at start-up, its least frequent
  // first. Blocks until they are resident; throws as acquire() does.
  void warm(const int32_t* layers, const int32_t* ids, int n);
  // Blocks until no read is queued or under way (tests, and clean measurements).
  void drain();
  // Most experts one acquire() can pin.
  int64_t num_slots() const { return opt_.num_slots; }
  size_t slot_bytes() const { return opt_.slot_bytes; }
  const void* pool() const { return pool_; }
  size_t pool_bytes() const { return pool_bytes_; }
  // Per layer: how its file is read ("O_DIRECT" or "buffered (why)").
  std::string io_mode(int layer) const;
  TierStats stats() const;
  void reset_stats();
  // Forgets every expert's uses so far (the policies' records; what is resident stays), so the
  // uses of enable's probe forwards do not weigh against a user's first tokens.
  void forget_uses();
  // Experts of `layer` resident now (for tests and reports).
  std::vector<int32_t> resident(int layer) const;
  const TierOptions& options() const { return opt_; }

 private:
  struct Layer;
  struct Slot;
  struct Request {
    int layer;
    int32_t expert;
    bool demand;
    int distance;  // predicted reads: layers ahead (1 = next)
    uint64_t seq;  // the acquire count at which it was queued
  };
  void worker();
  bool take_request(Request* r, std::unique_lock<std::mutex>& lk);
  int64_t pick_victim(bool for_prefetch);
  void evict(int64_t s);
  bool read_expert(int64_t slot, const Layer& L, int32_t e, std::string* err);
  void queue_prediction(int layer, const void* x, int64_t T, DType dt, int64_t H);
  uint64_t predict_layer(int target, int distance, const float* x, int64_t T, int64_t H, int extra);
  void enqueue(int layer, int32_t e, bool demand, int distance);
  std::pair<double, uint64_t> score(const Slot& s) const;  // eviction order: smallest first

  TierOptions opt_;
  uint8_t* pool_ = nullptr;
  size_t pool_bytes_ = 0;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<Slot> slots_;
  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<Request> demand_q_, predict_q_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
  int busy_ = 0, busy_demand_ = 0;  // reads under way; of them demanded
  uint64_t tick_ = 0;  // acquires so far (freq-decay's clock)
  uint64_t uses_ = 0;  // expert uses so far (the recency policies' clock)
  uint64_t active_seq_ = 0;  // tick_ of the acquire..release span under way, 0 when none
  std::atomic<int64_t> read_count_{0};
  std::mutex step_mu_;
  TierStats st_;
};

}  // namespace hina
