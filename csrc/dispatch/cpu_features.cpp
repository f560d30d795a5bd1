// Compiled at the baseline flags of the target: this file must run on every CPU, including
// those it reports as lacking every extension.
#include "hina_moe/cpu_features.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define HINA_X86 1
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace hina {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kGeneric: return "generic";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAmx: return "amx";
    case Isa::kNeon: return "neon";
    case Isa::kDotprod: return "dotprod";
    case Isa::kI8mm: return "i8mm";
    case Isa::kBf16: return "bf16";
  }
  return "unknown";
}

bool isa_from_name(const char* name, Isa* out) {
  static const Isa all[] = {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512, Isa::kAmx, Isa::kNeon, Isa::kDotprod, Isa::kI8mm, Isa::kBf16};
  for (Isa isa : all) {
    if (std::strcmp(name, isa_name(isa)) == 0) {
      *out = isa;
      return true;
    }
  }
  return false;
}

namespace {

#if defined(HINA_X86)
void cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
  __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}

uint64_t read_xcr0() {
  uint32_t lo = 0, hi = 0;
  // xgetbv is only legal once the OS has set CR4.OSXSAVE; the caller checks that first.
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool bit(uint32_t reg, int b) { return (reg >> b) & 1u; }

void detect_x86(CpuFeatures& f) {
  std::strcpy(f.arch, "x86_64");
  uint32_t r[4];
  cpuid(0, 0, r);
  const uint32_t max_leaf = r[0];
  std::memcpy(f.vendor + 0, &r[1], 4);
  std::memcpy(f.vendor + 4, &r[3], 4);
  std::memcpy(f.vendor + 8, &r[2], 4);

  cpuid(0x80000000u, 0, r);
  if (r[0] >= 0x80000004u) {
    for (uint32_t i = 0; i < 3; ++i) {
      cpuid(0x80000002u + i, 0, r);
      std::memcpy(f.brand + 16 * i, r, 16);
    }
  }

  bool osxsave = false;
  if (max_leaf >= 1) {
    cpuid(1, 0, r);
    f.sse42 = bit(r[2], 20);
    f.fma = bit(r[2], 12);
    f.f16c = bit(r[2], 29);
    f.avx = bit(r[2], 28);
    osxsave = bit(r[2], 27);
  }
  if (max_leaf >= 7) {
    cpuid(7, 0, r);
    const uint32_t max_sub = r[0];
    f.avx2 = bit(r[1], 5);
    f.avx512f = bit(r[1], 16);
    f.avx512dq = bit(r[1], 17);
    f.avx512bw = bit(r[1], 30);
    f.avx512vl = bit(r[1], 31);
    f.avx512vbmi = bit(r[2], 1);
    f.avx512vnni = bit(r[2], 11);
    f.amx_bf16 = bit(r[3], 22);
    f.avx512fp16 = bit(r[3], 23);
    f.amx_tile = bit(r[3], 24);
    f.amx_int8 = bit(r[3], 25);
    if (max_sub >= 1) {
      cpuid(7, 1, r);
      f.avx_vnni = bit(r[0], 4);
      f.avx512bf16 = bit(r[0], 5);
    }
  }
  if (osxsave) {
    f.xcr0 = read_xcr0();
    f.os_avx = (f.xcr0 & 0x6) == 0x6;                 // XMM + YMM state
    f.os_avx512 = f.os_avx && (f.xcr0 & 0xE0) == 0xE0;  // opmask + ZMM_Hi256 + Hi16_ZMM
    f.os_amx = (f.xcr0 & 0x60000) == 0x60000;         // XTILECFG + XTILEDATA
  }
#if defined(__linux__)
  if (f.amx_tile && f.os_amx) {
    // Linux keeps AMX tile data disabled until the process asks for it (kernel >= 5.16).
    constexpr int kArchGetXcompPerm = 0x1022;
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr unsigned long kXfeatureXtiledata = 18;
    unsigned long bitmask = 0;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 &&
        syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) == 0) {
      f.amx_permission = (bitmask >> kXfeatureXtiledata) & 1u;
    }
  }
#endif
}
#endif  // HINA_X86

#if defined(__aarch64__)
void detect_arm(CpuFeatures& f) {
  std::strcpy(f.arch, "aarch64");
  f.neon = true;  // Advanced SIMD is mandatory in AArch64
#if defined(__linux__)
  // The bits are the kernel's ABI (arch/arm64/include/uapi/asm/hwcap.h); spelled out for
  // toolchains whose headers predate them.
  constexpr unsigned long kAsimddp = 1ul << 20, kSve = 1ul << 22;  // AT_HWCAP
  constexpr unsigned long kI8mm = 1ul << 13, kBf16 = 1ul << 14;    // AT_HWCAP2
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  f.asimddp = (hw & kAsimddp) != 0;
  f.sve = (hw & kSve) != 0;
  f.i8mm = (hw2 & kI8mm) != 0;
  f.bf16 = (hw2 & kBf16) != 0;
#endif
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#if defined(HINA_X86)
  detect_x86(f);
#elif defined(__aarch64__)
  detect_arm(f);
#else
  std::strcpy(f.arch, "unknown");
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static std::once_flag once;
  static CpuFeatures features;
  std::call_once(once, [] { features = detect(); });
  return features;
}

namespace {
std::atomic<bool> g_amx_software{false};
}  // namespace

bool amx_software_tiles_built() {
#ifdef HINA_AMX_SOFTWARE_TILES_BUILT
  return true;
#else
  return false;
#endif
}

void use_amx_software_tiles(bool on) {
  if (on && !amx_software_tiles_built())
    throw std::logic_error("this build has no software-tile AMX kernels (only the C++ tests' build does)");
  g_amx_software.store(on);
}

bool amx_software_tiles() { return g_amx_software.load(std::memory_order_relaxed); }

bool isa_supported(const CpuFeatures& f, Isa isa) {
  const bool avx2 = f.avx2 && f.fma && f.f16c && f.os_avx;
  const bool avx512 = avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.os_avx512;
  switch (isa) {
    case Isa::kGeneric: return true;
    case Isa::kAvx2: return avx2;
    case Isa::kAvx512: return avx512;
    case Isa::kAmx:
      return avx512 && ((f.amx_tile && f.amx_bf16 && f.os_amx && f.amx_permission) || amx_software_tiles());
    case Isa::kNeon: return f.neon;
    case Isa::kDotprod: return f.neon && f.asimddp;
    case Isa::kI8mm: return f.neon && f.asimddp && f.i8mm;
    case Isa::kBf16: return f.neon && f.asimddp && f.i8mm && f.bf16;
  }
  return false;
}

Isa best_isa(const CpuFeatures& f) {
  if (f.neon) {
    if (!f.asimddp) return Isa::kNeon;
    return !f.i8mm ? Isa::kDotprod : f.bf16 ? Isa::kBf16 : Isa::kI8mm;
  }
  for (Isa isa : {Isa::kAmx, Isa::kAvx512, Isa::kAvx2}) {
    if (isa_supported(f, isa)) return isa;
  }
  return Isa::kGeneric;
}

}  // namespace hina
