// lossless12: every tier and path gives the plain lossless block's bits; the format and its errors.
#include "tests/harness.h"

namespace tests_l12 {

// ---- lossless12 (bf16 in ~75 % of the bytes; outputs are the plain lossless block's bits) ----

// Rows n % 4 == 1 of a bf16 [N, K] matrix get one word from `vals` each (at most 4 per 16-row
// panel and matrix: gate + up stay within the minimum spill cap of 8): values whose high byte
// is rare in the panel, so their blocks spill.
void inject_rare(std::vector<uint8_t>& m, int64_t N, int64_t K, const std::vector<uint16_t>& vals) {
  if (m.empty()) return;
  uint16_t* w = reinterpret_cast<uint16_t*>(m.data());
  const int64_t E = static_cast<int64_t>(m.size()) / 2 / (N * K);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 1; n < N; n += 4) w[(e * N + n) * K + (n * 7 + e) % K] = vals[static_cast<size_t>((n / 4 + e) % static_cast<int64_t>(vals.size()))];
}
// finite, so outputs stay comparable: +-2^20, 2^-40, -0, a subnormal
const std::vector<uint16_t> kRareFinite = {0x4980, 0xc980, 0x2b80, 0x8000, 0x0003};
// plus inf, -inf, NaN, the largest finite value (only unpacked, never run)
const std::vector<uint16_t> kRareAny = {0x7f80, 0xff80, 0x7fc1, 0x7f7f, 0xff7f, 0x0001, 0x8000, 0x4980};

// Spilled blocks in every panel of a lossless12 block (read from its flags).
int64_t count_spilled(const PackedExperts& pe) {
  const PackedHeader& h = pe.header();
  const int G = h.has_gate ? 2 : 1;
  int64_t n = 0;
  auto count = [&](const void* expert, int64_t panels, int64_t Kp, int Gm) {
    const int64_t stored = detail::panel_bytes(DType::kBF16, WFormat::kLossless12, 0, Kp, Gm);
    const detail::L12Geometry g = detail::l12_geometry(Kp * detail::kPanelN * Gm * 2);
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t b = 0; b < g.nb; ++b)
        n += static_cast<const uint8_t*>(expert)[p * stored + detail::kL12Table + b / 8] >> (b % 8) & 1;
  };
  for (int64_t e = 0; e < h.E; ++e) {
    count(pe.gate_up_expert(e), h.In / detail::kPanelN, h.Hk, G);
    if (!h.up_only) count(pe.down_expert(e), h.Hn / detail::kPanelN, h.Ik, 1);
  }
  return n;
}

std::vector<uint8_t> run_raw(const PackedExperts& pe, const Problem& p, MoePath path, int threads, bool static_split,
                             std::string* name) {
  std::vector<uint8_t> out(static_cast<size_t>(p.c.T * p.c.H) * 2, 0xCD);
  MoeParams mp = p.params;
  mp.path = path;
  mp.num_threads = threads;
  mp.static_split = static_split;
  *name = pe.forward(p.x.data(), p.c.T, p.idx.data(), 32, p.w.data(), p.c.K, out.data(), mp);
  return out;
}

// forward() of a lossless12 block == forward() of the lossless block of the same weights, bit for
// bit, on every tier and path, for thread counts 1-3 and both splits.
void test_l12_case(const Case& c, uint32_t seed, const std::vector<Isa>& tiers) {
  if (!sampled()) return;
  const std::string tag = "l12 T" + std::to_string(c.T) + " E" + std::to_string(c.E) + " K" + std::to_string(c.K) +
                          " H" + std::to_string(c.H) + " I" + std::to_string(c.I) + " " + act_name(c.act) + " (" +
                          c.why + ")";
  if (!selected(tag)) return;
  Problem p = make_problem(DType::kBF16, c, seed);
  inject_rare(p.gate, c.I, c.H, kRareFinite);
  inject_rare(p.up, c.I, c.H, kRareFinite);
  inject_rare(p.down, c.H, c.I, kRareFinite);
  const ExpertWeights w = weights_of(p);
  struct Run { int threads; bool static_split; };
  for (Isa isa : tiers) {
    auto plain = PackedExperts::pack(w, isa, 2);
    auto l12 = PackedExperts::pack(w, isa, 2, {WFormat::kLossless12, 64});
    for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
      std::string want_name, name;
      const std::vector<uint8_t> want = run_raw(*plain, p, path, 2, false, &want_name);
      for (const Run r : {Run{2, false}, Run{1, true}, Run{3, true}, Run{3, false}}) {
        const std::vector<uint8_t> got = run_raw(*l12, p, path, r.threads, r.static_split, &name);
        std::string expect = want_name;
        expect.replace(expect.find("_bf16_"), 6, "_l12_");
        report(got == want && name == expect, tag + " " + name + " threads " + std::to_string(r.threads) +
                                                  (r.static_split ? " static" : " dynamic") + " == " + want_name);
      }
      // the fused kernel itself on the rows of either path (the driver picks it for decode only)
      // against the plain AVX-512 kernel it mirrors (prefill may select another plain kernel)
      // (both builds: F/BW, and VBMI where the CPU has it)
      detail::KernelImpl plain512;
      if (isa == Isa::kAvx512 && detail::get_kernels_avx512(DType::kBF16, &plain512)) {
        std::vector<uint8_t> ref(want.size(), 0xCD);
        MoeParams mp = p.params;
        mp.path = path;
        mp.num_threads = 2;
        detail::forward_with(*plain, plain512, "plain", p.x.data(), c.T, p.idx.data(), 32, p.w.data(), c.K, ref.data(), mp);
        struct Build { const char* name; bool (*get)(detail::KernelImpl*); bool ok; };
        for (const Build& b : {Build{"avx512", &detail::get_l12_kernels_avx512, true},
                               Build{"avx512vbmi", &detail::get_l12_kernels_avx512vbmi, cpu_features().avx512vbmi}}) {
          detail::KernelImpl fused;
          if (!b.ok || !b.get(&fused)) continue;
          std::vector<uint8_t> got(want.size(), 0xCD);
          detail::forward_with(*l12, fused, "fused", p.x.data(), c.T, p.idx.data(), 32, p.w.data(), c.K, got.data(), mp);
          report(got == ref, tag + " fused l12 " + b.name + " kernel, " + path_name(path) + " rows == moe_" +
                                 path_name(path) + "_bf16_avx512");
        }
      }
    }
  }
}

// T = 1..20 (every row count of the decode kernels' 4-row blocks and the AMX tiles' edges),
// gated and not, with biases: lossless12 == lossless on every tier and path.
void test_l12_rows(const std::vector<Isa>& tiers) {
  if (!selected("l12 rows")) return;
  for (bool gated : {true, false}) {
    for (int64_t T = 1; T <= 20; ++T) {
      Case c{T, 3, 2, 72, 40, gated, true, false, gated ? Act::kSilu : Act::kRelu2, 0, 1, false, "rows"};
      Problem p = make_problem(DType::kBF16, c, static_cast<uint32_t>(100 + T));
      inject_rare(p.up, c.I, c.H, kRareFinite);
      inject_rare(p.down, c.H, c.I, kRareFinite);
      for (Isa isa : tiers) {
        auto plain = PackedExperts::pack(weights_of(p), isa, 1);
        auto l12 = PackedExperts::pack(weights_of(p), isa, 1, {WFormat::kLossless12, 64});
        for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
          std::string n0, n1;
          const bool ok = run_raw(*l12, p, path, 2, false, &n1) == run_raw(*plain, p, path, 2, false, &n0);
          report(ok, "l12 rows T=" + std::to_string(T) + (gated ? " gated " : " no-gate ") + n1 + " == " + n0);
        }
      }
    }
  }
}

// pack/unpack exact (inf, NaN, -0, subnormals, the largest values; padding in H and I), blocks
// spill and are read back, the AVX-512 decompressor writes the portable one's bytes, and the
// block is ~75 % of the lossless one.
void test_l12_format(const std::vector<Isa>& tiers) {
  if (!selected("l12 format")) return;
  for (bool gated : {true, false}) {
    for (const int64_t H : {37, 200}) {
      Case c{2, 3, 1, H, 21, gated, true, false, Act::kSilu, 0, 0, false, "odd sizes"};
      Problem p = make_problem(DType::kBF16, c, 17);
      inject_rare(p.gate, c.I, c.H, kRareAny);
      inject_rare(p.up, c.I, c.H, kRareAny);
      inject_rare(p.down, c.H, c.I, kRareAny);
      const std::string tag = std::string("l12 format H=") + std::to_string(H) + (gated ? " gated" : " no-gate");
      for (Isa isa : tiers) {
        auto pe = PackedExperts::pack(weights_of(p), isa, 2, {WFormat::kLossless12, 64});
        std::vector<uint8_t> g(p.up.size()), u(p.up.size()), d(p.down.size()), bg(p.bu.size()), bu(p.bu.size()),
            bd(p.bd.size());
        pe->unpack(gated ? g.data() : nullptr, u.data(), d.data(), gated ? bg.data() : nullptr, bu.data(), bd.data());
        bool ok = u == p.up && d == p.down && bu == p.bu && bd == p.bd;
        if (gated) ok = ok && g == p.gate && bg == p.bg;
        report(ok, tag + " unpack roundtrip " + isa_name(isa));
        // (H = 37: its panels hold fewer than 16 high bytes, the rare ones included: no spills)
        if (H == 200) report(count_spilled(*pe) > 0, tag + " has spilled blocks " + isa_name(isa));
        report(pe->wformat() == WFormat::kLossless12 && pe->header().kpack == 2, tag + " header " + isa_name(isa));
      }
    }
  }
  {  // the size: a 2048 x 1024 gate/up block is ~75 % of lossless
    const PackedHeader a = plan_packed(DType::kBF16, 1, 2048, 1024, true, false, false, false, Isa::kGeneric, {});
    const PackedHeader b =
        plan_packed(DType::kBF16, 1, 2048, 1024, true, false, false, false, Isa::kGeneric, {WFormat::kLossless12, 64});
    const double ratio = static_cast<double>(b.nbytes) / static_cast<double>(a.nbytes);
    report(ratio > 0.75 && ratio < 0.77, "l12 format: block is " + std::to_string(ratio) + " of lossless");
  }
  // the AVX-512 decompressor == the portable one, panel by panel (spilled blocks included)
  if (isa_supported(cpu_features(), Isa::kAvx512)) {
    std::mt19937 rng(5);
    int64_t total_spilled = 0;
    for (const int64_t Kp : {32, 64, 2048}) {
      for (int G : {1, 2}) {
        const int64_t plain_bytes = Kp * detail::kPanelN * G * 2;
        std::vector<uint16_t> plain(static_cast<size_t>(plain_bytes / 2));
        std::uniform_real_distribution<float> ud(-0.02f, 0.02f);  // 16 high bytes hold nearly all
        for (auto& v : plain) v = detail::f32_to_bf16(ud(rng));
        const detail::L12Geometry geo = detail::l12_geometry(plain_bytes);
        // half the cap in blocks of their own (a few of the random values spill too)
        for (int64_t b = 0; b < geo.cap / 2; ++b)
          plain[static_cast<size_t>(b * 64 * (geo.nb / geo.cap) + 5)] = 0x4980 + static_cast<uint16_t>(b << 8);
        std::vector<uint8_t> panel(static_cast<size_t>(geo.bytes));
        const int64_t spilled = detail::l12_compress_panel(plain.data(), plain_bytes, panel.data());
        std::vector<uint16_t> a(plain.size(), 1), v(plain.size(), 2);
        detail::l12_decompress_panel_portable(panel.data(), plain_bytes, a.data());
        detail::l12_decompress_panel_avx512(panel.data(), plain_bytes, v.data());
        total_spilled += spilled;
        report(spilled <= geo.cap && a == plain && v == plain,
               "l12 format: avx512 decompress == portable == plain, Kp=" + std::to_string(Kp) + " G=" +
                   std::to_string(G) + " (" + std::to_string(spilled) + " spilled)");
      }
    }
    // (the small panels hold fewer than 16 high bytes, the rare ones included: no spills there)
    report(total_spilled > 0, "l12 format: the decompressors saw spilled blocks");
  }
}

// Dense layers: pack_linear/linear in lossless12 == lossless, every tier and path.
void test_l12_linear(const std::vector<Isa>& tiers) {
  if (!selected("l12 linear")) return;
  struct L { int64_t O, In, T; };
  const L shapes[] = {{17, 33, 1}, {33, 65, 5}, {129, 64, 17}, {48, 256, 3}};
  std::mt19937 rng(12);
  for (const L& l : shapes) {
    for (bool bias : {false, true}) {
      auto w = random_array(DType::kBF16, l.O * l.In, 1.0f / std::sqrt(float(l.In)), rng);
      inject_rare(w, l.O, l.In, kRareFinite);
      const auto b = random_array(DType::kBF16, l.O, 0.1f, rng);
      const auto x = random_array(DType::kBF16, l.T * l.In, 1.0f, rng);
      for (Isa isa : tiers) {
        auto plain = PackedExperts::pack_linear(DType::kBF16, l.O, l.In, w.data(), bias ? b.data() : nullptr, isa, 2);
        auto l12 = PackedExperts::pack_linear(DType::kBF16, l.O, l.In, w.data(), bias ? b.data() : nullptr, isa, 2,
                                              {WFormat::kLossless12, 64});
        for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
          std::vector<uint8_t> o0(static_cast<size_t>(l.T * l.O) * 2, 0xff), o1(o0.size(), 0xee);
          MoeParams mp;
          mp.num_threads = 2;
          mp.path = path;
          const std::string n0 = plain->linear(x.data(), l.T, o0.data(), mp);
          const std::string n1 = l12->linear(x.data(), l.T, o1.data(), mp);
          report(o0 == o1, "l12 linear " + n1 + " O=" + std::to_string(l.O) + " In=" + std::to_string(l.In) +
                               " T=" + std::to_string(l.T) + (bias ? " bias" : "") + " == " + n0);
        }
      }
    }
  }
}

// Errors: a panel spilling past its cap (exactly cap blocks still packs), fp32/fp16 weights,
// and view() of valid and corrupted lossless12 headers.
void test_l12_errors() {
  if (!selected("l12 errors")) return;
  // A linear layer [48, 256] (3 panels of 16 rows, G = 1: block b of a panel = k 4b..4b+3,
  // nb = 64, cap = 9) of 16 frequent high bytes; panel 1 gets `spills` blocks with a word of a
  // high byte of its own.
  const int64_t O = 48, In = 256, cap = 64 / 64 + 8;
  auto layer = [&](int64_t spills) {
    std::mt19937 rng(21);
    std::vector<uint16_t> w(static_cast<size_t>(O * In));
    for (size_t i = 0; i < w.size(); ++i)
      w[i] = static_cast<uint16_t>(((0x30 + i % 8) | (i / 8 % 2) << 7) << 8 | (rng() & 0xff));
    for (int64_t b = 0; b < spills; ++b) w[static_cast<size_t>(16 * In + 4 * b)] = static_cast<uint16_t>((0x50 + b) << 8);
    return w;
  };
  for (const int64_t spills : {cap, cap + 1}) {
    const std::vector<uint16_t> w = layer(spills);
    std::string msg;
    try {
      auto pe = PackedExperts::pack_linear(DType::kBF16, O, In, w.data(), nullptr, Isa::kGeneric, 1,
                                           {WFormat::kLossless12, 64});
      std::vector<uint16_t> back(w.size());
      pe->unpack(nullptr, back.data(), nullptr, nullptr, nullptr, nullptr);
      report(spills == cap && back == w && count_spilled(*pe) == cap,
             "l12 errors: " + std::to_string(spills) + " spilled blocks (the cap) pack and unpack exactly");
    } catch (const std::invalid_argument& e) {
      msg = e.what();
    }
    if (spills > cap)
      report(msg.find("expert 0's up panel 1 ") != std::string::npos && msg.find("10 of its 64 blocks") != std::string::npos &&
                 msg.find("store these weights as 'lossless'") != std::string::npos,
             "l12 errors: cap + 1 spilled blocks refused: " + msg);
  }
  {  // experts: the error names the lowest expert that fails, and its gate/up or down panel
    // expert 2's down panel 1 (Ik = 1024: nb = 256, cap = 12): 64 equally frequent high bytes,
    // k % 64 -> 0x40 + k % 64; the table takes 0x40..0x4f, so 3 of 4 blocks spill
    Case c{1, 3, 1, 64, 1024, true, false, false, Act::kSilu, 0, 0, false, "spill errors"};
    Problem p = make_problem(DType::kBF16, c, 4);
    uint16_t* down = reinterpret_cast<uint16_t*>(p.down.data());
    for (int64_t row = 16; row < 32; ++row)
      for (int64_t k = 0; k < c.I; ++k) down[(2 * c.H + row) * c.I + k] = static_cast<uint16_t>((0x40 + k % 64) << 8);
    std::string msg;
    try { PackedExperts::pack(weights_of(p), Isa::kGeneric, 3, {WFormat::kLossless12, 64}); }
    catch (const std::invalid_argument& e) { msg = e.what(); }
    report(msg.find("expert 2's down panel 1 ") != std::string::npos, "l12 errors: names the expert and panel: " + msg);
  }
  for (DType dt : {DType::kF32, DType::kF16}) {
    std::string msg;
    try { plan_packed(dt, 2, 64, 64, true, false, false, false, Isa::kGeneric, {WFormat::kLossless12, 64}); }
    catch (const std::invalid_argument& e) { msg = e.what(); }
    report(msg.find("needs bfloat16") != std::string::npos && msg.find("'lossless'") != std::string::npos,
           std::string("l12 errors: ") + dtype_name(dt) + " refused: " + msg);
  }
  WFormat f;
  report(wformat_from_name("lossless12", &f) && f == WFormat::kLossless12 &&
             std::string(wformat_name(WFormat::kLossless12)) == "lossless12",
         "l12 errors: the format's name");
  // view(): a stored lossless12 block is accepted, a corrupted header refused
  Case c{3, 4, 2, 80, 48, true, true, false, Act::kSilu, 0, 0, false, "view"};
  const Problem p = make_problem(DType::kBF16, c, 6);
  auto pe = PackedExperts::pack(weights_of(p), Isa::kGeneric, 2, {WFormat::kLossless12, 64});
  const PackedHeader h = pe->header();
  void* mem = nullptr;
  if (posix_memalign(&mem, 64, h.nbytes) != 0) std::abort();
  std::memcpy(mem, pe->data(), h.nbytes);
  auto v = PackedExperts::view(h, mem, h.nbytes);
  std::string n0, n1;
  report(run_raw(*v, p, MoePath::kDecode, 2, false, &n1) == run_raw(*pe, p, MoePath::kDecode, 2, false, &n0),
         "l12 errors: view() of a lossless12 block runs as the block");
  auto refused = [&](PackedHeader bad) {
    try { PackedExperts::view(bad, mem, bad.nbytes); } catch (const std::invalid_argument&) { return true; }
    return false;
  };
  PackedHeader bad = h;
  bad.kpack = 1;
  report(refused(bad), "l12 errors: view() refuses a lossless12 header with kpack 1");
  bad = h;
  bad.dtype = static_cast<uint8_t>(DType::kF16);
  report(refused(bad), "l12 errors: view() refuses a float16 lossless12 header");
  bad = h;
  bad.gu_expert_bytes -= 64;
  report(refused(bad), "l12 errors: view() refuses a lossless12 header with a wrong expert size");
  bad = h;
  bad.wfmt = 4;
  report(refused(bad), "l12 errors: view() refuses an unknown format");
  std::free(mem);
  report(std::string(moe_kernel_name(Isa::kGeneric, DType::kBF16, MoePath::kDecode, WFormat::kLossless12)) ==
             "moe_decode_l12_generic",
         "l12 errors: kernel name moe_decode_l12_generic");
}

}  // namespace tests_l12
