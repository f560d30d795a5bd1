// Prefill attention for bfloat16 models with AVX-512 BF16 dot products (vdpbf16ps): many query
// rows per (batch, head) over the cached keys, in one pass over the keys with a running softmax
// (the "flash attention" order), so the [T, S] score matrix never exists in memory.
//
// Why: PyTorch's SDPA reached 76-148 GFLOP/s on prefill at 512-4096 tokens on the AMD EPYC of
// 2026-12-01, fd064b4 (8-25 % of an OLMoE-1B-7B prefill); the bf16 dot product does 32 multiply-adds per
// instruction with float32 sums. See benchmarks/bench_prefill_attention.py.
//
// Per (batch b, kv head g), once: the keys are packed into blocks of kNk = 32 keys laid out
// [D/2][32][2] (a key pair-of-dimensions per 32-bit lane: one register of 16 keys per two
// dimensions) and the values into [16 key pairs][D][2] (two keys' values of one dimension per
// lane). Then per work item (b, query head h, G blocks of kR query rows: one pass over the key
// blocks serves them all), per key block and row block:
//   scores (kR x 32, in 24 registers) = q . k over D/2 pair steps, a broadcast query pair
//     times two key registers per row;
//   times scale, masked (-inf), row maxima m', a = e^(m - m'), p = e^(s - m') (float32),
//     l = l a + sum(p); p rounded to bf16 (round to nearest even);
//   o = o a + p . v, o (kR x D float32) in an L1 buffer, RP rows at a time in registers.
// At the end out = o / l, rounded once to bf16 (with attention sinks, l also holds the sink's
// e^z, rescaled to the larger of the row's maximum and z). A row with no key attended gives zeros (what
// PyTorch's SDPA returns for it: transformers' left-padded batches have such rows).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "hina_moe/attention.h"
#include "hina_moe/thread_pool.h"
#include "vec_avx512.h"

namespace hina::detail {
namespace {

constexpr int kNk = 32;  // keys per block
constexpr int kR = 12;   // query rows per work item: the score tile is kR x 2 registers

// Rows of the p . v step held in registers at once for NC = D / 16 output registers per row:
// RP NC accumulators, a broadcast per row and the value register in flight within 32 registers,
// RP dividing kR.
constexpr int rows_pv(int nc) {
  for (int rp : {12, 6, 4, 3, 2})
    if (rp * nc + rp + 1 <= 32) return rp;
  return 1;
}

struct Layout {
  int64_t nblk;    // key blocks per (b, g)
  int64_t kblock;  // uint16 elements per packed key block (= value block): 32 D
  int64_t per_head() const { return nblk * kblock; }
};

// Keys [0, n) of (b, g) into kp (blocks [D/2][32][2]) and vp (blocks [16][D][2]); the positions
// from n to the end of the last block are zero (their scores are masked; a zero value keeps
// 0 x value finite).
void pack_head(const AttnPrefillArgs& a, int64_t b, int64_t g, int64_t n, const Layout& L, uint16_t* kp,
               uint16_t* vp) {
  const int64_t D = a.D, pairs = D / 2;
  const uint16_t* k = static_cast<const uint16_t*>(a.k) + b * a.k_strides[0] + g * a.k_strides[1];
  const uint16_t* v = static_cast<const uint16_t*>(a.v) + b * a.v_strides[0] + g * a.v_strides[1];
  for (int64_t blk = 0; blk < L.nblk; ++blk) {
    uint32_t* kb = reinterpret_cast<uint32_t*>(kp + blk * L.kblock);
    uint16_t* vb = vp + blk * L.kblock;
    for (int jj = 0; jj < kNk; ++jj) {
      const int64_t j = blk * kNk + jj;
      if (j < n) {
        uint32_t row[128];  // D <= 256: 128 pairs
        std::memcpy(row, k + j * a.k_strides[2], static_cast<size_t>(D) * 2);
        for (int64_t p = 0; p < pairs; ++p) kb[p * kNk + jj] = row[p];
        const uint16_t* vr = v + j * a.v_strides[2];
        uint16_t* vo = vb + (jj / 2) * D * 2 + (jj & 1);
        for (int64_t d = 0; d < D; ++d) vo[2 * d] = vr[d];
      } else {
        for (int64_t p = 0; p < pairs; ++p) kb[p * kNk + jj] = 0;
        uint16_t* vo = vb + (jj / 2) * D * 2 + (jj & 1);
        for (int64_t d = 0; d < D; ++d) vo[2 * d] = 0;
      }
    }
  }
}

inline __m512 bcast_pair(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(w)));
}

// o[r] = o[r] a[r] + p[r] . v over one value block, RP rows at a time.
template <int NC>
void pv_block(float* o, const float* alpha, const uint16_t* pb, const uint16_t* vb) {
  constexpr int RP = rows_pv(NC);
  constexpr int64_t D = NC * 16;
  for (int r0 = 0; r0 < kR; r0 += RP) {
    __m512 acc[RP][NC];
    for (int r = 0; r < RP; ++r) {
      const __m512 ar = _mm512_set1_ps(alpha[r0 + r]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (r0 + r) * D + 16 * c), ar);
    }
    for (int jp = 0; jp < kNk / 2; ++jp) {
      __m512 pr[RP];
      for (int r = 0; r < RP; ++r) pr[r] = bcast_pair(pb + (r0 + r) * kNk + 2 * jp);
      const uint16_t* vrow = vb + jp * D * 2;
      for (int c = 0; c < NC; ++c) {
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vrow + 32 * c);
        for (int r = 0; r < RP; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)pr[r], vv);
      }
    }
    for (int r = 0; r < RP; ++r)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + (r0 + r) * D + 16 * c, acc[r][c]);
  }
}

// The key validity of rows r0.. (kR of them) in block blk as 32-bit masks: key j of row r is
// attended iff j < nkeys and (no mask: j <= t0 + r; a mask: its byte is nonzero). Returns whether
// any row attends any key of the block.
bool block_masks(const uint8_t* const* mrow, int64_t t0, int64_t j0, int64_t nkeys,
                 __mmask32* valid) {
  const uint32_t in_range = nkeys - j0 >= 32 ? 0xFFFFFFFFu : (1u << (nkeys - j0)) - 1u;
  uint32_t any = 0;
  for (int r = 0; r < kR; ++r) {
    uint32_t m;
    if (mrow) {
      if (nkeys - j0 >= 32) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mrow[r] + j0));
        m = _mm256_test_epi8_mask(bytes, bytes);
      } else {
        m = 0;
        for (int64_t j = j0; j < nkeys; ++j) m |= (mrow[r][j] ? 1u : 0u) << (j - j0);
      }
    } else {
      const int64_t last = t0 + r - j0;  // keys j0 .. t0 + r
      m = last < 0 ? 0u : last >= 31 ? 0xFFFFFFFFu : (2u << last) - 1u;
    }
    valid[r] = m & in_range;
    any |= valid[r];
  }
  return any != 0;
}

// One block of up to kR query rows of (b, h): the rows' addresses, the running softmax state
// and their output accumulators (o: kR x D float32, pb: their bf16 probabilities of a block).
struct Rows {
  int64_t t0, rows, nkeys;  // first row, how many, keys [0, nkeys) some row may attend
  const uint16_t* q[kR];
  const uint8_t* mask[kR];
  float m[kR], l[kR], alpha[kR];
  float* o;
  uint16_t* pb;
};

void start(const AttnPrefillArgs& a, int64_t b, int64_t h, int64_t t0, Rows& R) {
  R.t0 = t0;
  R.rows = std::min<int64_t>(kR, a.T - t0);
  for (int r = 0; r < kR; ++r) {  // rows past the end repeat the last row; their results are dropped
    const int64_t t = t0 + std::min<int64_t>(r, R.rows - 1);
    R.q[r] = static_cast<const uint16_t*>(a.q) + b * a.q_strides[0] + t * a.q_strides[1] + h * a.q_strides[2];
    if (a.mask) R.mask[r] = a.mask + (a.mask_bstride ? b * a.mask_bstride : 0) + t * a.mask_tstride;
    R.m[r] = -INFINITY, R.l[r] = 0.f;
  }
  // no mask: causal, the first t0 + rows keys; a mask: all S
  R.nkeys = a.mask ? a.S : std::min(a.S, t0 + R.rows);
  std::memset(R.o, 0, sizeof(float) * kR * a.D);
}

// The rows' scores against key block blk, the running softmax, and p . v into o.
template <int NC>
void step(const AttnPrefillArgs& a, const Layout& L, const uint16_t* kp, const uint16_t* vp, int64_t blk, Rows& R) {
  constexpr int64_t D = NC * 16;
  const int64_t j0 = blk * kNk;
  if (j0 >= R.nkeys) return;
  __mmask32 valid[kR];
  if (!block_masks(a.mask ? R.mask : nullptr, R.t0, j0, R.nkeys, valid)) return;
  const uint16_t* kb = kp + blk * L.kblock;
  __m512 s[kR][2];
  for (int r = 0; r < kR; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * 2 * kNk);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + p * 2 * kNk + 32);
    for (int r = 0; r < kR; ++r) {
      const __m512bh qq = (__m512bh)bcast_pair(R.q[r] + 2 * p);
      s[r][0] = _mm512_dpbf16_ps(s[r][0], qq, k0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], qq, k1);
    }
  }
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int r = 0; r < kR; ++r) {
    const __mmask16 v0 = static_cast<__mmask16>(valid[r]), v1 = static_cast<__mmask16>(valid[r] >> 16);
    const __m512 s0 = _mm512_mask_mul_ps(ninf, v0, s[r][0], scale);
    const __m512 s1 = _mm512_mask_mul_ps(ninf, v1, s[r][1], scale);
    const float mx = std::max(R.m[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
    const float mu = mx == -INFINITY ? 0.f : mx;  // nothing attended yet: p = 0 below
    R.alpha[r] = R.m[r] == -INFINITY ? 0.f : std::exp(R.m[r] - mx);
    const __m512 mv = _mm512_set1_ps(mu);
    const __m512 p0 = _mm512_maskz_mov_ps(v0, v512::exp_ps(_mm512_sub_ps(s0, mv)));
    const __m512 p1 = _mm512_maskz_mov_ps(v1, v512::exp_ps(_mm512_sub_ps(s1, mv)));
    R.l[r] = R.l[r] * R.alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    R.m[r] = mx;
    _mm512_storeu_si512(R.pb + r * kNk, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  pv_block<NC>(R.o, R.alpha, R.pb, vp + blk * L.kblock);
}

// out = o / l, rounded once to bf16. With a sink logit z for head h, the denominator also holds
// e^z: with M = max(m, z), out = o e^(m - M) / (l e^(m - M) + e^(z - M)).
template <int NC>
void finish(const AttnPrefillArgs& a, int64_t b, int64_t h, const Rows& R) {
  constexpr int64_t D = NC * 16;
  const float z = a.sinks ? a.sinks[h] : -INFINITY;
  for (int64_t r = 0; r < R.rows; ++r) {
    float f = R.l[r] > 0.f ? 1.f / R.l[r] : 0.f;  // no key attended: 0, as SDPA gives
    if (z != -INFINITY && R.l[r] > 0.f) {
      const float M = std::max(R.m[r], z), c = std::exp(R.m[r] - M);
      f = c / (R.l[r] * c + std::exp(z - M));
    }
    const __m512 inv = _mm512_set1_ps(f);
    uint16_t* dst = static_cast<uint16_t*>(a.out) + ((b * a.T + R.t0 + r) * a.Hq + h) * D;
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(R.o + r * D + 16 * c), inv)));
  }
}

// G neighbouring row blocks of (b, h) in one pass over the key blocks: each packed key and value
// block is read from memory once for G kR rows (while it is in L1), not once per kR. kG by
// default; tuning builds (HINA_PREFETCH_TUNING) read HINA_PREFILL_ROW_BLOCKS (1..kGMax) per call.
constexpr int kG = 2, kGMax = 4;

int row_blocks() {
#ifdef HINA_PREFETCH_TUNING
  if (const char* e = std::getenv("HINA_PREFILL_ROW_BLOCKS")) {
    const int g = std::atoi(e);
    if (g >= 1 && g <= kGMax) return g;
  }
#endif
  return kG;
}

template <int NC>
void item(const AttnPrefillArgs& a, const Layout& L, const uint16_t* kp, const uint16_t* vp, int64_t b, int64_t h,
          int64_t t0, int G, Rows* R) {
  int n = 0;
  int64_t nkeys = 0;
  for (; n < G && t0 + n * kR < a.T; ++n) {
    start(a, b, h, t0 + n * kR, R[n]);
    nkeys = std::max(nkeys, R[n].nkeys);
  }
  for (int64_t blk = 0, nb = (nkeys + kNk - 1) / kNk; blk < nb; ++blk)
    for (int i = 0; i < n; ++i) step<NC>(a, L, kp, vp, blk, R[i]);
  for (int i = 0; i < n; ++i) finish<NC>(a, b, h, R[i]);
}

template <int NC>
void run(const AttnPrefillArgs& a, int num_threads) {
  const int64_t D = a.D;
  const int64_t npack = a.mask ? a.S : std::min(a.S, a.T);  // keys any row reads
  const Layout L{(npack + kNk - 1) / kNk, kNk * D};
  const int64_t heads = a.B * a.Hkv;
  // the calling thread's packing buffer, kept between calls (a prompt's layers ask for the same
  // size) up to kKeepBytes; a larger one (a very long prompt) is freed after the call
  constexpr size_t kKeepBytes = size_t{64} << 20;
  thread_local std::vector<uint16_t> packed;
  packed.resize(static_cast<size_t>(2 * heads * L.per_head()));
  struct Trim {
    std::vector<uint16_t>& v;
    ~Trim() {
      if (v.capacity() * sizeof(uint16_t) > kKeepBytes) std::vector<uint16_t>().swap(v);
    }
  } trim{packed};
  uint16_t* kp = packed.data();
  uint16_t* vp = kp + heads * L.per_head();
  const int G = row_blocks();
  const int64_t nq = (a.T + kR * G - 1) / (kR * G), groups = a.Hq / a.Hkv;  // items per (b, h)
  const int64_t items = a.B * a.Hq * nq;
  const int64_t macs = items * kR * G * npack * D;
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({num_threads, items, macs >> 18})));
  std::atomic<int64_t> next_pack{0}, next_item{0};
  ThreadPool::global().run(n, [&](int, int) {
    for (int64_t i; (i = next_pack.fetch_add(1, std::memory_order_relaxed)) < heads;)
      pack_head(a, i / a.Hkv, i % a.Hkv, npack, L, kp + i * L.per_head(), vp + i * L.per_head());
  });
  ThreadPool::global().run(n, [&](int, int) {
    alignas(64) float o[kGMax][kR * NC * 16];  // (kR * D: GCC 12 fails on a captured constexpr here)
    alignas(64) uint16_t pb[kGMax][kR * kNk];
    Rows R[kGMax];
    for (int i = 0; i < G; ++i) R[i].o = o[i], R[i].pb = pb[i];
    // head by head (the heads of a kv group one after the other), so that the threads share one
    // head's packed keys and values in the caches; within a head the last query blocks first
    // (under the causal mask they read the most keys), so the cheap ones end the region
    for (int64_t i; (i = next_item.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t qb = nq - 1 - i % nq, bh = i / nq;
      const int64_t b = bh / a.Hq, h = bh % a.Hq, g = b * a.Hkv + h / groups;
      item<NC>(a, L, kp + g * L.per_head(), vp + g * L.per_head(), b, h, qb * kR * G, G, R);
    }
  });
}

}  // namespace

bool attention_prefill_avx512bf16(const AttnPrefillArgs& a, int num_threads) {
  switch (a.D / 16) {
#define HINA_NC(n) \
  case n: run<n>(a, num_threads); return true;
    HINA_NC(1) HINA_NC(2) HINA_NC(3) HINA_NC(4) HINA_NC(5) HINA_NC(6) HINA_NC(7) HINA_NC(8)
    HINA_NC(9) HINA_NC(10) HINA_NC(11) HINA_NC(12) HINA_NC(13) HINA_NC(14) HINA_NC(15) HINA_NC(16)
#undef HINA_NC
    default: return false;
  }
}

}  // namespace hina::detail
