// Question: Would bf16 weights stored losslessly in fewer bytes make lossless decode faster (the kernels of the study)?
// Answered in benchmarks/log/whole-model.md, "A fresh machine's int4 share, the rotary table and final norm, and a lossless packing study (2026-11-30)".
// Kernel half of study_lossless_compression.py (built and run by it; not part of the package).
//
// Question: can a decode GEMV read bf16 weights stored in fewer bytes, losslessly, faster than
// it reads them plain? Format studied (per panel of 16 output rows, as the package's bf16 panels
// [K/2][16][2]): a table of 16 high bytes (sign and the exponent's top 7 bits) per panel, then per
// block of 64 weights (two 64-byte vectors of the plain layout) either 64 low bytes plus 32 bytes
// of 4-bit codes into the table (96 bytes), or, when a high byte is not in the table, the 128
// plain bytes; one flag bit per block. Decoding a block: the codes' nibbles, one vpshufb through
// the table, two byte interleaves give exactly the two plain vectors, so the kernel's FMAs see the
// same words and the output is the same bits (checked).
//
// Usage: study_lossless_compression <rows> <K> <reps> <threads> <std> [--no-prefetch]
// Prints one JSON line: bytes and medians of both arms, the ratio, and whether outputs are equal.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

constexpr int kRows = 16;  // rows per panel
constexpr int64_t kPf = 4096;  // software prefetch distance (bytes, into L2), as the package's kernels
bool g_prefetch = true;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even (no NaNs here)
  return static_cast<uint16_t>(u >> 16);
}

void* alloc(size_t bytes) {
  void* p = std::aligned_alloc(2 << 20, (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20));
  if (!p) std::abort();
  std::memset(p, 0, bytes);
  return p;
}

// ---- plain bf16 panels: [K/2][16][2] words per panel -------------------------------------------
inline void fma_pair(__m512i v, float x0, float x1, __m512& a0, __m512& a1) {
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  a0 = _mm512_fmadd_ps(even, _mm512_set1_ps(x0), a0);
  a1 = _mm512_fmadd_ps(odd, _mm512_set1_ps(x1), a1);
}

void plain_panels(const uint16_t* w, int64_t p0, int64_t p1, int64_t K, const float* x, float* y) {
  for (int64_t p = p0; p < p1; ++p) {
    const char* b = reinterpret_cast<const char*>(w + p * K * kRows);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2, b += 64) {
      if (g_prefetch) _mm_prefetch(b + kPf, _MM_HINT_T1);
      fma_pair(_mm512_load_si512(b), x[k], x[k + 1], a0, a1);
    }
    _mm512_storeu_ps(y + p * kRows, _mm512_add_ps(a0, a1));
  }
}

// ---- compressed panels ---------------------------------------------------------------------------
struct Packed {
  std::vector<int64_t> offset;  // per panel, bytes from base
  char* base = nullptr;
  size_t bytes = 0;
  int64_t raw_blocks = 0, blocks = 0;
};

// Panel layout: 64 bytes (16-byte table, replicated 4x for vpshufb), flags (1 bit per block,
// padded to 64 bytes), then the blocks in order.
Packed pack(const uint16_t* w, int64_t panels, int64_t K) {
  const int64_t nb = K / 4;  // blocks of 64 weights (4 k x 16 rows) per panel
  const int64_t flag_bytes = (nb + 511) / 512 * 64;
  Packed pk;
  pk.offset.resize(panels + 1);
  // worst case size, then filled
  const size_t worst = static_cast<size_t>(panels) * (64 + flag_bytes + nb * 128);
  pk.base = static_cast<char*>(alloc(worst));
  size_t at = 0;
  for (int64_t p = 0; p < panels; ++p) {
    pk.offset[p] = static_cast<int64_t>(at);
    const uint16_t* pw = w + p * K * kRows;
    int64_t hist[256] = {0};
    for (int64_t i = 0; i < K * kRows; ++i) ++hist[pw[i] >> 8];
    int order[256];
    for (int i = 0; i < 256; ++i) order[i] = i;
    std::stable_sort(order, order + 256, [&](int a, int b) { return hist[a] > hist[b]; });
    uint8_t table[16];
    int code[256];
    std::fill(code, code + 256, -1);
    for (int i = 0; i < 16; ++i) {
      table[i] = static_cast<uint8_t>(order[i]);
      code[order[i]] = i;
    }
    char* pb = pk.base + at;
    for (int r = 0; r < 4; ++r) std::memcpy(pb + 16 * r, table, 16);
    uint8_t* flags = reinterpret_cast<uint8_t*>(pb + 64);
    char* blk = pb + 64 + flag_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint16_t* v = pw + b * 64;  // two plain vectors: words [0, 32) and [32, 64)
      bool ok = true;
      for (int i = 0; i < 64 && ok; ++i) ok = code[v[i] >> 8] >= 0;
      ++pk.blocks;
      if (!ok) {
        flags[b / 8] |= static_cast<uint8_t>(1u << (b % 8));
        std::memcpy(blk, v, 128);
        blk += 128;
        ++pk.raw_blocks;
        continue;
      }
      // L byte (16j + q) for q < 8: vector 0's word 8j + q; q >= 8: vector 1's word 8j + q - 8
      uint8_t lo[64], cd[64];
      for (int j = 0; j < 4; ++j)
        for (int q = 0; q < 16; ++q) {
          const uint16_t word = q < 8 ? v[8 * j + q] : v[32 + 8 * j + q - 8];
          lo[16 * j + q] = static_cast<uint8_t>(word & 0xff);
          cd[16 * j + q] = static_cast<uint8_t>(code[word >> 8]);
        }
      std::memcpy(blk, lo, 64);
      for (int i = 0; i < 32; ++i) blk[64 + i] = static_cast<char>(cd[i] | (cd[i + 32] << 4));
      blk += 96;
    }
    at = static_cast<size_t>(blk - pk.base);
    at = (at + 63) / 64 * 64;
  }
  pk.offset[panels] = static_cast<int64_t>(at);
  pk.bytes = at;
  return pk;
}

void packed_panels(const Packed& pk, int64_t p0, int64_t p1, int64_t K, const float* x, float* y) {
  const int64_t nb = K / 4;
  const int64_t flag_bytes = (nb + 511) / 512 * 64;
  const __m256i nib = _mm256_set1_epi8(0x0f);
  for (int64_t p = p0; p < p1; ++p) {
    const char* pb = pk.base + pk.offset[p];
    const __m512i table = _mm512_load_si512(pb);
    const uint8_t* flags = reinterpret_cast<const uint8_t*>(pb + 64);
    const char* b = pb + 64 + flag_bytes;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t k = 4 * i;
      if (g_prefetch) {
        _mm_prefetch(b + kPf, _MM_HINT_T1);
        _mm_prefetch(b + kPf + 64, _MM_HINT_T1);
      }
      __m512i v0, v1;
      if (flags[i >> 3] & (1u << (i & 7))) {
        v0 = _mm512_loadu_si512(b);
        v1 = _mm512_loadu_si512(b + 64);
        b += 128;
      } else {
        const __m512i lo = _mm512_loadu_si512(b);
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64));
        const __m256i clo = _mm256_and_si256(c, nib);
        const __m256i chi = _mm256_and_si256(_mm256_srli_epi16(c, 4), nib);
        const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(clo), chi, 1);
        const __m512i hi = _mm512_shuffle_epi8(table, codes);
        v0 = _mm512_unpacklo_epi8(lo, hi);
        v1 = _mm512_unpackhi_epi8(lo, hi);
        b += 96;
      }
      fma_pair(v0, x[k], x[k + 1], a0, a1);
      fma_pair(v1, x[k + 2], x[k + 3], a0, a1);
    }
    _mm512_storeu_ps(y + p * kRows, _mm512_add_ps(a0, a1));
  }
}

template <typename F>
double timed(int threads, int64_t panels, F&& f) {
  const double t = now();
  std::vector<std::thread> ts;
  for (int i = 1; i < threads; ++i)
    ts.emplace_back([&, i] { f(panels * i / threads, panels * (i + 1) / threads); });
  f(0, panels / threads);
  for (auto& th : ts) th.join();
  return now() - t;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s rows K reps threads std [--no-prefetch]\n", argv[0]);
    return 2;
  }
  const int64_t M = std::atoll(argv[1]), K = std::atoll(argv[2]);
  const int reps = std::atoi(argv[3]), threads = std::atoi(argv[4]);
  const double sd = std::atof(argv[5]);
  if (argc > 6 && std::strcmp(argv[6], "--no-prefetch") == 0) g_prefetch = false;
  if (M % kRows || K % 64) {
    std::fprintf(stderr, "rows must be a multiple of 16 and K of 64\n");
    return 2;
  }
  const int64_t panels = M / kRows;
  auto* w = static_cast<uint16_t*>(alloc(static_cast<size_t>(M * K) * 2));
  {  // normal(0, sd) weights, generated in two threads (a GiB takes a while)
    auto fill = [&](int64_t a, int64_t b, unsigned seed) {
      std::mt19937_64 g(seed);
      std::normal_distribution<float> n(0.f, static_cast<float>(sd));
      for (int64_t i = a; i < b; ++i) w[i] = to_bf16(n(g));
    };
    std::thread t2(fill, M * K / 2, M * K, 2u);
    fill(0, M * K / 2, 1u);
    t2.join();
  }
  std::vector<float> x(K);
  std::mt19937 g(7);
  std::normal_distribution<float> n(0.f, 1.f);
  for (auto& v : x) v = n(g);
  const Packed pk = pack(w, panels, K);
  std::vector<float> y0(M), y1(M);
  std::vector<double> tp, tc;
  for (int r = 0; r < reps; ++r) {  // arms alternate
    tp.push_back(timed(threads, panels, [&](int64_t a, int64_t b) { plain_panels(w, a, b, K, x.data(), y0.data()); }));
    tc.push_back(timed(threads, panels, [&](int64_t a, int64_t b) { packed_panels(pk, a, b, K, x.data(), y1.data()); }));
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double plain_bytes = static_cast<double>(M * K) * 2;
  const bool equal = std::memcmp(y0.data(), y1.data(), M * 4) == 0;
  const double mp = med(tp), mc = med(tc);
  std::printf(
      "{\"rows\": %lld, \"K\": %lld, \"threads\": %d, \"prefetch\": %s, \"plain_bytes\": %.0f, \"packed_bytes\": %zu, "
      "\"raw_blocks\": %lld, \"blocks\": %lld, \"plain_ms\": %.3f, \"packed_ms\": %.3f, \"plain_gbs\": %.2f, "
      "\"packed_gbs\": %.2f, \"speedup\": %.3f, \"equal\": %s}\n",
      static_cast<long long>(M), static_cast<long long>(K), threads, g_prefetch ? "true" : "false", plain_bytes,
      pk.bytes, static_cast<long long>(pk.raw_blocks), static_cast<long long>(pk.blocks), mp * 1e3, mc * 1e3,
      plain_bytes / mp / 1e9, pk.bytes / mc / 1e9, mp / mc, equal ? "true" : "false");
  return equal ? 0 : 1;
}
