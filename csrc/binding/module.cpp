// The Python module hi_na_moe._native: the one place that knows Python (with the other files of
// this folder). Everything below it is plain C++ with no Python or torch. This file: the module,
// CPU features and tiers, the library's pool, the bandwidth probe; the rest by concern:
// experts.cpp (PackedExperts, BoundForward), model.cpp (checked ops, the layer and stack step),
// raw.cpp (every *_raw entry point, with the checking mode).
#include "binding/common.h"
#include "hina_moe/bandwidth.h"

namespace hina_bind {
void bind_experts(nb::module_& m);
void bind_model(nb::module_& m);
void bind_raw(nb::module_& m);
void bind_tier(nb::module_& m);

namespace {
nb::dict features_dict() {
  const hina::CpuFeatures& f = hina::cpu_features();
  nb::dict d;
  d["arch"] = std::string(f.arch);
  d["vendor"] = std::string(f.vendor);
  d["brand"] = std::string(f.brand);
  nb::dict cpu;
#define HINA_FLAG(name) cpu[#name] = f.name
  HINA_FLAG(sse42); HINA_FLAG(avx); HINA_FLAG(avx2); HINA_FLAG(fma); HINA_FLAG(f16c);
  HINA_FLAG(avx512f); HINA_FLAG(avx512bw); HINA_FLAG(avx512vl); HINA_FLAG(avx512dq);
  HINA_FLAG(avx512vbmi); HINA_FLAG(avx512vnni); HINA_FLAG(avx512bf16); HINA_FLAG(avx512fp16); HINA_FLAG(avx_vnni);
  HINA_FLAG(amx_tile); HINA_FLAG(amx_bf16); HINA_FLAG(amx_int8); HINA_FLAG(neon); HINA_FLAG(asimddp);
  HINA_FLAG(i8mm); HINA_FLAG(bf16); HINA_FLAG(sve);
#undef HINA_FLAG
  d["cpu"] = cpu;
  nb::dict os;
  put_fields(os, "xcr0", f.xcr0, "avx", f.os_avx, "avx512", f.os_avx512, "amx", f.os_amx, "amx_permission",
             f.amx_permission);
  d["os"] = os;
  return d;
}
}  // namespace
}  // namespace hina_bind

using namespace hina_bind;

NB_MODULE(_native, m) {
  m.doc() = "hi_na_moe native core (torch-free C++)";
  // PackedExperts live inside patched torch modules, which are often still referenced (module
  // globals, reference cycles) when the interpreter tears nanobind down; that is not a leak of
  // the binding, so the shutdown leak report would only be noise for users.
  nb::set_leak_warnings(false);
  m.def("cpu_features", &features_dict,
        "CPU features as reported by the processor and enabled by the OS.");
  m.def("best_isa", [] { return std::string(hina::isa_name(hina::best_isa(hina::cpu_features()))); },
        "The highest kernel tier this CPU and OS support.");
  m.def("isa_supported",
        [](const std::string& name) { return hina::isa_supported(hina::cpu_features(), parse_isa(name)); },
        nb::arg("name"), "Whether the named tier can run on this machine.");
  m.def("resolve_isa", [](const std::string& name) { return std::string(hina::isa_name(hina::resolve_isa(name.c_str()))); },
        nb::arg("name") = "auto",
        "The tier a PackedExperts(isa=name) would use: 'auto' is the best tier here unless the "
        "env var HINA_MOE_ISA names another; raises ValueError for a tier the CPU lacks.");
  m.attr("DEFAULT_PREFILL_MIN_TOKENS") = hina::kDefaultPrefillMinTokens;
  m.def("default_num_threads", &hina::default_num_threads,
        "Threads the op uses when num_threads=0 (CPUs in this process's affinity mask).");
  m.def("l12_prefetch", &hina::l12_prefetch,
        "Whether the lossless12 decode kernel prefetches its stream (not on AMD CPUs unless "
        "HINA_MOE_PREFETCH_BYTES is set).");
  m.def("prefetch_distance", &hina::prefetch_distance,
        "Bytes ahead of their weight stream the FMA and integer-dot kernels prefetch into L2, fixed when the "
        "library loaded: HINA_MOE_PREFETCH_BYTES if it held a multiple of 64 in [0, 65536], else 1024 on AMD "
        "CPUs and 4096 on others.");
  m.def("rows_prefetch_distance", &hina::rows_prefetch_distance, nb::arg("rows"),
        "The distance the int8 / int4 kernels prefetch at in a job of `rows` rows (batched decode, "
        "prefill): HINA_MOE_PREFETCH_BYTES if it was used, else prefetch_distance() for one row and on "
        "CPUs other than AMD; on AMD 0 (no software prefetch) for 2-3 rows and 16384 for 4 or more.");
  m.def("step_trace_compiled", &hina::step_trace_compiled,
        "Whether this build records decode_layers' timeline (a tuning build, HINA_PREFETCH_TUNING).");
  m.def("take_step_trace", [] {
          nb::list out;
          for (const auto& e : hina::take_step_trace())
            out.append(nb::make_tuple(e.layer, hina::step_op_name(e.op), e.t0, e.t1));
          return out;
        },
        "The ops decode_layers ran since the last call, as (layer, op, t0_ns, t1_ns) one after the other "
        "(layer -1: the final norm); empty unless step_trace_compiled().");
  m.def("set_pool_backend", [](const std::string& name) { hina::ThreadPool::global().set_backend(pool_backend_from(name)); },
        nb::arg("name"),
        "Process-wide: which threads run the kernels' parallel regions ('auto': the loaded "
        "libgomp's team when there is one, else the library's own workers; 'own'; 'openmp'; "
        "'mixed': the own workers, prefill-sized calls on the loaded libgomp's team).");
  m.def("set_pool_hosting", [](bool on) { hina::ThreadPool::global().set_hosting(on); }, nb::arg("on"),
        "Process-wide: whether a decode step through the layers (StepPlan.run) on the own or mixed backend "
        "runs its regions on the loaded libgomp's team, hosted (ThreadPool::host; default on).");
  m.def("pool_hosting", [] { return hina::ThreadPool::global().hosting(); });
  m.def("pool_stats", [] {
        const auto& p = hina::ThreadPool::global();
        nb::dict d;
        d["hosted_calls"] = p.hosted_calls();
        d["guest_shares"] = p.guest_shares();
        d["host_shares"] = p.host_shares();
        d["host_backoffs"] = p.host_backoffs();
        return d;
      },
      "Counts since start: hosted calls (decode steps whose regions ran on OpenMP's team), the "
      "worker shares that team's threads ran in them and those the calling thread ran itself, and "
      "the hosted calls that found the team held off its cores (the next calls then run on the own "
      "workers for a while).");
  m.def("_pool_host_contention_for_test", [] { hina::ThreadPool::global().host_contention_for_test(); },
        "Tests: the next hosted call counts as one that found OpenMP's team held off its cores.");
  m.def("_pool_host_reset_for_test", [] {
        nb::gil_scoped_release release;
        hina::ThreadPool::global().host_reset_for_test();
      },
      "Tests: ends a hosting backoff (the next decode step runs hosted again).");
  m.def("openmp_runtime", &hina::loaded_openmp_runtime,
        "Path of the GNU OpenMP runtime (libgomp) loaded in this process, '' if none.");
  m.def("pool_backend", [](std::optional<std::string> name) {
          return name ? hina::ThreadPool::backend_name(pool_backend_from(*name)) : hina::ThreadPool::global().backend_name();
        }, nb::arg("name") = nb::none(),
        "What parallel regions run on under backend `name` (default: the current one): 'own', "
        "'openmp (<libgomp path>)', or 'own (openmp requested, no libgomp loaded in this process)'.");

  hina_bind::bind_experts(m);
  hina_bind::bind_model(m);
  hina_bind::bind_raw(m);
  hina_bind::bind_tier(m);
  nb::class_<hina::BandwidthProbe>(m, "BandwidthProbe",
                                   "A read-bandwidth probe on a buffer allocated and touched once: "
                                   "read(bytes) times one read of the buffer's next `bytes` (round "
                                   "robin) and returns GB/s. For pairing every timed call with a probe.")
      .def("__init__",
           [](hina::BandwidthProbe* self, size_t bytes, int threads) {
             if (threads <= 0) threads = hina::default_num_threads();
             nb::gil_scoped_release release;
             new (self) hina::BandwidthProbe(bytes, threads);
           },
           nb::arg("bytes") = size_t(1) << 30, nb::arg("threads") = 0)
      .def("read",
           [](hina::BandwidthProbe& self, size_t bytes) {
             nb::gil_scoped_release release;
             return self.pass(bytes);
           },
           nb::arg("bytes") = size_t(256) << 20)
      .def_prop_ro("size", &hina::BandwidthProbe::size);

  m.def("measure_read_bandwidth",
        [](size_t bytes, int threads, int passes) {
          hina::BandwidthResult r;
          if (threads <= 0) threads = hina::default_num_threads();
          {
            nb::gil_scoped_release release;
            r = hina::measure_read_bandwidth(bytes, threads, passes);
          }
          nb::dict d;
          put_fields(d, "best_gbs", r.best_gbs, "median_gbs", r.median_gbs, "bytes", r.bytes, "threads", r.threads,
                     "passes", r.passes);
          return d;
        },
        nb::arg("bytes") = size_t(1) << 30, nb::arg("threads") = 0, nb::arg("passes") = 5,
        "Memory read bandwidth of this machine (GB/s) over a buffer of `bytes` (make it far larger "
        "than the last-level cache); threads=0 means default_num_threads().");
  m.attr("__build__") = std::string("compiler=") +
#if defined(__clang__)
      "clang " __clang_version__;
#elif defined(__GNUC__)
      "gcc " __VERSION__;
#else
      "unknown";
#endif
}
