// The fused MoE experts op. Torch-free C++ API. Weight formats: the model's own dtype (fp32 /
// bf16 / fp16, lossless), or quantised (int8 per output channel, int4 group-wise); activations
// (x, out) are always in the model's dtype.
//
// Semantics (the contract with the Python side). Shape letters: T tokens, E experts, K top-k,
// H hidden, I expert intermediate. For each token t and slot k with e = topk_idx[t,k]
// (e < 0: skip the slot) and w = topk_w[t,k]:
//   xin = x_t, or with weight_on_input: xin = round_to_weight_dtype(w * x_t) and w := 1
//   g = W_gate[e] @ xin + b_gate[e]            (gated experts only; W_gate [E,I,H])
//   u = W_up[e]   @ xin + b_up[e]              (W_up [E,I,H])
//   gated:   h = min(act(min(g, gate_limit)), post_act_limit) * (clamp(u, ±up_limit) + up_offset)
//   no gate: h = act(u)
//   y = W_down[e] @ h + b_down[e]              (W_down [E,H,I])
//   out_t = sum over slots of w * y            (fp32 accumulation; out written in x's dtype)
// Quantised weights (WFormat, fixed at pack time; W_* above then means the dequantised weights):
//   int8: per output row n, s_n = max_k |W[n,k]| / 127, q = clamp(round(W / s_n), -127, 127);
//         W ~ s_n * q. Kernels compute s_n * sum_k q x_k (fp32 scale, exact factoring).
//   int4: per output row n and group g of `group` consecutive k (32, 64 or 128), m_g = the
//         element of largest |W| (first one); the row's factor F = max_g |m_g| / 8; the group's
//         scale d = F * t(c) (one fp32 product), t(c) = (-1)^s 2^-(8a + b)/8 for a code c with
//         bits b (0-2), s (3), a (4-7) (kernel_api.h: q4_step, q4_scale); s = 1 where m_g > 0,
//         and 8a + b among e0, e0 + 1, ..., e0 + 6, e0 - 1 (clamped to 0..127), e0 the index
//         nearest |m_g| / 8 / F in 2^(1/8) steps (q4_nearest_step), the one with the smallest
//         float sum in k order of (W - d q)^2 (first on ties), where
//         q = clamp(round(W * (1/d)), -8, 7); W ~ d * q
//         (the largest element maps to about -8, so all 16 levels are used). Kernels compute
//         sum_groups d * sum_{k in group} q x_k.
// Two kernel families compute quantised experts (MoeParams::qdot picks; both are tested):
//   expand (qdot = expand; current numerics): x and h stay fp32 on the FMA tiers (weights are
//   expanded in registers; no activation quantisation). The AMX prefill path expands each panel
//   to bf16 (bf16(s * q)) and runs the bf16 tiles, rounding x and h to bf16 as the lossless AMX
//   path does.
//   integer dot (qdot = int; W8A8 / W4A8): the fp32 input rows (xin of every token, or of every
//   routed row with weight_on_input; h of every routed row, after the activation) are quantised
//   per row in blocks of 32 consecutive k (the row zero-padded to a multiple of 32; padding
//   quantises to 0):
//     a = max_k |v_k| over the block (NaN if one is NaN), s_b = a / 127 (fp32 division),
//     qx_k = 0 if s_b is not > 0, else round-to-nearest-even(clamp(v_k / s_b, -127, 127))
//     (a NaN quotient gives 0; the NaN or inf in s_b then reaches the output),
//   and every dot product is computed from exact int32 block sums I_b = sum_{k in b} q_k qx_k:
//     int8: y = s_n * A,  A = fma(float(I_b), s_b, A) over blocks b in ascending order, A = 0
//     int4: y = F * Y, Y = sum over groups g in order of fma(B_g, t_g, Y), Y = 0,
//           B_g = fma(float(I_b), s_b, B_g) over the blocks b of group g in order, B_g = 0;
//           t_g the group's step (d_g = F * t_g)
//   (fma: one rounding). Bias, activation, routing weight (acc = fma(w, y + b_down, acc)) as
//   above. Every kernel of this family computes exactly these values (the generic oracle
//   emulates it), so SIMD results differ from it only where their activation function
//   differs from the scalar one by an ulp and that moves an h element across a rounding step.
//   Kernels that run: avx512vnni (vpdpbusd zmm; tiers avx512 and amx on CPUs with
//   AVX512-VNNI), avxvnni (vpdpbusd ymm; tier avx2, and avx512 without AVX512-VNNI, on CPUs
//   with AVX-VNNI), avx2dot (vpmaddubsw + vpmaddwd; the same tiers without AVX-VNNI),
//   genericdot (the scalar emulation; tier generic, only when asked for).
// h stays in fp32 on every path except the bf16 prefill paths that multiply in bf16: the AMX
// prefill path, and the AVX512-BF16 dot-product prefill of bf16 weights (avx512 tier, CPUs with
// AVX512-BF16), where it is rounded to bf16 to feed the tiles / dot products (what PyTorch
// itself does when the model runs in bf16); x rows are bf16 there (a bf16 model's own).

#pragma once

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "hina_moe/types.h"

namespace hina {

class ExpertTier;  // hina_moe/tier.h

// Unpacked weights, caller-owned, C-contiguous, all in `dtype`. Biases are optional (nullptr).
struct ExpertWeights {
  DType dtype = DType::kBF16;
  int64_t E = 0, H = 0, I = 0;
  const void* gate = nullptr;  // [E, I, H], nullptr for experts without a gate
  const void* up = nullptr;    // [E, I, H]
  const void* down = nullptr;  // [E, H, I]
  const void* gate_bias = nullptr;  // [E, I]
  const void* up_bias = nullptr;    // [E, I]
  const void* down_bias = nullptr;  // [E, H]
};

// Fewer experts a token than its router chose (HinaConfig.top_k; docs/adaptive-top-k.md).
// forward() applies it to topk_idx / topk_w before anything else, so every path that runs the
// block (decode, prefill, a memory tier's pieces, the one-call decode step) runs the same
// selection. A token's "valid" slots are those whose index is >= 0; its largest weights are
// ranked in descending order, equal weights by slot. A token with a NaN weight is left whole.
struct RoutingTrim {
  enum class Mode : int32_t { kFull = 0, kFixed = 1, kAdaptive = 2 };
  Mode mode = Mode::kFull;
  int64_t keep = 0;        // kFixed: the token keeps its `keep` largest weights
  // kAdaptive: a slot stays while its weight >= threshold x an even share of the token's routing
  // weight (renorm: the valid weights' sum / K; otherwise 1 / K, a router's probabilities over
  // every expert summing to 1), and the min_k largest stay whatever their weight
  float threshold = 0.0f;
  int64_t min_k = 1;
  // The kept weights scaled by (sum of the valid weights) / (sum of the kept ones), both summed
  // in float32 in slot order: a router that normalises its k weights gives the same sum for
  // fewer. Off: the weights as the router gave them.
  bool renorm = false;
};

// `trim` applied to [T, K] routing: idx_out [T, K] (int64; a dropped slot -1), w_out [T, K]
// float32. Returns how many slots stay (index >= 0). Throws std::invalid_argument on a bad trim.
// E: the block's experts (an index >= E is an error, as in forward()).
int64_t trim_routing(const RoutingTrim& trim, const void* topk_idx, int idx_bits, const void* topk_w, DType w_dt,
                     int64_t T, int64_t K, int64_t E, int64_t* idx_out, float* w_out);

struct MoeParams {
  Act act = Act::kSilu;
  float alpha = 1.702f;  // only used by sigmoid_alpha
  float gate_limit = INFINITY;
  float up_limit = INFINITY;
  float post_act_limit = INFINITY;
  float up_offset = 0.0f;
  bool weight_on_input = false;
  int num_threads = 0;  // 0: default_num_threads()
  MoePath path = MoePath::kAuto;
  int prefill_min_tokens = kDefaultPrefillMinTokens;
  // Threads own fixed, equal ranges of panels instead of claiming chunks from a shared counter
  // (the default, which tolerates a thread that runs late). For measurements and tests.
  bool static_split = false;
  QDot qdot = QDot::kAuto;  // quantised weights only
  // dtype of forward()'s topk_w: routers often hand over their weights in the model's dtype,
  // and converting them in the caller costs an op call per layer (~35 us with cold caches).
  DType topk_w_dtype = DType::kF32;
};

// Versioned tag carried by packed weights, so a kernel never reads a layout it was not written
// for. It is a plain struct (no pointers) so it can be stored beside the data on disk.
// Layout v5 (ISA-independent; one layout serves generic/avx2/avx512/amx). Per expert, the output
// dimension is cut into panels of 16 rows (zero-padded); the reduction dimension is zero-padded
// to k_align (32, or the int4 group size when larger). G = 2 interleaves gate and up so one pass
// streams both; G = 1 for down (and for up without a gate). One panel:
//   lossless bf16: [Kp/2][G][16][2] (VNNI pairs, the AMX B-tile layout); fp32/fp16: [Kp][G][16]
//   int8: [G][16] fp32 row scales (64*G bytes), then [Kp/4][G][16][4] int8 (q, signed): 4
//         consecutive k of one output row in one 32-bit lane, the operand shape of integer dot
//         products (vpdpbusd, vpmaddubsw + vpmaddwd, sdot)
//   int4: [G][16] fp32 row factors F (64*G bytes), then per group of `group` k, [G][16] one-byte
//         scale codes (16 G bytes) and [group/8][G][16][4] code bytes; byte j of a lane holds
//         k = j (low nibble) and k = j + 4 (high nibble) of its 8 k, as q + 8 in 0..15 (so v &
//         0x0f and (v >> 4) & 0x0f are two u8 quads). A scale code c (bits 0-2 b, bit 3 sign,
//         bits 4-7 a) scales its group by F * (-1)^sign 2^-(8a + b)/8 (one fp32 product of F and
//         the exact step, kernel_api.h's q4_scale); F is the row's largest |extreme| / 8, so a
//         group's scale ranges over 2^-15.9 .. 1 of F in 2^(1/8) steps. Groups are stored in blocks
//         of 64 scale-code bytes followed by the codes of the groups they scale: G = 2: two groups
//         a block; G = 1: four (scale codes of groups 4b .. 4b + 3, then their codes in order);
//         a count that is not a multiple ends with a block of the rest (its unused scale bytes
//         zero). So int4 costs 4 + 8 / group bits a weight, plus 32 bits a row.
//   lossless12 (bf16 only): the lossless bf16 panel above (P = Kp*G*32 bytes: nvec = P/64
//         vectors of 32 words, in order), compressed in blocks of two consecutive vectors
//         (nb = P/128 blocks of 64 weights). A bf16 word's high byte (sign and the exponent's
//         top 7 bits) takes few values within a panel; its low byte is noise. Fixed size, in order:
//     1. 64 bytes: the table, the panel's 16 most frequent high bytes (ties: the lower byte
//        value first), replicated 4x (one copy per 128-bit lane, for vpshufb);
//     2. flags: bit b % 8 of byte b / 8 is 1 when block b is spilled (one of its high bytes is
//        not in the table); padded to a 64-byte multiple;
//     3. nb slots of 96 bytes. Byte order of a block ("L bytes", i = 16 j + q, j < 4, q < 16):
//        L byte i is word 8j+q of the block's first vector for q < 8, word 8j+q-8 of its second
//        for q >= 8. Slot bytes [0, 64): the low bytes of the 64 words in L order. Normal block:
//        bytes [64, 96) hold 4-bit table indices, byte 64+i: L byte i (low nibble), L byte
//        i+32 (high nibble). Decoding is codes = [c & 0x0f | (c >> 4) & 0x0f] (64 bytes),
//        hi = vpshufb(table, codes), vectors = unpacklo_epi8(lo, hi), unpackhi_epi8(lo, hi).
//        Spilled block: bytes [64, 96) are the high bytes of L bytes 0..31 themselves;
//     4. the spill area: cap = nb/64 + 8 slots of 32 bytes (padded to 64 bytes); the high bytes
//        of L bytes 32..63 of the spilled blocks, in block order (the s-th spilled block in
//        slot s). A panel with more than cap spilled blocks cannot be stored: pack throws, and
//        such weights are stored as lossless.
//   Padding (rows >= N, k >= K) is zero words, compressed like any other.
// (v4, before: int4 scales were bfloat16, 32 G bytes a group, blocks of 2 / G groups, no row
// factors: 4.25 bits a weight at group 64, 4.5 at 32; v3: a G = 1 int4 block held one group,
// its 32 scale bytes padded to 64; v2: int8 [Kp][G][16], int4 bytes holding k even / k odd; v1:
// no quantised formats.)
// The block: all experts' gate/up panels, all experts' down panels, then fp32 biases ([E][In]
// gate, [E][In] up, [E][Hn] down, each present only when the model has it); every part 64-byte
// aligned; nbytes is the whole block.
struct PackedHeader {
  uint32_t magic = 0x454D4E48;  // "HNME"
  uint16_t version = 5;
  uint8_t dtype = 0;            // DType of the model (x, out, and lossless weights)
  uint8_t isa = 0;              // Isa the kernels were chosen for
  uint8_t panel_n = 16;         // output rows per panel
  uint8_t kpack = 1;            // reduction elements per pair (2 for lossless bf16 and lossless12)
  uint8_t wfmt = 0;             // WFormat
  uint8_t has_gate = 0;
  uint8_t has_gate_bias = 0, has_up_bias = 0, has_down_bias = 0;
  uint8_t up_only = 0;          // 1: a dense linear layer (E = 1, no down): linear() runs it; with
                                // has_gate a paired one (plan_packed)
  uint16_t group = 0;           // int4 group size (0 otherwise)
  uint16_t k_align = 32;        // reduction dimension padding
  uint32_t reserved1 = 0;
  int64_t E = 0, H = 0, I = 0;
  int64_t Hk = 0;  // H padded to k_align (reduction length of gate/up)
  int64_t In = 0;  // I padded to panel_n (output rows of gate/up)
  int64_t Ik = 0;  // I padded to k_align (reduction length of down)
  int64_t Hn = 0;  // H padded to panel_n (output rows of down)
  uint64_t gu_expert_bytes = 0, down_expert_bytes = 0;  // 64-byte multiples
  uint64_t nbytes = 0;                                   // the whole block
};
static_assert(sizeof(PackedHeader) == 104, "PackedHeader is stored on disk: keep it fixed-size");

// The header pack() would produce for these shapes and format (all derived fields filled).
// Throws std::invalid_argument on bad shapes, dtype, format or group size (lossless12 needs
// bf16). up_only: a dense
// linear layer y = x W^T (+ b) packed as the up projection of one expert (W [I, H]: I outputs,
// H inputs; E = 1, no gate, no down, no gate/down bias); its block holds no down panels. With
// has_gate too, a paired linear layer of 2 I outputs: rows [0, I) of W as the gate matrix and
// rows [I, 2 I) as the up matrix of one gated expert, interleaved in its panels (a bias split
// the same way into gate and up biases); the gate/up kernels then store both halves, with no
// activation, one pass of the weight stream feeding two output rows per broadcast input
// (PackedExperts::pack_linear's paired).
PackedHeader plan_packed(DType dt, int64_t E, int64_t H, int64_t I, bool has_gate,
                         bool gate_bias, bool up_bias, bool down_bias, Isa isa, QuantSpec q,
                         bool up_only = false);

class PackedExperts {
 public:
  // Copies and packs (quantising when q asks for it). Throws std::invalid_argument on bad
  // shapes or an ISA this machine lacks.
  static std::unique_ptr<PackedExperts> pack(const ExpertWeights& w, Isa isa, int num_threads = 0,
                                             QuantSpec q = {});
  // A dense linear layer: weight [out_features, in_features], bias [out_features] or nullptr,
  // in dt; packed as an up-only block (plan_packed's up_only), run with linear(). paired: as a
  // paired up-only block (plan_packed; out_features must be even), the same outputs bit for
  // bit; the decode kernels stream it faster than the one-matrix form (benchmarks/RESULTS.md).
  static std::unique_ptr<PackedExperts> pack_linear(DType dt, int64_t out_features, int64_t in_features,
                                                    const void* weight, const void* bias, Isa isa,
                                                    int num_threads = 0, QuantSpec q = {}, bool paired = false);
  // An empty block for `h` (from plan_packed), to be filled with pack_experts(). With `mem`
  // (h.nbytes bytes, 64-byte aligned, caller-owned and outliving the object) the block lives
  // there, e.g. in a memory-mapped file; otherwise it is allocated.
  static std::unique_ptr<PackedExperts> create(const PackedHeader& h, void* mem = nullptr);
  // A read-only view of a block written earlier (e.g. mmapped from the store). Validates the
  // header (magic, version, derived sizes, nbytes == mem_bytes, tier supported here); throws
  // std::invalid_argument naming what is wrong. The caller keeps `mem` alive and unchanged.
  static std::unique_ptr<PackedExperts> view(const PackedHeader& h, const void* mem,
                                             size_t mem_bytes);
  // A block of its own holding a copy of one written earlier (validated as view() validates it),
  // in memory allocated as create() allocates it (blocks of 4 MiB or more 2 MiB-aligned with
  // transparent huge pages requested): the kernels stream it at one speed, where a file mapping's
  // depends on the page cache's state (docs/design.md, "Where packed blocks live"). `mem` is read
  // once, here.
  static std::unique_ptr<PackedExperts> copy_of(const PackedHeader& h, const void* mem, size_t mem_bytes);
  // A block whose experts live in a memory tier (hina_moe/tier.h) as its layer `layer` (E and the
  // experts' sizes must match what the layer was registered with): only the header and the
  // biases are held here (`biases`: the block's bias region, bias_bytes = nbytes - E x expert
  // bytes, copied). forward() acquires the experts its rows route to from the tier, and when
  // they cannot all be pinned at once (a prefill of more experts than the pool's slots) runs the
  // rows in pieces that fit, on the path the whole call would take, so the outputs are those of
  // the all-in-memory block bit for bit. data(), unpack(), pack_experts() throw on such a block.
  static std::unique_ptr<PackedExperts> tiered(const PackedHeader& h, std::shared_ptr<ExpertTier> tier, int layer,
                                               const void* biases, size_t bias_bytes);
  // Packs experts [e0, e0 + w.E) from w (w.E experts, shapes as in the header). Biases in w
  // must be given exactly when the header has them. lossless12: throws std::invalid_argument
  // naming the expert and panel when a panel has more spilled blocks than its spill area holds
  // (pack and pack_linear too); those weights are to be stored as lossless.
  void pack_experts(int64_t e0, const ExpertWeights& w, int num_threads = 0);
  ~PackedExperts();

  // Runs the op; returns the name of the kernel that ran ("moe_decode_bf16_avx512", ...).
  // x, out: [T, H] in dtype(); topk_idx: [T, K] int32 (idx_bits 32) or int64 (idx_bits 64);
  // topk_w: [T, K] in p.topk_w_dtype (fp32 by default). out is overwritten. Throws std::invalid_argument on a bad argument
  // (e.g. an expert index >= E) before touching out.
  const char* forward(const void* x, int64_t T, const void* topk_idx, int idx_bits,
                      const void* topk_w, int64_t K, void* out, const MoeParams& p) const;
  // The selection forward() trims every call's routing with (RoutingTrim; default: none). Set it
  // before the block runs: a call running meanwhile may see either.
  void set_trim(const RoutingTrim& t);
  const RoutingTrim& trim() const { return trim_; }
  // What forward() has run since the block was made or reset_routing_counts(): rows (tokens) and
  // the expert slots they used after the trim (their mean: experts a token).
  int64_t routed_tokens() const { return routed_tokens_.load(std::memory_order_relaxed); }
  int64_t routed_slots() const { return routed_slots_.load(std::memory_order_relaxed); }
  void reset_routing_counts() {
    routed_tokens_.store(0, std::memory_order_relaxed);
    routed_slots_.store(0, std::memory_order_relaxed);
  }
  // An up-only block's layer: out [T, I] = x [T, H] W^T (+ b), in dtype(), with the same
  // kernels as forward()'s gate/up pass (identity activation; p's act and limits are ignored;
  // fp32 accumulation, one rounding to dtype()). Throws std::invalid_argument on a block with
  // a down projection (and forward() on an up-only block).
  const char* linear(const void* x, int64_t T, void* out, const MoeParams& p) const;

  // Inverse of pack(): exact for the lossless formats; for int8/int4 the dequantised weights
  // (s * q, rounded to dtype()). Destinations as in ExpertWeights (nullptr: skip that array).
  void unpack(void* gate, void* up, void* down, void* gate_bias, void* up_bias,
              void* down_bias) const;
  // An up-only (pack_linear) int8 or int4 block's weight [I, H] as RowQuant (fmt and group this
  // block's): the codes and scales the panels hold, exactly. codes and scales sized as RowQuant
  // says. Throws std::invalid_argument for another block, or int4 with H not a multiple of the
  // group.
  void unpack_row_quant(void* codes, void* scales) const;

  const PackedHeader& header() const { return hdr_; }
  ExpertTier* tier() const { return tier_.get(); }
  int tier_layer() const { return tier_layer_; }
  DType dtype() const { return static_cast<DType>(hdr_.dtype); }
  WFormat wformat() const { return static_cast<WFormat>(hdr_.wfmt); }
  const void* data() const { return mem_; }
  Isa isa() const { return static_cast<Isa>(hdr_.isa); }
  int64_t E() const { return hdr_.E; }
  int64_t H() const { return hdr_.H; }
  int64_t I() const { return hdr_.I; }
  bool has_gate() const { return hdr_.has_gate != 0; }
  bool up_only() const { return hdr_.up_only != 0; }
  // A paired up-only block (pack_linear's paired): out_features() = 2 I.
  bool paired() const { return hdr_.up_only != 0 && hdr_.has_gate != 0; }
  int64_t out_features() const { return paired() ? 2 * hdr_.I : hdr_.I; }
  bool has_gate_bias() const { return bias_g_ != nullptr; }
  bool has_up_bias() const { return bias_u_ != nullptr; }
  bool has_down_bias() const { return bias_d_ != nullptr; }
  size_t nbytes() const { return static_cast<size_t>(hdr_.nbytes); }

  // Internal views used by the driver and the tests.
  const void* gate_up_expert(int64_t e) const;
  const void* down_expert(int64_t e) const;
  const float* bias_g() const { return bias_g_; }
  const float* bias_u() const { return bias_u_; }
  const float* bias_d() const { return bias_d_; }

 private:
  PackedExperts() = default;
  void bind(void* mem);  // sets the section pointers from hdr_
  void bind_biases(uint8_t* b);
  const char* forward_tiered(const void* x, int64_t T, const void* topk_idx, int idx_bits, const void* topk_w,
                             int64_t K, void* out, const MoeParams& p) const;
  // forward() after the trim: the path's kernels, or the tier's
  const char* forward_selected(const void* x, int64_t T, const void* topk_idx, int idx_bits, const void* topk_w,
                               int64_t K, void* out, const MoeParams& p) const;
  PackedHeader hdr_;
  std::shared_ptr<ExpertTier> tier_;  // a tiered block: where its experts live
  int tier_layer_ = -1;
  RoutingTrim trim_;
  mutable std::atomic<int64_t> routed_tokens_{0}, routed_slots_{0};
  mutable std::vector<const void*> tier_gu_, tier_dn_;  // the pinned experts' panels, during a forward
  void* mem_ = nullptr;  // one 64-byte aligned block: gate_up panels, down panels, biases
  bool owns_ = false;
  uint8_t* gu_ = nullptr;
  uint8_t* down_ = nullptr;
  float* bias_g_ = nullptr;  // [E, In] fp32 (exact copies of the bf16/fp16/fp32 values)
  float* bias_u_ = nullptr;  // [E, In]
  float* bias_d_ = nullptr;  // [E, Hn]
};

// Name of the kernel `forward` would run for this tier, format, path and qdot (kAuto is not a
// path): `moe_<path>_<format>_<kernel>`, format = f32 | bf16 | f16 | int8 | int4 | l12; kernel = the
// tier of the kernel that runs (generic | avx2 | avx512 | amx) for the lossless and expansion
// kernels, avx512bf16 for the bf16 dot-product prefill, avx512vnni | avxvnni | avx2dot |
// genericdot for the integer-dot kernels.
const char* moe_kernel_name(Isa isa, DType dt, MoePath path, WFormat wf = WFormat::kLossless,
                            QDot qdot = QDot::kAuto);
// Bytes ahead of their weight stream the FMA and integer-dot kernels prefetch into L2, fixed
// when the library loads: HINA_MOE_PREFETCH_BYTES if it holds a multiple of 64 in [0, 65536],
// else 1024 on AMD CPUs and 4096 on others (measured per vendor: csrc/moe/prefetch.h).
int prefetch_distance();
// The distance an int8 / int4 kernel job of `rows` rows prefetches at: HINA_MOE_PREFETCH_BYTES if
// set, else prefetch_distance() for one row and on CPUs other than AMD; on AMD 0 (no software
// prefetch) for 2-3 rows and 16384 for 4 or more (csrc/moe/prefetch.h).
int rows_prefetch_distance(int64_t rows);
// Whether the lossless12 decode kernel prefetches its stream at that distance too: not on AMD
// CPUs (measured slower there; csrc/moe/prefetch.h) unless HINA_MOE_PREFETCH_BYTES is set.
bool l12_prefetch();

}  // namespace hina
