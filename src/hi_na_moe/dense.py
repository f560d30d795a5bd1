"""scope="all": the model's dense linear layers (attention projections, shared experts, dense
MLPs, lm_head) on the experts' kernels, in the configured weight format.

Each `nn.Linear` outside the MoE experts is packed as an up-only block
(`PackedExperts.pack_linear`: the same panels, tiers, formats and threads as the experts; one
expert, identity activation, no down pass) and its forward is replaced by a call to it. Decode
(T = 1) is a weight stream, as for the experts: PyTorch's bf16 GEMV reaches about half the
bandwidth of our decode kernels on this machine (benchmarks/RESULTS.md, session 4 baselines).

Which layers: every `nn.Linear` (exactly that class) that is not inside an accelerated MoE
block's experts and not matched by `dense_exclude`, with at least 64 Ki weights (smaller ones,
such as a shared expert's 1-output gate, have no bytes worth a kernel call). Layers matched by
`dense_lossless` (default "lm_head") stay in the model's own dtype when `weights` is int8/int4.
Patterns are fnmatch patterns on the module's name in the model ("lm_head", "*.self_attn.*").

Memory and the store: a lossless layer is packed in memory, its own weight released (a
zero-byte placeholder) and rebuilt bit-exactly from the packed copy by disable and by
state_dict(). A quantised layer, with the config's cache on (the default), lives in the
packed-expert store like the experts: it is quantised and written there on the first enable
and memory-mapped afterwards (keyed by a hash of its weight and bias, the format and the tier),
next to an exact lossless backup of its originals; its own weight is then released and rebuilt
from that backup by disable and by state_dict(). With cache=False a quantised layer is
quantised at every enable and keeps its own weight (no backup to restore it from).
"""

from __future__ import annotations

import fnmatch
import threading
import types
from dataclasses import dataclass

import torch
from torch import nn

MIN_WEIGHTS = 1 << 16


@dataclass
class DenseReport:
    name: str
    out_features: int
    in_features: int
    weights: str  # the format it runs in
    kernel: str  # the decode kernel's name
    packed_bytes: int  # what a decode step reads for this layer
    released_bytes: int
    cache: str | None = None  # quantised with the store: "built", "reused" or "rebuilt (why)"


def _matches(name: str, patterns: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p.strip()) for p in patterns.split(",") if p.strip())


def _format_of(name: str, cfg) -> str:
    """The weight format the dense layer `name` runs in under `cfg`."""
    return "lossless" if cfg.weights == "lossless" or _matches(name, cfg.dense_lossless) else cfg.weights


def find_linears(model: nn.Module, inside: list[nn.Module], exclude: str,
                 devices: tuple[str, ...] = ("cpu",)) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the linears scope="all" runs, in module order."""
    skip = {id(m) for blk in inside for m in blk.modules()}
    found = []
    for name, m in model.named_modules():
        if (type(m) is nn.Linear and id(m) not in skip and not _matches(name, exclude)
                and m.weight.numel() >= MIN_WEIGHTS and m.weight.device.type in devices
                and m.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)):
            found.append((name, m))
    return found


class NativeLinear:
    """One nn.Linear on the native kernels: pack, the replacement forward, release, restore."""

    def __init__(self, name: str, module: nn.Linear, weights: str, group_size: int, isa: str, threads: int,
                 qdot: str, store=None):
        self.name, self.module = name, module
        self.weights, self.threads = weights, threads
        self.isa, self.group_size = isa, group_size
        w = module.weight.detach().contiguous()
        b = module.bias.detach().contiguous() if module.bias is not None else None
        # quantised layers live in the store (store.PackedStore), lossless ones in memory
        self.store = store if weights != "lossless" else None
        self.cache_event: str | None = None
        self._entry = None  # the store entry the packed layer is mapped from
        self._backup = None  # (key, entry name) of the exact originals in the store
        if self.store is None:
            self.packed = self._pack_now(w, b, weights)
        else:
            from .store import tensor_identity

            self._identity = tensor_identity([t for t in (w, b) if t is not None])
            self.packed, self._entry, self.cache_event = self._from_store(w, b, weights, name)
        self.bound = self.packed.bind(qdot=qdot)
        self.dtype = w.dtype
        self.in_features, self.out_features = module.in_features, module.out_features
        self.nbytes = self.packed.nbytes
        self.kernel = self.packed.kernel_name("decode", qdot)
        self._released = False
        self._hook = None
        self._lock = threading.Lock()

    # -- packing and the store ----------------------------------------------------------------
    def _pack_now(self, w: torch.Tensor, b: torch.Tensor | None, weights: str):
        from .hardware import native_module

        return native_module()[0].PackedExperts.pack_linear(
            w, b, isa=self.isa, num_threads=self.threads, weights=weights, group_size=self.group_size)

    def _expect(self, weights: str) -> dict:
        from .hardware import native_module

        return {"layout_version": int(native_module()[0].PACKED_LAYOUT_VERSION), "weights": weights,
                "isa": self.isa, "group_size": self.group_size if weights == "int4" else 0, "up_only": True}

    def _key(self, weights: str) -> str:
        from .store import entry_key

        return entry_key(self._identity, kind="linear", **self._expect(weights))

    def _from_store(self, w, b, weights: str, name: str):
        """The packed layer in `weights` from the store, built and written there if absent,
        stale or corrupt. Returns (PackedExperts view, entry, event)."""
        from .hardware import native_module

        native, _ = native_module()

        def build():
            pe = self._pack_now(w, b, weights)
            meta = dict(native.header_info(pe.header), header=pe.header.hex(), layer=self.name,
                        **self._expect(weights))
            return meta, {"block": pe.data}

        entry, built, reason = self.store.get_or_build(self._key(weights), name, self._expect(weights), build)
        view = native.PackedExperts.view(bytes.fromhex(entry.meta["header"]), entry.array("block", "uint8"))
        if not view.up_only:
            entry.close()
            raise RuntimeError(f"hi_na_moe: the store entry for {self.name!r} ({entry.path}) is not a linear layer")
        event = "reused" if not built else (f"rebuilt ({reason})" if reason else "built")
        return view, entry, event

    # -- the forward --------------------------------------------------------------------------
    def forward(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        # the common inference call in few operations: with the caches a decode step leaves,
        # every torch op here costs ~30 us (benchmarks/bench_call_overhead.py), and a step
        # calls every dense layer once
        if (type(x) is torch.Tensor and x.dtype is self.dtype and x.is_contiguous() and x.is_cpu
                and not x.requires_grad and not x.is_neg() and x.dim() >= 1 and x.shape[-1] == self.in_features
                and not (module.training and torch.is_grad_enabled())):
            out = torch.empty(x.shape[:-1] + (self.out_features,), dtype=self.dtype)
            # every thread, also for small layers: OLMoE's int4 attention projections (2.2 MB) on
            # one thread (the experts' ops.SMALL_CALL_BYTES rule) made a whole decode step 10-25 %
            # slower (benchmarks/RESULTS.md, session 5)
            self.bound.linear(x.data_ptr(), x.numel() // self.in_features, out.data_ptr(),
                              self.threads or torch.get_num_threads())
            return out
        return self._forward_general(module, x)

    def _forward_general(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """Everything forward()'s first branch does not take: training with autograd, other
        dtypes, strided or lazily negated inputs, wrong shapes and devices (errors)."""
        if module.training and torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad):
            if self._released:
                raise RuntimeError(
                    f"hi_na_moe: gradients are requested through {self.name!r}, a linear layer packed for the "
                    "native kernels (scope='all') with its weight released; disable_for_model(model) first, or "
                    "enable with scope='experts' to train")
            return torch.nn.functional.linear(x, module.weight, module.bias)
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"hi_na_moe: {self.name}: input has shape {tuple(x.shape)}; the layer takes "
                             f"[..., {self.in_features}]")
        if not x.is_cpu:
            raise ValueError(f"hi_na_moe: {self.name}: input is on {x.device}; the layer runs on the CPU")
        x2 = x.detach().to(self.dtype).resolve_neg().contiguous()
        out = torch.empty(x.shape[:-1] + (self.out_features,), dtype=self.dtype)
        self.bound.linear(x2.data_ptr(), x2.numel() // self.in_features, out.data_ptr(),
                          self.threads or torch.get_num_threads())
        return out if out.dtype is x.dtype else out.to(x.dtype)

    # -- memory -------------------------------------------------------------------------------
    def release(self) -> int:
        """Free the module's own weight; it is rebuilt exactly from the packed copy (lossless)
        or from the backup written to the store first (quantised). Returns the bytes freed
        (0 for a quantised layer without a store, which keeps its weight)."""
        if self.weights != "lossless":
            if self.store is None:
                return 0
            w = self.module.weight.detach().contiguous()
            b = self.module.bias.detach().contiguous() if self.module.bias is not None else None
            backup = self.name + ".original"
            _, entry, _ = self._from_store(w, b, "lossless", backup)
            entry.close()
            self._backup = (self._key("lossless"), backup)
        p = self.module.weight
        freed = p.numel() * p.element_size()
        self._shape, self._stride = p.shape, p.stride()
        p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)
        self._released = True

        def fill_state_dict(mod, state_dict, prefix, local_metadata):
            key = prefix + "weight"
            if key in state_dict:
                state_dict[key] = self._unpacked()

        self._hook = self.module.register_state_dict_post_hook(fill_state_dict)
        return freed

    def _unpacked(self) -> torch.Tensor:
        """The exact original weight, in the module's own strides."""
        out = torch.empty_strided(self._shape, self._stride, dtype=self.dtype)
        if self._backup is None:
            _, w, _, _, _, _ = self.packed.unpack()
            return out.copy_(torch.from_dlpack(w))
        from .hardware import native_module

        key, name = self._backup
        try:
            with self.store.open(key, name, expect=self._expect("lossless")) as entry:
                # unpack copies out of the mapping, so the entry can close right after
                view = native_module()[0].PackedExperts.view(bytes.fromhex(entry.meta["header"]),
                                                               entry.array("block", "uint8"))
                _, w, _, _, _, _ = view.unpack()
                return out.copy_(torch.from_dlpack(w))
        except Exception as exc:
            raise RuntimeError(
                f"hi_na_moe: cannot restore the original weight of {self.name!r}: its exact backup in the "
                f"packed-expert store is unreadable ({exc}). The layer keeps running on its {self.weights} "
                "copy; reload the model from its checkpoint to get the original.") from exc

    def restore(self) -> None:
        with self._lock:
            if self._released:
                self.module.weight.data = self._unpacked()
                self._released = False
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self.packed = self.bound = None
            if self._entry is not None:
                self._entry.close()
                self._entry = None


def plan(model: nn.Module, cfg, inside: list[nn.Module]) -> list[DenseReport]:
    """What patch() would do, without packing (inspect_model): the layers, their format, the
    decode kernel and the packed bytes (from the planner: works on the meta device too)."""
    from .hardware import native_module
    from .ops import _isa_name, _kernel_names

    native, _ = native_module()
    isa = _isa_name(cfg)
    reports = []
    for name, m in find_linears(model, inside, cfg.dense_exclude, devices=("cpu", "meta")):
        fmt = _format_of(name, cfg)
        dt = str(m.weight.dtype).replace("torch.", "")
        header = native.PackedExperts.plan(dt, 1, m.in_features, m.out_features, False, up_bias=m.bias is not None,
                                           isa=isa, weights=fmt, group_size=cfg.group_size, up_only=True)
        reports.append(DenseReport(name, m.out_features, m.in_features, fmt,
                                   _kernel_names(isa, m.weight.dtype, fmt, cfg.qdot)["decode"],
                                   native.header_info(header)["nbytes"], 0))
    return reports


def patch(model: nn.Module, cfg, gate, inside: list[nn.Module], gated):
    """Pack and patch the linears of scope="all", then the RMSNorms; returns
    ([(module, runner, old forward)], linear reports, norm names patched, norm names whose probe
    did not match). On an error, what was patched is undone before it propagates."""
    from tqdm.auto import tqdm

    from .ops import _isa_name

    isa = _isa_name(cfg)
    todo = find_linears(model, inside, cfg.dense_exclude)
    store = None
    if cfg.weights != "lossless" and cfg.cache and todo:
        from .store import PackedStore

        store = PackedStore(cfg.store_root())
    # a weight shared with another module (tied lm_head / embeddings) is never released
    seen: dict[int, int] = {}
    for _, prm in model.named_parameters(remove_duplicate=False):
        seen[id(prm)] = seen.get(id(prm), 0) + 1
    done, reports = [], []
    try:
        for name, m in tqdm(todo, desc=f"hi_na_moe: packing dense layers ({cfg.weights})", unit="layer",
                            leave=False, disable=None if len(todo) > 8 else True):
            fmt = _format_of(name, cfg)
            runner = NativeLinear(name, m, fmt, cfg.group_size, isa, cfg.threads, cfg.qdot, store)
            old = m.__dict__.get("forward", _MISSING)
            m.forward = types.MethodType(gated(gate, runner.forward), m)
            done.append((m, runner, old))
            freed = 0 if cfg.keep_weights or seen.get(id(m.weight), 0) > 1 else runner.release()
            reports.append(DenseReport(name, m.out_features, m.in_features, fmt, runner.kernel, runner.nbytes, freed,
                                       runner.cache_event))
        norm_done, norms, norms_differ = patch_norms(model, cfg, gate, gated)
        done += norm_done
    except BaseException:
        unpatch(done)
        raise
    return done, reports, norms, norms_differ


_MISSING = object()

# -- RMSNorm ----------------------------------------------------------------------------------
# A decode step calls every RMSNorm once per token (OLMoE-1B-7B: 65 per step) and PyTorch runs
# each as ~7 small ops; with the caches the weight streaming leaves behind they cost ~80 us per
# norm (benchmarks/bench_decode_breakdown.py). One native call replaces them for a few rows.

NORM_MAX_ROWS = 16  # more rows (prefill): the module's own forward, which PyTorch parallelises
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# a probe result may differ from the module's own by this much (relative): the sum of squares
# is added in another order, so an rsqrt can differ in its last bit and round h differently
_NORM_RTOL = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _norm_eps(m: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(m, attr, None)
        if isinstance(v, float) and v >= 0:
            return v
    return None


def find_norms(model: nn.Module, exclude: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of the RMSNorm candidates: a class named *RMSNorm with a float `eps` or
    `variance_epsilon`, one 1-D `weight` parameter (on the CPU, float dtype) and nothing else.
    What such a module computes is still checked (NativeNorm.matches) before it is patched."""
    found = []
    for name, m in model.named_modules():
        if not type(m).__name__.endswith("RMSNorm") or _matches(name, exclude) or _norm_eps(m) is None:
            continue
        params = dict(m.named_parameters(recurse=True))
        if set(params) != {"weight"} or any(True for _ in m.buffers()):
            continue
        w = params["weight"]
        if w.dim() == 1 and w.device.type == "cpu" and w.dtype in _DTYPE_CODES and w.numel() > 0:
            found.append((name, m))
    return found


class NativeNorm:
    """One RMSNorm module on the native kernel (hina_moe rms_norm) for decode-sized inputs."""

    weights = "lossless"

    def __init__(self, name: str, module: nn.Module, original_forward):
        from .hardware import native_module

        self.name, self.module = name, module
        self.native = native_module()[0]
        self.eps = _norm_eps(module)
        self.n = module.weight.numel()
        self.original = original_forward  # the module's own forward (bound)

    def matches(self) -> bool:
        """Whether the module computes what the kernel does: both run on a probe of rows at
        scales from 1e-3 to 1e3, with the module's own weight; every value within the dtype's
        rounding of the module's own output."""
        w = self.module.weight.detach()
        gen = torch.Generator().manual_seed(7)
        scale = torch.logspace(-3, 3, 7).unsqueeze(1)
        x = (torch.randn(7, self.n, generator=gen) * scale).to(w.dtype)
        with torch.no_grad():
            try:
                want = self.original(x)
            except Exception:
                return False
            if not isinstance(want, torch.Tensor) or want.shape != x.shape or want.dtype != x.dtype:
                return False
            got = torch.empty_like(x)
            self.native.rms_norm(x, w.contiguous(), self.eps, got)
        diff = (got.float() - want.float()).abs()
        return bool((diff <= _NORM_RTOL[w.dtype] * want.float().abs() + 1e-30).all())

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if (type(x) is torch.Tensor and x.dtype is w.dtype and x.is_contiguous() and x.is_cpu
                and x.dim() >= 1 and x.shape[-1] == self.n and x.numel() <= NORM_MAX_ROWS * self.n
                and not x.requires_grad and not x.is_neg() and w.is_contiguous() and w.is_cpu
                and not (module.training and torch.is_grad_enabled() and w.requires_grad)):
            out = torch.empty(x.shape, dtype=x.dtype)
            self.native.rms_norm_raw(x.data_ptr(), x.numel() // self.n, self.n, w.data_ptr(), self.eps,
                                     out.data_ptr(), _DTYPE_CODES[x.dtype])
            return out
        return self.original(x)

    def restore(self) -> None:  # the module's weight was never touched
        pass


def patch_norms(model: nn.Module, cfg, gate, gated) -> tuple[list, list[str], list[str]]:
    """Patch the RMSNorm modules whose probe matches; returns (done, patched names, names left
    to PyTorch because their probe did not match)."""
    done, names, differ = [], [], []
    try:
        for name, m in find_norms(model, cfg.dense_exclude):
            old = m.__dict__.get("forward", _MISSING)
            runner = NativeNorm(name, m, m.forward)
            if not runner.matches():
                differ.append(name)
                continue
            m.forward = types.MethodType(gated(gate, runner.forward), m)
            done.append((m, runner, old))
            names.append(name)
    except BaseException:
        unpatch(done)
        raise
    return done, names, differ


def unpatch(done: list) -> list:
    """Restore every layer of `done`. Returns [((module, runner, old forward), exception)] for
    the layers whose weight could not be restored: those stay patched, running on their packed
    copy, so unpatch can be called again on them."""
    failed = []
    for item in reversed(done):
        m, runner, old = item
        try:
            runner.restore()
        except Exception as exc:
            failed.append((item, exc))
            continue
        if old is _MISSING:
            m.__dict__.pop("forward", None)
        else:
            m.forward = old
    return failed[::-1]
