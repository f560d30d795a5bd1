// [NOTE] Read-bandwidth probe, AVX-512 flavour: 16 interleaved streams per thread, one 64-byte
// load per stream per step, XOR-folded into 4 accumulators (the sum only has to be kept alive).
// Compiled with the AVX-512 tier's flags; called only when that tier is supported.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace hina::detail {

uint64_t read_streams_avx512(const uint64_t* const* base, int streams, int64_t len) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < len; i += 8) {
    int k = 0;
    for (; k + 4 <= streams; k += 4) {
      a0 = _mm512_xor_si512(a0, _mm512_load_si512(base[k] + i));
      a1 = _mm512_xor_si512(a1, _mm512_load_si512(base[k + 1] + i));
      a2 = _mm512_xor_si512(a2, _mm512_load_si512(base[k + 2] + i));
      a3 = _mm512_xor_si512(a3, _mm512_load_si512(base[k + 3] + i));
    }
    for (; k < streams; ++k) a0 = _mm512_xor_si512(a0, _mm512_load_si512(base[k] + i));
  }
  a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  // summed as uint64 (wrapping): GCC's _mm512_reduce_add_epi64 adds the lanes as signed long long,
  // which overflows on the probe's arbitrary bits (UBSan stopped the sanitizer runs on it)
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, a0);
  uint64_t sum = 0;
  for (uint64_t v : lanes) sum += v;
  return sum;
}

}  // namespace hina::detail
