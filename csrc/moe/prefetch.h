// Software prefetch of the weight stream, shared by the FMA and integer-dot kernels (avx2, avx512).
//
// Distance: fixed when the library loads (load_prefetch_distance, experts/forward.cpp), into L2 (prefetcht1):
// HINA_MOE_PREFETCH_BYTES when it holds a multiple of 64 in [0, 65536], else by the CPU's vendor.
// The best distance depends on the memory system (benchmarks/bench_prefetch.py and
// bench_decode_breakdown.py --ab-prefetch, distances interleaved in one process; RESULTS.md):
// - Intel (the Xeon with AMX measured until 2026-11-30): 4 KiB. Against the first guess (1 KiB
//   into L1) it took an OLMoE-shaped decode op from 19.0 to 22.6 GB/s; 2 KiB was 6 % slower at
//   int4 (2026-11-30, a13f73e). The L2 streamer stops at every 4 KiB page; a page ahead keeps it going.
// - AMD (EPYC Zen 4 with AVX-512): 1 KiB. First measured: 4 KiB was the worst of 0-4 KiB at every
//   width (whole OLMoE steps 2 KiB against 4 KiB -10 % int4, -16 % lossless, -2 % int8, Qwen
//   int4 -8 %). Measured again on 2026-12-05 (5ffb27c), the kernels of layout 4 (in-process A/B, tuning build): int4 whole
//   steps 2.4-4 % shorter at 1 KiB than at 2 KiB (OLMoE and Qwen 4L, both host phases; 512 bytes
//   and none alike), int8 steps equal (Qwen 4L) or 6 % shorter (OLMoE), lossless12 equal; at
//   op level int4 +3 %, int8 -0.5 %, bf16 equal; the AVX2 kernels on that core int8 +47 %,
//   int4 +18 %.
// - Anything else: 4 KiB (untested).
// The lossless12 decode kernel (moe_l12_avx512.cpp) decodes each block before its FMAs; on the AMD
// EPYC its software prefetch cost 40 % of a single thread's speed (19.6-20.1 against 14.2-14.4 GB/s
// of packed bytes; whole Qwen steps 1.19x lossless without it, 0.80-1.04x with it), so there it
// leaves the stream to the hardware prefetchers: l12_prefetch() is false on AMD unless
// HINA_MOE_PREFETCH_BYTES is set (then every kernel takes that distance).
//
// Jobs of several rows (batched decode, prefill; the int8 / int4 kernels only), on AMD: none for 2-3
// rows, 16 KiB for kManyRows (4) or more. A row block of 2-3 rows takes longer per byte than the
// memory system delivers it, and a software prefetch 1 KiB ahead slowed such jobs instead of
// helping (2026-12-05, ebf37b6: the int4 lm_head of Qwen1.5-MoE 4L at 4 rows 9.7 ms at 1 KiB, 8.6 with
// none, 7.2 at 16 KiB; 2 rows best without a far one; benchmarks/study_linear_rows.py). Whole
// steps (bench_batch_decode.py --ab-prefetch, three runs): batches of 4 / 8 / 16 sequences
// 1.22x / 1.10x / 1.06-1.11x faster at 16 KiB than at 1 KiB and 1.13-1.15x / 1.07-1.08x /
// 1.02-1.03x than with none, batches of 2 4-7 % slower at 16 KiB than with none; one row
// unchanged. Elsewhere the one-row distance (untested: Intel's was measured on one-row jobs).
// HINA_MOE_PREFETCH_BYTES sets all three; 0 means no software prefetch in the int8 / int4 kernels.
//
// A build configured with -DHINA_PREFETCH_TUNING=ON reads HINA_PF (bytes ahead), HINA_PFM (bytes
// ahead for every job of several rows; the defaults above when unset, HINA_PF's value when only
// it is set) and HINA_PFH (0: L1, 1: L2, 2: L3, 3: non-temporal) at the start of every kernel job
// instead, so benchmarks/bench_prefetch.py, bench_batch_decode.py and study_linear_rows.py can
// compare settings round by round in one process. Never in a release build.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HINA_PF(p, x86_hint, locality) _mm_prefetch((p), x86_hint)
#else
// other architectures (aarch64): the same distances through the compiler's portable prefetch
#define HINA_PF(p, x86_hint, locality) __builtin_prefetch((p), 0, locality)
#endif

#include <cstdint>
#include <cstdlib>

namespace hina::detail::pf {

int load_prefetch_distance();  // experts/forward.cpp: the environment or the CPU's vendor
int load_rows_prefetch(bool many);  // experts/forward.cpp: the same for jobs of 2-3 rows (many: kManyRows or more)
constexpr int64_t kManyRows = 4;
bool load_l12_prefetch();      // experts/forward.cpp: whether the lossless12 kernel prefetches (see above)
inline const bool g_l12_prefetch = load_l12_prefetch();
inline bool l12_prefetch() { return g_l12_prefetch; }

#ifdef HINA_PREFETCH_TUNING
inline int g_bytes = load_prefetch_distance();
inline int g_hint = 1;
inline int g_few_bytes = load_rows_prefetch(false);
inline int g_many_bytes = load_rows_prefetch(true);
inline int g_amx = 2;
inline void reload() {
  const char* b = std::getenv("HINA_PF");
  const char* m = std::getenv("HINA_PFM");
  const char* h = std::getenv("HINA_PFH");
  g_bytes = b ? std::atoi(b) : load_prefetch_distance();
  g_few_bytes = m ? std::atoi(m) : b ? g_bytes : load_rows_prefetch(false);
  g_many_bytes = m ? std::atoi(m) : b ? g_bytes : load_rows_prefetch(true);
  g_hint = h ? std::atoi(h) : 1;
  const char* a = std::getenv("HINA_PFA");
  g_amx = a ? std::atoi(a) : 2;
}
inline int bytes() { return g_bytes; }
inline int rows_bytes(bool many) { return many ? g_many_bytes : g_few_bytes; }
inline int amx_mode() { return g_amx; }
inline void line(const void* p) {
  const char* c = static_cast<const char*>(p);
  if (g_hint == 0) HINA_PF(c, _MM_HINT_T0, 3);
  else if (g_hint == 1) HINA_PF(c, _MM_HINT_T1, 2);
  else if (g_hint == 2) HINA_PF(c, _MM_HINT_T2, 1);
  else HINA_PF(c, _MM_HINT_NTA, 0);
}
#else
inline const int g_bytes_at_load = load_prefetch_distance();
inline const int g_few_bytes_at_load = load_rows_prefetch(false);
inline const int g_many_bytes_at_load = load_rows_prefetch(true);
inline void reload() {}
inline int bytes() { return g_bytes_at_load; }
inline int rows_bytes(bool many) { return many ? g_many_bytes_at_load : g_few_bytes_at_load; }
constexpr int amx_mode() { return 2; }
inline void line(const void* p) { HINA_PF(static_cast<const char*>(p), _MM_HINT_T1, 2); }
#endif

// The distance an int8 / int4 job of `rows` rows prefetches its weights at (0: none).
inline int ahead(int64_t rows) { return rows > 1 ? rows_bytes(rows >= kManyRows) : bytes(); }

}  // namespace hina::detail::pf
