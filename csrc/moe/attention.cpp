// Decode attention and rotary embedding for hi_na_moe's attention path (scope="all",
// hi_na_moe/attention.py): the baseline build of attention_impl.h, the calls into the AVX-512
// and AVX2 builds (chosen in dispatch/select.cpp), and rope_rotate_half.
#include <algorithm>

#include "attention_impl.h"
#include "dispatch/select.h"
#include "parallel_rows.h"
#include "hina_moe/cpu_features.h"
#include "hina_moe/attention.h"
#include "hina_moe/ops.h"
#include "hina_moe/thread_pool.h"
#include "kernel_api.h"

namespace hina {
namespace detail {
void attention_decode_avx512(const AttnDecodeArgs& a, int64_t h0, int64_t h1);
void attention_decode_avx2(const AttnDecodeArgs& a, int64_t h0, int64_t h1);
bool attention_prefill_avx512bf16(const AttnPrefillArgs& a, int num_threads);
void rope_rotate_half_bf16_avx512(const uint16_t* x, int64_t B, int64_t heads, int64_t D, const uint16_t* cos,
                                  const uint16_t* sin, uint16_t* out, bool half_table);
}  // namespace detail

namespace {

template <class T>
void rope_rows(const T* x, int64_t B, int64_t heads, int64_t D, const T* cos, const T* sin, T* out, bool half_table,
               int64_t rot) {
  using E = attn_impl::Elem<T>;
  const int64_t half = rot / 2, width = half_table ? half : rot;
  auto round = [](float v) {
    T t;
    E::put(&t, 0, v);
    return E::get(&t, 0);
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + (b * heads + h) * D;
      T* yr = out + (b * heads + h) * D;
      const T* c = cos + b * width;
      const T* s = sin + b * width;
      for (int64_t i = 0; i < rot; ++i) {
        const float other = i < half ? -E::get(xr, i + half) : E::get(xr, i - half);
        const int64_t ti = half_table && i >= half ? i - half : i;  // the table's entry for i
        const float a = round(E::get(xr, i) * E::get(c, ti));
        const float r = round(other * E::get(s, ti));
        E::put(yr, i, a + r);
      }
      for (int64_t i = rot; i < D; ++i) yr[i] = xr[i];  // past the rotary dims: as they are
    }
}
}  // namespace

void rope_rotate_half(DType dt, const void* x, int64_t B, int64_t heads, int64_t D, const void* cos,
                      const void* sin, void* out, bool half_table, int64_t rot) {
  if (rot <= 0) rot = D;
  switch (dt) {
    case DType::kF32:
      rope_rows(static_cast<const float*>(x), B, heads, D, static_cast<const float*>(cos),
                static_cast<const float*>(sin), static_cast<float*>(out), half_table, rot);
      break;
    case DType::kBF16:
      rope_rows(static_cast<const uint16_t*>(x), B, heads, D, static_cast<const uint16_t*>(cos),
                static_cast<const uint16_t*>(sin), static_cast<uint16_t*>(out), half_table, rot);
      break;
    case DType::kF16:
      using H = attn_impl::Half;
      rope_rows(static_cast<const H*>(x), B, heads, D, static_cast<const H*>(cos), static_cast<const H*>(sin),
                static_cast<H*>(out), half_table, rot);
      break;
  }
}

void rope_rotate_half(DType dt, const void* x, int64_t B, int64_t heads, int64_t D, const void* cos,
                      const void* sin, void* out, Isa isa, int num_threads, bool half_table, int64_t rot) {
  const size_t es = dtype_size(dt);
  if (rot <= 0) rot = D;
  const int64_t width = half_table ? rot / 2 : rot;  // table entries per row
  auto rows = [&](int64_t b0, int64_t b1) {
    const char* xb = static_cast<const char*>(x) + b0 * heads * D * es;
    const char* cb = static_cast<const char*>(cos) + b0 * width * es;
    const char* sb = static_cast<const char*>(sin) + b0 * width * es;
    char* ob = static_cast<char*>(out) + b0 * heads * D * es;
#if defined(HINA_HAVE_X86_KERNELS)
    if (detail::rope_bf16_avx512(dt, isa, rot, D))
      return detail::rope_rotate_half_bf16_avx512(reinterpret_cast<const uint16_t*>(xb), b1 - b0, heads, D,
                                                  reinterpret_cast<const uint16_t*>(cb),
                                                  reinterpret_cast<const uint16_t*>(sb), reinterpret_cast<uint16_t*>(ob),
                                                  half_table);
#else
    (void)isa;
#endif
    rope_rotate_half(dt, xb, b1 - b0, heads, D, cb, sb, ob, half_table, rot);
  };
  detail::parallel_rows(B, B * heads * D, num_threads, rows);
}

namespace {
template <class T>
void rope_interleaved_rows(const T* x, int64_t B, int64_t heads, int64_t D, const float* cos, const float* sin,
                           int64_t table_bstride, T* out) {
  using E = attn_impl::Elem<T>;
  for (int64_t b = 0; b < B; ++b) {
    const float* c = cos + b * table_bstride;
    const float* s = sin + b * table_bstride;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + (b * heads + h) * D;
      T* yr = out + (b * heads + h) * D;
      for (int64_t i = 0; i < D / 2; ++i) {
        const float x0 = E::get(xr, 2 * i), x1 = E::get(xr, 2 * i + 1);
        // separate statements, and this file has no FMA contraction: each product is rounded
        const float a0 = x0 * c[i], b0 = -x1 * s[i];
        const float a1 = x1 * c[i], b1 = x0 * s[i];
        E::put(yr, 2 * i, a0 + b0);
        E::put(yr, 2 * i + 1, a1 + b1);
      }
    }
  }
}
}  // namespace

void rope_interleaved_f32(DType dt, const void* x, int64_t B, int64_t heads, int64_t D, const float* cos,
                          const float* sin, int64_t table_bstride, void* out, int num_threads) {
  const size_t es = dtype_size(dt);
  auto rows = [&](int64_t b0, int64_t b1) {
    const void* xb = static_cast<const char*>(x) + b0 * heads * D * es;
    void* ob = static_cast<char*>(out) + b0 * heads * D * es;
    const float* cb = cos + b0 * table_bstride;
    const float* sb = sin + b0 * table_bstride;
    switch (dt) {
      case DType::kF32:
        rope_interleaved_rows(static_cast<const float*>(xb), b1 - b0, heads, D, cb, sb, table_bstride,
                              static_cast<float*>(ob));
        break;
      case DType::kBF16:
        rope_interleaved_rows(static_cast<const uint16_t*>(xb), b1 - b0, heads, D, cb, sb, table_bstride,
                              static_cast<uint16_t*>(ob));
        break;
      case DType::kF16:
        rope_interleaved_rows(static_cast<const attn_impl::Half*>(xb), b1 - b0, heads, D, cb, sb, table_bstride,
                              static_cast<attn_impl::Half*>(ob));
        break;
    }
  };
  detail::parallel_rows(B, B * heads * D, num_threads, rows);
}

namespace {
template <class T>
void rope_latent_rows(LatentRope form, const T* x, int64_t heads, int64_t xs, int64_t D, const void* tab,
                      const void* sin, T* out, int64_t os) {
  using E = attn_impl::Elem<T>;
  auto round = [](float v) {
    T t;
    E::put(&t, 0, v);
    return E::get(&t, 0);
  };
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* xr = x + h * xs;
    T* yr = out + h * os;
    if (form == LatentRope::kComplex) {
      const float* f = static_cast<const float*>(tab);
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = E::get(xr, 2 * i), x1 = E::get(xr, 2 * i + 1), c = f[2 * i], s = f[2 * i + 1];
        // separate statements, and this file has no FMA contraction: each product is rounded
        const float ac = x0 * c, bd = x1 * s, ad = x0 * s, bc = x1 * c;
        E::put(yr, 2 * i, ac - bd);
        E::put(yr, 2 * i + 1, ad + bc);
      }
    } else {  // kInterleaved
      const T* c = static_cast<const T*>(tab);
      const T* s = static_cast<const T*>(sin);
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = E::get(xr, 2 * i), x1 = E::get(xr, 2 * i + 1), ci = E::get(c, i), si = E::get(s, i);
        E::put(yr, i, round(x0 * ci) - round(x1 * si));
        E::put(yr, half + i, round(x1 * ci) + round(x0 * si));
      }
    }
  }
}
}  // namespace

void rope_latent(DType dt, LatentRope form, const void* x, int64_t heads, int64_t x_hstride, int64_t D,
                 const void* tab, const void* sin, void* out, int64_t out_hstride) {
  if (form == LatentRope::kRotateHalf) {
    const size_t es = dtype_size(dt);
    for (int64_t h = 0; h < heads; ++h)
      rope_rotate_half(dt, static_cast<const char*>(x) + h * x_hstride * es, 1, 1, D, tab, sin,
                       static_cast<char*>(out) + h * out_hstride * es);
    return;
  }
  switch (dt) {
    case DType::kF32:
      rope_latent_rows(form, static_cast<const float*>(x), heads, x_hstride, D, tab, sin, static_cast<float*>(out),
                       out_hstride);
      break;
    case DType::kBF16:
      rope_latent_rows(form, static_cast<const uint16_t*>(x), heads, x_hstride, D, tab, sin,
                       static_cast<uint16_t*>(out), out_hstride);
      break;
    case DType::kF16:
      rope_latent_rows(form, static_cast<const attn_impl::Half*>(x), heads, x_hstride, D, tab, sin,
                       static_cast<attn_impl::Half*>(out), out_hstride);
      break;
  }
}

void attention_decode(const AttnDecodeArgs& a, int num_threads, Isa isa) {
  const int64_t rows = a.B * a.Hq;
  if (rows <= 0) return;
  auto part = [&](int64_t h0, int64_t h1) {
#if defined(HINA_HAVE_X86_KERNELS)
    const detail::VecBuild build = detail::vec_build(isa);
    if (build == detail::VecBuild::kAvx512) return detail::attention_decode_avx512(a, h0, h1);
    if (build == detail::VecBuild::kAvx2) return detail::attention_decode_avx2(a, h0, h1);
#else
    (void)isa;
#endif
    attn_impl::run(a, h0, h1);
  };
  detail::parallel_rows(rows, rows * std::max<int64_t>(a.S, 1) * a.D * 2, num_threads, part);
}

bool attention_prefill_supported(const AttnPrefillArgs& a, Isa isa) {
  return detail::attention_prefill_bf16(a, isa);
}

bool attention_prefill(const AttnPrefillArgs& a, int num_threads, Isa isa) {
  if (!attention_prefill_supported(a, isa)) return false;
  if (a.B <= 0 || a.T <= 0 || a.Hq <= 0) return true;
  if (num_threads <= 0) num_threads = default_num_threads();
#if defined(HINA_HAVE_X86_KERNELS)
  const ThreadPool::PrefillScope prefill(a.T >= kMixedTeamRows);  // (PoolBackend::kMixed: on OpenMP's team)
  return detail::attention_prefill_avx512bf16(a, num_threads);
#else
  return false;
#endif
}

}  // namespace hina
