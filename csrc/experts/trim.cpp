// RoutingTrim (hina_moe/experts.h): fewer experts a token than its router chose. The oracle it is
// tested against is hi_na_moe.core.reference.trim_routing, which makes the same float32 moves in
// the same order (so the kept sets and weights agree bit for bit).
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "hina_moe/experts.h"
#include "moe/kernel_api.h"

namespace hina {
namespace {

// The number of valid slots of row v[0..K) ranked before slot j: a larger weight, or an equal
// one in an earlier slot.
int64_t rank_of(const float* v, const int64_t* idx, int64_t K, int64_t j) {
  int64_t r = 0;
  for (int64_t i = 0; i < K; ++i) {
    if (i == j || idx[i] < 0) continue;
    r += v[i] > v[j] || (v[i] == v[j] && i < j);
  }
  return r;
}

}  // namespace

int64_t trim_routing(const RoutingTrim& trim, const void* topk_idx, int idx_bits, const void* topk_w, DType w_dt,
                     int64_t T, int64_t K, int64_t E, int64_t* idx_out, float* w_out) {
  if (idx_bits != 32 && idx_bits != 64) throw std::invalid_argument("topk_idx must be int32 or int64");
  int64_t kept = 0;
  for (int64_t t = 0; t < T; ++t) {
    int64_t* idx = idx_out + t * K;
    float* v = w_out + t * K;
    bool nan = false;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t s = t * K + j;
      const int64_t e = idx_bits == 32 ? static_cast<const int32_t*>(topk_idx)[s] : static_cast<const int64_t*>(topk_idx)[s];
      if (e >= E)
        throw std::invalid_argument("topk_idx[" + std::to_string(t) + ", " + std::to_string(j) + "] = " +
                                    std::to_string(e) + " is out of range: the experts have E = " + std::to_string(E) +
                                    " (negative indices mean 'skip this slot')");
      idx[j] = e < 0 ? -1 : e;
      v[j] = detail::load_elem(w_dt, topk_w, s);
      if (e < 0) continue;
      nan |= std::isnan(v[j]);
    }
    if (nan) {  // left whole: the kernels give the NaN the router made
      for (int64_t j = 0; j < K; ++j) kept += idx[j] >= 0;
      continue;
    }
    float all = 0.0f, sum = 0.0f;
    for (int64_t j = 0; j < K; ++j)
      if (idx[j] >= 0) all += v[j];
    // an even share of the token's routing weight: of the k weights' sum when they are
    // renormalised, of the router's total (1: probabilities over every expert) when not
    const float bar = (trim.threshold * (trim.renorm ? all : 1.0f)) / static_cast<float>(K);
    for (int64_t j = 0; j < K; ++j) {
      if (idx[j] < 0) continue;
      bool keep = true;
      if (trim.mode == RoutingTrim::Mode::kFixed) {
        keep = rank_of(v, idx, K, j) < trim.keep;
      } else if (trim.mode == RoutingTrim::Mode::kAdaptive) {
        keep = v[j] >= bar || rank_of(v, idx, K, j) < trim.min_k;
      }
      if (keep) {
        sum += v[j];
      } else {
        idx[j] = -1;
      }
    }
    // (a slot dropped keeps its weight in w_out: the kernels never read it)
    if (trim.renorm && sum != all) {
      const float scale = all / sum;
      for (int64_t j = 0; j < K; ++j)
        if (idx[j] >= 0) v[j] = v[j] * scale;
    }
    for (int64_t j = 0; j < K; ++j) kept += idx[j] >= 0;
  }
  return kept;
}

}  // namespace hina
