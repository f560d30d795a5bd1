// Packing experts into the panel layout (PackedHeader in hina_moe/experts.h): the plan, the
// block's allocation and views of stored blocks, packing and quantising the weights, and the
// inverse (unpack). Baseline flags with -ffp-contract=off: the portable build of
// moe/quant_panel.h runs here (the AVX-512 build where the CPU has it: same bytes, tested).
#include <cmath>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>


#include "hina_moe/experts.h"
#include "hina_moe/tier.h"
#include "hina_moe/thread_pool.h"
#include "moe/kernel_api.h"
#include "dispatch/select.h"
#include "moe/quant_panel.h"

namespace hina {

using namespace detail;

namespace {

// Packs one [N, K] matrix into panels; Elem is the raw element (uint16_t / uint32_t).
template <typename Elem>
void pack_matrix(const Elem* src, int64_t N, int64_t K, Elem* dst, int64_t Np, int64_t Kp,
                 int kpack, int G, int gi) {
  for (int64_t p = 0; p < Np / kPanelN; ++p) {
    Elem* panel = dst + p * Kp * kPanelN * G;
    for (int64_t k = 0; k < Kp; ++k) {
      for (int n = 0; n < kPanelN; ++n) {
        const int64_t row = p * kPanelN + n;
        panel[panel_index(kpack, G, k, gi, n)] = (row < N && k < K) ? src[row * K + k] : Elem(0);
      }
    }
  }
}

template <typename Elem>
void unpack_matrix(const Elem* panels, int64_t N, int64_t K, Elem* dst, int64_t Kp, int kpack,
                   int G, int gi) {
  for (int64_t row = 0; row < N; ++row) {
    const Elem* panel = panels + (row / kPanelN) * Kp * kPanelN * G;
    const int n = static_cast<int>(row % kPanelN);
    for (int64_t k = 0; k < K; ++k) dst[row * K + k] = panel[panel_index(kpack, G, k, gi, n)];
  }
}


// Quantises one [N, K] matrix into the panels of matrix gi (see PackedHeader, layout v5): each
// panel's 16 rows are transposed into fp32 and handed to the panel quantiser (moe/quant_panel.h;
// its AVX-512 build where the CPU has it: same bytes, several times faster).
void quant_matrix(const void* src, DType dt, int64_t N, int64_t K, uint8_t* dst, int64_t Np,
                  int64_t Kp, int G, int gi, WFormat wf, int group, std::vector<float>& buf, Isa tier) {
  buf.assign(static_cast<size_t>(Kp * kPanelN), 0.0f);
  const int64_t pbytes = panel_bytes(dt, wf, group, Kp, G);
  // the block's own tier decides (tiers below avx512 use the portable build: the tests pack at
  // every tier and compare both builds with the same independent quantisation)
  const bool avx512 = tier == Isa::kAvx512 || tier == Isa::kAmx;
  const bool avx2 = tier == Isa::kAvx2;
  for (int64_t p = 0; p < Np / kPanelN; ++p) {
    for (int n = 0; n < kPanelN; ++n) {
      const int64_t row = p * kPanelN + n;
      float* col = buf.data() + n;
      if (row >= N) {
        for (int64_t k = 0; k < Kp; ++k) col[k * kPanelN] = 0.0f;
        continue;
      }
      if (dt == DType::kBF16) {
        const uint16_t* r = static_cast<const uint16_t*>(src) + row * K;
        for (int64_t k = 0; k < K; ++k) col[k * kPanelN] = bf16_to_f32(r[k]);
      } else if (dt == DType::kF32) {
        const float* r = static_cast<const float*>(src) + row * K;
        for (int64_t k = 0; k < K; ++k) col[k * kPanelN] = r[k];
      } else {
        for (int64_t k = 0; k < K; ++k) col[k * kPanelN] = load_elem(dt, src, row * K + k);
      }
      for (int64_t k = K; k < Kp; ++k) col[k * kPanelN] = 0.0f;
    }
    uint8_t* panel = dst + p * pbytes;
#if defined(HINA_HAVE_X86_KERNELS)
    if (avx512) {
      quant_panel_avx512(buf.data(), Kp, G, gi, wf, group, panel);
      continue;
    }
    if (avx2) {
      quant_panel_avx2(buf.data(), Kp, G, gi, wf, group, panel);
      continue;
    }
#endif
    qp::quant_panel<4>(buf.data(), Kp, G, gi, wf, group, panel);
  }
  (void)avx512;
  (void)avx2;
}

// Inverse of quant_matrix: the dequantised [N, K] matrix in dtype dt.
void dequant_matrix(const uint8_t* panels, DType dt, int64_t N, int64_t K, void* dst, int64_t Kp,
                    int G, int gi, WFormat wf, int group) {
  Layout L{};
  L.dtype = dt;
  L.wfmt = wf;
  L.group = group;
  std::vector<float> w(static_cast<size_t>(Kp * kPanelN));
  const int64_t pbytes = panel_bytes(dt, wf, group, Kp, G);
  for (int64_t p = 0; p * kPanelN < N; ++p) {
    dequant_panel_f32(panels + p * pbytes, L, Kp, G, gi, w.data());
    for (int n = 0; n < kPanelN && p * kPanelN + n < N; ++n)
      for (int64_t k = 0; k < K; ++k) store_elem(dt, dst, (p * kPanelN + n) * K + k, w[k * kPanelN + n]);
  }
}

}  // namespace

PackedHeader plan_packed(DType dt, int64_t E, int64_t H, int64_t I, bool has_gate,
                         bool gate_bias, bool up_bias, bool down_bias, Isa isa, QuantSpec q,
                         bool up_only) {
  // Headers also come back from stores (view): sizes must never wrap. Each dimension fits int32
  // (the driver keeps expert ids and token rows in int32), and the block's bytes are summed
  // with overflow checks up to 2^62, so every derived size and offset is exact.
  constexpr int64_t kMaxDim = INT32_MAX;
  constexpr uint64_t kMaxBytes = uint64_t{1} << 62;
  if (E < 1 || H < 1 || I < 1 || E > kMaxDim || H > kMaxDim || I > kMaxDim) {
    throw std::invalid_argument("experts need 1 <= E, H, I <= 2^31 - 1 (got E=" + std::to_string(E) +
                                ", H=" + std::to_string(H) + ", I=" + std::to_string(I) + ")");
  }
  if (dt != DType::kF32 && dt != DType::kBF16 && dt != DType::kF16) {
    throw std::invalid_argument("unsupported weight dtype");
  }
  if (q.fmt != WFormat::kLossless && q.fmt != WFormat::kInt8 && q.fmt != WFormat::kInt4 &&
      q.fmt != WFormat::kLossless12) {
    throw std::invalid_argument("unknown weight format");
  }
  if (q.fmt == WFormat::kLossless12 && dt != DType::kBF16) {
    throw std::invalid_argument(std::string("weights 'lossless12' needs bfloat16 weights (got ") + dtype_name(dt) +
                                "); use 'lossless' for float32 and float16 models");
  }
  if (q.fmt == WFormat::kInt4 && q.group != 32 && q.group != 64 && q.group != 128) {
    throw std::invalid_argument("int4 group size must be 32, 64 or 128 (got " +
                                std::to_string(q.group) + ")");
  }
  if (up_only && (E != 1 || down_bias || (gate_bias && !has_gate) || (has_gate && gate_bias != up_bias))) {
    throw std::invalid_argument("an up-only (linear) block has E = 1, no down bias, and a gate (paired) only with "
                                "biases on both halves or neither");
  }
  if (up_only && has_gate && q.fmt != WFormat::kInt8 && q.fmt != WFormat::kInt4) {
    throw std::invalid_argument(std::string("a paired linear layer is int8 or int4 (got ") + wformat_name(q.fmt) + ")");
  }
  PackedHeader h;
  h.up_only = up_only;
  h.dtype = static_cast<uint8_t>(dt);
  h.isa = static_cast<uint8_t>(isa);
  h.wfmt = static_cast<uint8_t>(q.fmt);
  h.group = static_cast<uint16_t>(q.fmt == WFormat::kInt4 ? q.group : 0);
  h.kpack = ((q.fmt == WFormat::kLossless || q.fmt == WFormat::kLossless12) && dt == DType::kBF16) ? 2 : 1;
  h.k_align = static_cast<uint16_t>(q.fmt == WFormat::kInt4 && q.group > kKAlign ? q.group : kKAlign);
  h.has_gate = has_gate;
  h.has_gate_bias = gate_bias;
  h.has_up_bias = up_bias;
  h.has_down_bias = down_bias;
  h.E = E;
  h.H = H;
  h.I = I;
  h.Hk = round_up(H, h.k_align);
  h.In = round_up(I, kPanelN);
  h.Ik = round_up(I, h.k_align);
  h.Hn = round_up(H, kPanelN);
  const int G = has_gate ? 2 : 1;
  auto too_big = [&]() {
    throw std::invalid_argument("packed experts of E=" + std::to_string(E) + ", H=" + std::to_string(H) +
                                ", I=" + std::to_string(I) + " would take more than 2^62 bytes");
  };
  auto mul = [&](uint64_t a, uint64_t b) {
    if (a != 0 && b > kMaxBytes / a) too_big();
    return a * b;
  };
  auto add = [&](uint64_t a, uint64_t b) {
    if (b > kMaxBytes - a) too_big();
    return a + b;
  };
  auto a64 = [&](uint64_t b) { return add(b, 63) / 64 * 64; };
  // panel_bytes stays in int64 for dimensions <= 2^31 + 128 (at most 2^38 bytes per panel)
  const uint64_t gu_panel = static_cast<uint64_t>(panel_bytes(dt, q.fmt, h.group, h.Hk, G));
  const uint64_t dn_panel = static_cast<uint64_t>(panel_bytes(dt, q.fmt, h.group, h.Ik, 1));
  const uint64_t e = static_cast<uint64_t>(E);
  h.gu_expert_bytes = a64(mul(static_cast<uint64_t>(h.In / kPanelN), gu_panel));
  h.down_expert_bytes = up_only ? 0 : a64(mul(static_cast<uint64_t>(h.Hn / kPanelN), dn_panel));
  uint64_t n = mul(add(h.gu_expert_bytes, h.down_expert_bytes), e);
  if (gate_bias) n = add(n, a64(mul(mul(4, e), static_cast<uint64_t>(h.In))));
  if (up_bias) n = add(n, a64(mul(mul(4, e), static_cast<uint64_t>(h.In))));
  if (down_bias) n = add(n, a64(mul(mul(4, e), static_cast<uint64_t>(h.Hn))));
  h.nbytes = n;
  return h;
}

PackedExperts::~PackedExperts() {
  if (owns_) std::free(mem_);
}

const void* PackedExperts::gate_up_expert(int64_t e) const {
  if (tier_) return tier_gu_[static_cast<size_t>(e)];
  return gu_ + static_cast<size_t>(e) * hdr_.gu_expert_bytes;
}
const void* PackedExperts::down_expert(int64_t e) const {
  if (tier_) return tier_dn_[static_cast<size_t>(e)];
  return down_ + static_cast<size_t>(e) * hdr_.down_expert_bytes;
}

void PackedExperts::bind(void* mem) {
  const PackedHeader& h = hdr_;
  mem_ = mem;
  uint8_t* base = static_cast<uint8_t*>(mem);
  gu_ = base;
  down_ = base + h.gu_expert_bytes * static_cast<size_t>(h.E);
  bind_biases(down_ + h.down_expert_bytes * static_cast<size_t>(h.E));
}

void PackedExperts::bind_biases(uint8_t* b) {
  const PackedHeader& h = hdr_;
  auto a64 = [](int64_t n) { return static_cast<size_t>(round_up(n, 64)); };
  bias_g_ = bias_u_ = bias_d_ = nullptr;
  if (h.has_gate_bias) { bias_g_ = reinterpret_cast<float*>(b); b += a64(4 * h.E * h.In); }
  if (h.has_up_bias) { bias_u_ = reinterpret_cast<float*>(b); b += a64(4 * h.E * h.In); }
  if (h.has_down_bias) { bias_d_ = reinterpret_cast<float*>(b); }
}

std::unique_ptr<PackedExperts> PackedExperts::create(const PackedHeader& h, void* mem) {
  const PackedHeader want = plan_packed(static_cast<DType>(h.dtype), h.E, h.H, h.I, h.has_gate,
                                        h.has_gate_bias, h.has_up_bias, h.has_down_bias,
                                        static_cast<Isa>(h.isa),
                                        {static_cast<WFormat>(h.wfmt), h.group ? h.group : 64}, h.up_only != 0);
  if (std::memcmp(&want, &h, sizeof(h)) != 0) {
    throw std::invalid_argument("packed header is not what plan_packed gives for its shapes");
  }
  check_tier(static_cast<Isa>(h.isa));
  if (mem && reinterpret_cast<uintptr_t>(mem) % 64 != 0) {
    throw std::invalid_argument("packed block memory must be 64-byte aligned");
  }
  std::unique_ptr<PackedExperts> pe(new PackedExperts());
  pe->hdr_ = h;
  pe->owns_ = mem == nullptr;
  if (!mem) {
    mem = alloc_weights(h.nbytes);
    std::memset(mem, 0, h.nbytes);  // padding bytes are part of the block's checksum
  }
  pe->bind(mem);
  return pe;
}

std::unique_ptr<PackedExperts> PackedExperts::view(const PackedHeader& h, const void* mem,
                                                   size_t mem_bytes) {
  if (h.magic != PackedHeader{}.magic) throw std::invalid_argument("not a packed-experts header (bad magic)");
  if (h.version != PackedHeader{}.version) {
    throw std::invalid_argument("packed layout version " + std::to_string(h.version) +
                                " is not this build's version " + std::to_string(PackedHeader{}.version));
  }
  if (h.dtype > 2 || h.wfmt > 3 || std::strcmp(isa_name(static_cast<Isa>(h.isa)), "unknown") == 0) throw std::invalid_argument("packed header has an unknown dtype, format or tier");
  if (h.nbytes != mem_bytes) {
    throw std::invalid_argument("packed block is " + std::to_string(mem_bytes) +
                                " bytes; its header says " + std::to_string(h.nbytes));
  }
  if (!mem) throw std::invalid_argument("null packed block");
  auto pe = create(h, const_cast<void*>(mem));  // never written through: forward/unpack read only
  return pe;
}

std::unique_ptr<PackedExperts> PackedExperts::copy_of(const PackedHeader& h, const void* mem, size_t mem_bytes) {
  view(h, mem, mem_bytes);  // validates; the view itself is dropped
  std::unique_ptr<PackedExperts> pe(new PackedExperts());
  pe->hdr_ = h;
  void* own = alloc_weights(h.nbytes);
  // in 2 MiB pieces over the pool: the page faults (the OS zeroing each fresh page, 44 % of a
  // copy's samples in a profile of 2026-12-02, aa179b1) run on the thread that faults
  constexpr size_t kPiece = size_t(2) << 20;
  const size_t pieces = (h.nbytes + kPiece - 1) / kPiece;
  ThreadPool::global().run(default_num_threads(), [&](int tid, int n) {
    int64_t p0, p1;
    split_range(static_cast<int64_t>(pieces), tid, n, &p0, &p1);
    const size_t b0 = static_cast<size_t>(p0) * kPiece, b1 = std::min(h.nbytes, static_cast<size_t>(p1) * kPiece);
    if (b1 > b0) std::memcpy(static_cast<char*>(own) + b0, static_cast<const char*>(mem) + b0, b1 - b0);
  });
  pe->owns_ = true;
  pe->bind(own);
  return pe;
}

std::unique_ptr<PackedExperts> PackedExperts::tiered(const PackedHeader& h, std::shared_ptr<ExpertTier> tier,
                                                     int layer, const void* biases, size_t bias_bytes) {
  if (!tier) throw std::invalid_argument("tiered block without a tier");
  if (h.up_only) throw std::invalid_argument("a dense linear layer (up-only block) cannot live in the memory tier");
  const uint64_t experts_bytes = (h.gu_expert_bytes + h.down_expert_bytes) * static_cast<uint64_t>(h.E);
  if (h.nbytes < experts_bytes || h.nbytes - experts_bytes != bias_bytes)
    throw std::invalid_argument("tiered block: its bias region is " + std::to_string(h.nbytes - experts_bytes) +
                                " bytes by its header, " + std::to_string(bias_bytes) + " were given");
  if (tier->experts(layer) != h.E)
    throw std::invalid_argument("tiered block: the tier's layer " + std::to_string(layer) + " has " +
                                std::to_string(tier->experts(layer)) + " experts, the header " + std::to_string(h.E));
  if (h.magic != PackedHeader{}.magic || h.version != PackedHeader{}.version)
    throw std::invalid_argument("tiered block: not a packed-experts header of this build's layout version");
  const PackedHeader want = plan_packed(static_cast<DType>(h.dtype), h.E, h.H, h.I, h.has_gate, h.has_gate_bias,
                                        h.has_up_bias, h.has_down_bias, static_cast<Isa>(h.isa),
                                        {static_cast<WFormat>(h.wfmt), h.group ? h.group : 64}, false);
  if (std::memcmp(&want, &h, sizeof(h)) != 0)
    throw std::invalid_argument("packed header is not what plan_packed gives for its shapes");
  check_tier(static_cast<Isa>(h.isa));
  std::unique_ptr<PackedExperts> pe(new PackedExperts());
  pe->hdr_ = h;
  pe->owns_ = true;
  pe->mem_ = alloc_weights(std::max<size_t>(bias_bytes, 64));
  if (bias_bytes) std::memcpy(pe->mem_, biases, bias_bytes);
  pe->gu_ = pe->down_ = nullptr;
  pe->bind_biases(static_cast<uint8_t*>(pe->mem_));
  pe->tier_ = std::move(tier);
  pe->tier_layer_ = layer;
  pe->tier_gu_.assign(static_cast<size_t>(h.E), nullptr);
  pe->tier_dn_.assign(static_cast<size_t>(h.E), nullptr);
  return pe;
}

std::unique_ptr<PackedExperts> PackedExperts::pack_linear(DType dt, int64_t out_features, int64_t in_features,
                                                          const void* weight, const void* bias, Isa isa,
                                                          int num_threads, QuantSpec q, bool paired) {
  if (!weight) throw std::invalid_argument("the weight is required");
  if (paired && (out_features < 2 || out_features % 2 != 0))
    throw std::invalid_argument("a paired linear layer needs an even number of outputs (got " +
                                std::to_string(out_features) + ")");
  check_tier(isa);
  const int64_t I = paired ? out_features / 2 : out_features;
  const PackedHeader h = plan_packed(dt, 1, in_features, I, paired, paired && bias != nullptr, bias != nullptr,
                                     false, isa, q, true);
  ExpertWeights w;
  w.dtype = dt;
  w.E = 1;
  w.H = in_features;
  w.I = I;
  const size_t esz = dtype_size(dt);
  if (paired) {  // rows [0, I) the gate matrix, [I, 2 I) the up matrix
    w.gate = weight;
    w.up = static_cast<const uint8_t*>(weight) + static_cast<size_t>(I * in_features) * esz;
    w.gate_bias = bias;
    w.up_bias = bias ? static_cast<const uint8_t*>(bias) + static_cast<size_t>(I) * esz : nullptr;
  } else {
    w.up = weight;
    w.up_bias = bias;
  }
  auto pe = create(h);
  pe->pack_experts(0, w, num_threads);
  return pe;
}

std::unique_ptr<PackedExperts> PackedExperts::pack(const ExpertWeights& w, Isa isa,
                                                   int num_threads, QuantSpec q) {
  if (!w.up || !w.down) throw std::invalid_argument("up and down weights are required");
  check_tier(isa);
  const PackedHeader h = plan_packed(w.dtype, w.E, w.H, w.I, w.gate != nullptr,
                                     w.gate_bias != nullptr, w.up_bias != nullptr,
                                     w.down_bias != nullptr, isa, q);
  auto pe = create(h);
  pe->pack_experts(0, w, num_threads);
  return pe;
}

void PackedExperts::pack_experts(int64_t e0, const ExpertWeights& w, int num_threads) {
  if (tier_) throw std::invalid_argument("this block's experts live in the memory tier; it cannot be packed into");
  const PackedHeader& h = hdr_;
  if (!w.up || (!w.down && !up_only())) throw std::invalid_argument("up and down weights are required");
  if (w.down && up_only()) throw std::invalid_argument("an up-only (linear) block takes no down weights");
  if (w.dtype != dtype() || w.H != h.H || w.I != h.I || w.E < 1 || e0 < 0 || e0 + w.E > h.E) {
    throw std::invalid_argument("pack_experts: experts [" + std::to_string(e0) + ", " +
                                std::to_string(e0 + w.E) + ") of dtype " + dtype_name(w.dtype) +
                                " H=" + std::to_string(w.H) + " I=" + std::to_string(w.I) +
                                " do not fit the block (E=" + std::to_string(h.E) + ", dtype " +
                                dtype_name(dtype()) + ", H=" + std::to_string(h.H) +
                                ", I=" + std::to_string(h.I) + ")");
  }
  if ((w.gate != nullptr) != has_gate() || (w.gate_bias != nullptr) != has_gate_bias() ||
      (w.up_bias != nullptr) != has_up_bias() || (w.down_bias != nullptr) != has_down_bias()) {
    throw std::invalid_argument("pack_experts: gate / bias arrays differ from the block's header");
  }
  const int G = h.has_gate ? 2 : 1;
  const size_t esz = dtype_size(w.dtype);
  const WFormat wf = wformat();
  const int nth = num_threads > 0 ? num_threads : default_num_threads();
  // lossless12: a panel that does not fit its spill area fails the whole call; the error of the
  // lowest such expert is thrown after the region (exceptions do not cross the pool's threads)
  std::mutex l12_mu;
  int64_t l12_bad_expert = h.E;
  std::string l12_error;
  auto l12_compress = [&](const std::vector<uint16_t>& plain, int64_t panels, int64_t Kp, int Gm,
                          uint8_t* dst, const char* what, int64_t e) {
    const int64_t plain_bytes = panel_bytes(DType::kBF16, WFormat::kLossless, 0, Kp, Gm);
    const int64_t stored = panel_bytes(DType::kBF16, WFormat::kLossless12, 0, Kp, Gm);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t spilled = l12_compress_panel(plain.data() + p * plain_bytes / 2, plain_bytes, dst + p * stored);
      const L12Geometry g = l12_geometry(plain_bytes);
      if (spilled <= g.cap) continue;
      std::lock_guard<std::mutex> lock(l12_mu);
      if (e < l12_bad_expert) {
        l12_bad_expert = e;
        l12_error = "lossless12 cannot store expert " + std::to_string(e) + "'s " + what + " panel " +
                    std::to_string(p) + " (output rows " + std::to_string(p * kPanelN) + ".." +
                    std::to_string(p * kPanelN + kPanelN - 1) + "): " + std::to_string(spilled) + " of its " +
                    std::to_string(g.nb) + " blocks of 64 weights have a high byte (sign and exponent) " +
                    "outside the panel's 16 most frequent, more than the " + std::to_string(g.cap) +
                    " its spill area holds; store these weights as 'lossless'";
      }
      return false;
    }
    return true;
  };
  ThreadPool::global().run(static_cast<int>(std::min<int64_t>(nth, w.E)), [&](int tid, int n) {
    int64_t s0, s1;
    split_range(w.E, tid, n, &s0, &s1);
    std::vector<float> buf;
    std::vector<uint16_t> plain;  // lossless12: one matrix's plain bf16 panels
    for (int64_t se = s0; se < s1; ++se) {
      const int64_t e = e0 + se;
      const size_t gu_off = static_cast<size_t>(se * w.I * w.H);
      const size_t dn_off = static_cast<size_t>(se * w.H * w.I);
      uint8_t* gu_dst = gu_ + static_cast<size_t>(e) * h.gu_expert_bytes;
      uint8_t* dn_dst = down_ + static_cast<size_t>(e) * h.down_expert_bytes;
      if (wf == WFormat::kLossless) {
        // Packing only moves elements, so the element type is just its size (bf16/fp16 or fp32).
        auto pack_expert = [&](auto elem) {
          using El = decltype(elem);
          if (w.gate)
            pack_matrix(static_cast<const El*>(w.gate) + gu_off, w.I, w.H,
                        reinterpret_cast<El*>(gu_dst), h.In, h.Hk, h.kpack, G, 0);
          pack_matrix(static_cast<const El*>(w.up) + gu_off, w.I, w.H,
                      reinterpret_cast<El*>(gu_dst), h.In, h.Hk, h.kpack, G, G - 1);
          if (w.down)
            pack_matrix(static_cast<const El*>(w.down) + dn_off, w.H, w.I,
                        reinterpret_cast<El*>(dn_dst), h.Hn, h.Ik, h.kpack, 1, 0);
        };
        if (esz == 2) pack_expert(uint16_t{});
        else pack_expert(uint32_t{});
      } else if (wf == WFormat::kLossless12) {
        // the expert's plain bf16 panels (the lossless layout), then each compressed into the block
        plain.assign(static_cast<size_t>(std::max(h.In * h.Hk * G, h.Hn * h.Ik)), 0);
        auto src = [&](const void* base, size_t off) { return static_cast<const uint16_t*>(base) + off; };
        if (w.gate) pack_matrix(src(w.gate, gu_off), w.I, w.H, plain.data(), h.In, h.Hk, h.kpack, G, 0);
        pack_matrix(src(w.up, gu_off), w.I, w.H, plain.data(), h.In, h.Hk, h.kpack, G, G - 1);
        if (!l12_compress(plain, h.In / kPanelN, h.Hk, G, gu_dst, G == 2 ? "gate/up" : "up", e)) continue;
        if (w.down) {
          pack_matrix(src(w.down, dn_off), w.H, w.I, plain.data(), h.Hn, h.Ik, h.kpack, 1, 0);
          if (!l12_compress(plain, h.Hn / kPanelN, h.Ik, 1, dn_dst, "down", e)) continue;
        }
      } else {
        auto at = [&](const void* base, size_t off) {
          return static_cast<const uint8_t*>(base) + off * esz;
        };
        if (w.gate) quant_matrix(at(w.gate, gu_off), w.dtype, w.I, w.H, gu_dst, h.In, h.Hk, G, 0, wf, h.group, buf, isa());
        quant_matrix(at(w.up, gu_off), w.dtype, w.I, w.H, gu_dst, h.In, h.Hk, G, G - 1, wf, h.group, buf, isa());
        if (w.down) quant_matrix(at(w.down, dn_off), w.dtype, w.H, w.I, dn_dst, h.Hn, h.Ik, 1, 0, wf, h.group, buf, isa());
      }
      for (int64_t i = 0; i < h.In; ++i) {
        if (bias_g_)
          bias_g_[e * h.In + i] = i < w.I ? load_elem(w.dtype, w.gate_bias, se * w.I + i) : 0.f;
        if (bias_u_)
          bias_u_[e * h.In + i] = i < w.I ? load_elem(w.dtype, w.up_bias, se * w.I + i) : 0.f;
      }
      if (bias_d_)
        for (int64_t c = 0; c < h.Hn; ++c)
          bias_d_[e * h.Hn + c] = c < w.H ? load_elem(w.dtype, w.down_bias, se * w.H + c) : 0.f;
    }
  });
  if (!l12_error.empty()) throw std::invalid_argument(l12_error);
}

void PackedExperts::unpack(void* gate, void* up, void* down, void* gate_bias, void* up_bias,
                           void* down_bias) const {
  if (tier_) throw std::invalid_argument("this block's experts live in the memory tier: unpack a view of its store entry");
  const PackedHeader& h = hdr_;
  const int G = h.has_gate ? 2 : 1;
  const DType dt = dtype();
  const WFormat wf = wformat();
  const bool e16 = dtype_size(dt) == 2;
  const size_t esz = dtype_size(dt);
  for (int64_t e = 0; e < h.E; ++e) {
    const size_t gu_off = static_cast<size_t>(e * h.I * h.H);
    const uint8_t* gu_src = gu_ + static_cast<size_t>(e) * h.gu_expert_bytes;
    const uint8_t* dn_src = down_ + static_cast<size_t>(e) * h.down_expert_bytes;
    if (wf == WFormat::kLossless12) {
      // panel by panel back to the plain bf16 panels, then unpacked as lossless
      auto unpack_l12 = [&](const uint8_t* stored, int64_t panels, int64_t Kp, int Gm, auto&& unpack_plain) {
        const int64_t plain_bytes = panel_bytes(dt, WFormat::kLossless, 0, Kp, Gm);
        const int64_t stored_bytes = panel_bytes(dt, wf, 0, Kp, Gm);
        std::vector<uint16_t> plain(static_cast<size_t>(panels * plain_bytes / 2));
        for (int64_t p = 0; p < panels; ++p)
          l12_decompress_panel_portable(stored + p * stored_bytes, plain_bytes, plain.data() + p * plain_bytes / 2);
        unpack_plain(plain.data());
      };
      auto to = [&](void* base) { return static_cast<uint16_t*>(base) + gu_off; };
      if (gate || up) {
        unpack_l12(gu_src, h.In / kPanelN, h.Hk, G, [&](const uint16_t* pl) {
          if (gate && h.has_gate) unpack_matrix(pl, h.I, h.H, to(gate), h.Hk, h.kpack, G, 0);
          if (up) unpack_matrix(pl, h.I, h.H, to(up), h.Hk, h.kpack, G, G - 1);
        });
      }
      if (down && !h.up_only)
        unpack_l12(dn_src, h.Hn / kPanelN, h.Ik, 1,
                   [&](const uint16_t* pl) { unpack_matrix(pl, h.H, h.I, to(down), h.Ik, h.kpack, 1, 0); });
    } else if (wf != WFormat::kLossless) {
      auto at = [&](void* base) { return static_cast<uint8_t*>(base) + gu_off * esz; };
      if (gate && h.has_gate) dequant_matrix(gu_src, dt, h.I, h.H, at(gate), h.Hk, G, 0, wf, h.group);
      if (up) dequant_matrix(gu_src, dt, h.I, h.H, at(up), h.Hk, G, G - 1, wf, h.group);
      if (down && !h.up_only) dequant_matrix(dn_src, dt, h.H, h.I, at(down), h.Ik, 1, 0, wf, h.group);
    } else {
      auto unpack_expert = [&](auto elem) {  // element type by size only, as in pack()
        using El = decltype(elem);
        auto* gs = reinterpret_cast<const El*>(gu_src);
        if (gate && h.has_gate) unpack_matrix(gs, h.I, h.H, static_cast<El*>(gate) + gu_off, h.Hk, h.kpack, G, 0);
        if (up) unpack_matrix(gs, h.I, h.H, static_cast<El*>(up) + gu_off, h.Hk, h.kpack, G, G - 1);
        if (down && !h.up_only) unpack_matrix(reinterpret_cast<const El*>(dn_src), h.H, h.I, static_cast<El*>(down) + gu_off, h.Ik, h.kpack, 1, 0);
      };
      if (e16) unpack_expert(uint16_t{});
      else unpack_expert(uint32_t{});
    }
    for (int64_t i = 0; i < h.I; ++i) {
      if (gate_bias && bias_g_) store_elem(dt, gate_bias, e * h.I + i, bias_g_[e * h.In + i]);
      if (up_bias && bias_u_) store_elem(dt, up_bias, e * h.I + i, bias_u_[e * h.In + i]);
    }
    if (down_bias && bias_d_)
      for (int64_t c = 0; c < h.H; ++c) store_elem(dt, down_bias, e * h.H + c, bias_d_[e * h.Hn + c]);
  }
}

void PackedExperts::unpack_row_quant(void* codes, void* scales) const {
  if (tier_) throw std::invalid_argument("this block's experts live in the memory tier");
  const PackedHeader& h = hdr_;
  const WFormat wf = wformat();
  if (!h.up_only || (wf != WFormat::kInt8 && wf != WFormat::kInt4))
    throw std::invalid_argument(std::string("unpack_row_quant reads an up-only int8 or int4 block; this one is ") +
                                (h.up_only ? "" : "MoE experts in ") + wformat_name(wf));
  const int64_t N = h.I, K = h.H, group = h.group;
  if (wf == WFormat::kInt4 && K % group != 0)
    throw std::invalid_argument("unpack_row_quant: int4 rows of " + std::to_string(K) +
                                " values are not whole groups of " + std::to_string(group));
  const int G = h.has_gate ? 2 : 1;  // a paired block: output rows [0, I) matrix 0, [I, 2 I) matrix 1
  const int64_t pbytes = panel_bytes(dtype(), wf, group, h.Hk, G);
  for (int gi = 0; gi < G; ++gi) {
    for (int64_t p = 0; p * kPanelN < N; ++p) {
      const uint8_t* panel = gu_ + p * pbytes;
      for (int n = 0; n < kPanelN && p * kPanelN + n < N; ++n) {
        const int64_t row = gi * N + p * kPanelN + n;
        if (wf == WFormat::kInt8) {
          std::memcpy(static_cast<float*>(scales) + row, panel + gi * 64 + n * 4, 4);
          int8_t* q = static_cast<int8_t*>(codes) + row * K;
          for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int8_t>(panel[64 * G + q8_index(k, G, gi, n)]);
          continue;
        }
        uint8_t* q = static_cast<uint8_t*>(codes) + row * (K / 2);
        for (int64_t g = 0; g < K / group; ++g) {
          const uint8_t* c = panel + q4_codes_at(g, G, static_cast<int>(group));
          static_cast<float*>(scales)[row * (K / group) + g] =
              q4_scale(panel[q4_scales_at(g, G, static_cast<int>(group)) + gi * 16 + n], q4_factors(panel, gi)[n]);
          for (int64_t j = 0; j < group / 2; ++j)
            q[g * group / 2 + j] = static_cast<uint8_t>((int4_q(c, j, G, gi, n) + 8) |
                                                        (int4_q(c, group / 2 + j, G, gi, n) + 8) << 4);
        }
      }
    }
  }
}

namespace detail {

void* alloc_weights(size_t bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  if (bytes < 2 * kHuge) return aligned_alloc64(bytes);
  void* p = nullptr;
  if (posix_memalign(&p, kHuge, bytes) != 0) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
#ifdef HINA_PREFETCH_TUNING
  const char* thp = std::getenv("HINA_THP");  // tuning builds: 0 = no huge-page hint
  if (thp && std::atoi(thp) == 0) return p;
#endif
  // whole huge pages inside the block only; a hint: failure changes nothing
  madvise(p, bytes / kHuge * kHuge, MADV_HUGEPAGE);
#endif
  return p;
}

}  // namespace detail
}  // namespace hina
