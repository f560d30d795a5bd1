// [NOTE] l12_decompress_panel_avx512: the AVX-512 build of the lossless12 panel decompressor
// (PackedHeader in hina_moe/moe.h), used by the wrapped kernels of the avx512 and amx tiers.
// Flags: those of moe_avx512.cpp (F/BW/VL): vpshufb zmm and the byte unpacks are AVX-512 BW.
// Plan per block: lo = 64 low bytes; hi = vpshufb(table, [c & 15 | c >> 4 & 15]) (normal) or
// [slot's 32 | next spill slot's 32] (spilled); unpacklo/hi_epi8(lo, hi) = the two plain
// vectors, bit for bit.
#include <immintrin.h>

#include <algorithm>

#include "moe/kernel_api.h"

namespace hina::detail {
namespace {

// Walks the blocks of one panel in order (spilled blocks take the spill slots in order).
struct PanelReader {
  const uint8_t* panel;
  L12Geometry g;
  __m512i table;
  int64_t spilled = 0;

  PanelReader(const void* p, int64_t plain_bytes)
      : panel(static_cast<const uint8_t*>(p)), g(l12_geometry(plain_bytes)),
        table(_mm512_loadu_si512(p)) {}

  const uint8_t* slot(int64_t b) const { return panel + g.slots + b * kL12Slot; }

  inline void block(int64_t b, __m512i& v0, __m512i& v1) {
    const uint8_t* s = slot(b);
    const __m512i lo = _mm512_loadu_si512(s);
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    __m512i hi;
    if (panel[kL12Table + (b >> 3)] >> (b & 7) & 1) {
      const uint8_t* sp = panel + g.spill + std::min(spilled++, g.cap - 1) * kL12SpillSlot;
      hi = _mm512_inserti64x4(_mm512_castsi256_si512(c), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)), 1);
    } else {
      const __m256i nib = _mm256_set1_epi8(0x0f);
      const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(c, nib)),
                                               _mm256_and_si256(_mm256_srli_epi16(c, 4), nib), 1);
      hi = _mm512_shuffle_epi8(table, codes);
    }
    v0 = _mm512_unpacklo_epi8(lo, hi);
    v1 = _mm512_unpackhi_epi8(lo, hi);
  }
};

}  // namespace

void l12_decompress_panel_avx512(const uint8_t* panel, int64_t plain_bytes, uint16_t* plain) {
  PanelReader pr(panel, plain_bytes);
  for (int64_t b = 0; b < pr.g.nb; ++b) {
    __m512i v0, v1;
    pr.block(b, v0, v1);
    _mm512_storeu_si512(plain + b * 64, v0);
    _mm512_storeu_si512(plain + b * 64 + 32, v1);
  }
}

}  // namespace hina::detail
