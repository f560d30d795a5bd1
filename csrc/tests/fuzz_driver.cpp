// A standalone driver for fuzz_packed_header.cpp where libFuzzer is not available (gcc):
// a deterministic mutation loop, run under ASan + UBSan. Seeds are real store inputs (header +
// block from PackedExperts::pack over dtypes, formats, gate/bias layouts, tiers); each
// iteration applies 1-4 mutations: bit flips in the header or the block, header fields set to
// extreme integers, a field spliced from another seed, truncation or extension of the block, and
// "self-consistent" headers (extreme E/H/I with every derived field re-planned and the block
// sized to match) that only the planner's own checks can refuse.
//   hina_fuzz_header [--iters N] [--seed S] [--write-seeds DIR] [FILE...]
// FILEs are replayed once each (a libFuzzer crash file, a corpus); otherwise N iterations
// (default 20000) from seed S (default 1). The last line is "N passed, N failed" (a failure
// aborts: the sanitizer or the target prints why).
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "hina_moe/cpu_features.h"
#include "hina_moe/experts.h"
#include "moe/kernel_api.h"

extern "C" int hina_fuzz_packed_header_one(const uint8_t* data, size_t size);
// The sanitizers' hook run before they exit on a report (absent without a sanitizer runtime).
extern "C" void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

using namespace hina;

namespace {

using Bytes = std::vector<uint8_t>;
constexpr size_t kHdr = sizeof(PackedHeader);
constexpr size_t kMaxBlock = size_t{4} << 20;  // never build inputs larger than this

struct Field {
  size_t off, size;
  bool is_signed;
};
#define HINA_F(name, sgn) Field{offsetof(PackedHeader, name), sizeof(PackedHeader::name), sgn}
const Field kFields[] = {
    HINA_F(magic, false), HINA_F(version, false), HINA_F(dtype, false), HINA_F(isa, false),
    HINA_F(panel_n, false), HINA_F(kpack, false), HINA_F(wfmt, false), HINA_F(has_gate, false),
    HINA_F(has_gate_bias, false), HINA_F(has_up_bias, false), HINA_F(has_down_bias, false),
    HINA_F(up_only, false), HINA_F(group, false), HINA_F(k_align, false), HINA_F(reserved1, false),
    HINA_F(E, true), HINA_F(H, true), HINA_F(I, true), HINA_F(Hk, true), HINA_F(In, true),
    HINA_F(Ik, true), HINA_F(Hn, true), HINA_F(gu_expert_bytes, false),
    HINA_F(down_expert_bytes, false), HINA_F(nbytes, false)};
#undef HINA_F
constexpr size_t kNumFields = sizeof(kFields) / sizeof(kFields[0]);

PackedHeader header_of(const Bytes& in) {
  PackedHeader h;
  std::memcpy(&h, in.data(), kHdr);
  return h;
}
void set_header(Bytes& in, const PackedHeader& h) { std::memcpy(in.data(), &h, kHdr); }

void put_field(Bytes& in, const Field& f, uint64_t v) {
  // little-endian hosts only (x86_64, aarch64): the low bytes of v
  std::memcpy(in.data() + f.off, &v, f.size);
}

// Interesting integers for a field of `bytes` bytes.
uint64_t extreme(std::mt19937_64& rng, size_t bytes, bool sgn) {
  const int bits = static_cast<int>(bytes * 8);
  const uint64_t mask = bits == 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1;
  switch (rng() % 9) {
    case 0: return 0;
    case 1: return 1;
    case 2: return mask;  // -1 / the largest unsigned
    case 3: return sgn ? mask >> 1 : mask - 1;  // the largest signed
    case 4: return sgn ? (mask >> 1) + 1 : 2;   // the smallest signed
    case 5: { const int k = static_cast<int>(rng() % bits); return (uint64_t{1} << k) & mask; }
    case 6: { const int k = static_cast<int>(rng() % bits); return ((uint64_t{1} << k) - 1) & mask; }
    case 7: { const int k = static_cast<int>(rng() % bits); return ((uint64_t{1} << k) + 1) & mask; }
    default: return rng() & mask;
  }
}

// Extreme shapes with every other field planned from them, the block sized to nbytes when that
// is small: a header consistent with itself, so only the planner's range checks stand between
// it and the kernels.
void replan(Bytes& in, std::mt19937_64& rng) {
  PackedHeader h = header_of(in);
  int64_t* dims[3] = {&h.E, &h.H, &h.I};
  for (int64_t* d : dims)
    if (rng() % 2) *d = static_cast<int64_t>(extreme(rng, 8, true));
  PackedHeader p;
  try {
    p = plan_packed(static_cast<DType>(h.dtype), h.E, h.H, h.I, h.has_gate, h.has_gate_bias,
                    h.has_up_bias, h.has_down_bias, static_cast<Isa>(h.isa),
                    {static_cast<WFormat>(h.wfmt), h.group ? h.group : 64});
  } catch (const std::invalid_argument&) {
    set_header(in, h);  // the planner refuses these shapes: keep the raw values
    return;
  }
  set_header(in, p);
  if (p.nbytes <= kMaxBlock) in.resize(kHdr + static_cast<size_t>(p.nbytes), 0);
}

void mutate(Bytes& in, const std::vector<Bytes>& seeds, std::mt19937_64& rng) {
  const int n = 1 + static_cast<int>(rng() % 4);
  for (int m = 0; m < n; ++m) {
    switch (rng() % 10) {
      case 0: case 1: {  // bit flip in the header
        const size_t bit = rng() % (kHdr * 8);
        in[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
        break;
      }
      case 2: {  // bit flip in the block
        if (in.size() == kHdr) break;
        const size_t bit = rng() % ((in.size() - kHdr) * 8);
        in[kHdr + bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
        break;
      }
      case 3: case 4: {  // one field to an extreme value
        const Field& f = kFields[rng() % kNumFields];
        put_field(in, f, extreme(rng, f.size, f.is_signed));
        break;
      }
      case 5: {  // a field from another seed
        const Bytes& o = seeds[rng() % seeds.size()];
        const Field& f = kFields[rng() % kNumFields];
        std::memcpy(in.data() + f.off, o.data() + f.off, f.size);
        break;
      }
      case 6: {  // truncate the block (or the header itself, rarely)
        const size_t keep = rng() % 8 == 0 ? rng() % kHdr : kHdr + (in.size() > kHdr ? rng() % (in.size() - kHdr) : 0);
        in.resize(keep);
        if (in.size() < kHdr) return;  // nothing more to mutate in a short input
        break;
      }
      case 7: {  // extend the block
        const size_t add = rng() % 3 == 0 ? 64 * (1 + rng() % 4) : 1 + rng() % 63;
        if (in.size() + add > kHdr + kMaxBlock) break;
        for (size_t i = 0; i < add; ++i) in.push_back(static_cast<uint8_t>(rng()));
        break;
      }
      case 8: {  // nbytes told the truth about the mutated block
        PackedHeader h = header_of(in);
        h.nbytes = in.size() - kHdr;
        set_header(in, h);
        break;
      }
      default: replan(in, rng); break;
    }
  }
}

// Real store inputs: header + block from pack() over the layouts the header can describe.
std::vector<Bytes> make_seeds() {
  struct Shape { int64_t E, H, I; };
  const Shape shapes[] = {{1, 1, 1}, {2, 17, 9}, {3, 64, 32}, {2, 33, 65}, {2, 100, 72}, {1, 160, 129}};
  const QuantSpec qs[] = {{WFormat::kLossless, 64}, {WFormat::kInt8, 64}, {WFormat::kInt4, 32},
                          {WFormat::kInt4, 64}, {WFormat::kInt4, 128}, {WFormat::kLossless12, 64}};
  std::vector<Isa> tiers{Isa::kGeneric};
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kAmx})
    if (isa_supported(cpu_features(), isa)) tiers.push_back(isa);
  std::mt19937 rng(12345);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<Bytes> seeds;
  int i = 0;
  for (const Shape& s : shapes) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const QuantSpec& q : qs) {
        if (q.fmt == WFormat::kLossless12 && dt != DType::kBF16) continue;  // bf16 only
        const bool gated = (i % 3) != 2, bias = (i % 4) == 1;
        const Isa isa = tiers[static_cast<size_t>(i) % tiers.size()];
        ++i;
        const size_t esz = dtype_size(dt);
        auto arr = [&](int64_t n) {
          std::vector<uint8_t> v(static_cast<size_t>(n) * esz);
          for (int64_t k = 0; k < n; ++k) detail::store_elem(dt, v.data(), k, u(rng));
          return v;
        };
        const auto g = arr(s.E * s.I * s.H), up = arr(s.E * s.I * s.H), dn = arr(s.E * s.H * s.I);
        const auto bg = arr(s.E * s.I), bu = arr(s.E * s.I), bd = arr(s.E * s.H);
        ExpertWeights w;
        w.dtype = dt;
        w.E = s.E;
        w.H = s.H;
        w.I = s.I;
        w.gate = gated ? g.data() : nullptr;
        w.up = up.data();
        w.down = dn.data();
        if (bias) {
          w.gate_bias = gated ? bg.data() : nullptr;
          w.up_bias = bu.data();
          w.down_bias = bd.data();
        }
        auto pe = PackedExperts::pack(w, isa, 1, q);
        Bytes in(kHdr + pe->nbytes());
        std::memcpy(in.data(), &pe->header(), kHdr);
        std::memcpy(in.data() + kHdr, pe->data(), pe->nbytes());
        seeds.push_back(std::move(in));
      }
    }
  }
  return seeds;
}

// The input being run, written to ./hina_fuzz_crash.bin when the run dies on it (abort or a
// sanitizer report), so it can be replayed: hina_fuzz_header hina_fuzz_crash.bin
const Bytes* g_current = nullptr;
void save_current() {
  if (!g_current) return;
  const int fd = open("hina_fuzz_crash.bin", O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  const char msg[] = "hina_fuzz_header: the failing input is in ./hina_fuzz_crash.bin\n";
  if (write(fd, g_current->data(), g_current->size()) >= 0) (void)!write(2, msg, sizeof(msg) - 1);
  close(fd);
  g_current = nullptr;
}
void on_abort(int sig) {
  save_current();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

Bytes read_file(const char* path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(std::string("cannot read ") + path);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace

int main(int argc, char** argv) {
  long long iters = 20000;
  unsigned long long seed = 1;
  const char* seed_dir = nullptr;
  std::vector<const char*> files;
  for (int a = 1; a < argc; ++a) {
    const std::string s = argv[a];
    if (s == "--iters" && a + 1 < argc) iters = std::atoll(argv[++a]);
    else if (s == "--seed" && a + 1 < argc) seed = std::strtoull(argv[++a], nullptr, 10);
    else if (s == "--write-seeds" && a + 1 < argc) seed_dir = argv[++a];
    else if (s.rfind("--", 0) == 0) {
      std::fprintf(stderr, "usage: %s [--iters N] [--seed S] [--write-seeds DIR] [FILE...]\n", argv[0]);
      return 2;
    } else files.push_back(argv[a]);
  }
  long long passed = 0, accepted = 0;
  if (!files.empty()) {
    for (const char* f : files) {
      const Bytes in = read_file(f);
      accepted += hina_fuzz_packed_header_one(in.data(), in.size());
      ++passed;
    }
    std::printf("replayed %lld inputs (%lld accepted)\n", passed, accepted);
    std::printf("%lld passed, 0 failed\n", passed);
    return 0;
  }
  const std::vector<Bytes> seeds = make_seeds();
  if (seed_dir) {
    for (size_t i = 0; i < seeds.size(); ++i) {
      const std::string path = std::string(seed_dir) + "/seed_" + std::to_string(i);
      std::ofstream f(path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(seeds[i].data()), static_cast<std::streamsize>(seeds[i].size()));
      if (!f) { std::fprintf(stderr, "cannot write %s\n", path.c_str()); return 2; }
    }
    std::printf("wrote %zu seeds to %s\n", seeds.size(), seed_dir);
    return 0;
  }
  const auto t0 = std::chrono::steady_clock::now();
  long long seed_ok = 0;
  for (const Bytes& s : seeds) {  // every seed is a valid store input: all must be accepted
    if (hina_fuzz_packed_header_one(s.data(), s.size()) != 1) {
      std::printf("FAIL a block written by pack() was refused (seed %lld)\n", seed_ok);
      std::printf("%lld passed, 1 failed\n", passed);
      return 1;
    }
    ++seed_ok;
  }
  std::signal(SIGABRT, on_abort);
  std::signal(SIGSEGV, on_abort);
  if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(save_current);
  std::mt19937_64 rng(seed);
  for (long long it = 0; it < iters; ++it) {
    Bytes in = seeds[rng() % seeds.size()];
    mutate(in, seeds, rng);
    g_current = &in;
    accepted += hina_fuzz_packed_header_one(in.data(), in.size());
    g_current = nullptr;
    ++passed;
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("fuzz packed header: %zu seeds accepted; %lld mutated inputs (seed %llu): %lld accepted, %lld rejected; %.1f s\n",
              seeds.size(), passed, seed, accepted, passed - accepted, sec);
  std::printf("%lld passed, 0 failed\n", passed + seed_ok);
  return 0;
}
