// The AMX tile operations moe_amx.cpp uses (HINA_TILE_* with a literal tile number).
//
// The hardware build maps each one to its intrinsic. The software build
// (HINA_AMX_SOFTWARE_TILES, moe_amx_sw.cpp: the C++ tests' build only, never the Python
// module) keeps the eight tiles in a thread's memory and does what the instructions do, so the
// AMX kernels' own code (panel expansion, the tile plan, epilogues, the next panel's prefetch)
// runs and is checked on CPUs without AMX. Only what the kernels use is modelled: palette 1,
// loads and stores of rows x colsb bytes, zeroing, and TDPBF16PS (Intel SDM: for each row m,
// for each pair k, c[m][n] += a[m][2k] * b[k][2n], then += a[m][2k+1] * b[k][2n+1], in fp32;
// rounding each step here, so sums may differ from the hardware in the last bits: the tests
// compare within a tolerance, as they do on real AMX).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace hina::detail::tiles {

// The 64-byte tile configuration (palette 1): bytes 16-47 colsb[16], 48-63 rows[16].
struct alignas(64) Config {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(Config) == 64, "tile configuration is 64 bytes");

#ifndef HINA_AMX_SOFTWARE_TILES

inline void configure(const Config& c) { _tile_loadconfig(&c); }
inline void release() { _tile_release(); }
// GCC's tile intrinsics paste the tile number into their assembly text, so it has to be a
// literal at the call: macros here, not templates.
#define HINA_TILE_ZERO(t) _tile_zero(t)
#define HINA_TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define HINA_TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define HINA_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)

#else

struct State {
  alignas(64) uint8_t t[8][16][64];
  int rows[8];
  int colsb[8];
  bool configured = false;
};
inline thread_local State tls_state;

[[noreturn]] inline void misuse(const char* what) {
  std::fprintf(stderr, "software AMX tiles: %s\n", what);
  std::abort();
}

inline void configure(const Config& c) {
  if (c.palette_id != 1) misuse("only palette 1 is modelled");
  State& s = tls_state;
  for (int i = 0; i < 8; ++i) {
    if (c.rows[i] > 16 || c.colsb[i] > 64 || c.colsb[i] % 4 != 0) misuse("tile shape beyond palette 1");
    s.rows[i] = c.rows[i];
    s.colsb[i] = c.colsb[i];
  }
  std::memset(s.t, 0, sizeof(s.t));
  s.configured = true;
}
inline void release() { tls_state.configured = false; }
inline State& ready() {
  if (!tls_state.configured) misuse("tile used before configure()");
  return tls_state;
}
template <int T>
inline void zero() {
  std::memset(ready().t[T], 0, sizeof(tls_state.t[T]));
}
template <int T>
inline void load(const void* p, int64_t stride) {
  State& s = ready();
  for (int r = 0; r < s.rows[T]; ++r)
    std::memcpy(s.t[T][r], static_cast<const uint8_t*>(p) + r * stride, static_cast<size_t>(s.colsb[T]));
}
template <int T>
inline void store(void* p, int64_t stride) {
  State& s = ready();
  for (int r = 0; r < s.rows[T]; ++r)
    std::memcpy(static_cast<uint8_t*>(p) + r * stride, s.t[T][r], static_cast<size_t>(s.colsb[T]));
}
inline float bf16_at(const uint8_t* row, int i) {
  uint16_t h;
  std::memcpy(&h, row + 2 * i, 2);
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <int C, int A, int B>
inline void dpbf16ps() {
  static_assert(C != A && C != B && A != B, "TDPBF16PS takes three different tiles");
  State& s = ready();
  const int M = s.rows[C], N = s.colsb[C] / 4, K = s.colsb[A] / 4;
  if (s.rows[A] != M || s.rows[B] != K || s.colsb[B] != s.colsb[C]) misuse("TDPBF16PS shapes do not agree");
  for (int m = 0; m < M; ++m) {
    float c[16];
    std::memcpy(c, s.t[C][m], sizeof(float) * N);
    for (int k = 0; k < K; ++k)
      for (int n = 0; n < N; ++n) {
        c[n] += bf16_at(s.t[A][m], 2 * k) * bf16_at(s.t[B][k], 2 * n);
        c[n] += bf16_at(s.t[A][m], 2 * k + 1) * bf16_at(s.t[B][k], 2 * n + 1);
      }
    std::memcpy(s.t[C][m], c, sizeof(float) * N);
  }
}

#define HINA_TILE_ZERO(t) ::hina::detail::tiles::zero<t>()
#define HINA_TILE_LOAD(t, p, stride) ::hina::detail::tiles::load<t>(p, stride)
#define HINA_TILE_STORE(t, p, stride) ::hina::detail::tiles::store<t>(p, stride)
#define HINA_TILE_DPBF16PS(c, a, b) ::hina::detail::tiles::dpbf16ps<c, a, b>()

#endif

}  // namespace hina::detail::tiles
