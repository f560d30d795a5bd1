// Decode attention of multi-head latent attention (hina::mla_decode): the baseline build of
// mla_impl.h and the dispatch to its AVX-512 and AVX2 builds.
#include <algorithm>

#include "hina_moe/cpu_features.h"
#include "hina_moe/moe.h"
#include "hina_moe/thread_pool.h"
#include "mla_impl.h"

namespace hina {
namespace detail {
void mla_decode_avx512(const MlaDecodeArgs& a, int64_t h0, int64_t h1);
void mla_decode_avx2(const MlaDecodeArgs& a, int64_t h0, int64_t h1);
}  // namespace detail

void mla_decode(const MlaDecodeArgs& a, int num_threads, Isa isa) {
  if (a.B <= 0 || a.H <= 0) return;
  auto part = [&](int64_t h0, int64_t h1) {
#if defined(HINA_HAVE_X86_KERNELS)
    if (isa == Isa::kAvx512 || isa == Isa::kAmx) return detail::mla_decode_avx512(a, h0, h1);
    if (isa == Isa::kAvx2) return detail::mla_decode_avx2(a, h0, h1);
#else
    (void)isa;
#endif
    mla_impl::run<mla_impl::BaseOps>(a, h0, h1);
  };
  if (num_threads <= 0) num_threads = default_num_threads();
  // below this many multiply-adds one thread does the work: waking the pool costs more
  constexpr int64_t kParallelMacs = 1 << 16;
  const int64_t macs = a.B * a.H * ((a.Dn + a.Dv) * a.L + std::max<int64_t>(a.S, 1) * (2 * a.L + a.Dr));
  const int n = static_cast<int>(std::min<int64_t>({num_threads, a.H, std::max<int64_t>(1, macs / kParallelMacs)}));
  if (n <= 1) return part(0, a.H);
  ThreadPool::global().run(n, [&](int tid, int nt) { part(a.H * tid / nt, a.H * (tid + 1) / nt); });
}

}  // namespace hina
