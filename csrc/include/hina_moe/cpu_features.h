// CPU feature detection: what the processor reports (cpuid / hwcaps) AND what the operating
// system lets us use (XCR0 state components, AMX permission). A feature counts only when both
// agree: an AVX-512 CPU under an OS that does not save ZMM state must not run AVX-512 code.
#pragma once

#include <cstdint>

namespace hina {

// Kernel tiers, ordered: a higher x86 tier implies every lower one is usable.
enum class Isa : int {
  kGeneric = 0,  // portable scalar C++: the oracle every SIMD kernel is tested against
  kAvx2 = 1,     // AVX2 + FMA + F16C
  kAvx512 = 2,   // AVX-512 F/BW/VL (+BF16/FP16/VNNI used when present)
  kAmx = 3,      // AVX-512 tier + AMX tile/bf16 with the kernel's permission granted
  kNeon = 10,    // aarch64 Advanced SIMD (separate family; not ordered against x86 tiers)
  kDotprod = 11, // neon + SDOT/UDOT (FEAT_DotProd, Armv8.2-A and later: Graviton 2/3/4, Altra, Grace)
  kI8mm = 12,    // dotprod + SMMLA (FEAT_I8MM: Neoverse N2/V1/V2, Graviton 3/4, Grace)
  kBf16 = 13,    // i8mm + BFDOT/BFMMLA (FEAT_BF16: the same cores; Armv8.6-A requires both)
};

const char* isa_name(Isa isa);
// Parses "generic" | "avx2" | "avx512" | "amx" | "neon" | "dotprod" | "i8mm" | "bf16"; returns false on an unknown name.
bool isa_from_name(const char* name, Isa* out);

struct CpuFeatures {
  char arch[16] = {0};    // "x86_64", "aarch64", ...
  char vendor[16] = {0};  // cpuid vendor string on x86
  char brand[64] = {0};   // cpuid brand string on x86
  // What the CPU reports.
  bool sse42 = false, avx = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512vbmi = false, avx512vnni = false, avx512bf16 = false, avx512fp16 = false, avx_vnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  // aarch64, from the Linux hwcaps (AT_HWCAP / AT_HWCAP2), named as /proc/cpuinfo names them:
  // asimddp = SDOT/UDOT, i8mm = SMMLA/USMMLA, bf16 = BFDOT/BFMMLA/BFCVT, sve = SVE (any length).
  bool neon = false, asimddp = false, i8mm = false, bf16 = false, sve = false;
  // What the OS enables (XCR0 bits) and grants (AMX needs a per-process permission on Linux).
  uint64_t xcr0 = 0;
  bool os_avx = false, os_avx512 = false, os_amx = false;
  bool amx_permission = false;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) succeeded
};

// Detects once (thread-safe, cached) and returns the process-wide result. The first call on an
// AMX-capable Linux machine requests the AMX tile-data permission for this process.
const CpuFeatures& cpu_features();

// The highest tier whose every requirement (CPU + OS + permission) holds.
Isa best_isa(const CpuFeatures& f);
// Whether `isa` can run here (used to refuse an override that asks for more than the CPU has).
bool isa_supported(const CpuFeatures& f, Isa isa);

// Tests only. In builds with the software-tile AMX kernels (the C++ tests' build:
// amx_software_tiles_built()), use_amx_software_tiles(true) makes the amx tier available on an
// AVX-512 CPU without AMX and runs its kernels on software tiles (kernels/amx/tiles.h): slow,
// for checking the kernels' code, never for speed. Elsewhere it throws std::logic_error. Set it
// before anything selects an amx kernel: the lossless12 path keeps its first selection.
bool amx_software_tiles_built();
void use_amx_software_tiles(bool on);
bool amx_software_tiles();

}  // namespace hina
