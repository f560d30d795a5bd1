// A MoE router's selection from its logits (hi_na_moe.routers), in the forms transformers writes
// (hina_moe/ops.h): softmax then top-k (optionally choosing on the probabilities plus a correction bias and
// keeping the probabilities as weights: ERNIE 4.5), top-k then a softmax over the k, and the
// grouped forms of DeepSeek-V3 (sigmoid), DeepSeek-V2 (softmax) and Mistral 4 (softmax in the
// logits' dtype).
//
// The top-k reproduces torch.topk's CPU kernel, ties included: PyTorch selects with the C++
// standard library (a partial sort when 64 k <= E, else nth_element and a sort of the first
// k - 1), over (value, index) pairs in index order, with a comparator that only looks at the
// value (NaN first). The same algorithms on the same pairs with the same comparator make the
// same moves, so equal values come out in PyTorch's order, which is not the index order
// (tests/test_routers.py checks it against torch.topk on tie-heavy rows, every path).
//
// The softmax is exp(x - max) / sum in float32 with std::exp; PyTorch's vectorised exp
// differs from it (and between PyTorch's own CPU builds) in the last bits, so the weights can
// differ from the module's by a few float32 ulps, as the other scope="all" kernels' results do.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "hina_moe/ops.h"
#include "kernel_api.h"

namespace hina {
namespace {

using detail::load_elem;
using detail::store_elem;

using Entry = std::pair<float, int64_t>;

bool before(const Entry& a, const Entry& b) {  // the larger value first, NaN before any number
  return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
}

// The k largest of q[0..n) (in index order on entry) to q[0..k) as torch.topk moves them:
// largest first, or with sorted false as its selection leaves them (PyTorch sorts only after
// nth_element; partial_sort's output is sorted either way).
void top_k(Entry* q, int64_t n, int64_t k, bool sorted = true) {
  if (k * 64 <= n) {
    std::partial_sort(q, q + k, q + n, before);
  } else {
    std::nth_element(q, q + (k - 1), q + n, before);
    if (sorted) std::sort(q, q + (k - 1), before);
  }
}

void top_k(std::vector<Entry>& q, int64_t k) { top_k(q.data(), static_cast<int64_t>(q.size()), k); }

// out[j] = exp(v[j] - max) / sum over the n values (float32).
void softmax(float* v, int64_t n) {
  float m = -INFINITY;
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    nan |= std::isnan(v[j]);
    m = std::max(m, v[j]);
  }
  if (nan) m = NAN;  // PyTorch's max propagates NaN, and every output is NaN then
  float s = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    v[j] = std::exp(v[j] - m);
    s += v[j];
  }
  const float r = 1.0f / s;
  for (int64_t j = 0; j < n; ++j) v[j] *= r;
}

// Of the G groups scored in groups[0..G) (index order on entry), marks in keep the topk_group that
// torch.topk(..., sorted=False) picks.
void keep_groups(Entry* groups, int64_t G, int64_t topk_group, std::vector<char>& keep) {
  top_k(groups, G, topk_group, false);
  keep.assign(static_cast<size_t>(G), 0);
  for (int64_t i = 0; i < topk_group; ++i) keep[static_cast<size_t>(groups[i].second)] = 1;
}

// x rounded to dt and back (PyTorch's result of an op in that dtype computed in float32)
float round_to(DType dt, float x) {
  if (dt == DType::kF32) return x;
  uint32_t h = 0;  // (room for any dtype's element)
  store_elem(dt, &h, 0, x);
  return load_elem(dt, &h, 0);
}

// The grouped forms' last steps: the k largest of c[0..E) (torch.topk(sorted=False)), their
// weights the scores s of the chosen, with renorm over (their sum + eps), times scale; every step
// rounded to dt (float32: not at all).
void choose(const RouterSelectArgs& a, DType dt, Entry* c, const float* s, int64_t* idx, float* w) {
  top_k(c, a.E, a.k, false);
  float sum = 0.0f;
  for (int64_t j = 0; j < a.k; ++j) {
    idx[j] = c[j].second;
    w[j] = s[c[j].second];
    sum += w[j];
  }
  if (a.renorm) {
    const float d = round_to(dt, round_to(dt, sum) + a.eps);
    for (int64_t j = 0; j < a.k; ++j) w[j] = round_to(dt, w[j] / d);
  }
  for (int64_t j = 0; j < a.k; ++j) w[j] = round_to(dt, w[j] * a.scale);
}

// DeepSeek-V3's grouped selection (kSigmoidGroupTopk) of one row of E float32 logits, as the
// module's ops compute it: sigmoid, the bias added, group scores, the groups' and the experts'
// top-k (hina_moe/ops.h). q: G + E entries of scratch, s: E floats of scratch.
void sigmoid_group_row(const RouterSelectArgs& a, const float* logits, Entry* q, std::vector<char>& keep, float* s,
                       int64_t* idx, float* w) {
  const int64_t E = a.E, G = a.groups, n = E / G;
  for (int64_t j = 0; j < E; ++j) s[j] = 1.0f / (1.0f + std::exp(-logits[j]));
  Entry* c = q + G;  // one group's entries, then the experts'
  for (int64_t i = 0; i < G; ++i) {  // a group's score: its two largest of s + bias (topk(2)), summed
    for (int64_t j = 0; j < n; ++j) c[j] = {s[i * n + j] + a.sel_bias[i * n + j], j};
    top_k(c, n, 2);
    q[i] = {c[0].first + c[1].first, i};
  }
  keep_groups(q, G, a.topk_group, keep);
  // the kept groups' experts; the others' scores are -inf (masked_fill), in index order
  for (int64_t j = 0; j < E; ++j) c[j] = {keep[static_cast<size_t>(j / n)] ? s[j] + a.sel_bias[j] : -INFINITY, j};
  choose(a, DType::kF32, c, s, idx, w);
}

// DeepSeek-V2's selection (kSoftmaxGroupTopk) of one row of E float32 logits (hina_moe/ops.h), p holding
// them. q: G + E entries of scratch.
void softmax_group_row(const RouterSelectArgs& a, float* p, Entry* q, std::vector<char>& keep, int64_t* idx,
                       float* w) {
  const int64_t E = a.E, G = a.groups, n = E / G;
  softmax(p, E);
  Entry* c = q + G;
  if (G > 1) {  // the groups' largest probabilities; the experts of all but the best topk_group count as 0
    for (int64_t i = 0; i < G; ++i) {
      float m = p[i * n];
      for (int64_t j = 1; j < n; ++j) m = std::isnan(m) ? m : std::max(m, p[i * n + j]);
      q[i] = {m, i};
    }
    keep_groups(q, G, a.topk_group, keep);
    for (int64_t j = 0; j < E; ++j) c[j] = {keep[static_cast<size_t>(j / n)] ? p[j] : 0.0f, j};
  } else {
    for (int64_t j = 0; j < E; ++j) c[j] = {p[j], j};
  }
  top_k(c, E, a.k, false);
  for (int64_t j = 0; j < a.k; ++j) {
    idx[j] = c[j].second;
    w[j] = c[j].first * a.scale;
  }
}

// Mistral 4's selection (kSoftmaxGroupTopkInDtype) of one row of E logits (hina_moe/ops.h), p holding them as
// float32; every step rounded to the logits' dtype. q: G + E entries of scratch.
void softmax_group_in_dtype_row(const RouterSelectArgs& a, float* p, Entry* q, std::vector<char>& keep, int64_t* idx,
                                float* w) {
  const int64_t E = a.E, G = a.groups, n = E / G;
  const DType dt = a.dtype;
  softmax(p, E);
  for (int64_t j = 0; j < E; ++j) p[j] = round_to(dt, p[j]);
  Entry* c = q + G;
  if (G > 1) {  // a group's score: its two largest p (topk(2)), summed in the dtype
    for (int64_t i = 0; i < G; ++i) {
      for (int64_t j = 0; j < n; ++j) c[j] = {p[i * n + j], j};
      top_k(c, n, 2);
      q[i] = {round_to(dt, c[0].first + c[1].first), i};
    }
    keep_groups(q, G, a.topk_group, keep);
    for (int64_t j = 0; j < E; ++j) c[j] = {keep[static_cast<size_t>(j / n)] ? p[j] : 0.0f, j};
  } else {  // (one group: the module's mask keeps every expert)
    for (int64_t j = 0; j < E; ++j) c[j] = {p[j], j};
  }
  choose(a, dt, c, p, idx, w);
}

}  // namespace

void router_select(const RouterSelectArgs& a) {
  if (a.form == RouterForm::kSigmoidGroupTopk || a.form == RouterForm::kSoftmaxGroupTopk ||
      a.form == RouterForm::kSoftmaxGroupTopkInDtype) {
    thread_local std::vector<Entry> q;
    thread_local std::vector<char> keep;
    thread_local std::vector<float> buf;
    q.resize(static_cast<size_t>(a.groups + a.E));
    buf.resize(static_cast<size_t>(2 * a.E + a.k));
    float* v = buf.data();  // the row's logits
    float* s = v + a.E;
    float* w = s + a.E;
    const size_t ldt = dtype_size(a.dtype);
    for (int64_t b = 0; b < a.B; ++b) {
      const char* row = static_cast<const char*>(a.logits) + b * a.E * ldt;
      for (int64_t j = 0; j < a.E; ++j) v[j] = load_elem(a.dtype, row, j);
      if (a.form == RouterForm::kSigmoidGroupTopk)
        sigmoid_group_row(a, v, q.data(), keep, s, a.idx + b * a.k, w);
      else if (a.form == RouterForm::kSoftmaxGroupTopk)
        softmax_group_row(a, v, q.data(), keep, a.idx + b * a.k, w);
      else
        softmax_group_in_dtype_row(a, v, q.data(), keep, a.idx + b * a.k, w);
      for (int64_t j = 0; j < a.k; ++j) store_elem(a.w_dtype, a.w, b * a.k + j, w[j]);
    }
    return;
  }
  thread_local std::vector<Entry> q;
  thread_local std::vector<float> vals;
  q.resize(static_cast<size_t>(a.E));
  vals.resize(static_cast<size_t>(std::max(a.E, a.k)));
  const size_t ldt = dtype_size(a.dtype);
  for (int64_t b = 0; b < a.B; ++b) {
    const char* row = static_cast<const char*>(a.logits) + b * a.E * ldt;
    float* v = vals.data();
    for (int64_t j = 0; j < a.E; ++j) v[j] = load_elem(a.dtype, row, j);
    if (a.form == RouterForm::kSoftmaxTopk) softmax(v, a.E);
    const bool biased = a.form == RouterForm::kSoftmaxTopk && a.sel_bias != nullptr;
    for (int64_t j = 0; j < a.E; ++j) q[j] = {biased ? v[j] + a.sel_bias[j] : v[j], j};
    top_k(q, a.k);
    for (int64_t j = 0; j < a.k; ++j) a.idx[b * a.k + j] = q[j].second;
    // the chosen weights: the probabilities themselves when a bias chose them (q holds p + bias;
    // v is read before it is written, k <= E and q[j] names an index, so gather first)
    for (int64_t j = 0; j < a.k; ++j) q[j].first = biased ? v[q[j].second] : q[j].first;
    for (int64_t j = 0; j < a.k; ++j) v[j] = q[j].first;
    if (a.form == RouterForm::kSoftmaxTopk) {
      if (a.renorm) {
        float s = 0.0f;
        for (int64_t j = 0; j < a.k; ++j) s += v[j];
        if (biased) s = std::isnan(s) ? s : std::max(s, a.norm_min);  // torch.clamp(sum, min=norm_min)
        for (int64_t j = 0; j < a.k; ++j) v[j] /= s;
      }
    } else {
      softmax(v, a.k);
    }
    for (int64_t j = 0; j < a.k; ++j) store_elem(a.w_dtype, a.w, b * a.k + j, v[j]);
  }
}

}  // namespace hina
