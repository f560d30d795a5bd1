// A pre-norm decoder layer's decode step in two native calls (hi_na_moe.layers): everything
// before the KV-cache update, and everything after it up to the router's logits (and its selection). Only the
// library's own kernels, composed in the order and with the roundings hi_na_moe's per-module
// path runs them, so both give the same bits (tests/test_layers.py compares them).
#include <cstring>

#include "hina_moe/moe.h"

namespace hina {

void layer_decode_pre(const LayerPreArgs& a, int num_threads) {
  const size_t es = dtype_size(a.dtype);
  const int64_t nq = a.Hq * a.D, nkv = a.Hkv * a.D, n = nq + 2 * nkv;
  auto* qkv = static_cast<char*>(a.qkv_out);
  auto* tmp = static_cast<char*>(a.qk_tmp);  // [B, nq + nkv]: q and k after their norms
  rms_norm(a.dtype, a.x, a.B, a.H, a.ln1_w, a.ln1_eps, a.h);
  MoeParams p = a.qkv_params;
  p.num_threads = num_threads;
  a.qkv->linear(a.h, a.B, a.qkv_out, p);
  const auto* cos = static_cast<const char*>(a.cos);
  const auto* sin = static_cast<const char*>(a.sin);
  for (int64_t b = 0; b < a.B; ++b) {
    const char* qr = qkv + b * n * es;
    const char* kr = qr + nq * es;
    const char* vr = kr + nkv * es;
    char* qn = tmp + b * (nq + nkv) * es;
    char* kn = qn + nq * es;
    if (a.qk_norm == 1) {  // over the whole projection (OLMoE)
      rms_norm(a.dtype, qr, 1, nq, a.qn_w, a.qn_eps, qn);
      rms_norm(a.dtype, kr, 1, nkv, a.kn_w, a.kn_eps, kn);
      qr = qn;
      kr = kn;
    } else if (a.qk_norm == 2) {  // per head (Qwen3)
      rms_norm(a.dtype, qr, a.Hq, a.D, a.qn_w, a.qn_eps, qn);
      rms_norm(a.dtype, kr, a.Hkv, a.D, a.kn_w, a.kn_eps, kn);
      qr = qn;
      kr = kn;
    }
    const char* cb = cos + b * a.cos_bstride * es;
    const char* sb = sin + b * a.cos_bstride * es;
    rope_rotate_half(a.dtype, qr, 1, a.Hq, a.D, cb, sb, static_cast<char*>(a.q) + b * nq * es);
    char* kb = static_cast<char*>(a.k) + b * a.kv_bstride * es;
    char* vb = static_cast<char*>(a.v) + b * a.kv_bstride * es;
    if (a.kv_hstride == a.D) {
      rope_rotate_half(a.dtype, kr, 1, a.Hkv, a.D, cb, sb, kb);
      std::memcpy(vb, vr, static_cast<size_t>(nkv) * es);
    } else {  // one head at a time into the cache's rows
      for (int64_t h = 0; h < a.Hkv; ++h) {
        rope_rotate_half(a.dtype, kr + h * a.D * es, 1, 1, a.D, cb, sb, kb + h * a.kv_hstride * es);
        std::memcpy(vb + h * a.kv_hstride * es, vr + h * a.D * es, static_cast<size_t>(a.D) * es);
      }
    }
  }
}

void layer_decode_post(const LayerPostArgs& a, int num_threads, Isa attn_isa) {
  if (a.attn.q != nullptr) attention_decode(a.attn, num_threads, attn_isa);
  MoeParams p = a.o_params;
  p.num_threads = num_threads;
  a.o->linear(a.attn.out, a.B, a.o_out, p);
  add_rms_norm(a.dtype, a.x, a.o_out, a.B, a.H, a.ln2_w, a.ln2_eps, a.sum, a.normed);
  if (a.router != nullptr) {
    MoeParams r = a.router_params;
    r.num_threads = num_threads;
    a.router->linear(a.normed, a.B, a.logits, r);
    if (a.select.w != nullptr) {
      RouterSelectArgs s = a.select;
      s.dtype = a.dtype;
      s.logits = a.logits;
      s.B = a.B;
      router_select(s);
    }
  }
}

}  // namespace hina
