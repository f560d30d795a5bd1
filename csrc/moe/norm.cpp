// RMSNorm rows, as transformers' Llama-family RMSNorm modules compute them (scope="all").
//
// Per row of n values: h = x * 1/sqrt(mean(x*x) + eps) in fp32, rounded to the input dtype,
// then y = w * h rounded to the dtype again: the roundings and their order of
//   h = x.float(); h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
//   return weight * h.to(x.dtype)
// Only the sum of squares is added in another order than PyTorch's reduction (16 lanes here),
// so a result can differ from PyTorch's in the last bit. Single-threaded: it is meant for the
// few rows of a decode step, where a call into PyTorch's ~7 ops costs far more than the work.
#include <cmath>

#include "hina_moe/ops.h"
#include "kernel_api.h"

namespace hina {
namespace {
using detail::bf16_to_f32;
using detail::f32_to_bf16;
using detail::f16_to_f32;
using detail::f32_to_f16;

struct F32 {
  static float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  static float round(float v) { return v; }
  static void store(void* p, int64_t i, float v) { static_cast<float*>(p)[i] = v; }
};
struct BF16 {
  static float load(const void* p, int64_t i) { return bf16_to_f32(static_cast<const uint16_t*>(p)[i]); }
  static float round(float v) { return bf16_to_f32(f32_to_bf16(v)); }
  static void store(void* p, int64_t i, float v) { static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); }
};
struct F16 {
  static float load(const void* p, int64_t i) { return f16_to_f32(static_cast<const uint16_t*>(p)[i]); }
  static float round(float v) { return f16_to_f32(f32_to_f16(v)); }
  static void store(void* p, int64_t i, float v) { static_cast<uint16_t*>(p)[i] = f32_to_f16(v); }
};

template <class D>
void rows(const char* x, int64_t nrows, int64_t n, const void* w, float eps, char* out, size_t esize) {
  constexpr int kLanes = 16;
  for (int64_t r = 0; r < nrows; ++r) {
    const void* xr = x + r * n * esize;
    void* yr = out + r * n * esize;
    float lane[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float v = D::load(xr, i + l);
        const float sq = v * v;  // rounded, as pow(2) is (no contraction: -ffp-contract=off)
        lane[l] += sq;
      }
    for (int l = 0; i < n; ++i, ++l) {
      const float v = D::load(xr, i);
      const float sq = v * v;
      lane[l] += sq;
    }
    float sum = 0.f;
    for (float v : lane) sum += v;
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t k = 0; k < n; ++k) {
      const float h = D::round(D::load(xr, k) * inv);
      D::store(yr, k, D::load(w, k) * h);
    }
  }
}

// sum = round(a + b), elementwise in fp32, rounded once to the dtype: PyTorch's `a + b` on CPU
// tensors of one dtype (its vectorised bf16/fp16 add widens to fp32, adds, rounds to nearest even).
template <class D>
void add_elems(const void* a, const void* b, int64_t count, void* sum) {
  for (int64_t i = 0; i < count; ++i) D::store(sum, i, D::load(a, i) + D::load(b, i));
}

template <class D>
void add_then_norm(const void* a, const void* b, int64_t nrows, int64_t n, const void* w, float eps, void* sum,
                   void* out, size_t esize) {
  add_elems<D>(a, b, nrows * n, sum);
  rows<D>(static_cast<const char*>(sum), nrows, n, w, eps, static_cast<char*>(out), esize);
}

}  // namespace

void add(DType dt, const void* a, const void* b, int64_t count, void* sum) {
  switch (dt) {
    case DType::kF32: add_elems<F32>(a, b, count, sum); break;
    case DType::kBF16: add_elems<BF16>(a, b, count, sum); break;
    case DType::kF16: add_elems<F16>(a, b, count, sum); break;
  }
}

void add_rms_norm(DType dt, const void* a, const void* b, int64_t nrows, int64_t n, const void* weight, float eps,
                  void* sum, void* out) {
  switch (dt) {
    case DType::kF32: add_then_norm<F32>(a, b, nrows, n, weight, eps, sum, out, 4); break;
    case DType::kBF16: add_then_norm<BF16>(a, b, nrows, n, weight, eps, sum, out, 2); break;
    case DType::kF16: add_then_norm<F16>(a, b, nrows, n, weight, eps, sum, out, 2); break;
  }
}

void rms_norm(DType dt, const void* x, int64_t nrows, int64_t n, const void* weight, float eps, void* out) {
  const auto* xc = static_cast<const char*>(x);
  auto* oc = static_cast<char*>(out);
  switch (dt) {
    case DType::kF32: rows<F32>(xc, nrows, n, weight, eps, oc, 4); break;
    case DType::kBF16: rows<BF16>(xc, nrows, n, weight, eps, oc, 2); break;
    case DType::kF16: rows<F16>(xc, nrows, n, weight, eps, oc, 2); break;
  }
}

}  // namespace hina
