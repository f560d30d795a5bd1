// Every selection ladder in one place (dispatch/select.h): the experts' kernels, lossless12's,
// the integer dot's, and the per-row vector builds of attention, MLA, rope and silu_mul.
// Baseline flags: this file only chooses; the kernels live in their ISA translation units.
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "dispatch/select.h"
#include "hina_moe/cpu_features.h"
#include "hina_moe/experts.h"

namespace hina {
namespace detail {

std::string cpu_summary() {
  const CpuFeatures& f = cpu_features();
  std::string s = "best tier here: '";
  s += isa_name(best_isa(f));
  if (f.neon) {
    return s + "'; cpu: " + f.arch + " neon=1 asimddp=" + std::to_string(f.asimddp) + " i8mm=" +
           std::to_string(f.i8mm) + " bf16=" + std::to_string(f.bf16) + " sve=" + std::to_string(f.sve);
  }
  s += "'; cpu: avx2=" + std::to_string(f.avx2) + " fma=" + std::to_string(f.fma) +
       " f16c=" + std::to_string(f.f16c) + " avx512f=" + std::to_string(f.avx512f) +
       " avx512bw=" + std::to_string(f.avx512bw) + " avx512vl=" + std::to_string(f.avx512vl) +
       " amx_tile=" + std::to_string(f.amx_tile) + " amx_bf16=" + std::to_string(f.amx_bf16) +
       "; os: avx=" + std::to_string(f.os_avx) + " avx512=" + std::to_string(f.os_avx512) +
       " amx=" + std::to_string(f.os_amx) + " amx_permission=" + std::to_string(f.amx_permission);
  return s;
}

// Which kernels run for (tier, dtype, concrete path, format, qdot), and under which name.
// `kernel` is the <kernel> part of the name: an Isa (0..3), one of the integer-dot kinds, or the
// bf16 dot-product prefill (avx512bf16).
const char* kind_name(int kind) {
  switch (kind) {
    case kKindGenericDot: return "genericdot";
    case kKindAvx2Dot: return "avx2dot";
    case kKindAvx512Vnni: return "avx512vnni";
    case kKindAvxVnni: return "avxvnni";
    case kKindAvx512Bf16: return "avx512bf16";
    case kKindNeon: return "neon";
    case kKindNeonDot: return "neondot";
    case kKindDotprod: return "dotprod";
    case kKindI8mm: return "i8mm";
    case kKindNeonBf16: return "neonbf16";
    default: return isa_name(static_cast<Isa>(kind));
  }
}


// The prefill of bf16 weights on the avx512 tier of a CPU with AVX512-BF16 (and so no AMX tier,
// or the amx tier forced down): vdpbf16ps on bf16 x and h rows, the AMX kernels' contract.
// Tuning builds (HINA_PREFETCH_TUNING) read HINA_BF16DOT=0 at every call to turn it off, so a
// benchmark can compare it with the fp32 kernel in one process; release builds cannot.
static bool bf16dot_prefill(Isa tier, MoePath path) {
  if (tier != Isa::kAvx512 || path != MoePath::kPrefill || !cpu_features().avx512bf16) return false;
#ifdef HINA_PREFETCH_TUNING
  if (const char* v = std::getenv("HINA_BF16DOT"); v && std::atoi(v) == 0) return false;
#endif
  return true;
}

static bool arm_tier(Isa t) {
  return t == Isa::kNeon || t == Isa::kDotprod || t == Isa::kI8mm || t == Isa::kBf16;
}

// The Arm kernels exist only in aarch64 builds (kernels/neon/); elsewhere the Arm tiers never
// pass check_tier, and these say so to the ladders below.
#if defined(HINA_HAVE_NEON_KERNELS)
bool neon_kernels(DType dt, KernelImpl* k) { return get_kernels_neon(dt, k); }
static bool neon_qdot(WFormat wf, KernelImpl* k) { return get_qdot_kernels_neon(wf, k); }
static bool dotprod_qdot(WFormat wf, KernelImpl* k) {
  return cpu_features().asimddp && get_qdot_kernels_dotprod(wf, k);
}
static bool i8mm_qdot(WFormat wf, KernelImpl* k) {
  return cpu_features().asimddp && cpu_features().i8mm && get_qdot_kernels_i8mm(wf, k);
}
bool neonbf16_kernels(DType dt, KernelImpl* k) {
  const CpuFeatures& f = cpu_features();
  return f.asimddp && f.i8mm && f.bf16 && get_kernels_neonbf16(dt, k);
}
#else
bool neon_kernels(DType, KernelImpl*) { return false; }
static bool neon_qdot(WFormat, KernelImpl*) { return false; }
static bool dotprod_qdot(WFormat, KernelImpl*) { return false; }
static bool i8mm_qdot(WFormat, KernelImpl*) { return false; }
bool neonbf16_kernels(DType, KernelImpl*) { return false; }
#endif

// The integer-dot kernels for this tier (false: the tier has no SIMD integer-dot kernel).
static bool select_qdot(Isa tier, WFormat wf, Selected* s) {
  if ((tier == Isa::kI8mm || tier == Isa::kBf16) && i8mm_qdot(wf, &s->k)) {
    s->kind = kKindI8mm;
    return true;
  }
  if ((tier == Isa::kDotprod || tier == Isa::kI8mm || tier == Isa::kBf16) && dotprod_qdot(wf, &s->k)) {
    s->kind = kKindDotprod;
    return true;
  }
  if (arm_tier(tier) && neon_qdot(wf, &s->k)) {
    s->kind = kKindNeonDot;
    return true;
  }
  const bool x86 = tier == Isa::kAvx2 || tier == Isa::kAvx512 || tier == Isa::kAmx;
  if ((tier == Isa::kAvx512 || tier == Isa::kAmx) && cpu_features().avx512vnni &&
      get_qdot_kernels_avx512vnni(wf, &s->k)) {
    s->kind = kKindAvx512Vnni;
    return true;
  }
  if (x86 && cpu_features().avx_vnni && get_qdot_kernels_avxvnni(wf, &s->k)) {
    s->kind = kKindAvxVnni;
    return true;
  }
  if (x86 && get_qdot_kernels_avx2(wf, &s->k)) {
    s->kind = kKindAvx2Dot;
    return true;
  }
  return false;
}

// The amx tier's kernels: the hardware build, or in the C++ tests' build while
// use_amx_software_tiles(true) the same code on software tiles (moe_amx_sw.cpp).
bool amx_kernels(DType dt, KernelImpl* k) {
#ifdef HINA_AMX_SOFTWARE_TILES_BUILT
  if (amx_software_tiles()) return get_kernels_amx_sw(dt, k);
#endif
  return get_kernels_amx(dt, k);
}
bool amx_qkernels(WFormat wf, KernelImpl* k) {
#ifdef HINA_AMX_SOFTWARE_TILES_BUILT
  if (amx_software_tiles()) return get_qkernels_amx_sw(wf, k);
#endif
  return get_qkernels_amx(wf, k);
}

// lossless12 (bf16 only): the fused AVX-512 kernels for decode on the avx512 and amx tiers, the
// wrapped plain kernels of the tier and path everywhere else.
static Selected select_l12(Isa tier, MoePath path) {
  Selected s{};
  const bool avx512 = tier == Isa::kAvx512 || tier == Isa::kAmx;
  if (tier == Isa::kAmx && path == MoePath::kPrefill && l12_wrapped_kernels(Plain::kAmx, &s.k)) {
    s.kind = static_cast<int>(Isa::kAmx);
  } else if (bf16dot_prefill(tier, path) && l12_wrapped_kernels(Plain::kAvx512Bf16, &s.k)) {
    s.kind = kKindAvx512Bf16;
  } else if (avx512 && path == MoePath::kDecode &&
             ((cpu_features().avx512vbmi && get_l12_kernels_avx512vbmi(&s.k)) || get_l12_kernels_avx512(&s.k))) {
    s.kind = static_cast<int>(Isa::kAvx512);  // either build: the same bytes, the same name
  } else if (avx512 && l12_wrapped_kernels(Plain::kAvx512, &s.k)) {
    s.kind = static_cast<int>(Isa::kAvx512);
  } else if (tier == Isa::kAvx2 && l12_wrapped_kernels(Plain::kAvx2, &s.k)) {
    s.kind = static_cast<int>(Isa::kAvx2);
  } else if (tier == Isa::kBf16 && l12_wrapped_kernels(Plain::kNeonBf16, &s.k)) {
    s.kind = kKindNeonBf16;
  } else if (arm_tier(tier) && l12_wrapped_kernels(Plain::kNeon, &s.k)) {
    s.kind = kKindNeon;
  } else {
    l12_wrapped_kernels(Plain::kGeneric, &s.k);
    s.kind = static_cast<int>(Isa::kGeneric);
  }
  return s;
}

Selected select_kernels(Isa tier, DType dt, MoePath path, WFormat wf, QDot qd) {
  if (wf == WFormat::kLossless12) return select_l12(tier, path);
  Selected s{};
  bool ok = false;
  const bool q = wf != WFormat::kLossless;
  const bool amx_prefill = tier == Isa::kAmx && path == MoePath::kPrefill && dt == DType::kBF16;
  if (q && (qd == QDot::kInt || (qd == QDot::kAuto && !amx_prefill))) {
    if (select_qdot(tier, wf, &s)) return s;
    if (qd == QDot::kInt) {
      get_qdot_kernels_generic(wf, &s.k);
      s.kind = kKindGenericDot;
      return s;
    }
  }
  // The AMX kernels take bf16 x rows; models in other dtypes stay on the FMA tiers, which keep
  // x in fp32 (rounding an fp32/fp16 model's activations to bf16 would lose precision).
  if (amx_prefill) {
    ok = q ? amx_qkernels(wf, &s.k) : amx_kernels(dt, &s.k);
    s.kind = static_cast<int>(Isa::kAmx);
  }
  if (!ok && !q && bf16dot_prefill(tier, path)) {
    ok = get_kernels_avx512bf16(dt, &s.k);  // false for fp32 / fp16 models: they keep fp32 x and h
    s.kind = kKindAvx512Bf16;
  }
  if (!ok && (tier == Isa::kAmx || tier == Isa::kAvx512)) {
    ok = q ? get_qkernels_avx512(wf, &s.k) : get_kernels_avx512(dt, &s.k);
    s.kind = static_cast<int>(Isa::kAvx512);
  }
  if (!ok && tier == Isa::kAvx2) {
    ok = q ? get_qkernels_avx2(wf, &s.k) : get_kernels_avx2(dt, &s.k);
    s.kind = static_cast<int>(Isa::kAvx2);
  }
  // tier bf16: BFDOT / BFMMLA on bf16 models, both paths (false for fp32 / fp16 models: they keep
  // fp32 x and h on the FMA kernels below)
  if (!ok && !q && tier == Isa::kBf16) {
    ok = neonbf16_kernels(dt, &s.k);
    s.kind = kKindNeonBf16;
  }
  // the Arm tiers' FMA kernels (lossless weights; quantised ones expand on the generic kernels)
  if (!ok && !q && arm_tier(tier)) {
    ok = neon_kernels(dt, &s.k);
    s.kind = kKindNeon;
  }
  if (!ok) {
    if (q) get_qkernels_generic(wf, false, &s.k);
    else get_kernels_generic(dt, false, &s.k);
    s.kind = static_cast<int>(Isa::kGeneric);
  }
  return s;
}

void check_tier(Isa isa) {
  if (!isa_supported(cpu_features(), isa)) {
    throw std::invalid_argument(std::string("isa '") + isa_name(isa) +
                                "' is not supported on this machine (" + cpu_summary() + ")");
  }
}

VecBuild vec_build(Isa isa) {
#if defined(HINA_HAVE_X86_KERNELS)
  if (isa == Isa::kAvx512 || isa == Isa::kAmx) return VecBuild::kAvx512;
  if (isa == Isa::kAvx2) return VecBuild::kAvx2;
#else
  (void)isa;
#endif
  return VecBuild::kBase;
}

bool rope_bf16_avx512(DType dt, Isa isa, int64_t rot, int64_t D) {
  // (partial rotary dims: the baseline loops, not vectorised)
  return dt == DType::kBF16 && vec_build(isa) == VecBuild::kAvx512 && rot == D;
}

bool attention_prefill_bf16(const AttnPrefillArgs& a, Isa isa) {
  return vec_build(isa) == VecBuild::kAvx512 && cpu_features().avx512bf16 && a.D % 16 == 0 && a.D >= 16 &&
         a.D <= 256 && a.Hkv > 0 && a.Hq % a.Hkv == 0;
}

bool mla_scores_bf16() {
  static const bool cpu = cpu_features().avx512bf16;
  return cpu && mla_bf16_dots();
}

int quant_act_build() {
#if defined(HINA_HAVE_X86_KERNELS)
  static const int best = isa_supported(cpu_features(), Isa::kAvx512) ? 2 : isa_supported(cpu_features(), Isa::kAvx2) ? 1 : 0;
  return best;
#else
  return 0;
#endif
}

}  // namespace detail

Isa resolve_isa(const char* name) {
  const CpuFeatures& f = cpu_features();
  std::string n = name ? name : "auto";
  if (n == "auto") {
    const char* env = std::getenv("HINA_MOE_ISA");
    if (env && *env && std::strcmp(env, "auto") != 0) {
      n = env;
    } else {
      return best_isa(f);
    }
  }
  Isa isa;
  if (!isa_from_name(n.c_str(), &isa)) {
    throw std::invalid_argument("isa '" + n +
                                "' is unknown; expected auto, generic, avx2, avx512, amx, neon, dotprod, i8mm or bf16");
  }
  if (!isa_supported(f, isa)) {
    // An Arm tier on an x86 CPU (or the reverse) is not a tier too high for it: say whose it is
    // and which tiers this CPU has.
    const bool arm = detail::arm_tier(isa);
    std::string have;
    for (Isa t : {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512, Isa::kAmx, Isa::kNeon, Isa::kDotprod, Isa::kI8mm, Isa::kBf16})
      if (isa_supported(f, t)) have += std::string(have.empty() ? "" : ", ") + isa_name(t);
    const std::string other = isa != Isa::kGeneric && arm != f.neon
                                  ? std::string(", a tier of ") + (arm ? "aarch64" : "x86-64") + " CPUs,"
                                  : "";
    throw std::invalid_argument("isa '" + n + "'" + other + " is not supported on this machine (this CPU's tiers: " +
                                have + "; " + detail::cpu_summary() + ")");
  }
  return isa;
}

}  // namespace hina
