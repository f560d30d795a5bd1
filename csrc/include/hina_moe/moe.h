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

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "hina_moe/cpu_features.h"

namespace hina {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
const char* dtype_name(DType dt);   // "float32" | "bfloat16" | "float16"
const char* dtype_short(DType dt);  // "f32" | "bf16" | "f16" (the <format> in kernel names)
size_t dtype_size(DType dt);

// How expert weights are stored. kLossless: the model's dtype, lossless. kLossless12: bf16
// weights, lossless, in about 75 % of their bytes (layout below); kernels give the bits of
// kLossless.
enum class WFormat : int { kLossless = 0, kInt8 = 1, kInt4 = 2, kLossless12 = 3 };
const char* wformat_name(WFormat f);  // "lossless" | "int8" | "int4" | "lossless12"
bool wformat_from_name(const char* name, WFormat* out);
struct QuantSpec {
  WFormat fmt = WFormat::kLossless;
  int group = 32;  // int4 only: 32, 64 or 128
};

// A quantised matrix W [N, K] in plain row order, the codes and scales of the packed formats
// above without the panels (PackedExperts::unpack_row_quant writes one from an up-only block;
// mla_decode reads kv_b_proj's weight in it):
//   kInt8: codes int8 [N, K], scales float32 [N]: W[n, k] = scales[n] * codes[n, k].
//   kInt4: codes uint8 [N, K / 2], scales float32 [N, K / group]: group g of row n is the
//          group / 2 bytes at codes + n * K / 2 + g * group / 2, byte j holding q(g*group + j) + 8
//          in its low nibble and q(g*group + group/2 + j) + 8 in its high one (the two halves of
//          the group, so that one vector of bytes gives two vectors of consecutive k);
//          W[n, k] = scale(n, k / group) * q(k). K is a multiple of group (32, 64 or 128).
struct RowQuant {
  WFormat fmt = WFormat::kLossless;  // kInt8 or kInt4 when set
  const void* codes = nullptr;
  const void* scales = nullptr;
  int64_t group = 0;  // kInt4's group size
};

enum class Act : int { kSilu, kGelu, kGeluTanh, kRelu, kRelu2, kSigmoidAlpha, kIdentity };
const char* act_name(Act act);  // "silu" | "gelu" | "gelu_tanh" | "relu" | "relu2" | "sigmoid_alpha" | "identity"
bool act_from_name(const char* name, Act* out);

enum class MoePath : int { kAuto = 0, kDecode = 1, kPrefill = 2 };
const char* path_name(MoePath path);  // "auto" | "decode" | "prefill"

// Auto path choice: the prefill path (tokens grouped per expert; AMX tiles or AVX512-BF16 dot
// products for bf16, 4- or 8-row weight reuse on the FMA tiers) from this many tokens on, the decode path (one token at a time) below.
// Measured on OLMoE-shaped layers (benchmarks/bench_native_paths.py, benchmarks/RESULTS.md): the
// prefill path is as fast or faster from T = 2 on, on both the AMX and the AVX-512 tier, because
// the decode path streams each expert's weights once per token.
constexpr int kDefaultPrefillMinTokens = 2;
// Rows (tokens) from which a call counts as prefill-sized for PoolBackend::kMixed (its regions on
// OpenMP's team): a prefill, or a decode batch of as many sequences, where a region is long
// beside one OpenMP join.
constexpr int64_t kMixedTeamRows = 32;

// Which kernel family computes quantised weights (see the numerics above). kAuto: the integer
// dot where the tier has a SIMD kernel for it, except the AMX prefill path of bf16 models,
// which keeps its bf16 tiles; kInt: always the integer dot (the generic tier runs its scalar
// emulation); kExpand: always the expansion kernels. Lossless weights ignore it.
enum class QDot : int { kAuto = 0, kInt = 1, kExpand = 2 };
const char* qdot_name(QDot q);  // "auto" | "int" | "expand"
bool qdot_from_name(const char* name, QDot* out);

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
  PackedHeader hdr_;
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
// "auto" -> the best tier here, unless the env var HINA_MOE_ISA names a (lower) tier; other
// names must be supported by this CPU. Throws std::invalid_argument naming the tier and what
// the CPU supports.
Isa resolve_isa(const char* name);
// Hardware threads this process may run on (sched_getaffinity), >= 1.
int default_num_threads();
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

// RMSNorm of `rows` C-contiguous rows of n values (x, weight [n] and out in dtype dt), in
// transformers' Llama-family order of roundings: out = w * round(x / sqrt(mean(x^2) + eps)),
// fp32 math (see csrc/moe/norm.cpp). Single-threaded; out may not overlap x.
void rms_norm(DType dt, const void* x, int64_t rows, int64_t n, const void* weight, float eps, void* out);

// sum = a + b over `count` values of dtype dt, each rounded once to the dtype, as PyTorch adds
// two CPU tensors of that dtype (bit-identical). sum may be a or b; otherwise no overlap.
void add(DType dt, const void* a, const void* b, int64_t count, void* sum);

// A decoder layer's residual add and the RMSNorm that follows it, in one call: sum = a + b as
// add() computes it, then out = rms_norm(sum) as rms_norm() computes it (the same bits as the
// two calls). Rows of n values; out may not overlap a, b or sum.
void add_rms_norm(DType dt, const void* a, const void* b, int64_t rows, int64_t n, const void* weight, float eps,
                  void* sum, void* out);

// Rotary embedding, transformers' rotate_half form, for one position per batch row:
// out = round(round(x * cos) + round(rotate_half(x) * sin)), each product and the sum rounded to
// the dtype as PyTorch's elementwise ops round them (bit-identical). x and out [B, heads, D],
// cos and sin [B, D], all C-contiguous in dtype dt; D even; out may not overlap x. half_table:
// cos and sin are [B, D/2], one angle for both halves (GPT-OSS's tables; the same bits as the
// table written twice). rot (even, <= D; 0: D): partial rotary (GLM-4.5's partial_rotary_factor),
// only the first rot values of each head rotated as a head of rot values, the rest copied as they
// are; the tables then hold rot values a row (rot / 2 with half_table).
void rope_rotate_half(DType dt, const void* x, int64_t B, int64_t heads, int64_t D, const void* cos,
                      const void* sin, void* out, bool half_table = false, int64_t rot = 0);
// The same bits, for many rows (a prompt's B*T positions): bfloat16 on the AVX-512 build at
// tiers avx512/amx (16 values a vector), rows split over num_threads (0: every hardware thread)
// when there are enough; other dtypes and tiers, and partial rotary, the baseline loops.
void rope_rotate_half(DType dt, const void* x, int64_t B, int64_t heads, int64_t D, const void* cos,
                      const void* sin, void* out, Isa isa, int num_threads, bool half_table = false,
                      int64_t rot = 0);
// Rotary embedding, interleaved pairs in float32 (ERNIE 4.5's form): for pair i of a head,
// c = cos[i], s = sin[i] (the first D/2 entries of a float32 table row of table_bstride values),
//   out[2i]     = round_dt(f32(f32(x[2i] * c) + f32(-x[2i+1] * s)))
//   out[2i + 1] = round_dt(f32(f32(x[2i+1] * c) + f32(x[2i] * s)))
// each product and the sum rounded to float32 and the result once to the dtype, as PyTorch's
// float32 elementwise ops after x.float() and the final .to(dtype) round them (bit-identical).
// x and out [B, heads, D] C-contiguous in dtype dt; D even; out may not overlap x. Rows split over
// num_threads (0: every hardware thread) when there are enough.
void rope_interleaved_f32(DType dt, const void* x, int64_t B, int64_t heads, int64_t D, const float* cos,
                          const float* sin, int64_t table_bstride, void* out, int num_threads);

// Rotary embedding of latent attention's rope dims (hi_na_moe.mla) for one position: `heads`
// rows of D values (D even) at x + h * x_hstride elements into out + h * out_hstride (out may
// not overlap x), each product and sum rounded as the module's PyTorch ops round them:
//   kComplex (DeepSeek-V2: x.float() viewed as complex pairs times a complex64 table, then
//     .type_as(x)): tab holds D/2 float32 (re, im) pairs (sin unused); for pair i, (c, s) = tab[i],
//     out[2i] = dt(f32(x0 c) - f32(x1 s)), out[2i+1] = dt(f32(x0 s) + f32(x1 c)) (no FMA, as
//     PyTorch's vectorised complex product; its scalar loop, which runs at under 8 pairs, contracts one);
//   kInterleaved (DeepSeek-V3's rope_interleave: the pairs de-interleaved, then rotate_half): tab
//     and sin rows of D values in dtype, c, s their first D/2; out[i] = r(r(x0 c_i) - r(x1 s_i)),
//     out[D/2 + i] = r(r(x1 c_i) + r(x0 s_i)), r rounding to the dtype;
//   kRotateHalf: rope_rotate_half's bits (tab: cos).
enum class LatentRope : int { kNone = -1, kComplex = 0, kInterleaved = 1, kRotateHalf = 2 };
void rope_latent(DType dt, LatentRope form, const void* x, int64_t heads, int64_t x_hstride, int64_t D,
                 const void* tab, const void* sin, void* out, int64_t out_hstride);

// Attention of one query per (batch, head) over S cached keys/values (see csrc/moe/attention_impl.h).
struct AttnDecodeArgs {
  DType dtype;
  const void* q;  // [B, Hq, D] contiguous
  const void* k;  // element (b, h, s, d) at k[b*k_strides[0] + h*k_strides[1] + s*k_strides[2] + d]
  const void* v;  // likewise with v_strides
  void* out;      // [B, Hq, D] contiguous
  int64_t B, Hq, Hkv, S, D;
  int64_t k_strides[3], v_strides[3];
  float scale;  // applied to q . k before the softmax
  // optional: key j of batch row b is attended to iff mask[b * mask_bstride + j] != 0 (a bool
  // mask [B or 1, 1, 1, S], as transformers passes for a StaticCache or padded batches); masked
  // keys and values are not read. A row with every key masked gives zeros, as PyTorch's SDPA does.
  const uint8_t* mask = nullptr;
  int64_t mask_bstride = 0;
  // optional: attention sinks, one float32 logit per query head [Hq] (GPT-OSS): the softmax runs
  // over the scores and sinks[h] together and the sink's share is dropped, so the weights of the
  // keys sum to less than 1: p_j = e^(s_j - m) / (sum_i e^(s_i - m) + e^(sinks[h] - m)).
  const float* sinks = nullptr;
};
// Query head h reads kv head h / (Hq / Hkv) (grouped-query attention; Hq a multiple of Hkv).
// float32 math, one rounding at the end; heads split across num_threads (0: every hardware
// thread) when the work is large enough. isa picks the build (kAvx512/kAmx: AVX-512; kAvx2:
// AVX2; others: the baseline build).
void attention_decode(const AttnDecodeArgs& a, int num_threads, Isa isa);

// Decode attention of multi-head latent attention (MLA: DeepSeek-V2/V3 and the families built on
// them; see csrc/moe/mla_impl.h) over its compressed cache, the key and value up-projection
// absorbed into the query and the output. Per (batch row b, head h), with W = kv_b_proj's
// weight viewed [H, Dn + Dv, L] (rows d < Dn make head h's keys from the latent, the next Dv its
// values):
//   ql = sum_d q_nope[b, h, d] W[h, d, :]                       (float32, L values)
//   score_s = (ql . latent[b, s] + q_rope[b, h] . k_rope[b, s]) * scale,  p = softmax(score)
//   out[b, h, e] = W[h, Dn + e, :] . (sum_s p_s latent[b, s])     (e < Dv)
// which is the softmax attention of q = [q_nope, q_rope] over keys [W_k latent_s, k_rope_s] and
// values W_v latent_s, without making those keys and values. float32 math, one rounding to
// dtype at the end.
struct MlaDecodeArgs {
  DType dtype;
  const void* q_nope;  // element (b, h, d) at q_nope[b*qn_strides[0] + h*qn_strides[1] + d], d < Dn
  const void* q_rope;  // (b, h, d) at q_rope[b*qr_strides[0] + h*qr_strides[1] + d], d < Dr (rotated)
  const void* w;       // [H, Dn + Dv, L] contiguous; or null, and wq holds it quantised
  const void* latent;  // (b, s, l) at latent[b*c_strides[0] + s*c_strides[1] + l], l < L
  const void* k_rope;  // (b, s, d) at k_rope[b*kr_strides[0] + s*kr_strides[1] + d], d < Dr (rotated)
  void* out;           // [B, H, Dv] contiguous
  int64_t B, H, S, Dn, Dr, L, Dv;
  int64_t qn_strides[2], qr_strides[2], c_strides[2], kr_strides[2];
  float scale;
  // optional: position s of row b is attended iff mask[b * mask_bstride + s] != 0 (as
  // AttnDecodeArgs::mask); a row attending nothing gives zeros
  const uint8_t* mask = nullptr;
  int64_t mask_bstride = 0;
  // with w null: the weight [H (Dn + Dv), L] quantised (RowQuant's codes and scales: int8 with L
  // a multiple of 64, or int4 in groups of 32 to 128 dividing L; Dn and Dv multiples of 4), its
  // rows in blocks of four (rows 4b .. 4b + 3) interleaved so that the kernel reads a block as one
  // sequential stream:
  //   int8: block b's codes at codes + 4 b L, values [64 c, 64 c + 64) of its row r at
  //         (4 c + r) 64 from there; scales float32 [rows], plain;
  //   int4: block b's codes at codes + 2 b L, group g of its row r (RowQuant's group / 2 bytes) at
  //         (4 g + r) group / 2 from there; its scales at scales + 4 b L / group, group g of row r
  //         at 4 g + r from there.
  // Computed in float32 as s * q (the query's absorption multiplies each row's query element by
  // the row's or group's scale once, then by the codes). hi_na_moe.mla's QuantWeight makes it
  // from PackedExperts::unpack_row_quant's rows.
  RowQuant wq{};
  bool has_weight() const { return w != nullptr || wq.fmt != WFormat::kLossless; }
};
// Heads split across num_threads (0: every hardware thread) when the work is large enough; each
// thread reads the cache once for all of its heads. Throws std::invalid_argument for a null w
// without a wq of the form above. isa picks the build (kAvx512/kAmx: AVX-512; kAvx2: AVX2;
// others: the baseline build).
void mla_decode(const MlaDecodeArgs& a, int num_threads, Isa isa);
// Whether mla_decode reads kv_b_proj's weight of these sizes quantised in this format (wq).
bool mla_quant_fits(WFormat fmt, int64_t group, int64_t L, int64_t Dn, int64_t Dv);
// Whether mla_decode reads a bfloat16 latent cache (L a multiple of 32) with AVX512-BF16 dot
// products where the CPU has them (tiers avx512 / amx; vdpbf16ps: pairs of products summed in
// float32): the scores' latent half with each head's latent query rounded to bfloat16 once, the
// latent outputs with the probabilities rounded to bfloat16 (as PyTorch's bf16 attention rounds
// them for the product with the values). On by default; off: float32 FMAs, as every other build
// (for A/B measurements and tests; process-wide).
bool mla_bf16_dots();
void set_mla_bf16_dots(bool on);

// Attention of T query rows per (batch, head) over S cached keys/values, bfloat16 in and out
// (see csrc/kernels/avx512/attention_prefill_avx512bf16.cpp): the prefill counterpart of
// attention_decode, float32 sums and softmax, the probabilities rounded to bfloat16 for p . v.
struct AttnPrefillArgs {
  const void* q;  // row (b, t, h) at q + b*q_strides[0] + t*q_strides[1] + h*q_strides[2], D contiguous
  const void* k;  // element (b, h, s, d) at k[b*k_strides[0] + h*k_strides[1] + s*k_strides[2] + d]
  const void* v;  // likewise with v_strides
  void* out;      // [B, T, Hq, D] contiguous
  int64_t B, T, Hq, Hkv, S, D;
  int64_t q_strides[3], k_strides[3], v_strides[3];
  float scale;  // applied to q . k before the softmax
  // No mask: query t attends keys 0..t (causal from the first key, what SDPA's is_causal does
  // and what transformers asks for when it passes no mask; keys from T on are not read). A mask:
  // query t of batch row b attends key j iff mask[b*mask_bstride + t*mask_tstride + j] != 0 (a
  // bool mask [B or 1, 1, T, S]; mask_bstride 0 broadcasts one over the batch). A query row
  // attending no key gives zeros, as SDPA does (and attention_decode).
  const uint8_t* mask = nullptr;
  int64_t mask_bstride = 0, mask_tstride = 0;
  const float* sinks = nullptr;  // optional [Hq]: attention sinks, as AttnDecodeArgs::sinks
};
// Whether attention_prefill has a kernel for these arguments at tier isa on this CPU: bfloat16
// dot products (AVX512-BF16) at the avx512/amx tiers, D a multiple of 16 up to 256, Hq a
// multiple of Hkv.
bool attention_prefill_supported(const AttnPrefillArgs& a, Isa isa);
// Runs it on num_threads (0: every hardware thread); returns false (nothing written) when
// attention_prefill_supported is false.
bool attention_prefill(const AttnPrefillArgs& a, int num_threads, Isa isa);

// A MoE router's selection from its logits (csrc/moe/router.cpp), per row of E logits:
//   kSoftmaxTopk: p = softmax(float32(logits)); the k largest p (values and indices), then
//                 optionally w = top / sum(top) (renorm);
//   kTopkSoftmax: the k largest logits, then w = softmax over those k (float32 math);
//   kSigmoidGroupTopk (DeepSeek-V3 and its kin): s = sigmoid(float32(logits)), c = s + sel_bias
//                 (required); the E experts in `groups` groups of E / groups (at least 2), each
//                 group scored by the sum of its two largest c; the topk_group best groups kept
//                 and the k largest c among their experts chosen, both as torch.topk(...,
//                 sorted=False) leaves them (index order: its selection's); w = s of the chosen,
//                 divided by (their sum + eps) with renorm, then times scale. With one group
//                 (groups = topk_group = 1) every expert is a candidate (MiniMax-M2, Hunyuan-V3).
// The top-k moves ties as torch.topk's CPU kernel does (not by index); the softmax and the
// sigmoid use std::exp, so w can differ from PyTorch's in the last float32 bits. w is rounded
// once to w_dtype; idx is int64. Single-threaded (a decode step's few rows).
//   kSoftmaxGroupTopk (DeepSeek-V2): p = softmax(float32(logits)); with groups > 1 each group
//                 scored by its largest p, the topk_group best kept and the others' p taken as 0;
//                 the k largest as torch.topk(..., sorted=False) leaves them, w = p * scale.
//   kSoftmaxGroupTopkInDtype (Mistral 4): every step in the logits' dtype as PyTorch's ops in it
//                 round (r(x): x rounded to that dtype; nothing for float32): p = r(softmax(float32
//                 (logits))); each of the groups scored by r(the sum of its two largest p), the
//                 topk_group best (torch.topk(sorted=False)) kept and the others' p taken as 0; the
//                 k largest as torch.topk(..., sorted=False) leaves them, w = their p; with renorm
//                 w = r(w / r(r(sum of w, in their order) + eps)); then w = r(w * scale).
enum class RouterForm : int {
  kSoftmaxTopk = 0,
  kTopkSoftmax = 1,
  kSigmoidGroupTopk = 2,
  kSoftmaxGroupTopk = 3,
  kSoftmaxGroupTopkInDtype = 4
};
struct RouterSelectArgs {
  DType dtype;         // the logits'
  const void* logits;  // [B, E] contiguous
  int64_t B, E, k;     // 1 <= k <= E
  RouterForm form;
  bool renorm;  // kSoftmaxTopk, kSigmoidGroupTopk and kSoftmaxGroupTopkInDtype
  DType w_dtype;
  void* w;       // out [B, k]
  int64_t* idx;  // out [B, k]
  // kSoftmaxTopk only: with sel_bias [E] (float32), the top k of probs + sel_bias choose the experts
  // and their weights are the probabilities without it (ERNIE 4.5's score correction); renorm
  // then divides by max(sum, norm_min)
  const float* sel_bias = nullptr;
  float norm_min = 0.0f;
  // kSigmoidGroupTopk, kSoftmaxGroupTopk and kSoftmaxGroupTopkInDtype (groups divides E, E / groups
  // >= 2, 1 <= topk_group <= groups, and k <= topk_group * E / groups)
  int64_t groups = 1, topk_group = 1;
  float scale = 1.0f;
  float eps = 1e-20f;  // kSigmoidGroupTopk, kSoftmaxGroupTopkInDtype: the renormalising sum's epsilon
};
void router_select(const RouterSelectArgs& a);

// A gated MLP's decode step on two up-only blocks (csrc/moe/mlp.cpp): [g | u] = gate_up.linear(x)
// (I gate rows, then I up rows), m = round(round(silu(g)) * u), out = down.linear(m), every
// rounding to the dtype where PyTorch's F.silu and product round; silu in float32, the baseline
// build as PyTorch's scalar loop writes it, the AVX-512 build (isa of gate_up) with a vector exp.
struct GatedMlpArgs {
  DType dtype;
  int64_t B, I;
  const PackedExperts* gate_up;  // [B, H] -> [B, 2 I]
  MoeParams gate_up_params;
  const PackedExperts* down;  // [B, I] -> [B, H]
  MoeParams down_params;
  const void* x;  // [B, H]
  void* gu;       // scratch [B, 2 I]
  void* m;        // scratch [B, I]
  void* out;      // out [B, H]
};
void gated_mlp_decode(const GatedMlpArgs& a, int num_threads);
// Its two halves: [g | u] = gate_up.linear(x) and m (gated_mlp_gate_up), then out = down.linear(m).
void gated_mlp_gate_up(const GatedMlpArgs& a, int num_threads);
void gated_mlp_down(const GatedMlpArgs& a, int num_threads);
// out[i] = round(round(silu(g[i])) * u[i]) over n values (gated_mlp_decode's middle step).
void silu_mul(DType dt, Isa isa, const void* g, const void* u, int64_t n, void* out);
// A shared expert's sigmoid gate (Qwen2-MoE): out = round(routed + round(round(sigmoid(logit_b))
// * shared)) per row b of H values, logit [B] one per row; float32 math, std::exp, each step
// rounded to the dtype as PyTorch's sigmoid (its scalar loop, B under two vectors of its build;
// hi_na_moe.mlp.sigmoid_rows), product and add round it. out may be routed.
void shared_combine(DType dt, const void* routed, const void* shared, const void* logit, int64_t B, int64_t H,
                    void* out);

// A pre-norm decoder layer's decode step before the KV-cache update (csrc/moe/layer_step.cpp):
// h = rms_norm(x); [q | k | v] = qkv.linear(h); q and k through their RMSNorms (qk_norm 1: over
// the whole projection, 2: per head, 0: none); q, k rotated (rope_rotate_half); v copied. Every
// buffer C-contiguous in dtype, none overlapping another, except k and v: head h of row b goes
// to k + (b * kv_bstride + h * kv_hstride) elements (likewise v), so they can be one position
// of a KV cache laid out [B, Hkv, capacity, D] (hi_na_moe.kv_cache); kv_hstride = D and
// kv_bstride = Hkv D is the contiguous [B, Hkv, D].
struct LayerPreArgs {
  DType dtype;
  int64_t B, H;  // rows (one new token each), hidden size
  const void* x;  // [B, H]
  const void* ln1_w;
  float ln1_eps;
  const PackedExperts* qkv;  // an up-only block: [B, H] -> [B, (Hq + 2 Hkv) D]
  MoeParams qkv_params;
  int64_t Hq, Hkv, D;
  int qk_norm;
  const void* qn_w;  // [Hq D] (qk_norm 1) or [D] (2)
  const void* kn_w;
  float qn_eps, kn_eps;
  const void* cos;  // row b at cos + b * cos_bstride elements, D values (likewise sin)
  const void* sin;
  int64_t cos_bstride;
  void* h;        // scratch [B, H]
  void* qkv_out;  // scratch [B, (Hq + 2 Hkv) D]
  void* qk_tmp;   // scratch [B, (Hq + Hkv) D]
  void* q;        // out [B, Hq, D]
  void* k;        // out [B, Hkv, D] at the strides below
  void* v;        // out [B, Hkv, D] at the strides below
  int64_t kv_bstride, kv_hstride;  // elements
  bool half_table = false;  // cos and sin rows of D/2 values (rope_rotate_half's half_table: GPT-OSS)
  // the rotation is rope_interleaved_f32's (ERNIE 4.5): cos and sin are float32, cos_bstride counts
  // float32 values
  bool interleaved_f32 = false;
  int64_t rot = 0;  // rope_rotate_half's rotary dims (0: D)
  // Latent attention (hi_na_moe.mla: DeepSeek-V2/V3's MLA) when mla.rope is not kNone. Then Hq
  // is its heads (Hkv, D, qk_norm, qk_tmp's size above unused) and the step is, per row:
  //   h = rms_norm(x); [qa | c | kr] = qkv.linear(h) (qkv: the packed group of q_proj, or q_a_proj,
  //   and kv_a_proj_with_mqa: [B, H] -> [B, nqa + L + Dr], nqa = q_lora or Hq (Dn + Dr));
  //   with q_lora > 0: qf = q_b.linear(rms_norm(qa, qa_w)), else qf = qa (each head Dn + Dr values);
  //   q [B, Hq, Dn + Dr] = qf with each head's last Dr values rotated (rope_latent, form mla.rope;
  //   cos as rope_latent's tab: float32 pairs for kComplex, cos_bstride then counting float32
  //   values); k + b * kv_bstride: rms_norm(c, kv_w) (the latent cache's slot of row b, L values);
  //   v + b * v_bstride: kr rotated (the rope key's slot, Dr values).
  // qk_tmp: scratch [B, q_lora + Hq (Dn + Dr)].
  struct Latent {
    LatentRope rope = LatentRope::kNone;
    int64_t Dn = 0, Dr = 0, L = 0, q_lora = 0, v_bstride = 0;
    const PackedExperts* q_b = nullptr;  // with q_lora: [B, q_lora] -> [B, Hq (Dn + Dr)]
    MoeParams q_b_params;
    const void* qa_w = nullptr;
    float qa_eps = 0.f;
    const void* kv_w = nullptr;
    float kv_eps = 0.f;
    // optional [B] in dtype: every query value of row b times q_scale[b], rounded to the dtype
    // (Mistral 4's query scale of the position, after the rotary embedding)
    const void* q_scale = nullptr;
  } mla;
};
// isa: the tier of rope_rotate_half in the step (the same bits at every tier; latent attention's
// rope_latent has one build and ignores it).
void layer_decode_pre(const LayerPreArgs& a, int num_threads, Isa isa);

// The step after the cache update: the attention (attn, with its sinks when set; skipped when
// attn.q is null, its out then already holding the heads' outputs), o = o_proj.linear(attn.out), sum = x + o and
// normed = rms_norm(sum) (add_rms_norm), then, with a router, logits = router.linear(normed) and,
// with select.w, the router's selection from them (router_select), and with experts, the MoE
// block's experts and the residual add into sum; or, in a dense layer (mlp.gate_up set, no
// router), sum += gated_mlp_decode(normed).
struct LayerPostArgs {
  DType dtype;
  int64_t B, H;
  AttnDecodeArgs attn;  // out: scratch [B, Hq D]
  const PackedExperts* o;
  MoeParams o_params;
  void* o_out;  // scratch [B, H]
  const void* x;
  const void* ln2_w;
  float ln2_eps;
  void* sum;     // out [B, H]
  void* normed;  // out [B, H]
  const PackedExperts* router = nullptr;  // [B, H] -> [B, E]
  MoeParams router_params;
  void* logits = nullptr;  // out [B, E]
  // with a router and select.w set: then router_select() on the logits (its dtype, logits and
  // B are taken from here)
  RouterSelectArgs select{};
  // with the selection and experts set: then the MoE block's experts on it and the layer's last
  // residual add, sum += experts.forward(normed, select.idx, select.w) (add(): rounded as
  // PyTorch's add), experts_out: scratch [B, H]
  const PackedExperts* experts = nullptr;
  MoeParams experts_params;  // num_threads: experts_threads below; topk_w_dtype: select.w_dtype
  int experts_threads = 0;
  void* experts_out = nullptr;
  // with the experts and shared_mlp.gate_up set: the block's shared expert too, before the
  // residual add: experts_out = shared_combine(experts_out, gated_mlp_decode(normed),
  // shared_gate.linear(normed)) (shared_mlp's dtype, B, x, gu, m and out are set here;
  // shared_logit: scratch [B])
  // shared_gate null: a shared expert without a gate, added as it is (ERNIE 4.5):
  // experts_out = add(experts_out, gated_mlp_decode(normed))
  GatedMlpArgs shared_mlp{};
  const PackedExperts* shared_gate = nullptr;  // [B, H] -> [B, 1]
  MoeParams shared_gate_params;
  void* shared_logit = nullptr;
  // a router of another dtype than the layer's (ERNIE 4.5's float32 router, which casts its input):
  // normed converted to router_dtype into router_in (scratch [B, H] of it) for its linear; the
  // logits (and select.dtype) are then of router_dtype
  DType router_dtype = DType::kF32;
  bool router_cast = false;
  void* router_in = nullptr;
  // a dense layer: its gated MLP (dtype, B and x set here; gu, m and out: scratch), no router
  GatedMlpArgs mlp{};
  // latent attention: with mla's weight set (mla.has_weight()), mla_decode(mla) runs instead of
  // attention_decode(attn), its out set here to attn.out ([B, H Dv]; attn's other fields unused)
  MlaDecodeArgs mla{};
};
// Returns the name of the experts' kernel that ran (forward()'s), or null when none ran.
const char* layer_decode_post(const LayerPostArgs& a, int num_threads, Isa attn_isa);

// One decoder layer of decode_layers(): its two calls' arguments with what stays between steps
// (weights, sizes, the packed blocks, the router's selection form, the experts, a shared expert's
// blocks); decode_layers sets the rest, scratch included. The layer must have a router with a
// selection and experts, or be dense (post.mlp.gate_up set).
struct DecodeLayer {
  LayerPreArgs pre;
  LayerPostArgs post;
  int num_threads;
  Isa attn_isa;
};
// Where a layer's KV cache is: buffers k and v laid out [B, Hkv, capacity, D] with these element
// strides (the last dimension contiguous); this step writes position pos and the attention reads
// positions [0, S) (hi_na_moe.kv_cache: a DynamicCache's slot, pos = S - 1; a StaticCache's
// buffers, S = their capacity and the mask hiding what is not written yet).
// A latent attention layer's: k the latent cache [B, 1, capacity, L], v the rope keys' [B, 1,
// capacity, Dr] with their own strides v_bstride, v_sstride (for other layers these equal k's).
struct DecodeKV {
  int64_t k, v;  // addresses
  int64_t bstride, hstride, sstride, S, pos;
  int64_t v_bstride, v_sstride;
};
// A decode step through L decoder layers, one after the other, as L pairs of layer_decode_pre and
// layer_decode_post (with the experts) compute them: the same kernels on the same values, so
// the same bits. x [B, H] the first layer's input, out [B, H] the last layer's output; cos and
// sin as LayerPreArgs, and the attention mask (null: none) as AttnDecodeArgs, the same for every
// layer. scratch: at least decode_layers_scratch(layers, L, B) bytes. names[l]: the experts'
// kernel layer l ran. norm_w non-null: then also normed [B, H] = rms_norm(out) with that weight
// and norm_eps (the stack's final norm, as hi_na_moe.dense's NativeNorm runs it).
// q_scale: as LayerPreArgs::mla's, for every latent attention layer (null: none).
// head non-null (with norm_w): then also logits [B, head's outputs] = head->linear(normed) with
// head_params (the causal LM's lm_head, as hi_na_moe.dense's NativeLinear runs it).
size_t decode_layers_scratch(const DecodeLayer* layers, int64_t L, int64_t B);
void decode_layers(const DecodeLayer* layers, const DecodeKV* kv, int64_t L, int64_t B, const void* x, const void* cos,
                   const void* sin, int64_t cos_bstride, const uint8_t* mask, int64_t mask_bstride, void* scratch,
                   void* out, const char** names, const void* norm_w = nullptr, float norm_eps = 0.f,
                   void* normed = nullptr, const void* q_scale = nullptr, const PackedExperts* head = nullptr,
                   const MoeParams* head_params = nullptr, void* logits = nullptr);

// The timeline of decode_layers, op by op, in a tuning build (HINA_PREFETCH_TUNING; a release
// build records nothing and step_trace_compiled() is false). Each event is one op of one layer:
// its span [t0, t1) in nanoseconds of steady_clock on the calling thread, the ops following each
// other without gaps from the call's start (the final norm's and the head's layer is -1); the experts' call in its
// parts (the routing metadata and input rows, the gate/up region, the h rows' quantisation, the
// down region; kExperts what follows it); a gated MLP (a dense layer's kMlp*, a shared expert's
// kShared*) in its gate/up linear with the activation, and its down linear, kShared then being
// the shared expert's sigmoid gate and the sum. One stepping thread at a
// time; take_step_trace() returns the events since its last call (at most 1 << 20) and clears them.
enum class StepOp : int32_t {
  kNorm, kQkv, kRopeKv, kAttn, kO, kAddNorm, kMlpGateUp, kMlpDown, kRouter, kSelect, kExpertsPrep, kExpertsGateUp,
  kExpertsQuantH, kExpertsDown, kExperts, kSharedGateUp, kSharedDown, kShared, kAdd, kFinalNorm, kHead, kCount
};
const char* step_op_name(StepOp op);
struct StepTraceEvent {
  int32_t layer;
  StepOp op;
  int64_t t0, t1;
};
bool step_trace_compiled();
std::vector<StepTraceEvent> take_step_trace();

}  // namespace hina
