// The memory tier's Python class (ExpertTier), crc32c, and PackedExperts.tiered.
#include "binding/experts.h"
#include "hina_moe/tier.h"

#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace hina_bind {

namespace {

struct PyTier {
  std::shared_ptr<hina::ExpertTier> t;
  std::vector<nb::object> routers;  // the router weights and biases prediction reads, kept alive
};

nb::dict stats_dict(const hina::TierStats& s) {
  nb::dict d;
  put_fields(d, "acquires", s.acquires, "hits", s.hits, "misses", s.misses, "inflight_hits", s.inflight_hits, "reads",
             s.reads, "bytes_read", s.bytes_read, "retries", s.retries, "prefetch_issued", s.prefetch_issued,
             "prefetch_dropped", s.prefetch_dropped, "prefetch_unused", s.prefetch_unused,
             "prefetch_skipped", s.prefetch_skipped, "predicted", s.predicted, "refined", s.refined,
             "predicted_used", s.predicted_used, "demanded", s.demanded, "evictions", s.evictions, "io_wait_s",
             s.io_wait_s, "read_s", s.read_s);
  nb::list layers;
  for (const auto& l : s.layers) {
    nb::dict ld;
    put_fields(ld, "hits", l.hits, "misses", l.misses, "predicted", l.predicted, "predicted_used", l.predicted_used,
               "demanded", l.demanded);
    layers.append(ld);
  }
  d["layers"] = layers;
  return d;
}

}  // namespace

void bind_tier(nb::module_& m) {
  nb::exception<hina::TierError>(m, "TierError", PyExc_OSError);
  m.def("crc32c",
        [](RoByteArray b, uint32_t crc) {
          nb::gil_scoped_release release;
          return hina::crc32c(b.data(), b.shape(0), crc);
        },
        nb::arg("buffer"), nb::arg("crc") = 0,
        "CRC-32C (Castagnoli) of a uint8 array, continuing from `crc`: what the memory tier checks every "
        "expert read against. GIL released.");
  m.def("tier_slot_bytes", &hina::ExpertTier::slot_bytes_for, nb::arg("gu_bytes"), nb::arg("down_bytes"),
        "Bytes of one memory-tier slot for experts of these gate/up and down sizes.");
  nb::class_<PyTier>(m, "ExpertTier",
      "The memory tier (hina_moe/tier.h): a pool of expert slots filled from the packed-expert store's "
      "files by I/O threads, for models whose packed experts exceed memory_limit.")
      .def("__init__",
           [](PyTier* self, size_t slot_bytes, int64_t num_slots, int io_threads, bool direct_io,
              const std::string& policy, double half_life, int window, int extra, int max_rows,
              bool skip_unused_reads, bool refine, int64_t fault_short_every, int64_t fault_eio_every, int64_t fault_flip_every) {
             hina::TierOptions o;
             o.slot_bytes = slot_bytes;
             o.num_slots = num_slots;
             o.io_threads = io_threads;
             o.direct_io = direct_io;
             if (!hina::eviction_from_name(policy.c_str(), &o.policy))
               bad("eviction policy '" + policy + "' is unknown; expected lru, lru-2, freq-decay or lfu");
             o.decay_half_life = half_life;
             o.prediction_window = window;
             o.prediction_extra = extra;
             o.prediction_max_rows = max_rows;
             o.skip_unused_reads = skip_unused_reads;
             o.refine = refine;
             o.fault_short_every = fault_short_every;
             o.fault_eio_every = fault_eio_every;
             o.fault_flip_every = fault_flip_every;
             new (self) PyTier{std::make_shared<hina::ExpertTier>(o), {}};
           },
           nb::arg("slot_bytes"), nb::arg("num_slots"), nb::arg("io_threads") = 4, nb::arg("direct_io") = true,
           nb::arg("policy") = "lru", nb::arg("half_life") = 64.0, nb::arg("prediction_window") = 2,
           nb::arg("prediction_extra") = 2, nb::arg("prediction_max_rows") = 8,
           nb::arg("skip_unused_reads") = true, nb::arg("refine") = true, nb::arg("fault_short_every") = 0,
           nb::arg("fault_eio_every") = 0, nb::arg("fault_flip_every") = 0,
           "slot_bytes from tier_slot_bytes() of the largest layer; the fault_* arguments are for tests only "
           "(every n-th read cut short, failing with EIO, or with a flipped byte).")
      .def("add_layer",
           [](PyTier& self, const std::string& path, int64_t E, uint64_t gu_offset, uint64_t gu_bytes,
              uint64_t down_offset, uint64_t down_bytes, const std::vector<uint32_t>& crc_gu,
              const std::vector<uint32_t>& crc_down) {
             return self.t->add_layer(path, E, gu_offset, gu_bytes, down_offset, down_bytes, crc_gu, crc_down);
           },
           nb::arg("path"), nb::arg("E"), nb::arg("gu_offset"), nb::arg("gu_bytes"), nb::arg("down_offset"),
           nb::arg("down_bytes"), nb::arg("crc_gu"), nb::arg("crc_down"),
           "Registers a layer's experts in a store file (offsets and sizes in bytes, one CRC-32C per expert "
           "region); returns its layer id (registration order = the order prediction reads ahead in).")
      .def("set_router",
           [](PyTier& self, int layer, nb::object weight, std::optional<nb::object> bias, int k) {
             InArray w = nb::cast<InArray>(weight);
             if (w.ndim() != 2) bad("router weight must be [E, H]");
             check_array("router weight", w, {self.t->experts(layer), -1});
             const auto dt = to_dtype(w.dtype());
             if (!dt) bad("router weight has dtype " + dtype_str(w.dtype()) + "; supported: float32, bfloat16, float16");
             const float* b = nullptr;
             if (bias && !bias->is_none()) {
               auto ba = nb::cast<nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>>(*bias);
               if (static_cast<int64_t>(ba.shape(0)) != self.t->experts(layer)) bad("router bias must be [E] float32");
               b = ba.data();
               self.routers.push_back(*bias);
             }
             self.routers.push_back(weight);
             self.t->set_router(layer, w.data(), *dt, static_cast<int64_t>(w.shape(1)), b, k);
           },
           nb::arg("layer"), nb::arg("weight"), nb::arg("bias").none() = nb::none(), nb::arg("k"),
           "The layer's router for prediction: weight [E, H] (kept alive), bias [E] float32 or None, "
           "k experts a token routes to.")
      .def("set_norm",
           [](PyTier& self, int layer, nb::object weight, float eps) {
             InArray w = nb::cast<InArray>(weight);
             if (w.ndim() != 1) bad("norm weight must be [H]");
             check_array("norm weight", w, {-1});
             const auto dt = to_dtype(w.dtype());
             if (!dt) bad("norm weight has dtype " + dtype_str(w.dtype()) + "; supported: float32, bfloat16, float16");
             if (!(eps >= 0)) bad("norm eps must be >= 0, got " + std::to_string(eps));
             self.t->set_norm(layer, w.data(), *dt, static_cast<int64_t>(w.shape(0)), eps);
           },
           nb::arg("layer"), nb::arg("weight"), nb::arg("eps"),
           "The RMSNorm in front of the layer's router (weight [H], copied; eps), for refine: layer_done() "
           "of an earlier layer applies it and the router to that layer's output.")
      .def("layer_done",
           [](PyTier& self, int layer, nb::object residual) {
             InArray x = nb::cast<InArray>(residual);
             if (x.ndim() < 1) bad("layer_done: the residual must be [..., H]");
             check_array("layer_done residual", x, std::vector<int64_t>(x.ndim(), -1));
             const auto dt = to_dtype(x.dtype());
             if (!dt) bad("layer_done residual has dtype " + dtype_str(x.dtype()) + "; supported: float32, bfloat16, float16");
             const int64_t H = static_cast<int64_t>(x.shape(x.ndim() - 1));
             const int64_t T = H > 0 ? static_cast<int64_t>(x.size()) / H : 0;
             nb::gil_scoped_release r;
             self.t->layer_done(layer, x.data(), T, *dt, H);
           },
           nb::arg("layer"), nb::arg("residual"),
           "Layer `layer` is done and residual [..., H] is its output: queues predicted reads of the next "
           "layers' experts from it (refine; never waits for a read).")
      .def("prefetch",
           [](PyTier& self, int layer, const std::vector<int32_t>& experts) {
             self.t->prefetch(layer, experts.data(), static_cast<int>(experts.size()));
           },
           nb::arg("layer"), nb::arg("experts"), "Queues reads of these experts as predicted ones.")
      .def("warm",
           [](PyTier& self, const std::vector<int32_t>& layers, const std::vector<int32_t>& experts) {
             if (layers.size() != experts.size()) bad("warm: layers and experts must be of one length");
             nb::gil_scoped_release r;
             self.t->warm(layers.data(), experts.data(), static_cast<int>(layers.size()));
           },
           nb::arg("layers"), nb::arg("experts"),
           "Reads (layers[i], experts[i]) into the pool in that order as demanded reads would (the last the "
           "most recently used): a frequency prior at start-up, least frequent first. Blocks until resident.")
      .def("drain", [](PyTier& self) { nb::gil_scoped_release r; self.t->drain(); },
           "Waits until no read is queued or under way.")
      .def("stats", [](const PyTier& self) { return stats_dict(self.t->stats()); },
           "Counters since creation or reset_stats(), and per layer.")
      .def("reset_stats", [](PyTier& self) { self.t->reset_stats(); })
      .def("forget_uses", [](PyTier& self) { self.t->forget_uses(); },
           "Forgets every expert's uses so far (the eviction policy's records, and which read-aheads went "
           "unused); what is resident stays.")
      .def("resident", [](const PyTier& self, int layer) { return self.t->resident(layer); }, nb::arg("layer"))
      .def("io_mode", [](const PyTier& self, int layer) { return self.t->io_mode(layer); }, nb::arg("layer"))
      .def_prop_ro("num_layers", [](const PyTier& self) { return self.t->num_layers(); })
      .def_prop_ro("num_slots", [](const PyTier& self) { return self.t->num_slots(); })
      .def_prop_ro("slot_bytes", [](const PyTier& self) { return self.t->slot_bytes(); })
      .def_prop_ro("pool_address", [](const PyTier& self) { return reinterpret_cast<uintptr_t>(self.t->pool()); })
      .def_prop_ro("pool_bytes", [](const PyTier& self) { return self.t->pool_bytes(); })
      .def_prop_ro("policy", [](const PyTier& self) { return std::string(hina::eviction_name(self.t->options().policy)); });

  m.def("packed_tiered",
        [](const nb::bytes& header, PyTier& tier, int layer, RoByteArray biases) {
          const hina::PackedHeader h = header_from_bytes(header);
          auto pe = hina::PackedExperts::tiered(h, tier.t, layer, biases.data(), biases.shape(0));
          PyPackedExperts r(std::move(pe), nb::none());
          r.set_readonly();
          return r;
        },
        nb::arg("header"), nb::arg("tier"), nb::arg("layer"), nb::arg("biases"),
        "A PackedExperts whose experts live in `tier` as its layer `layer`; biases: the block's bias "
        "region (uint8, nbytes - E x expert bytes; copied).");
}

}  // namespace hina_bind
