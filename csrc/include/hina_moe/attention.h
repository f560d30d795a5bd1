// Attention kernels: decode (one query per head), latent attention (MLA) decode, bf16 prefill.
#pragma once

#include <cstdint>

#include "hina_moe/types.h"

namespace hina {

// Attention of one query per (batch, head) over S cached keys/values (see csrc/moe/attention_impl.h).
struct AttnDecodeArgs {
  DType dtype;
  const void* q;  // [B, Hq, D] contiguous
  const void* k;  // element (b, h, s, d) at k[b*k_strides[0] + h*k_strides[1] + s*k_strides[2] + d]
  const void* v;  // likewise with v_strides
  void* out;      // [B, Hq, D] contiguous
  int64_t B, Hq, Hkv, S, D;
  int64_t k_strides[3], v_strides[3];
  float scale;  // applied to q . k before the softmax
  // optional: key j of batch row b is attended to iff mask[b * mask_bstride + j] != 0 (a bool
  // mask [B or 1, 1, 1, S], as transformers passes for a StaticCache or padded batches); masked
  // keys and values are not read. A row with every key masked gives zeros, as PyTorch's SDPA does.
  const uint8_t* mask = nullptr;
  int64_t mask_bstride = 0;
  // optional: attention sinks, one float32 logit per query head [Hq] (GPT-OSS): the softmax runs
  // over the scores and sinks[h] together and the sink's share is dropped, so the weights of the
  // keys sum to less than 1: p_j = e^(s_j - m) / (sum_i e^(s_i - m) + e^(sinks[h] - m)).
  const float* sinks = nullptr;
};
// Query head h reads kv head h / (Hq / Hkv) (grouped-query attention; Hq a multiple of Hkv).
// float32 math, one rounding at the end; heads split across num_threads (0: every hardware
// thread) when the work is large enough. isa picks the build (kAvx512/kAmx: AVX-512; kAvx2:
// AVX2; others: the baseline build).
void attention_decode(const AttnDecodeArgs& a, int num_threads, Isa isa);

// Decode attention of multi-head latent attention (MLA: DeepSeek-V2/V3 and the families built on
// them; see csrc/moe/mla_impl.h) over its compressed cache, the key and value up-projection
// absorbed into the query and the output. Per (batch row b, head h), with W = kv_b_proj's
// weight viewed [H, Dn + Dv, L] (rows d < Dn make head h's keys from the latent, the next Dv its
// values):
//   ql = sum_d q_nope[b, h, d] W[h, d, :]                       (float32, L values)
//   score_s = (ql . latent[b, s] + q_rope[b, h] . k_rope[b, s]) * scale,  p = softmax(score)
//   out[b, h, e] = W[h, Dn + e, :] . (sum_s p_s latent[b, s])     (e < Dv)
// which is the softmax attention of q = [q_nope, q_rope] over keys [W_k latent_s, k_rope_s] and
// values W_v latent_s, without making those keys and values. float32 math, one rounding to
// dtype at the end.
struct MlaDecodeArgs {
  DType dtype;
  const void* q_nope;  // element (b, h, d) at q_nope[b*qn_strides[0] + h*qn_strides[1] + d], d < Dn
  const void* q_rope;  // (b, h, d) at q_rope[b*qr_strides[0] + h*qr_strides[1] + d], d < Dr (rotated)
  const void* w;       // [H, Dn + Dv, L] contiguous; or null, and wq holds it quantised
  const void* latent;  // (b, s, l) at latent[b*c_strides[0] + s*c_strides[1] + l], l < L
  const void* k_rope;  // (b, s, d) at k_rope[b*kr_strides[0] + s*kr_strides[1] + d], d < Dr (rotated)
  void* out;           // [B, H, Dv] contiguous
  int64_t B, H, S, Dn, Dr, L, Dv;
  int64_t qn_strides[2], qr_strides[2], c_strides[2], kr_strides[2];
  float scale;
  // optional: position s of row b is attended iff mask[b * mask_bstride + s] != 0 (as
  // AttnDecodeArgs::mask); a row attending nothing gives zeros
  const uint8_t* mask = nullptr;
  int64_t mask_bstride = 0;
  // with w null: the weight [H (Dn + Dv), L] quantised (RowQuant's codes and scales: int8 with L
  // a multiple of 64, or int4 in groups of 32 to 128 dividing L; Dn and Dv multiples of 4), its
  // rows in blocks of four (rows 4b .. 4b + 3) interleaved so that the kernel reads a block as one
  // sequential stream:
  //   int8: block b's codes at codes + 4 b L, values [64 c, 64 c + 64) of its row r at
  //         (4 c + r) 64 from there; scales float32 [rows], plain;
  //   int4: block b's codes at codes + 2 b L, group g of its row r (RowQuant's group / 2 bytes) at
  //         (4 g + r) group / 2 from there; its scales at scales + 4 b L / group, group g of row r
  //         at 4 g + r from there.
  // Computed in float32 as s * q (the query's absorption multiplies each row's query element by
  // the row's or group's scale once, then by the codes). hi_na_moe.mla's QuantWeight makes it
  // from PackedExperts::unpack_row_quant's rows.
  RowQuant wq{};
  bool has_weight() const { return w != nullptr || wq.fmt != WFormat::kLossless; }
};
// Heads split across num_threads (0: every hardware thread) when the work is large enough; each
// thread reads the cache once for all of its heads. Throws std::invalid_argument for a null w
// without a wq of the form above. isa picks the build (kAvx512/kAmx: AVX-512; kAvx2: AVX2;
// others: the baseline build).
void mla_decode(const MlaDecodeArgs& a, int num_threads, Isa isa);
// Whether mla_decode reads kv_b_proj's weight of these sizes quantised in this format (wq).
bool mla_quant_fits(WFormat fmt, int64_t group, int64_t L, int64_t Dn, int64_t Dv);
// Whether mla_decode reads a bfloat16 latent cache (L a multiple of 32) with AVX512-BF16 dot
// products where the CPU has them (tiers avx512 / amx; vdpbf16ps: pairs of products summed in
// float32): the scores' latent half with each head's latent query rounded to bfloat16 once, the
// latent outputs with the probabilities rounded to bfloat16 (as PyTorch's bf16 attention rounds
// them for the product with the values). On by default; off: float32 FMAs, as every other build
// (for A/B measurements and tests; process-wide).
bool mla_bf16_dots();
void set_mla_bf16_dots(bool on);

// Attention of T query rows per (batch, head) over S cached keys/values, bfloat16 in and out
// (see csrc/kernels/avx512/attention_prefill_avx512bf16.cpp): the prefill counterpart of
// attention_decode, float32 sums and softmax, the probabilities rounded to bfloat16 for p . v.
struct AttnPrefillArgs {
  const void* q;  // row (b, t, h) at q + b*q_strides[0] + t*q_strides[1] + h*q_strides[2], D contiguous
  const void* k;  // element (b, h, s, d) at k[b*k_strides[0] + h*k_strides[1] + s*k_strides[2] + d]
  const void* v;  // likewise with v_strides
  void* out;      // [B, T, Hq, D] contiguous
  int64_t B, T, Hq, Hkv, S, D;
  int64_t q_strides[3], k_strides[3], v_strides[3];
  float scale;  // applied to q . k before the softmax
  // No mask: query t attends keys 0..t (causal from the first key, what SDPA's is_causal does
  // and what transformers asks for when it passes no mask; keys from T on are not read). A mask:
  // query t of batch row b attends key j iff mask[b*mask_bstride + t*mask_tstride + j] != 0 (a
  // bool mask [B or 1, 1, T, S]; mask_bstride 0 broadcasts one over the batch). A query row
  // attending no key gives zeros, as SDPA does (and attention_decode).
  const uint8_t* mask = nullptr;
  int64_t mask_bstride = 0, mask_tstride = 0;
  const float* sinks = nullptr;  // optional [Hq]: attention sinks, as AttnDecodeArgs::sinks
};
// Whether attention_prefill has a kernel for these arguments at tier isa on this CPU: bfloat16
// dot products (AVX512-BF16) at the avx512/amx tiers, D a multiple of 16 up to 256, Hq a
// multiple of Hkv.
bool attention_prefill_supported(const AttnPrefillArgs& a, Isa isa);
// Runs it on num_threads (0: every hardware thread); returns false (nothing written) when
// attention_prefill_supported is false.
bool attention_prefill(const AttnPrefillArgs& a, int num_threads, Isa isa);

}  // namespace hina
