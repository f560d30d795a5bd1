// The C++ test runner's shared pieces (harness.h).
#include "tests/harness.h"

int g_passed = 0, g_failed = 0;
const char* g_filter = nullptr;
int g_every = 1;
bool g_hardware_only = false;
long g_case_runs = 0;
std::map<std::string, double> g_worst;
std::map<std::string, int> g_compared;
std::map<std::string, double> g_min_sqnr;

void note(const std::string& key, double err) {
  double& w = g_worst[key];
  if (!(err <= w)) w = err;
  ++g_compared[key];
}

void report(bool ok, const std::string& what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("FAIL %s\n", what.c_str());
  }
}

// The per-case runs come in passes over kCases (one per dtype / format); with --every N, pass p
// runs the cases c with c = p (mod N), so every case runs in some dtypes and formats.
bool sampled() {
  const long i = g_case_runs++;
  return (i % kNumCases) % g_every == (i / kNumCases) % g_every;
}

std::vector<uint8_t> random_array(DType dt, int64_t n, float scale, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint8_t> v(static_cast<size_t>(n) * dtype_size(dt));
  for (int64_t i = 0; i < n; ++i) store_elem(dt, v.data(), i, u(rng) * scale);
  return v;
}

Problem make_problem(DType dt, const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p{dt, c, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  if (c.gated) p.gate = random_array(dt, c.E * c.I * c.H, 2.0f / std::sqrt(float(c.H)), rng);
  p.up = random_array(dt, c.E * c.I * c.H, 2.0f / std::sqrt(float(c.H)), rng);
  p.down = random_array(dt, c.E * c.H * c.I, 2.0f / std::sqrt(float(c.I)), rng);
  if (c.bias) {
    if (c.gated) p.bg = random_array(dt, c.E * c.I, 0.5f, rng);
    p.bu = random_array(dt, c.E * c.I, 0.5f, rng);
    p.bd = random_array(dt, c.E * c.H, 0.5f, rng);
  }
  p.x = random_array(dt, c.T * c.H, 1.0f, rng);
  const int64_t pool = c.used_experts > 0 ? c.used_experts : c.E;
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  p.idx.resize(static_cast<size_t>(c.T * c.K));
  p.w.resize(static_cast<size_t>(c.T * c.K));
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<int32_t> perm(static_cast<size_t>(pool));
    for (int64_t e = 0; e < pool; ++e) perm[e] = static_cast<int32_t>(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t k = 0; k < c.K; ++k) {
      const int64_t s = t * c.K + k;
      p.idx[s] = perm[k % pool];
      p.w[s] = uw(rng);
      if (c.skip_every > 0 && s % c.skip_every == 0) p.idx[s] = -1;
    }
  }
  p.params.act = c.act;
  p.params.weight_on_input = c.woi;
  if (c.limits) {
    p.params.gate_limit = 0.5f;
    p.params.up_limit = 0.7f;
    p.params.post_act_limit = 0.4f;
    p.params.up_offset = 1.0f;
  }
  return p;
}

ExpertWeights weights_of(const Problem& p) {
  ExpertWeights w;
  w.dtype = p.dt;
  w.E = p.c.E;
  w.H = p.c.H;
  w.I = p.c.I;
  w.gate = p.gate.empty() ? nullptr : p.gate.data();
  w.up = p.up.data();
  w.down = p.down.data();
  w.gate_bias = p.bg.empty() ? nullptr : p.bg.data();
  w.up_bias = p.bu.empty() ? nullptr : p.bu.data();
  w.down_bias = p.bd.empty() ? nullptr : p.bd.data();
  return w;
}

std::vector<float> oracle(const Problem& p, const Deq* dq) {
  const Case& c = p.c;
  const DType dt = p.dt;
  detail::ActParams ap{p.params.act, p.params.alpha, p.params.gate_limit, p.params.up_limit,
                       p.params.post_act_limit, p.params.up_offset};
  std::vector<double> acc(static_cast<size_t>(c.T * c.H), 0.0);
  std::vector<double> xin(static_cast<size_t>(c.H));
  std::vector<double> h(static_cast<size_t>(c.I));
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t k = 0; k < c.K; ++k) {
      const int32_t e = p.idx[t * c.K + k];
      if (e < 0) continue;
      double w = p.w[t * c.K + k];
      for (int64_t j = 0; j < c.H; ++j) {
        const float xv = load_elem(dt, p.x.data(), t * c.H + j);
        xin[j] = c.woi ? detail::round_to(dt, static_cast<float>(w) * xv) : xv;
      }
      if (c.woi) w = 1.0;
      for (int64_t i = 0; i < c.I; ++i) {
        double g = 0, u = 0;
        for (int64_t j = 0; j < c.H; ++j) {
          const int64_t o = (e * c.I + i) * c.H + j;
          u += double(dq ? dq->up[o] : load_elem(dt, p.up.data(), o)) * xin[j];
          if (c.gated) g += double(dq ? dq->gate[o] : load_elem(dt, p.gate.data(), o)) * xin[j];
        }
        if (c.bias) {
          u += load_elem(dt, p.bu.data(), e * c.I + i);
          if (c.gated) g += load_elem(dt, p.bg.data(), e * c.I + i);
        }
        h[i] = detail::h_scalar(ap, c.gated, static_cast<float>(g), static_cast<float>(u));
      }
      for (int64_t j = 0; j < c.H; ++j) {
        double y = 0;
        for (int64_t i = 0; i < c.I; ++i) {
          const int64_t o = (e * c.H + j) * c.I + i;
          y += double(dq ? dq->down[o] : load_elem(dt, p.down.data(), o)) * h[i];
        }
        if (c.bias) y += load_elem(dt, p.bd.data(), e * c.H + j);
        acc[t * c.H + j] += w * y;
      }
    }
  }
  std::vector<float> out(acc.size());
  for (size_t i = 0; i < acc.size(); ++i) out[i] = detail::round_to(dt, static_cast<float>(acc[i]));
  return out;
}

std::vector<float> run(const PackedExperts& pe, const Problem& p, MoePath path, int threads,
                       const char** name, const detail::KernelImpl* twin, const char* twin_name) {
  std::vector<uint8_t> out(static_cast<size_t>(p.c.T * p.c.H) * dtype_size(p.dt), 0xCD);
  MoeParams mp = p.params;
  mp.path = path;
  mp.num_threads = threads;
  const char* n;
  if (twin) {
    n = detail::forward_with(pe, *twin, twin_name, p.x.data(), p.c.T, p.idx.data(), 32,
                             p.w.data(), p.c.K, out.data(), mp);
  } else {
    n = pe.forward(p.x.data(), p.c.T, p.idx.data(), 32, p.w.data(), p.c.K, out.data(), mp);
  }
  if (name) *name = n;
  std::vector<float> f(static_cast<size_t>(p.c.T * p.c.H));
  for (size_t i = 0; i < f.size(); ++i) f[i] = load_elem(p.dt, out.data(), static_cast<int64_t>(i));
  return f;
}

// max |a - b| / max(max |ref|, 1e-3)
double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  double md = 0, mr = 1e-3;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(ref[i]));
    if (!(d <= md)) md = d;  // NaN propagates as a failure
    mr = std::max(mr, std::fabs(double(ref[i])));
  }
  return md / mr;
}

double tol(DType dt) { return dt == DType::kF32 ? 1e-5 : dt == DType::kF16 ? 3e-3 : 1.2e-2; }

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool selected(const std::string& name) { return !g_filter || name.find(g_filter) != std::string::npos; }
