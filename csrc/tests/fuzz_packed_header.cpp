// Fuzz target: the store-loading entry point of packed experts. An input is what a store entry
// gives the loader: the 104 header bytes (the hex string in the entry's metadata, decoded; the
// binding's header_from_bytes takes exactly these) followed by the block bytes (the mmapped
// "block" array). PackedExperts::view must reject a bad pair with std::invalid_argument naming
// what is wrong; a pair it accepts must be safe to use, so the target then runs forward() on
// both paths and unpack() and checks that every section pointer lies inside the block.
// Built two ways (CMakeLists.txt): with clang's libFuzzer (-fsanitize=fuzzer,address), and
// with gcc + ASan/UBSan together with fuzz_driver.cpp, a deterministic mutation loop.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

#include "hina_moe/experts.h"
#include "moe/kernel_api.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_packed_header: %s\n", what);
  std::abort();
}

// The block in memory of exactly `n` bytes (so ASan sees any read past it), 64-byte aligned as
// the store maps it.
struct Block {
  void* p = nullptr;
  explicit Block(const uint8_t* src, size_t n) {
    if (posix_memalign(&p, 64, n ? n : 1) != 0) throw std::bad_alloc();
    if (n) std::memcpy(p, src, n);
  }
  ~Block() { std::free(p); }
};

bool inside(const void* p, size_t len, const void* base, size_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(base);
  return a >= b && a - b <= n && len <= n - (a - b);
}

// Everything a user of an accepted view may do with it.
void use(const hina::PackedExperts& pe, const void* mem, size_t n) {
  using namespace hina;
  const PackedHeader& h = pe.header();
  if (h.nbytes != n) fail("accepted a header whose nbytes differs from the block size");
  const int64_t E = pe.E(), H = pe.H(), I = pe.I();
  if (E < 1 || H < 1 || I < 1) fail("accepted a header with empty shapes");
  for (int64_t e : {int64_t{0}, E - 1}) {
    if (!inside(pe.gate_up_expert(e), h.gu_expert_bytes, mem, n)) fail("gate/up expert outside the block");
    if (!inside(pe.down_expert(e), h.down_expert_bytes, mem, n)) fail("down expert outside the block");
  }
  const size_t bn = static_cast<size_t>(E) * static_cast<size_t>(h.In) * 4;
  const size_t bd = static_cast<size_t>(E) * static_cast<size_t>(h.Hn) * 4;
  if (pe.bias_g() && !inside(pe.bias_g(), bn, mem, n)) fail("gate bias outside the block");
  if (pe.bias_u() && !inside(pe.bias_u(), bn, mem, n)) fail("up bias outside the block");
  if (pe.bias_d() && !inside(pe.bias_d(), bd, mem, n)) fail("down bias outside the block");

  // forward on both paths (and the integer-dot kernels for quantised blocks): tokens routed to
  // the first and the last expert, the two ends of the block
  const DType dt = pe.dtype();
  const int64_t T = 3, K = E > 1 ? 2 : 1;
  std::vector<uint8_t> x(static_cast<size_t>(T * H) * dtype_size(dt)), out(x.size());
  for (int64_t i = 0; i < T * H; ++i) detail::store_elem(dt, x.data(), i, 0.25f * static_cast<float>(i % 7) - 0.75f);
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  std::vector<float> w(idx.size(), 0.5f);
  for (int64_t s = 0; s < T * K; ++s) idx[s] = static_cast<int32_t>(s % 2 ? E - 1 : 0);
  for (MoePath path : {MoePath::kDecode, MoePath::kPrefill}) {
    for (QDot qd : {QDot::kAuto, QDot::kInt}) {
      if (qd == QDot::kInt && (pe.wformat() == WFormat::kLossless || pe.wformat() == WFormat::kLossless12)) continue;
      MoeParams p;
      p.path = path;
      p.qdot = qd;
      p.num_threads = 2;
      pe.forward(x.data(), path == MoePath::kDecode ? 1 : T, idx.data(), 32, w.data(), K, out.data(), p);
    }
  }
  // unpack writes E*I*H elements per matrix: only for blocks of modest size
  const size_t elems = static_cast<size_t>(E) * static_cast<size_t>(H) * static_cast<size_t>(I);
  if (elems <= (size_t{1} << 20)) {
    const size_t esz = dtype_size(dt);
    std::vector<uint8_t> g(elems * esz), u(elems * esz), d(elems * esz);
    std::vector<uint8_t> bg(static_cast<size_t>(E * I) * esz), bu(bg.size()), bdd(static_cast<size_t>(E * H) * esz);
    pe.unpack(g.data(), u.data(), d.data(), bg.data(), bu.data(), bdd.data());
  }
}

}  // namespace

// 1: the view was accepted (and used), 0: rejected with std::invalid_argument. Any other
// outcome (another exception type, an empty message, a sanitizer report) aborts.
extern "C" int hina_fuzz_packed_header_one(const uint8_t* data, size_t size) {
  hina::PackedHeader h;
  if (size < sizeof(h)) return 0;  // header_from_bytes refuses anything but 104 bytes
  std::memcpy(&h, data, sizeof(h));
  const size_t n = size - sizeof(h);
  const Block block(data + sizeof(h), n);
  std::unique_ptr<hina::PackedExperts> pe;
  try {
    pe = hina::PackedExperts::view(h, block.p, n);
  } catch (const std::invalid_argument& e) {
    if (!e.what() || !*e.what()) fail("rejected without a message");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_packed_header: view threw %s, not std::invalid_argument\n", e.what());
    std::abort();
  }
  try {
    use(*pe, block.p, n);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_packed_header: an accepted block failed in use: %s\n", e.what());
    std::abort();
  }
  return 1;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hina_fuzz_packed_header_one(data, size);
  return 0;
}
