// Decode attention of multi-head latent attention (hina::mla_decode): the baseline build of
// mla_impl.h and the calls into its AVX-512 and AVX2 builds (chosen in dispatch/select.cpp).
#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "hina_moe/cpu_features.h"
#include "hina_moe/attention.h"
#include "hina_moe/thread_pool.h"
#include "dispatch/select.h"
#include "mla_impl.h"
#include "parallel_rows.h"

namespace hina {
namespace detail {
void mla_decode_avx512(const MlaDecodeArgs& a, int64_t h0, int64_t h1);
void mla_decode_avx2(const MlaDecodeArgs& a, int64_t h0, int64_t h1);
}  // namespace detail

namespace {
std::atomic<bool> g_bf16_dots{true};
}
bool mla_bf16_dots() { return g_bf16_dots.load(std::memory_order_relaxed); }
void set_mla_bf16_dots(bool on) { g_bf16_dots.store(on, std::memory_order_relaxed); }

bool mla_quant_fits(WFormat fmt, int64_t group, int64_t L, int64_t Dn, int64_t Dv) {
  if (Dn % 4 != 0 || Dv % 4 != 0 || L <= 0) return false;
  if (fmt == WFormat::kInt8) return L % 64 == 0;
  return fmt == WFormat::kInt4 && (group == 32 || group == 64 || group == 128) && L % group == 0;
}

void mla_decode(const MlaDecodeArgs& a, int num_threads, Isa isa) {
  if (a.w == nullptr) {
    const RowQuant& q = a.wq;
    if (!mla_quant_fits(q.fmt, q.group, a.L, a.Dn, a.Dv) || q.codes == nullptr || q.scales == nullptr)
      throw std::invalid_argument("mla_decode: without w, wq must hold codes and scales, int8 with L a multiple of 64 "
                                  "or int4 in groups of 32 to 128 dividing L, and Dn and Dv multiples of 4");
  }
  if (a.B <= 0 || a.H <= 0) return;
  auto part = [&](int64_t h0, int64_t h1) {
#if defined(HINA_HAVE_X86_KERNELS)
    const detail::VecBuild build = detail::vec_build(isa);
    if (build == detail::VecBuild::kAvx512) return detail::mla_decode_avx512(a, h0, h1);
    if (build == detail::VecBuild::kAvx2) return detail::mla_decode_avx2(a, h0, h1);
#else
    (void)isa;
#endif
    mla_impl::run<mla_impl::BaseOps>(a, h0, h1);
  };
  const int64_t macs = a.B * a.H * ((a.Dn + a.Dv) * a.L + std::max<int64_t>(a.S, 1) * (2 * a.L + a.Dr));
  detail::parallel_rows(a.H, macs, num_threads, part);
}

}  // namespace hina
