// Attention: decode and prefill, latent attention (MLA) decode and the latent layer step around it,
// every tier against the baseline build and the form transformers computes, in double.
#include "tests/harness.h"

namespace tests_attention {

// A latent attention decoder layer's decode step (LayerPreArgs::mla, LayerPostArgs::mla; dense
// MLP): layer_decode_pre's outputs against their parts (the q / kv_a group's rows, q_b_proj, the
// norms, rope_rotate_half for that form and the complex and interleaved products in double), then
// decode_layers (the stack's one call: its scratch sized by decode_layers_scratch, which ASan
// checks) against the two calls layer_decode_pre / layer_decode_post, bit for bit, outputs and
// cache writes.
void test_latent_layer_step(const std::vector<Isa>& tiers) {
  if (!selected("latent_layer")) return;
  std::mt19937 rng(29);
  const int64_t B = 2, Hd = 64, Hq = 3, Dn = 16, Dr = 32, L = 48, Dv = 16, I = 40, cap = 8, pos = 4;
  const int64_t hd = Dn + Dr, nqf = Hq * hd;
  for (DType dt : {DType::kF32, DType::kBF16})
    for (LatentRope form : {LatentRope::kComplex, LatentRope::kInterleaved, LatentRope::kRotateHalf})
      for (int64_t lora : {int64_t{0}, int64_t{24}})
        for (Isa isa : tiers) {
          const size_t es = dtype_size(dt);
          const int64_t nqa = lora ? lora : nqf, ny = nqa + L + Dr;
          const float sc = 1.0f / std::sqrt(float(Hd));
          const auto x = random_array(dt, B * Hd, 1.0f, rng);
          const auto ln1 = random_array(dt, Hd, 1.0f, rng), ln2 = random_array(dt, Hd, 1.0f, rng);
          const auto qa_w = random_array(dt, lora ? lora : 1, 1.0f, rng), kv_w = random_array(dt, L, 1.0f, rng);
          const auto w_qkv = random_array(dt, ny * Hd, sc, rng);
          const auto w_qb = random_array(dt, nqf * (lora ? lora : 1), 0.2f, rng);
          const auto w_o = random_array(dt, Hd * Hq * Dv, 0.2f, rng);
          const auto w_kvb = random_array(dt, Hq * (Dn + Dv) * L, 0.2f, rng);
          const auto w_gu = random_array(dt, 2 * I * Hd, sc, rng), w_d = random_array(dt, Hd * I, 0.15f, rng);
          auto qkv = PackedExperts::pack_linear(dt, ny, Hd, w_qkv.data(), nullptr, isa, 1);
          auto qb = lora ? PackedExperts::pack_linear(dt, nqf, lora, w_qb.data(), nullptr, isa, 1) : nullptr;
          auto o = PackedExperts::pack_linear(dt, Hd, Hq * Dv, w_o.data(), nullptr, isa, 1);
          auto gu = PackedExperts::pack_linear(dt, 2 * I, Hd, w_gu.data(), nullptr, isa, 1);
          auto down = PackedExperts::pack_linear(dt, Hd, I, w_d.data(), nullptr, isa, 1);
          // the rotary tables of one position a row: float32 (re, im) pairs, or rows of Dr
          std::vector<float> pairs(static_cast<size_t>(B * Dr));
          std::vector<uint8_t> cosv(static_cast<size_t>(B * Dr) * es), sinv(cosv.size());
          std::uniform_real_distribution<float> ang(0.0f, 6.2f);
          for (int64_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < Dr / 2; ++i) {
              const float a = ang(rng);
              pairs[b * Dr + 2 * i] = std::cos(a);
              pairs[b * Dr + 2 * i + 1] = std::sin(a);
              for (int64_t j : {i, i + Dr / 2}) {
                store_elem(dt, cosv.data(), b * Dr + j, std::cos(a));
                store_elem(dt, sinv.data(), b * Dr + j, std::sin(a));
              }
            }
          const bool cx = form == LatentRope::kComplex;
          const void* cos = cx ? static_cast<const void*>(pairs.data()) : cosv.data();
          const void* sin = cx ? static_cast<const void*>(pairs.data()) : sinv.data();
          // the caches: [B, 1, cap, L] and [B, 1, cap, Dr], positions before pos random
          const auto lat0 = random_array(dt, B * cap * L, 1.0f, rng), kr0 = random_array(dt, B * cap * Dr, 1.0f, rng);
          LayerPreArgs pre{};
          pre.dtype = dt;
          pre.H = Hd;
          pre.ln1_w = ln1.data();
          pre.ln1_eps = 1e-6f;
          pre.qkv = qkv.get();
          pre.Hq = Hq;
          pre.Hkv = 1;
          pre.D = hd;
          pre.mla.rope = form;
          pre.mla.Dn = Dn;
          pre.mla.Dr = Dr;
          pre.mla.L = L;
          pre.mla.q_lora = lora;
          pre.mla.q_b = qb.get();
          pre.mla.qa_w = qa_w.data();
          pre.mla.qa_eps = 1e-6f;
          pre.mla.kv_w = kv_w.data();
          pre.mla.kv_eps = 1e-6f;
          LayerPostArgs post{};
          post.dtype = dt;
          post.H = Hd;
          post.o = o.get();
          post.ln2_w = ln2.data();
          post.ln2_eps = 1e-6f;
          post.mlp.I = I;
          post.mlp.gate_up = gu.get();
          post.mlp.down = down.get();
          MlaDecodeArgs& m = post.mla;
          m.dtype = dt;
          m.w = w_kvb.data();
          m.H = Hq;
          m.Dn = Dn;
          m.Dr = Dr;
          m.L = L;
          m.Dv = Dv;
          m.scale = 0.125f;
          const std::string name = std::string("latent layer step ") + dtype_name(dt) + " form " +
                                   std::to_string(int(form)) + " q_lora " + std::to_string(lora) + " " + isa_name(isa);

          // the two calls, and layer_decode_pre's outputs against their parts
          auto lat1 = lat0, kr1 = kr0;
          std::vector<uint8_t> h(static_cast<size_t>(B * Hd) * es), y(static_cast<size_t>(B * ny) * es),
              tmp(static_cast<size_t>(B * (lora + nqf)) * es), q(static_cast<size_t>(B * nqf) * es),
              attn(static_cast<size_t>(B * Hq * Dv) * es), o_out(h.size()), sum1(h.size()), normed(h.size()),
              mgu(static_cast<size_t>(B * 2 * I) * es), mm(static_cast<size_t>(B * I) * es), mout(h.size());
          LayerPreArgs p1 = pre;
          p1.B = B;
          p1.x = x.data();
          p1.cos = cos;
          p1.sin = sin;
          p1.cos_bstride = Dr;
          p1.h = h.data();
          p1.qkv_out = y.data();
          p1.qk_tmp = tmp.data();
          p1.q = q.data();
          p1.k = lat1.data() + static_cast<size_t>(pos * L) * es;
          p1.v = kr1.data() + static_cast<size_t>(pos * Dr) * es;
          p1.kv_bstride = cap * L;
          p1.mla.v_bstride = cap * Dr;
          layer_decode_pre(p1, 1, isa);
          // the parts: the group's rows, q_b_proj on the normed q_a, the latent's norm
          std::vector<uint8_t> h_ref(h.size()), y_ref(y.size()), qf(static_cast<size_t>(B * nqf) * es);
          MoeParams lp;
          lp.num_threads = 1;
          rms_norm(dt, x.data(), B, Hd, ln1.data(), 1e-6f, h_ref.data());
          qkv->linear(h_ref.data(), B, y_ref.data(), lp);
          bool ok = y_ref == y;
          for (int64_t b = 0; b < B; ++b) {
            const uint8_t* yr = y_ref.data() + static_cast<size_t>(b * ny) * es;
            std::vector<uint8_t> qrow(static_cast<size_t>(nqf) * es), nl(static_cast<size_t>(L) * es);
            if (lora) {
              std::vector<uint8_t> qn(static_cast<size_t>(lora) * es);
              rms_norm(dt, yr, 1, lora, qa_w.data(), 1e-6f, qn.data());
              qb->linear(qn.data(), 1, qrow.data(), lp);
            } else {
              std::memcpy(qrow.data(), yr, qrow.size());
            }
            rms_norm(dt, yr + static_cast<size_t>(nqa) * es, 1, L, kv_w.data(), 1e-6f, nl.data());
            ok = ok && std::memcmp(nl.data(), lat1.data() + static_cast<size_t>(b * cap * L + pos * L) * es, nl.size()) == 0;
            const uint8_t* qo = q.data() + static_cast<size_t>(b * nqf) * es;
            double worst = 0;
            // one rope part: the query heads' and the key's, against rope_rotate_half or the
            // product in double (within one rounding to the dtype)
            auto rope_check = [&](const uint8_t* in, const uint8_t* out) {
              if (form == LatentRope::kRotateHalf) {
                std::vector<uint8_t> want(static_cast<size_t>(Dr) * es);
                rope_rotate_half(dt, in, 1, 1, Dr, cosv.data() + static_cast<size_t>(b * Dr) * es,
                                 sinv.data() + static_cast<size_t>(b * Dr) * es, want.data());
                ok = ok && std::memcmp(want.data(), out, want.size()) == 0;
                return;
              }
              for (int64_t i = 0; i < Dr / 2; ++i) {
                const double x0 = load_elem(dt, in, 2 * i), x1 = load_elem(dt, in, 2 * i + 1);
                const double c = cx ? pairs[b * Dr + 2 * i] : load_elem(dt, cosv.data(), b * Dr + i);
                const double s2 = cx ? pairs[b * Dr + 2 * i + 1] : load_elem(dt, sinv.data(), b * Dr + i);
                const double a = x0 * c - x1 * s2, bb = x0 * s2 + x1 * c;
                const int64_t ia = cx ? 2 * i : i, ib = cx ? 2 * i + 1 : Dr / 2 + i;
                worst = std::max({worst, std::fabs(load_elem(dt, out, ia) - a), std::fabs(load_elem(dt, out, ib) - bb)});
              }
            };
            for (int64_t hh = 0; hh < Hq; ++hh) {
              ok = ok && std::memcmp(qo + static_cast<size_t>(hh * hd) * es, qrow.data() + static_cast<size_t>(hh * hd) * es,
                                     static_cast<size_t>(Dn) * es) == 0;
              rope_check(qrow.data() + static_cast<size_t>(hh * hd + Dn) * es, qo + static_cast<size_t>(hh * hd + Dn) * es);
            }
            rope_check(yr + static_cast<size_t>(nqa + L) * es, kr1.data() + static_cast<size_t>(b * cap * Dr + pos * Dr) * es);
            ok = ok && worst <= (dt == DType::kF32 ? 1e-5 : 3.0 / 128);  // values up to ~2: bf16's steps
          }
          // a query scale (Mistral 4): the same run's query, each value times its row's scale, rounded
          {
            std::vector<uint8_t> qsv(static_cast<size_t>(B) * es), q3(q.size()), y3(y.size()), tmp3(tmp.size());
            store_elem(dt, qsv.data(), 0, 1.5f);
            store_elem(dt, qsv.data(), 1, 0.75f);
            auto lat3 = lat0, kr3 = kr0;
            LayerPreArgs p3 = p1;
            p3.qkv_out = y3.data();
            p3.qk_tmp = tmp3.data();
            p3.q = q3.data();
            p3.k = lat3.data() + static_cast<size_t>(pos * L) * es;
            p3.v = kr3.data() + static_cast<size_t>(pos * Dr) * es;
            p3.mla.q_scale = qsv.data();
            layer_decode_pre(p3, 1, isa);
            for (int64_t i = 0; i < B * nqf; ++i)
              ok = ok && load_elem(dt, q3.data(), i) ==
                             detail::round_to(dt, load_elem(dt, q.data(), i) * load_elem(dt, qsv.data(), i / nqf));
            ok = ok && lat3 == lat1 && kr3 == kr1;
          }
          LayerPostArgs a1 = post;
          a1.B = B;
          a1.attn.out = attn.data();
          a1.o_out = o_out.data();
          a1.x = x.data();
          a1.sum = sum1.data();
          a1.normed = normed.data();
          a1.mlp.gu = mgu.data();
          a1.mlp.m = mm.data();
          a1.mlp.out = mout.data();
          a1.mla.B = B;
          a1.mla.S = pos + 1;
          a1.mla.q_nope = q.data();
          a1.mla.q_rope = q.data() + static_cast<size_t>(Dn) * es;
          a1.mla.qn_strides[0] = a1.mla.qr_strides[0] = nqf;
          a1.mla.qn_strides[1] = a1.mla.qr_strides[1] = hd;
          a1.mla.latent = lat1.data();
          a1.mla.c_strides[0] = cap * L;
          a1.mla.c_strides[1] = L;
          a1.mla.k_rope = kr1.data();
          a1.mla.kr_strides[0] = cap * Dr;
          a1.mla.kr_strides[1] = Dr;
          layer_decode_post(a1, 1, isa);

          // the stack's one call, two threads, its scratch exactly decode_layers_scratch
          auto lat2 = lat0, kr2 = kr0;
          DecodeLayer d{pre, post, 2, isa};
          DecodeKV kv{static_cast<int64_t>(reinterpret_cast<uintptr_t>(lat2.data())),
                      static_cast<int64_t>(reinterpret_cast<uintptr_t>(kr2.data())), cap * L, 0, L, pos + 1, pos,
                      cap * Dr, Dr};
          std::vector<uint8_t> scratch(decode_layers_scratch(&d, 1, B)), sum2(h.size(), 0xee);
          const char* names[1] = {nullptr};
          decode_layers(&d, &kv, 1, B, x.data(), cos, sin, Dr, nullptr, 0, scratch.data(), sum2.data(), names);
          report(ok && sum2 == sum1 && lat2 == lat1 && kr2 == kr1,
                 name + ": the first call's parts; one call = the two calls, bit for bit");
        }
}

// Rows [N, row_bytes] of codes in MlaDecodeArgs::wq's blocks of four rows: chunks of `chunk` bytes of
// the block's rows interleaved (int8: chunks of 64 values; int4: half a group's bytes).
std::vector<uint8_t> mla_blocks(const std::vector<uint8_t>& plain, int64_t N, int64_t row_bytes, int64_t chunk) {
  std::vector<uint8_t> out(plain.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < row_bytes / chunk; ++c)
      std::memcpy(&out[static_cast<size_t>(n / 4 * 4 * row_bytes + (c * 4 + n % 4) * chunk)],
                  &plain[static_cast<size_t>(n * row_bytes + c * chunk)], static_cast<size_t>(chunk));
  return out;
}

// mla_decode on every tier against the form transformers computes, in double: every head's keys
// [W_k latent_s, k_rope_s] and values W_v latent_s made explicitly, then softmax attention. Latent
// and rope keys read through strides of a longer buffer, queries through per-head strides (the
// nope and rope parts of one projection), sizes with and without whole vectors, a mask. The
// weight in the model's dtype, and as RowQuant: int8 rows and int4 groups of 32 / 64 / 128 (the
// reference then from their values, scale * code).
void test_mla_decode(const std::vector<Isa>& tiers) {
  if (!selected("mla")) return;
  std::mt19937 rng(21);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    // sizes: with and without whole vectors; ten heads (the AVX-512 build's blocks of four and
    // eight heads and their remainders, on one and two threads) over more positions than its
    // block of 256
    struct Dims { int64_t H, Dn, Dr, L, Dv; std::vector<int64_t> Ss; };
    for (const Dims& d : {Dims{4, 32, 16, 64, 32, {1, 5, 33}}, Dims{3, 24, 8, 40, 20, {1, 5, 33}},
                          Dims{2, 128, 64, 512, 128, {1, 5, 33}}, Dims{10, 16, 16, 64, 16, {7, 301}}}) {
      for (int64_t S : d.Ss) {
        const int64_t B = 2, Smax = S + 3, qw = d.Dn + d.Dr, rows = d.Dn + d.Dv;
        const auto q = random_array(dt, B * d.H * qw, 1.0f, rng);  // [B, H, Dn + Dr]: nope then rope
        const auto dense = random_array(dt, d.H * rows * d.L, 0.2f, rng);
        const auto lat = random_array(dt, B * Smax * d.L, 1.0f, rng);
        const auto kr = random_array(dt, B * Smax * d.Dr, 1.0f, rng);
        const float scale = 1.0f / std::sqrt(static_cast<float>(qw));
        std::vector<uint8_t> mask(static_cast<size_t>(B * S), 1);
        for (int64_t j = 1; j < S; j += 2) mask[S + j] = 0;  // row 1: every other position hidden
        for (const int64_t form : {int64_t{0}, int64_t{8}, int64_t{32}, int64_t{64}, int64_t{128}}) {  // 0 dense, 8 int8, else int4's group
        if (form && !mla_quant_fits(form == 8 ? WFormat::kInt8 : WFormat::kInt4, form, d.L, d.Dn, d.Dv)) continue;
        const int64_t N = d.H * rows;
        std::vector<double> wv(static_cast<size_t>(N * d.L));
        std::vector<uint8_t> codes;
        std::vector<float> s8;
        std::vector<float> s4;
        RowQuant wq{};
        if (form == 0) {
          for (int64_t i = 0; i < N * d.L; ++i) wv[i] = load_elem(dt, dense.data(), i);
        } else if (form == 8) {
          codes.resize(static_cast<size_t>(N * d.L));
          s8.resize(static_cast<size_t>(N));
          for (int64_t n = 0; n < N; ++n) {
            s8[n] = std::uniform_real_distribution<float>(0.05f, 0.2f)(rng) / 127;
            for (int64_t l = 0; l < d.L; ++l) {
              const int c = std::uniform_int_distribution<int>(-127, 127)(rng);
              codes[n * d.L + l] = static_cast<uint8_t>(static_cast<int8_t>(c));
              wv[n * d.L + l] = double(s8[n]) * c;
            }
          }
          wq = RowQuant{WFormat::kInt8, codes.data(), s8.data(), 0};
          codes = mla_blocks(codes, N, d.L, 64);
        } else {
          const int64_t ng = d.L / form, half = form / 2;
          codes.assign(static_cast<size_t>(N * d.L / 2), 0);
          s4.resize(static_cast<size_t>(N * ng));
          for (int64_t n = 0; n < N; ++n)
            for (int64_t g = 0; g < ng; ++g) {
              s4[n * ng + g] = std::uniform_real_distribution<float>(0.05f, 0.2f)(rng) / 8;
              for (int64_t k = 0; k < form; ++k) {
                const int c = std::uniform_int_distribution<int>(-8, 7)(rng);
                codes[n * d.L / 2 + g * half + k % half] |= static_cast<uint8_t>((c + 8) << (k < half ? 0 : 4));
                wv[n * d.L + g * form + k] = double(s4[n * ng + g]) * c;
              }
            }
          codes = mla_blocks(codes, N, d.L / 2, form / 2);
          std::vector<float> plain = s4;  // scales: group g of row r of a block at 4 g + r
          for (int64_t n = 0; n < N; ++n)
            for (int64_t g = 0; g < ng; ++g) s4[(n / 4 * ng + g) * 4 + n % 4] = plain[n * ng + g];
          wq = RowQuant{WFormat::kInt4, codes.data(), s4.data(), form};
        }
        if (form) wq.codes = codes.data();
        const std::string wname = form == 0 ? "" : form == 8 ? " int8" : " int4/" + std::to_string(form);
        auto W = [&](int64_t h, int64_t r, int64_t l) { return wv[(h * rows + r) * d.L + l]; };
        for (const bool masked : {false, true}) {
          std::vector<double> ref(static_cast<size_t>(B * d.H * d.Dv));
          for (int64_t b = 0; b < B; ++b)
            for (int64_t h = 0; h < d.H; ++h) {
              std::vector<double> sc(static_cast<size_t>(S), 0.0);
              double mx = -1e300, sum = 0;
              for (int64_t s = 0; s < S; ++s) {
                if (masked && !mask[b * S + s]) continue;
                double dotp = 0;
                for (int64_t i = 0; i < d.Dn; ++i) {  // key i of head h at position s: W_k[h, i] . latent_s
                  double key = 0;
                  for (int64_t l = 0; l < d.L; ++l) key += W(h, i, l) * load_elem(dt, lat.data(), (b * Smax + s) * d.L + l);
                  dotp += double(load_elem(dt, q.data(), (b * d.H + h) * qw + i)) * key;
                }
                for (int64_t i = 0; i < d.Dr; ++i)
                  dotp += double(load_elem(dt, q.data(), (b * d.H + h) * qw + d.Dn + i)) *
                          load_elem(dt, kr.data(), (b * Smax + s) * d.Dr + i);
                sc[s] = dotp * scale;
                mx = std::max(mx, sc[s]);
              }
              for (int64_t s = 0; s < S; ++s)
                if (!masked || mask[b * S + s]) sum += (sc[s] = std::exp(sc[s] - mx));
              for (int64_t e = 0; e < d.Dv; ++e) {
                double o = 0;
                for (int64_t s = 0; s < S; ++s) {
                  if (masked && !mask[b * S + s]) continue;
                  double val = 0;
                  for (int64_t l = 0; l < d.L; ++l) val += W(h, d.Dn + e, l) * load_elem(dt, lat.data(), (b * Smax + s) * d.L + l);
                  o += sc[s] * val;
                }
                ref[(b * d.H + h) * d.Dv + e] = o / sum;
              }
            }
          double rmax = 0;
          for (double r : ref) rmax = std::max(rmax, std::fabs(r));
          std::vector<Isa> all = tiers;
          all.insert(all.begin(), Isa::kGeneric);
          const size_t es = dtype_size(dt);
          for (Isa isa : all) {
            // bfloat16 at the AVX-512 tiers: with the latent cache read on bf16 dot products (where
            // the CPU has them) and without
            const bool both = dt == DType::kBF16 && (isa == Isa::kAvx512 || isa == Isa::kAmx);
            for (int run = 0; run < (both ? 4 : 2); ++run) {
              const int threads = 1 + run % 2;
              set_mla_bf16_dots(run < 2);
              std::vector<uint8_t> out(static_cast<size_t>(B * d.H * d.Dv) * es, 0xff);
              MlaDecodeArgs a{dt, q.data(), q.data() + d.Dn * es, form ? nullptr : dense.data(), lat.data(), kr.data(), out.data(),
                              B, d.H, S, d.Dn, d.Dr, d.L, d.Dv, {d.H * qw, qw}, {d.H * qw, qw}, {Smax * d.L, d.L},
                              {Smax * d.Dr, d.Dr}, scale, masked ? mask.data() : nullptr, S, wq};
              mla_decode(a, threads, isa);
              double worst = 0;
              for (size_t i = 0; i < ref.size(); ++i)
                worst = std::max(worst, std::fabs(double(load_elem(dt, out.data(), int64_t(i))) - ref[i]) / rmax);
              const double lim = dt == DType::kF32 ? 1e-5 : dt == DType::kBF16 ? 1.0 / 128 : 1.0 / 512;
              set_mla_bf16_dots(true);
              const std::string sname = both ? (run < 2 ? " bf16-dots" : " f32-fmas") : "";
              note(std::string("mla_decode ") + dtype_name(dt) + wname + " " + isa_name(isa) + sname, worst);
              report(worst <= lim, std::string("mla_decode ") + dtype_name(dt) + wname + " " + isa_name(isa) + sname +
                                       (masked ? " masked" : "") + " H=" + std::to_string(d.H) + " L=" +
                                       std::to_string(d.L) + " S=" + std::to_string(S) + " threads=" +
                                       std::to_string(threads) + ": err " + std::to_string(worst));
            }
          }
        }
        }
      }
    }
  }
  // a quantised weight the kernel does not take is refused before anything runs
  std::vector<uint8_t> buf(4096);
  for (const auto& bad : {std::pair<RowQuant, int64_t>{RowQuant{WFormat::kInt4, buf.data(), buf.data(), 16}, 4},
                          std::pair<RowQuant, int64_t>{RowQuant{WFormat::kInt4, buf.data(), buf.data(), 32}, 6},
                          std::pair<RowQuant, int64_t>{RowQuant{WFormat::kInt8, nullptr, buf.data(), 0}, 4},
                          std::pair<RowQuant, int64_t>{RowQuant{WFormat::kLossless, buf.data(), buf.data(), 0}, 4}}) {
    MlaDecodeArgs a{DType::kF32, buf.data(), buf.data(), nullptr, buf.data(), buf.data(), buf.data(), 1, 1, 1,
                    bad.second, 4, 64, 4, {0, 0}, {0, 0}, {0, 0}, {0, 0}, 1.0f, nullptr, 0, bad.first};
    bool threw = false;
    try {
      mla_decode(a, 1, Isa::kGeneric);
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    report(threw, std::string("mla_decode refuses a quantised weight of ") + wformat_name(bad.first.fmt) + ", group " +
                      std::to_string(bad.first.group) + ", Dn " + std::to_string(bad.second));
  }
}

// attention_decode on every tier against a double-precision softmax attention, through strides
// of a longer cache buffer (StaticCache-like), with grouped-query heads, head sizes with and
// without a vector build, and with attention sinks (one head's sink far above its scores, one far
// below); rope_rotate_half against the same rounding steps in double.
void test_attention_decode(const std::vector<Isa>& tiers) {
  if (!selected("attention")) return;
  std::mt19937 rng(9);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t D : {16, 64, 72, 128}) {
      for (int64_t S : {1, 3, 4, 17, 70}) {
        const int64_t B = 2, Hq = 4, Hkv = 2, Smax = S + 5;
        const auto q = random_array(dt, B * Hq * D, 1.0f, rng);
        const auto k = random_array(dt, B * Hkv * Smax * D, 2.0f, rng);
        const auto v = random_array(dt, B * Hkv * Smax * D, 1.0f, rng);
        const float scale = 1.0f / std::sqrt(static_cast<float>(D));
        // a bool mask per batch row (every third key of row 1 masked, key 0 always attended)
        std::vector<uint8_t> mask(static_cast<size_t>(B * S), 1);
        for (int64_t j = 1; j < S; j += 3) mask[S + j] = 0;
        const std::vector<float> sinks = {0.5f, 30.0f, -1.25f, -40.0f};  // [Hq]
        for (const bool masked : {false, true})
        for (const bool sunk : {false, true}) {
          std::vector<double> ref(static_cast<size_t>(B * Hq * D));
          for (int64_t b = 0; b < B; ++b)
            for (int64_t h = 0; h < Hq; ++h) {
              const int64_t base = (b * Hkv + h / (Hq / Hkv)) * Smax * D;
              std::vector<double> sc(static_cast<size_t>(S), 0.0);
              double mx = -1e300, sum = 0;
              for (int64_t j = 0; j < S; ++j) {
                if (masked && !mask[b * S + j]) continue;
                double d = 0;
                for (int64_t i = 0; i < D; ++i)
                  d += double(load_elem(dt, q.data(), (b * Hq + h) * D + i)) * load_elem(dt, k.data(), base + j * D + i);
                sc[j] = d * scale;
                mx = std::max(mx, sc[j]);
              }
              if (sunk) mx = std::max(mx, double(sinks[h]));
              for (int64_t j = 0; j < S; ++j)
                if (!masked || mask[b * S + j]) sum += (sc[j] = std::exp(sc[j] - mx));
              if (sunk) sum += std::exp(double(sinks[h]) - mx);
              for (int64_t i = 0; i < D; ++i) {
                double o = 0;
                for (int64_t j = 0; j < S; ++j)
                  if (!masked || mask[b * S + j]) o += sc[j] * load_elem(dt, v.data(), base + j * D + i);
                ref[(b * Hq + h) * D + i] = o / sum;
              }
            }
          double rmax = 0;
          for (double r : ref) rmax = std::max(rmax, std::fabs(r));
          std::vector<Isa> all = tiers;
          all.insert(all.begin(), Isa::kGeneric);
          for (Isa isa : all) {
            for (int threads : {1, 2}) {
              std::vector<uint8_t> out(static_cast<size_t>(B * Hq * D) * dtype_size(dt), 0xff);
              AttnDecodeArgs a{dt, q.data(), k.data(), v.data(), out.data(), B, Hq, Hkv, S, D,
                               {Hkv * Smax * D, Smax * D, D}, {Hkv * Smax * D, Smax * D, D}, scale,
                               masked ? mask.data() : nullptr, S, sunk ? sinks.data() : nullptr};
              attention_decode(a, threads, isa);
              double worst = 0;
              for (size_t i = 0; i < ref.size(); ++i)
                worst = std::max(worst, std::fabs(double(load_elem(dt, out.data(), int64_t(i))) - ref[i]) / rmax);
              const double lim = dt == DType::kF32 ? 1e-5 : dt == DType::kBF16 ? 1.0 / 128 : 1.0 / 512;
              note(std::string("attention_decode ") + dtype_name(dt) + " " + isa_name(isa), worst);
              report(worst <= lim, std::string("attention_decode ") + dtype_name(dt) + " " + isa_name(isa) +
                                       (masked ? " masked" : "") + (sunk ? " sinks" : "") + " D=" + std::to_string(D) + " S=" +
                                       std::to_string(S) + ": err " + std::to_string(worst));
            }
          }
        }
      }
    }
    // rope: every step rounded to the dtype, as PyTorch's elementwise ops round them
    const int64_t B = 2, H = 3, D = 10;
    const auto x = random_array(dt, B * H * D, 3.0f, rng);
    const auto c = random_array(dt, B * D, 1.0f, rng);
    const auto sn = random_array(dt, B * D, 1.0f, rng);
    std::vector<uint8_t> out(static_cast<size_t>(B * H * D) * dtype_size(dt));
    rope_rotate_half(dt, x.data(), B, H, D, c.data(), sn.data(), out.data());
    std::vector<uint8_t> cell(dtype_size(dt));
    auto round = [&](double val) {
      store_elem(dt, cell.data(), 0, static_cast<float>(val));
      return double(load_elem(dt, cell.data(), 0));
    };
    bool same = true;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D; ++i) {
          const int64_t r = (b * H + h) * D;
          const double rot = i < D / 2 ? -double(load_elem(dt, x.data(), r + i + D / 2))
                                       : double(load_elem(dt, x.data(), r + i - D / 2));
          // a product of two dtype values is exact in float32 for bf16/f16 (and what float32 rounds)
          const double a = round(static_cast<float>(double(load_elem(dt, x.data(), r + i)) * load_elem(dt, c.data(), b * D + i)));
          const double rs = round(static_cast<float>(rot * load_elem(dt, sn.data(), b * D + i)));
          same = same && round(static_cast<float>(a + rs)) == double(load_elem(dt, out.data(), r + i));
        }
    report(same, std::string("rope_rotate_half ") + dtype_name(dt) + ": every step rounded as PyTorch does");
    // the tiered, threaded overload: the baseline's bits at every tier and thread count, on many
    // rows and head sizes whose half is not a multiple of 16
    for (int64_t Dm : {10, 80, 128}) {
      const int64_t Bm = 400, Hm = 3;  // 400 x 3 x 128 values: enough to split over two threads
      const auto xm = random_array(dt, Bm * Hm * Dm, 3.0f, rng);
      const auto cm = random_array(dt, Bm * Dm, 1.0f, rng);
      const auto sm = random_array(dt, Bm * Dm, 1.0f, rng);
      std::vector<uint8_t> want(static_cast<size_t>(Bm * Hm * Dm) * dtype_size(dt));
      rope_rotate_half(dt, xm.data(), Bm, Hm, Dm, cm.data(), sm.data(), want.data());
      std::vector<Isa> all = tiers;
      all.insert(all.begin(), Isa::kGeneric);
      for (Isa isa : all)
        for (int threads : {1, 2}) {
          std::vector<uint8_t> got(want.size(), 0xee);
          rope_rotate_half(dt, xm.data(), Bm, Hm, Dm, cm.data(), sm.data(), got.data(), isa, threads);
          report(got == want, std::string("rope_rotate_half ") + dtype_name(dt) + " " + isa_name(isa) + " D=" +
                                  std::to_string(Dm) + " threads=" + std::to_string(threads) + ": the baseline's bits");
        }
      // half-width tables (GPT-OSS): the bits of the full-width table holding each angle twice
      const size_t es = dtype_size(dt), hb = static_cast<size_t>(Dm / 2) * es;
      const auto ch = random_array(dt, Bm * Dm / 2, 1.0f, rng);
      const auto sh = random_array(dt, Bm * Dm / 2, 1.0f, rng);
      std::vector<uint8_t> cf(static_cast<size_t>(Bm * Dm) * es), sf(cf.size());
      for (int64_t b = 0; b < Bm; ++b)
        for (int part = 0; part < 2; ++part) {
          std::memcpy(cf.data() + (b * 2 + part) * hb, ch.data() + b * hb, hb);
          std::memcpy(sf.data() + (b * 2 + part) * hb, sh.data() + b * hb, hb);
        }
      rope_rotate_half(dt, xm.data(), Bm, Hm, Dm, cf.data(), sf.data(), want.data());
      for (Isa isa : all)
        for (int threads : {1, 2}) {
          std::vector<uint8_t> got(want.size(), 0xee);
          rope_rotate_half(dt, xm.data(), Bm, Hm, Dm, ch.data(), sh.data(), got.data(), isa, threads, true);
          report(got == want, std::string("rope_rotate_half ") + dtype_name(dt) + " " + isa_name(isa) + " D=" +
                                  std::to_string(Dm) + " threads=" + std::to_string(threads) +
                                  " half_table: the doubled table's bits");
        }
      // partial rotary (GLM-4.5): the first rot values of each head rotated as a head of rot
      // values on tables of rot values a row, the rest copied; every tier and thread count
      const int64_t rot = Dm / 2 % 2 == 0 ? Dm / 2 : Dm / 2 + 1;
      const size_t rb = static_cast<size_t>(rot) * es, db = static_cast<size_t>(Dm) * es;
      const auto cr = random_array(dt, Bm * rot, 1.0f, rng);
      const auto sr = random_array(dt, Bm * rot, 1.0f, rng);
      std::vector<uint8_t> xr(static_cast<size_t>(Bm * Hm) * rb), yr(xr.size());
      for (int64_t r = 0; r < Bm * Hm; ++r) std::memcpy(xr.data() + r * rb, xm.data() + r * db, rb);
      rope_rotate_half(dt, xr.data(), Bm, Hm, rot, cr.data(), sr.data(), yr.data());
      for (int64_t r = 0; r < Bm * Hm; ++r) {  // the rotated part, then the head's other values as they were
        std::memcpy(want.data() + r * db, yr.data() + r * rb, rb);
        std::memcpy(want.data() + r * db + rb, xm.data() + r * db + rb, db - rb);
      }
      for (Isa isa : all)
        for (int threads : {1, 2}) {
          std::vector<uint8_t> got(want.size(), 0xee);
          rope_rotate_half(dt, xm.data(), Bm, Hm, Dm, cr.data(), sr.data(), got.data(), isa, threads, false, rot);
          report(got == want, std::string("rope_rotate_half ") + dtype_name(dt) + " " + isa_name(isa) + " D=" +
                                  std::to_string(Dm) + " rot=" + std::to_string(rot) + " threads=" +
                                  std::to_string(threads) + ": a head of rot values, the rest copied");
        }
    }
  }
}

// attention_prefill (bf16, AVX512-BF16 dot products) against a double-precision softmax
// attention: causal without a mask (query t attends keys 0..t) and with a bool mask (a chunk after
// `past` cached positions, batch row 1 left-padded so that its first query attends nothing: zeros,
// as SDPA gives); query rows read through a padded row stride, keys and values through a longer
// cache buffer; row counts around the kernel's blocks of 12 and 24 query rows and 32 keys,
// grouped-query heads, head sizes from 16 to 256; 1 and 2 threads; with attention sinks (heads
// whose sink is far above, near and far below their scores). Tiers without the kernel must
// decline and write nothing.
void test_attention_prefill(const std::vector<Isa>& tiers) {
  if (!selected("attention")) return;
  std::mt19937 rng(11);
  const DType dt = DType::kBF16;
  std::vector<Isa> all = tiers;
  all.insert(all.begin(), Isa::kGeneric);
  for (int64_t D : {16, 48, 128, 256}) {
    for (int64_t T : {1, 5, 12, 13, 24, 25, 40, 70}) {
      for (int64_t past : {0, 7, 33}) {
        for (const bool masked : {false, true})
        for (const bool sunk : {false, true}) {
          if (!masked && past) continue;  // no mask: keys [0, T) of the cache, as transformers asks
          if (sunk && D != 48 && D != 128) continue;
          const std::vector<float> sinks = {30.0f, 0.25f, -2.0f, -50.0f};  // [Hq]
          const int64_t B = 2, Hq = 4, Hkv = 2, S = past + T, Smax = S + 3, qrow = Hq * D + 8;
          const auto q = random_array(dt, B * T * qrow, 1.0f, rng);
          const auto k = random_array(dt, B * Hkv * Smax * D, 2.0f, rng);
          const auto v = random_array(dt, B * Hkv * Smax * D, 1.0f, rng);
          const float scale = 1.0f / std::sqrt(static_cast<float>(D));
          std::vector<uint8_t> mask(static_cast<size_t>(B * T * S), 0);
          for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t j = 0; j <= past + t; ++j) mask[(b * T + t) * S + j] = b == 0 || j > past;
          auto attended = [&](int64_t b, int64_t t, int64_t j) {
            return masked ? mask[(b * T + t) * S + j] != 0 : j <= t;
          };
          std::vector<double> ref(static_cast<size_t>(B * T * Hq * D), 0.0);
          double rmax = 0;
          for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t h = 0; h < Hq; ++h) {
                const int64_t base = (b * Hkv + h / (Hq / Hkv)) * Smax * D, qo = (b * T + t) * qrow + h * D;
                std::vector<double> sc(static_cast<size_t>(S), 0.0);
                double mx = -1e300, sum = 0;
                for (int64_t j = 0; j < S; ++j) {
                  if (!attended(b, t, j)) continue;
                  double d = 0;
                  for (int64_t i = 0; i < D; ++i)
                    d += double(load_elem(dt, q.data(), qo + i)) * load_elem(dt, k.data(), base + j * D + i);
                  mx = std::max(mx, sc[j] = d * scale);
                }
                const bool any = mx > -1e300;  // no key attended: zeros, whatever the sink
                if (sunk) mx = std::max(mx, double(sinks[h]));
                for (int64_t j = 0; j < S; ++j)
                  if (attended(b, t, j)) sum += (sc[j] = std::exp(sc[j] - mx));
                if (sunk && any) sum += std::exp(double(sinks[h]) - mx);
                for (int64_t i = 0; i < D && sum > 0; ++i) {
                  double o = 0;
                  for (int64_t j = 0; j < S; ++j)
                    if (attended(b, t, j)) o += sc[j] * load_elem(dt, v.data(), base + j * D + i);
                  ref[((b * T + t) * Hq + h) * D + i] = o / sum;
                  rmax = std::max(rmax, std::fabs(o / sum));
                }
              }
          for (Isa isa : all) {
            for (int threads : {1, 2}) {
              std::vector<uint8_t> out(static_cast<size_t>(B * T * Hq * D) * 2, 0xff);
              AttnPrefillArgs a{q.data(), k.data(), v.data(), out.data(), B, T, Hq, Hkv, S, D,
                                {T * qrow, qrow, D}, {Hkv * Smax * D, Smax * D, D}, {Hkv * Smax * D, Smax * D, D},
                                scale, masked ? mask.data() : nullptr, T * S, S, sunk ? sinks.data() : nullptr};
              const std::string what = std::string("attention_prefill ") + isa_name(isa) + (masked ? " masked" : "") +
                                       (sunk ? " sinks" : "") +
                                       " D=" + std::to_string(D) + " T=" + std::to_string(T) + " past=" +
                                       std::to_string(past) + " threads=" + std::to_string(threads);
              const bool expect = attention_prefill_supported(a, isa);
              if (expect != ((isa == Isa::kAvx512 || isa == Isa::kAmx) && cpu_features().avx512bf16)) {
                report(false, what + ": attention_prefill_supported disagrees with the tier and the CPU");
                continue;
              }
              const bool ran = attention_prefill(a, threads, isa);
              if (!ran) {
                report(!expect && std::all_of(out.begin(), out.end(), [](uint8_t c) { return c == 0xff; }),
                       what + ": declined, nothing written");
                continue;
              }
              double worst = 0;
              for (size_t i = 0; i < ref.size(); ++i)
                worst = std::max(worst, std::fabs(double(load_elem(dt, out.data(), int64_t(i))) - ref[i]) / rmax);
              note("attention_prefill bf16", worst);
              report(expect && worst <= 1.0 / 128, what + ": err " + std::to_string(worst));
            }
          }
        }
      }
    }
  }
}

}  // namespace tests_attention
