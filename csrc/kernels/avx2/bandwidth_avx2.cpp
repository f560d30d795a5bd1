// [NOTE] Read-bandwidth probe, AVX2 flavour: 16 interleaved streams per thread, one 64-byte line
// per stream per step (two 32-byte loads), XOR-folded into 4 accumulators (the sum only has to be
// kept alive). Compiled with the AVX2 tier's flags; called only when that tier is supported and
// AVX-512 is not. Without it an AVX2-only CPU probed with the baseline-ISA loop, which our own
// decode kernels out-read (the demo showed 106 % of that "limit" on an AMD Zen 3).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace hina::detail {

uint64_t read_streams_avx2(const uint64_t* const* base, int streams, int64_t len) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < len; i += 8) {
    int k = 0;
    for (; k + 2 <= streams; k += 2) {
      const auto* p = reinterpret_cast<const __m256i*>(base[k] + i);
      const auto* q = reinterpret_cast<const __m256i*>(base[k + 1] + i);
      a0 = _mm256_xor_si256(a0, _mm256_load_si256(p));
      a1 = _mm256_xor_si256(a1, _mm256_load_si256(p + 1));
      a2 = _mm256_xor_si256(a2, _mm256_load_si256(q));
      a3 = _mm256_xor_si256(a3, _mm256_load_si256(q + 1));
    }
    for (; k < streams; ++k) {
      const auto* p = reinterpret_cast<const __m256i*>(base[k] + i);
      a0 = _mm256_xor_si256(a0, _mm256_xor_si256(_mm256_load_si256(p), _mm256_load_si256(p + 1)));
    }
  }
  a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a0);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

}  // namespace hina::detail
