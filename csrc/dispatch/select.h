// [NOTE] Every selection ladder in one place: which kernel build runs a call, from the tier it
// was given (hina::resolve_isa), the CPU's features (cpu_features()) and the call's shape.
// The experts' ladder (format x dtype x path x qdot -> KernelImpl and the <kernel> of its name),
// lossless12's, the integer dot's, and the per-row vector builds of attention, latent attention
// (MLA), rope, silu_mul and the activation quantisation. Kernel TUs never choose for themselves:
// they are called only after one of these said so (their ISA flags would fault elsewhere).
#pragma once

#include <cstdint>
#include <string>

#include "hina_moe/attention.h"
#include "hina_moe/types.h"
#include "moe/kernel_api.h"

namespace hina::detail {

// ---- the experts op ----
// `kind` is the <kernel> part of a kernel's name: an Isa (0..3), one of the integer-dot kinds,
// the bf16 dot-product prefill (avx512bf16), or an Arm build: neon (the FMA kernels of tiers
// neon, dotprod, i8mm and bf16's fp32 / fp16 models), neondot (integer dot with widening
// multiplies, tier neon), dotprod (SDOT, tier dotprod), i8mm (SMMLA row pairs, tiers i8mm and
// bf16), neonbf16 (BFDOT / BFMMLA on bf16 models, tier bf16).
enum KernelKind : int {
  kKindGenericDot = 4, kKindAvx2Dot = 5, kKindAvx512Vnni = 6, kKindAvxVnni = 7, kKindAvx512Bf16 = 8,
  kKindNeon = 9, kKindNeonDot = 10, kKindDotprod = 11, kKindI8mm = 12, kKindNeonBf16 = 13,
  kNumKinds = 14
};
const char* kind_name(int kind);
struct Selected {
  KernelImpl k;
  int kind;
};
// The kernels for (tier, dtype, concrete path, format, qdot); path is never kAuto here.
Selected select_kernels(Isa tier, DType dt, MoePath path, WFormat wf, QDot qd);
// The amx tier's kernels: the hardware build, or in the C++ tests' build while
// use_amx_software_tiles(true) the same code on software tiles (moe_amx_sw.cpp).
bool amx_kernels(DType dt, KernelImpl* k);
bool amx_qkernels(WFormat wf, KernelImpl* k);
// The Arm tiers' FMA kernels (kernels/neon/moe_neon.cpp); false in builds without them.
bool neon_kernels(DType dt, KernelImpl* k);
// Tier bf16's BFDOT / BFMMLA kernels (moe_bf16_neonbf16.cpp); false without them or FEAT_BF16.
bool neonbf16_kernels(DType dt, KernelImpl* k);
// lossless12 (bf16 only) runs a tier's plain bf16 kernels on decompressed panels, except the
// fused AVX-512 decode kernels: which plain kernels (experts/codecs.cpp wraps them).
enum class Plain : int { kGeneric, kAvx2, kAvx512, kAvx512Bf16, kAmx, kNeon, kNeonBf16 };
bool l12_wrapped_kernels(Plain p, KernelImpl* k);  // experts/codecs.cpp

// ---- tiers ----
// What this CPU offers, for error messages ("best tier here: ...; cpu: avx2=1 ...").
std::string cpu_summary();
// Throws std::invalid_argument when the experts cannot run at `isa` on this CPU.
void check_tier(Isa isa);

// ---- the per-row vector kernels (attention, MLA, rope, silu_mul) ----
// Which build of attention_impl.h / mla_impl.h / the activation runs at a tier: the AVX-512
// build at avx512 and amx, the AVX2 build at avx2, the baseline build at generic (and in
// builds without the x86 kernels).
enum class VecBuild : int { kBase, kAvx2, kAvx512 };
VecBuild vec_build(Isa isa);
// rope_rotate_half's AVX-512 bf16 rows: bfloat16, tier avx512/amx, the whole head rotated.
bool rope_bf16_avx512(DType dt, Isa isa, int64_t rot, int64_t D);
// The AVX512-BF16 prefill attention kernel's reach (attention_prefill_supported).
bool attention_prefill_bf16(const AttnPrefillArgs& a, Isa isa);
// Whether the AVX-512 MLA build reads bfloat16 latent caches with AVX512-BF16 dot products:
// the CPU has them and set_mla_bf16_dots has not turned them off.
bool mla_scores_bf16();
// The build of the integer-dot kernels' activation quantisation (quant_act_row): 2 AVX-512,
// 1 AVX2, 0 portable; the best this CPU runs (the same bytes in every build: tested).
int quant_act_build();

}  // namespace hina::detail
