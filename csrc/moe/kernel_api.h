// Internal contract between the driver (experts/ and dispatch/select.cpp, baseline flags) and the per-ISA kernel
// translation units. Header-only scalar helpers live here so every TU (including the generic
// oracle) converts and activates with the same code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

#include "hina_moe/experts.h"

namespace hina::detail {

constexpr int kPanelN = 16;  // output rows per packed panel
constexpr int kKAlign = 32;  // reduction padding (one AMX bf16 k-tile)

static inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

inline void* aligned_alloc64(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, bytes < 64 ? 64 : bytes) != 0) throw std::bad_alloc();
  return p;
}

// Memory for a packed block (freed with std::free). Blocks of 4 MiB and more are 2 MiB aligned
// and asked for transparent huge pages (Linux madvise; a hint the kernel may ignore): decode
// streams GBs of weights, and with 4 KiB pages every 4 KiB of the stream needs a new TLB entry.
void* alloc_weights(size_t bytes);

// Grow-only 64-byte aligned scratch (kept thread_local by its users).
struct AlignedBuf {
  void* p = nullptr;
  size_t cap = 0;
  AlignedBuf() = default;
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
  ~AlignedBuf() { std::free(p); }
  void* get(size_t bytes) {
    if (bytes > cap) {
      std::free(p);
      p = aligned_alloc64(bytes);
      cap = bytes;
    }
    return p;
  }
};

// Geometry of one packed PackedExperts (see PackedHeader).
struct Layout {
  DType dtype;
  int kpack;  // 2 for native bf16 (VNNI pairs), 1 otherwise
  int G;      // panels of gate/up: 2 (gate, up interleaved) or 1 (up only)
  int64_t H, I, Hk, In, Ik, Hn;
  WFormat wfmt = WFormat::kLossless;
  int group = 0;  // int4 group size
};

// Where the parts of a lossless12 panel are (see PackedHeader), from the bytes of the plain
// bf16 panel it holds (a multiple of 128: Kp is a multiple of 32).
struct L12Geometry {
  int64_t nb;     // blocks of 64 weights (two plain 64-byte vectors)
  int64_t slots;  // offset of the 96-byte block slots (the table is at 0, the flags at 64)
  int64_t spill;  // offset of the spill area
  int64_t cap;    // its 32-byte slots
  int64_t bytes;  // the whole panel (a 64-byte multiple)
};
constexpr int64_t kL12Table = 64, kL12Slot = 96, kL12SpillSlot = 32;
static inline L12Geometry l12_geometry(int64_t plain_bytes) {
  L12Geometry g;
  g.nb = plain_bytes / 128;
  g.slots = kL12Table + round_up((g.nb + 7) / 8, 64);
  g.spill = g.slots + g.nb * kL12Slot;
  g.cap = g.nb / 64 + 8;
  g.bytes = g.spill + round_up(g.cap * kL12SpillSlot, 64);
  return g;
}

// int4 panels (layout v5): [G][16] fp32 row factors (64 G bytes), then the Kp / group groups in
// blocks, each 64 bytes of scale codes followed by the codes of the groups they scale. A group has
// [G][16] one-byte scale codes (16 G bytes, q4_step) and group / 2 * G * 16 bytes of weight codes
// (q4_index), so a block holds 4 / G groups: two groups of a gate/up pair or four of a single
// matrix (scale codes of group 4b .. 4b + 3 in order, then their weight codes in the same order).
// The last block of a count that is not a multiple holds the rest (its unused scale bytes zero).
// int4 costs 4 + 8 / group bits a weight and 32 bits a row.
static constexpr int q4_per_block(int G) { return 4 / G; }
static inline int64_t q4_code_bytes(int group, int G) { return static_cast<int64_t>(group) / 2 * G * kPanelN; }
static inline int64_t q4_block_bytes(int group) { return 64 + static_cast<int64_t>(group) * 2 * kPanelN; }
// Offsets inside a panel of group g's scale codes (matrix gi's 16 at + 16 gi) and of its codes.
static inline int64_t q4_scales_at(int64_t g, int G, int group) {
  return 64 * G + g / q4_per_block(G) * q4_block_bytes(group) + g % q4_per_block(G) * 16 * G;
}
static inline int64_t q4_codes_at(int64_t g, int G, int group) {
  return 64 * G + g / q4_per_block(G) * q4_block_bytes(group) + 64 + g % q4_per_block(G) * q4_code_bytes(group, G);
}
// A scale code c: bits 0-2 b, bit 3 the sign, bits 4-7 a; its step t = (-1)^sign 2^-(8a + b)/8
// (kQ4Step[c & 15] times 2^-a, exact), and the group's scale is the row factor F times t, one
// fp32 product (q4_scale): the value every kernel multiplies a group's sums or codes by. So a
// group's scale is F times a power of 2^(1/8) from 1 down to 2^-15.9: a group 60000 times smaller
// than the row's largest still has its own scale.
constexpr float kQ4Step[16] = {
    0x1p+0f, 0x1.d5818ep-1f, 0x1.ae89fap-1f, 0x1.8ace54p-1f, 0x1.6a09e6p-1f, 0x1.4bfdaep-1f, 0x1.306fe0p-1f, 0x1.172b84p-1f,
    -0x1p+0f, -0x1.d5818ep-1f, -0x1.ae89fap-1f, -0x1.8ace54p-1f, -0x1.6a09e6p-1f, -0x1.4bfdaep-1f, -0x1.306fe0p-1f, -0x1.172b84p-1f};
static inline float q4_step(uint8_t c) {
  uint32_t u;
  std::memcpy(&u, &kQ4Step[c & 15], 4);
  u -= static_cast<uint32_t>(c >> 4) << 23;  // times 2^-a: the exponent field stays >= 111
  float t;
  std::memcpy(&t, &u, 4);
  return t;
}
static inline float q4_scale(uint8_t c, float factor) { return factor * q4_step(c); }
// The step index e (0..127, q4_step's 2^-(e/8)) nearest |a| / f in the log domain: a a group's
// m / 8, f its row's factor (|a| <= f). Exact operations only (frexp, comparisons with the
// float thresholds 2^((j + 0.5) / 8)), so every build picks the same. A zero group gets 127.
constexpr float kQ4Half[8] = {0x1.0b5586p+0f, 0x1.2387a6p+0f, 0x1.3dea64p+0f, 0x1.5ab07ep+0f,
                              0x1.7a1148p+0f, 0x1.9c4918p+0f, 0x1.c199bep+0f, 0x1.ea4afap+0f};
static inline int q4_nearest_step(float a, float f) {
  a = a < 0.0f ? -a : a;
  const float r = a / f;
  if (!(r > 0.0f)) return 127;  // a zero group, or f 0 or NaN
  if (!(r <= 1.0f)) return 0;   // inf / inf
  int ex = 0;
  const float x2 = std::frexp(r, &ex) * 2.0f;  // r = x2 * 2^(ex - 1), x2 in [1, 2)
  int j = 0;
  for (int i = 0; i < 8; ++i) j += x2 >= kQ4Half[i] ? 1 : 0;
  const int e = -8 * (ex - 1) - j;
  return e < 0 ? 0 : (e > 127 ? 127 : e);
}
// The row factors of matrix gi in an int4 panel.
static inline const float* q4_factors(const uint8_t* panel, int gi) {
  return reinterpret_cast<const float*>(panel + 64 * gi);
}
// The groups of one panel in order, for the streaming kernels: scales() (the current group's
// scale codes, matrix gi's at + 16 gi) and codes(); prefetch(ahead, pf) asks for the lines
// `ahead` bytes past the current group's: its codes, and at a block's start the block's scale
// codes; a line at a time as the group is consumed, not a block's at once (layout 5's blocks of
// 4 / G groups are 2 KiB at group 64: a burst of 33 prefetches a block cost several-row calls
// 5-10 %; 2026-12-05, 2f179e9).
template <int G>
struct Q4Walk {
  const uint8_t* blk;
  int64_t code_bytes, block_bytes;
  int s = 0;  // the current group's place in its block
  Q4Walk(const uint8_t* panel, int group)
      : blk(panel + 64 * G), code_bytes(q4_code_bytes(group, G)), block_bytes(q4_block_bytes(group)) {}
  const uint8_t* scales() const { return blk + s * 16 * G; }
  const uint8_t* codes() const { return blk + 64 + s * code_bytes; }
  template <class Pf>
  void prefetch(int64_t ahead, Pf&& pf) const {
    if (s == 0) pf(blk + ahead);
    const uint8_t* c = codes() + ahead;
    for (int64_t o = 0; o < code_bytes; o += 64) pf(c + o);
  }
  void next() {
    if (++s == q4_per_block(G)) {
      s = 0;
      blk += block_bytes;
    }
  }
};

// Bytes of one packed panel (16 output rows, reduction length Kp, G matrices interleaved).
static inline int64_t panel_bytes(DType dt, WFormat wf, int group, int64_t Kp, int G) {
  switch (wf) {
    case WFormat::kLossless: return Kp * kPanelN * G * (dt == DType::kF32 ? 4 : 2);
    case WFormat::kInt8: return 64 * G + Kp * G * kPanelN;
    case WFormat::kInt4: {
      const int64_t ng = Kp / group;
      return 64 * G + ng * q4_code_bytes(group, G) + (ng + q4_per_block(G) - 1) / q4_per_block(G) * 64;
    }
    case WFormat::kLossless12: return l12_geometry(Kp * kPanelN * G * 2).bytes;
  }
  return 0;
}
static inline int64_t gu_panel_bytes(const Layout& L) { return panel_bytes(L.dtype, L.wfmt, L.group, L.Hk, L.G); }
static inline int64_t down_panel_bytes(const Layout& L) { return panel_bytes(L.dtype, L.wfmt, L.group, L.Ik, 1); }

struct ActParams {
  Act act;
  float alpha, gate_limit, up_limit, post_act_limit, up_offset;
};

// gate/up for one expert: rows [0, nt) of x, output panels [p0, p1) (16 columns of I each).
// Writes h[r * h_stride + c] for every column c of those panels (columns >= I written as 0).
struct GateUpJob {
  const void* w;            // this expert's first gate/up panel
  const float* bias_g;      // [In] fp32 or nullptr
  const float* bias_u;      // [In] fp32 or nullptr
  int64_t p0, p1;
  const void* const* x;     // nt row pointers, each Hk long, zero-padded; fp32 or bf16 (x_bf16)
  int64_t x_stride;         // x_bf16 kernels: rows are contiguous from x[0] at this stride
  int64_t nt;
  void* h;                  // row r at h + r * h_stride elements; fp32 or bf16 (h_bf16)
  int64_t h_stride;
  const Layout* L;
  const ActParams* act;
  const void* w_next = nullptr;  // panel p0 of the job this thread runs next (prefetch hint)
  // a paired up-only block (experts.h: plan_packed): h elements from a row's gate half to its up
  // half; the kernel stores g + bias_g at column c and u + bias_u at pair + c, no activation
  // (0: not paired). Columns >= I of each half are written as 0 like any h column.
  int64_t pair = 0;
};

// down for one expert: acc[r][c] += wt[r] * (W_down h_r + b)[c] for columns c of panels [p0, p1).
struct DownJob {
  const void* w;            // this expert's first down panel
  const float* bias;        // [Hn] fp32 or nullptr
  int64_t p0, p1;
  const void* h;            // nt rows at stride h_stride, each Ik long (zero beyond I)
  int64_t h_stride;         // elements; bytes for the integer-dot kernels (quantised rows)
  int64_t nt;
  const float* wt;          // [nt] routing weight per row
  float* const* acc;        // [nt] fp32 accumulator rows (Hn long)
  const Layout* L;
  const void* w_next = nullptr;  // panel p0 of the job this thread runs next (prefetch hint)
};

struct KernelImpl {
  void (*gateup)(const GateUpJob&) = nullptr;
  void (*down)(const DownJob&) = nullptr;
  bool x_bf16 = false;      // x rows are bf16 and contiguous at stride Hk (AMX A tiles)
  bool h_bf16 = false;      // h rows are bf16 (AMX)
  int row_slack = 0;        // rows readable past the last row of x/h buffers (tile over-read)
  bool uses_w_next = false; // the kernels prefetch the job's w_next (the driver claims ahead)
  // Integer-dot kernels: the x rows (GateUpJob::x) and the h rows DownJob reads are quantised
  // activation rows (below; DownJob::h_stride is then in bytes); gate/up still writes fp32 h,
  // which the driver quantises between the two regions.
  bool qdot = false;
};

// A quantised activation row of Kp values (Kp a multiple of 32; experts.h has the numerics):
// [Kp] int8 q, then [Kp/32] fp32 block scales, then [Kp/32] int32 block sums of q; the row is
// padded to 64 bytes.
constexpr int kActBlock = 32;
static inline int64_t qrow_bytes(int64_t Kp) { return round_up(Kp + Kp / 4, 64); }
static inline const float* qrow_scales(const void* row, int64_t Kp) {
  return reinterpret_cast<const float*>(static_cast<const uint8_t*>(row) + Kp);
}
static inline const int32_t* qrow_sums(const void* row, int64_t Kp) {
  return reinterpret_cast<const int32_t*>(static_cast<const uint8_t*>(row) + Kp + Kp / 8);
}
// Pointers into NT such rows (what the integer-dot kernels read).
template <int NT>
struct QRows {
  const int8_t* q[NT];
  const float* s[NT];
  const int32_t* sum[NT];
  void set(int r, const void* row, int64_t Kp) {
    q[r] = static_cast<const int8_t*>(row);
    s[r] = qrow_scales(row, Kp);
    sum[r] = qrow_sums(row, Kp);
  }
};
// Quantises x[0, Kp) into a row as above: the lane-wise code in moe/quant_panel.h, its AVX-512
// or AVX2 build where the CPU has it, else the portable build in experts/codecs.cpp (same bytes; tested).
void quant_act_row(const float* x, int64_t Kp, uint8_t* row);
void quant_act_row_portable(const float* x, int64_t Kp, uint8_t* row);
void quant_act_row_avx512(const float* x, int64_t Kp, uint8_t* row);
void quant_act_row_avx2(const float* x, int64_t Kp, uint8_t* row);

// Per-ISA providers; false when that TU has no kernel for the dtype.
// `amx_twin`: the generic kernel that rounds exactly where the AMX kernel does (x, h in bf16).
bool get_kernels_generic(DType dt, bool amx_twin, KernelImpl* k);
bool get_kernels_avx2(DType dt, KernelImpl* k);
bool get_kernels_avx512(DType dt, KernelImpl* k);
bool get_kernels_amx(DType dt, KernelImpl* k);
// bf16 models' prefill with vdpbf16ps (the AMX kernels' x/h contract); needs AVX512-BF16 at run time.
bool get_kernels_avx512bf16(DType dt, KernelImpl* k);
// Quantised weights (int8 / int4); the kernels do not depend on the model's dtype (x and h
// rows arrive in fp32, or bf16 for the AMX kernels and their generic twin).
bool get_qkernels_generic(WFormat wf, bool amx_twin, KernelImpl* k);  // any format, lossless included
bool get_qkernels_avx2(WFormat wf, KernelImpl* k);
bool get_qkernels_avx512(WFormat wf, KernelImpl* k);
bool get_qkernels_amx(WFormat wf, KernelImpl* k);
// The same AMX kernels on software tiles (moe_amx_sw.cpp; C++ tests' builds only, where
// HINA_AMX_SOFTWARE_TILES_BUILT is defined), run by the amx tier while use_amx_software_tiles(true).
bool get_kernels_amx_sw(DType dt, KernelImpl* k);
bool get_qkernels_amx_sw(WFormat wf, KernelImpl* k);
// Integer-dot kernels (int8 / int4 only; KernelImpl::qdot). The generic one is the exact
// emulation of the contract; the avx512vnni TU needs AVX512-VNNI at run time.
bool get_qdot_kernels_generic(WFormat wf, KernelImpl* k);
bool get_qdot_kernels_avx512vnni(WFormat wf, KernelImpl* k);
bool get_qdot_kernels_avx2(WFormat wf, KernelImpl* k);
bool get_qdot_kernels_avxvnni(WFormat wf, KernelImpl* k);  // needs AVX-VNNI at run time
// The Arm tiers (kernels/neon/; aarch64 builds only, false elsewhere): the FMA kernels of
// lossless weights (tiers neon and dotprod), the integer dot with widening multiplies (neon) and
// with SDOT (dotprod: needs FEAT_DotProd at run time).
bool get_kernels_neon(DType dt, KernelImpl* k);
bool get_qdot_kernels_neon(WFormat wf, KernelImpl* k);
bool get_qdot_kernels_dotprod(WFormat wf, KernelImpl* k);
// SMMLA row pairs on the dotprod kernels' layout and contract (i8mm: needs FEAT_I8MM at run time).
bool get_qdot_kernels_i8mm(WFormat wf, KernelImpl* k);
// bf16 models with BFDOT (one row) / BFMMLA (row pairs), the x86 bf16 dot kernel's x/h contract
// (bf16: needs FEAT_BF16 at run time).
bool get_kernels_neonbf16(DType dt, KernelImpl* k);

// lossless12 panels (PackedHeader) <-> plain bf16 panels of plain_bytes bytes. Compressing is
// portable code only (packing); it writes every byte of the panel and returns the number of
// spilled blocks, the panel being complete only when that is <= l12_geometry().cap.
// Decompressing: the portable build, and an AVX-512 BW build (same bytes; tested). A spill
// index past the cap (a corrupted flag area) reads the last spill slot: never outside the panel.
int64_t l12_compress_panel(const uint16_t* plain, int64_t plain_bytes, uint8_t* panel);
void l12_decompress_panel_portable(const uint8_t* panel, int64_t plain_bytes, uint16_t* plain);
void l12_decompress_panel_avx512(const uint8_t* panel, int64_t plain_bytes, uint16_t* plain);
// The fused lossless12 kernels (AVX-512 F/BW): decode each block in registers and run the FMAs
// of the plain bf16 AVX-512 kernel in its order, so the outputs are its bits.
bool get_l12_kernels_avx512(KernelImpl* k);
bool get_l12_kernels_avx512vbmi(KernelImpl* k);  // the same bytes; needs AVX512-VBMI at run time

// Quantises one panel from its 16 rows transposed (wt[k * 16 + n], zero-padded, k < Kp) into
// matrix gi of `panel` (layout v5). x86 builds have AVX-512 and AVX2 copies of the portable
// code (moe/quant_panel.h); all write identical bytes.
void quant_panel_avx512(const float* wt, int64_t Kp, int G, int gi, WFormat wf, int group, uint8_t* panel);
void quant_panel_avx2(const float* wt, int64_t Kp, int G, int gi, WFormat wf, int group, uint8_t* panel);

// Dequantises output rows [n0, n0 + 16) of one quantised panel (matrix gi of G) into fp32
// w[k][16] for k < Kp (the generic kernels' view of a panel; also the unpack path).
void dequant_panel_f32(const uint8_t* panel, const Layout& L, int64_t Kp, int G, int gi, float* w);

// Runs forward with an explicit kernel (tests use it to run the generic AMX twin).
const char* forward_with(const PackedExperts& pe, const KernelImpl& k, const char* name,
                         const void* x, int64_t T, const void* topk_idx, int idx_bits,
                         const void* topk_w, int64_t K, void* out, const MoeParams& p);

// ---- scalar conversions (bit-exact, round-to-nearest-even) ----
static inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

static inline float bf16_to_f32(uint16_t b) { return bits_to_f32(static_cast<uint32_t>(b) << 16); }
// Round to nearest even; a NaN stays a quiet NaN. Branch-free, so loops over it vectorise.
static inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t qnan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? qnan : rounded);
}

static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t ex = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (ex == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24
    return sign ? -v : v;
  }
  if (ex == 31) return bits_to_f32(sign | 0x7f800000u | (mant << 13));
  return bits_to_f32(sign | ((ex + 112u) << 23) | (mant << 13));
}
static inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u);
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (a < 0x38800000u) {                         // below 2^-14: subnormal half (exact scaling)
    const float v = std::nearbyint(std::fabs(f) * 16777216.0f);
    return sign | static_cast<uint16_t>(v);
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;
  return sign | static_cast<uint16_t>(r >> 13);
}

static inline float load_elem(DType dt, const void* p, int64_t i) {
  switch (dt) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.0f;
}
static inline void store_elem(DType dt, void* p, int64_t i, float v) {
  switch (dt) {
    case DType::kF32: static_cast<float*>(p)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
  }
}
// dst[0, n) = src[0, n) in dtype dt: the switch outside the loop, so the compiler vectorises
// each loop.
static inline void store_row(DType dt, void* dst, const float* src, int64_t n) {
  switch (dt) {
    case DType::kF32: std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(n)); break;
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      break;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      break;
    }
  }
}
// Rounds an fp32 value to the weight dtype and back (weight_on_input).
static inline float round_to(DType dt, float v) {
  switch (dt) {
    case DType::kF32: return v;
    case DType::kBF16: return bf16_to_f32(f32_to_bf16(v));
    case DType::kF16: return f16_to_f32(f32_to_f16(v));
  }
  return v;
}

// ---- scalar activations (the oracle's definitions) ----
static inline float act_scalar(Act a, float z, float alpha) {
  switch (a) {
    case Act::kSilu: return z / (1.0f + std::exp(-z));
    case Act::kGelu: return 0.5f * z * (1.0f + std::erf(z * 0.70710678118654752f));
    case Act::kGeluTanh: {
      const float y = 0.79788456080286536f * (z + 0.044715f * z * z * z);
      return 0.5f * z * (1.0f + std::tanh(y));
    }
    case Act::kRelu: return z < 0.0f ? 0.0f : z;  // NaN stays NaN, -0 stays -0 (torch.relu)
    case Act::kRelu2: { const float r = z < 0.0f ? 0.0f : z; return r * r; }
    case Act::kSigmoidAlpha: return z / (1.0f + std::exp(-alpha * z));
    case Act::kIdentity: return z;
  }
  return z;
}
// The vector activations' coefficients (kernels/avx512/vec_avx512.h, kernels/avx2/vec_avx2.h:
// one table, so the two widths compute the same values). exp: x = n ln2 + r (ln2 split in two for
// an exact n ln2_hi), e^r ~ 1 + r + r^2 (c0 r^5 + ... + c5); erfc: Numerical Recipes' erfcc,
// t (t (... (c0 t + c1) ...) + c9) exponentiated, fractional error < 1.2e-7.
namespace act_poly {
inline constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
inline constexpr float kExp[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
inline constexpr float kErfc[10] = {0.17087277f, -0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f,
                                    -0.18628806f, 0.09678418f, 0.37409196f, 1.00002368f, -1.26551223f};
}  // namespace act_poly

// h for one column: gated (G == 2) or not.
static inline float h_scalar(const ActParams& p, bool gated, float g, float u) {
  if (!gated) return act_scalar(p.act, u, p.alpha);
  // Plain comparisons rather than std::min/max: those are COMDAT templates that an ISA TU may
  // emit with its own flags (at -O0), and the linker could hand that copy to baseline code.
  g = p.gate_limit < g ? p.gate_limit : g;
  u = u < -p.up_limit ? -p.up_limit : u;
  u = p.up_limit < u ? p.up_limit : u;
  float a = act_scalar(p.act, g, p.alpha);
  a = p.post_act_limit < a ? p.post_act_limit : a;
  return a * (u + p.up_offset);
}

// A gate/up panel's epilogue for one row in scalar code (the Arm tiers' kernels): the sums of
// panel p (acc: [G][kPanelN] fp32, G = 2 gated, 1 not) with the biases, through the activation
// into the row hr of h (fp32, or bf16 rounded once for KernelImpl::h_bf16 kernels), or for a
// paired linear layer (j.pair) g and u as they are into its two halves; columns >= I written as 0.
template <bool Gated, class HT>
static inline void gateup_row_scalar(const GateUpJob& j, int64_t p, const float* acc, HT* hr) {
  static_assert(std::is_same_v<HT, float> || std::is_same_v<HT, uint16_t>, "h rows are fp32 or bf16");
  auto put = [](float v) -> HT {
    if constexpr (std::is_same_v<HT, float>) return v;
    else return f32_to_bf16(v);
  };
  constexpr int G = Gated ? 2 : 1;
  for (int n = 0; n < kPanelN; ++n) {
    const int64_t col = p * kPanelN + n;
    float hv = 0.0f, hu = 0.0f;  // (hu: a paired linear layer's up half, j.pair on)
    if (col < j.L->I) {
      float g = Gated ? acc[n] : 0.0f, u = acc[(G - 1) * kPanelN + n];
      if (j.bias_g) g += j.bias_g[col];
      if (j.bias_u) u += j.bias_u[col];
      if (Gated && j.pair) hv = g, hu = u;
      else hv = h_scalar(*j.act, Gated, g, u);
    }
    hr[col] = put(hv);
    if (Gated && j.pair) hr[col + j.pair] = put(hu);
  }
}

// Layout v3-v5 quantised panels: 4 consecutive k of one output row share a 32-bit lane (the
// operand shape of vpdpbusd / vpmaddubsw+vpmaddwd / sdot), 16 lanes (64 bytes) per k step.
// int8: byte of (k, gi, n) after the [G][16] fp32 scales: quad k/4, matrix gi, lane n, byte k%4.
static inline int64_t q8_index(int64_t k, int G, int gi, int n) {
  return ((k >> 2) * G + gi) * (kPanelN * 4) + n * 4 + (k & 3);
}
// int4: byte of (k, gi, n) in a group's codes (q4_codes_at), k relative to the group: 8 k per
// lane, byte k%4, low nibble for k%8 < 4, high nibble for k%8 >= 4; the nibble is q + 8.
static inline int64_t q4_index(int64_t k, int G, int gi, int n) {
  return ((k >> 3) * G + gi) * (kPanelN * 4) + n * 4 + (k & 3);
}
static inline int int4_q(const uint8_t* bytes, int64_t k, int G, int gi, int n) {
  const uint8_t b = bytes[q4_index(k, G, gi, n)];
  return ((k & 4) ? (b >> 4) : (b & 15)) - 8;
}
static inline float int4_value(const uint8_t* bytes, int64_t k, int G, int gi, int n) {
  return static_cast<float>(int4_q(bytes, k, G, gi, n));
}

// Index of element (k, gi, n) inside one packed panel (gi: 0 = gate, G-1 = up).
static inline int64_t panel_index(int kpack, int G, int64_t k, int gi, int n) {
  return kpack == 2 ? ((k >> 1) * G + gi) * (kPanelN * 2) + n * 2 + (k & 1)
                    : (k * G + gi) * kPanelN + n;
}

}  // namespace hina::detail
