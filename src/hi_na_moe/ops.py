"""The experts op: choose, per MoE block, what computes it (a native kernel or the reference),
and the native runner itself."""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from . import reference, torch_ops
from .config import DEFAULT_GROUP_SIZE, LOSSLESS_FORMATS, HinaConfig
from .hardware import native_kernels_available, native_module
from .memory import load_block
from .spec import ExpertsSpec, Runner, check_routing, index_range_error

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# A call that streams less than this many bytes of expert weights runs on one thread: waking a
# second thread (and fighting torch's busy-waiting OpenMP workers for its core) costs more than
# it saves. Measured on the shipped model (786 KB per decode call): 1 thread 1.45x native tok/s,
# 2 threads 0.71x; on OLMoE-shaped layers (100 MB per call) 2 threads win (benchmarks/RESULTS.md).
SMALL_CALL_BYTES = 4 << 20


@dataclass(frozen=True)
class Choice:
    runner: Runner
    kernel: str  # what runs: "reference", or the native kernels' names ("moe_decode_bf16_avx512|...")
    note: str | None = None  # why not native, when it is not


def _isa_name(config: HinaConfig) -> str:
    """The tier the kernels run at: the config's, or for "auto" the best this machine has."""
    native, _ = native_module()
    return native.resolve_isa(config.isa)


@functools.lru_cache(maxsize=None)
def _kernel_names(isa: str, dtype: torch.dtype, weights: str = "lossless", qdot: str = "auto") -> dict[str, str]:
    """Kernel per path for experts of `dtype` stored as `weights` at tier `isa` under `qdot`: a
    one-expert probe pack answers exactly as a real block would."""
    native, _ = native_module()
    w = torch.zeros(1, 16, 32, dtype=dtype)
    probe = native.PackedExperts(w, w, w.transpose(1, 2).contiguous(), isa=isa, weights=weights)
    return {path: probe.kernel_name(path, qdot) for path in ("decode", "prefill")}


def kernel_label(isa: str, dtype: torch.dtype, weights: str, qdot: str) -> str:
    """The report's kernel field of a native block: "<decode kernel>|<prefill kernel>"."""
    names = _kernel_names(isa, dtype, weights, qdot)
    return f"{names['decode']}|{names['prefill']}"


def kernel_plan(config: HinaConfig) -> dict[str, str]:
    """The kernel each path uses for bf16 experts under `config`, for the capabilities report."""
    if config.backend == "reference" or not native_kernels_available():
        return {"decode": "reference", "prefill": "reference"}
    return dict(_kernel_names(_isa_name(config), torch.bfloat16, config.weights, config.qdot))


def weights_label(weights: str, group_size: int, dtype: torch.dtype) -> str:
    """How a block's expert weights are stored, for reports: "bfloat16", "bfloat16-lossless12",
    "int8", "int4-g32"."""
    if weights == "lossless":
        return str(dtype).replace("torch.", "")
    if weights == "lossless12":
        return str(dtype).replace("torch.", "") + "-lossless12"
    return "int4-g%d" % group_size if weights == "int4" else weights


def native_unsupported_reason(spec: ExpertsSpec, dry_run: bool = False) -> str | None:
    """None if a native kernel can run this block, else why not (shown in the report).
    dry_run: the weights will not be read (a plan on the meta device), so their device does not
    matter."""
    if not native_kernels_available():
        _, why = native_module()
        return f"native kernels not available in this build ({why or 'no PackedExperts'}): reference path"
    if spec.weight_dtype not in NATIVE_DTYPES:
        return f"expert weights are {spec.weight_dtype}; native kernels take float32/bfloat16/float16"
    if spec.gate_spec is None:
        return spec.gate_unrecognised or "gate not recognised"
    if spec.post_expert_norm is not None:
        return "post-expert norm runs per expert output; not fused in the native kernels yet"
    devices = ("cpu", "meta") if dry_run else ("cpu",)
    if any(t.device.type not in devices for t in spec.weight_tensors()):
        return "expert weights are not on the CPU"
    if not dry_run and any(t.is_meta for t in spec.weight_tensors()):
        return "expert weights are on the meta device"
    return None


_TENSOR_FIELDS = ("gate_up", "gate", "up", "down", "gate_up_bias", "down_bias")


class NativeExperts:
    """The experts of one block, packed once for the native kernels.

    Packing copies the weights into the kernels' layout (lossless), or quantises them (int8 /
    int4). `release` then frees the model's own copy (its parameters keep their shape and dtype,
    backed by a zero-byte placeholder) so that enabling does not double resident memory;
    `restore` rebuilds them bit-exactly: from the packed copy when it is lossless, else from an
    exact backup in the packed-expert store. While released, `state_dict()` of the block still
    returns the real weights (a state-dict hook rebuilds them), so saving a model is never
    corrupted. Quantised blocks are loaded from the store when the config's cache is on (copied
    or mapped: hi_na_moe.memory).
    """

    def __init__(self, spec: ExpertsSpec, isa: str, threads: int, weights: str = "lossless",
                 group_size: int = DEFAULT_GROUP_SIZE, store=None, name: str = "experts", qdot: str = "auto", memory: str = "map"):
        self.isa = isa
        self.packed = None  # packed by pack(), at patch time, one block at a time
        self.threads = threads
        self.spec = spec
        self.weights = weights
        self.group_size = group_size
        self.qdot = qdot  # int8/int4: integer-dot or expansion kernels (PackedExperts.forward)
        self.store = store  # a store.PackedStore, or None (no cache)
        self.name = name
        g = spec.gate_spec
        self.kwargs = dict(act=g.act, alpha=g.alpha, gate_limit=g.gate_limit, up_limit=g.up_limit,
                           post_act_limit=g.post_act_limit, up_offset=g.up_offset,
                           weight_on_input=spec.weight_on_input)
        # the same, as torch_ops.call takes them (built once: a decode step calls every block)
        self._params = (g.act, float(g.alpha), float(g.gate_limit), float(g.up_limit), float(g.post_act_limit),
                        float(g.up_offset), bool(spec.weight_on_input))
        self.handle: int | None = None
        self._pack_threads = torch.get_num_threads()
        self.expert_bytes = 0
        self.sqnr_db: float | None = None  # quantised: measured on a probe batch at pack time
        self.cache_event: str | None = None  # "built", "reused", "rebuilt (why)", or None
        self.memory = memory  # HinaConfig.memory: how a block from the store is held (hi_na_moe.memory)
        self.held: str | None = None  # from the store: "copied" or "mapped" (hi_na_moe.memory.load_block)
        self._identity: str | None = None
        self._entry = None  # the store entry the packed block is mapped from (None once copied)
        self._backup = None  # (key, name) of the exact originals in the store, for restore
        self._released: list[tuple[torch.nn.Module, str, torch.Size, tuple[int, ...]]] = []
        self._hook = self._load_hook = None  # state_dict / load_state_dict hooks while released
        # the released parameters' storage is swapped by state_dict() (briefly) and restore():
        # one at a time, or two threads would leave each other's tensors behind
        self._swap_lock = threading.RLock()
        # quality measurements: called as recorder(name, hidden, idx, w, out) after each call
        self.recorder: Callable | None = None
        # hi_na_moe.from_pretrained: the weights were never loaded; they live in the checkpoint
        # (loading.CheckpointOrigin), the packed block in the store under the checkpoint's key
        self.origin = None
        self.allow_build = True  # False: the store entry must exist (the weights are placeholders)
        self.preset_sqnr: float | None = None
        self.preset_event: str | None = None
        # why the block is stored in another format than asked for (lossless12 that did not fit)
        self.format_note: str | None = None

    @property
    def lossless(self) -> bool:
        return self.weights in LOSSLESS_FORMATS

    def _tensors(self) -> list:
        gate, up, down = self.spec.canonical()
        gb, ub, db = self.spec.canonical_biases()
        return [None if t is None else t.detach().contiguous() for t in (gate, up, down, gb, ub, db)]

    def _pack_now(self, tensors: list, weights: str):
        native, _ = native_module()
        try:
            return native.PackedExperts(*tensors, isa=self.isa, weights=weights, group_size=self.group_size,
                                        num_threads=self.threads)
        except ValueError as exc:
            if weights != "lossless12":
                raise
            # the packing's table did not cover these weights: the plain copy, bit for bit too
            self.format_note = f"stored as lossless: {exc}"
            return native.PackedExperts(*tensors, isa=self.isa, weights="lossless", num_threads=self.threads)

    def _settle_format(self) -> None:
        """After packing: the format the packed copy holds (lossless12 may have fallen back to
        lossless, when packed now or when its store entry was written)."""
        got = self.packed.weights
        if got != self.weights:
            self.format_note = self.format_note or f"stored as {got}: {self.weights} did not fit these weights"
            self.weights = got

    def _key(self, weights: str) -> str:
        from .store import entry_key, tensor_identity

        native, _ = native_module()
        if self._identity is None:
            if self.origin is not None:
                self._identity = f"checkpoint:{self.origin.identity}:{self.name}"
            else:
                self._identity = tensor_identity([t for t in self._tensors() if t is not None])
        return entry_key(self._identity, weights=weights, group_size=self.group_size if weights == "int4" else 0,
                         isa=self.isa, layout_version=int(native.PACKED_LAYOUT_VERSION))

    def _expect(self, weights: str) -> dict:
        native, _ = native_module()
        return {"layout_version": int(native.PACKED_LAYOUT_VERSION), "weights": weights, "isa": self.isa,
                "group_size": self.group_size if weights == "int4" else 0}

    def _from_store(self, weights: str, name: str, hold: bool = True):
        """The packed block for `weights`, from the store (built and written there if absent,
        stale or corrupt). hold: the block this runner runs, held as self.memory says
        (hi_na_moe.memory.load_block; self.held says how); else (an exact backup) only validated
        through the mapping. Returns (PackedExperts, the entry it is mapped from or None when
        copied, event)."""
        native, _ = native_module()
        tensors = self._tensors() if self.allow_build else None

        def build():
            if not self.allow_build:
                raise RuntimeError(
                    f"hi_na_moe: the packed experts of {self.name!r} are no longer in the store "
                    f"({self.store.root}) and this model never loaded their weights; load it again "
                    "with hi_na_moe.from_pretrained")
            pe = self._pack_now(tensors, weights)
            meta = dict(native.header_info(pe.header), header=pe.header.hex(), block=self.name,
                        **self._expect(weights))
            return meta, {"block": pe.data}

        entry, built, reason = self.store.get_or_build(self._key(weights), name, self._expect(weights), build)
        view, entry, held = load_block(native, entry, self.memory if hold else "map")
        if hold:
            self.held = held
        event = "reused" if not built else (f"rebuilt ({reason})" if reason else "built")
        return view, entry, event

    def pack(self) -> None:
        if self.origin is not None and not self.allow_build:
            self.packed, self._entry, event = self._from_store(self.weights, self.name)
            self.cache_event = self.preset_event or event
            self.sqnr_db = self.preset_sqnr
            self._settle_format()
            self.expert_bytes = self.packed.nbytes // max(1, self.spec.num_experts)
            self.handle = torch_ops.register(self.packed, owner=self, qdot=self.qdot)
            return
        if (self.lossless and self.origin is None) or self.store is None:
            self.packed = self._pack_now(self._tensors(), self.weights)
        else:
            self.packed, self._entry, self.cache_event = self._from_store(self.weights, self.name)
        self._settle_format()
        self.expert_bytes = self.packed.nbytes // max(1, self.spec.num_experts)
        # the custom op (torch.ops.hi_na_moe.experts) takes a handle, not the C++ object
        self.handle = torch_ops.register(self.packed, owner=self, qdot=self.qdot)
        if not self.lossless:
            self.sqnr_db = self.measure_sqnr()

    def measure_sqnr(self) -> float:
        """SQNR (dB) of this block's output against the original weights' output (the reference
        path) on a fixed random probe: every expert gets tokens, x ~ N(0, 1). Must run while the
        original weights are still in memory."""
        spec = self.spec
        E, K = spec.num_experts, min(4, spec.num_experts)
        T = max(4, -(-E // K))
        gen = torch.Generator().manual_seed(1234)
        x = torch.randn(T, spec.hidden, generator=gen).to(spec.weight_dtype)
        idx = torch.tensor([[(t * K + k) % E for k in range(K)] for t in range(T)], dtype=torch.int64)
        w = torch.full((T, K), 1.0 / K)
        with torch.no_grad():
            ref = reference.experts_forward(spec, x, idx, w).float()
            out = self(spec, x, idx, w).float()
        err = float((out - ref).pow(2).sum())
        sig = float(ref.pow(2).sum())
        return float("inf") if err == 0 else 10.0 * math.log10(max(sig, 1e-30) / err)

    # --- memory: hand the model's own expert storage back to the OS while packed ------------
    @staticmethod
    def _owned_params(module: torch.nn.Module, spec: ExpertsSpec):
        """Parameters of `module` that a spec tensor covers completely (a full view of them).
        A parameter only partly used by the spec (LongCat's zero-expert rows) is kept."""
        full = {(t.untyped_storage().data_ptr(), t.data_ptr(), t.numel()) for t in spec.weight_tensors()}
        for mod in module.modules():
            for name, p in mod.named_parameters(recurse=False):
                if (p.untyped_storage().data_ptr(), p.data_ptr(), p.numel()) in full:
                    yield mod, name, p

    def _unpacked(self):
        """The exact original weights: unpacked from the packed copy (lossless) or the backup."""
        if self.origin is not None and not self.allow_build:
            raise AssertionError("checkpoint-backed blocks restore by parameter name (_fill_real)")
        if self.lossless:
            source = self.packed
        else:
            key, name = self._backup
            native, _ = native_module()
            try:
                with self.store.open(key, name, expect=self._expect("lossless")) as entry:
                    # unpack copies out of the mapping, so the entry can close right after
                    source = native.PackedExperts.view(bytes.fromhex(entry.meta["header"]),
                                                       entry.array("block", "uint8"))
                    return [None if a is None else torch.from_dlpack(a) for a in source.unpack()]
            except Exception as exc:
                raise RuntimeError(
                    f"hi_na_moe: cannot restore the original expert weights of {self.name!r}: their exact "
                    f"backup in the packed-expert store is unreadable ({exc}). The block keeps running "
                    f"on its {self.weights} copy; reload the model from its checkpoint to get the originals."
                ) from exc
        return [None if a is None else torch.from_dlpack(a) for a in source.unpack()]

    def _copy_into(self, spec: ExpertsSpec, arrays) -> None:
        if spec.members is not None:  # separate modules: canonical() would be a gathered copy
            _, up, down, _, up_bias, down_bias = arrays
            spec.write_members(up, down, up_bias, down_bias)
            return
        gate, up, down = spec.canonical()
        gb, ub, db = spec.canonical_biases()
        with torch.no_grad():
            for dst, src in zip((gate, up, down, gb, ub, db), arrays):
                if dst is not None and src is not None:
                    dst.copy_(src.view(dst.shape))

    def release(self, module: torch.nn.Module, rebuild: Callable[[], ExpertsSpec]) -> int:
        """Free the model's own copy of the weights the packed copy holds; returns bytes freed.
        Quantised blocks first write an exact backup of the originals to the store (none: the
        originals stay, and 0 is returned)."""
        if self.origin is not None and not self.allow_build:
            return self._release_placeholders(module, rebuild)
        if not self.lossless:
            if self.store is None:
                return 0
            name = self.name + ".original"
            _, entry, _ = self._from_store("lossless", name, hold=False)
            entry.close()
            self._backup = (self._key("lossless"), name)
        freed = 0
        for mod, name, p in list(self._owned_params(module, self.spec)):
            self._released.append((mod, name, p.shape, p.stride()))
            freed += p.numel() * p.element_size()
            p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)
        if not self._released:
            return 0
        # the spec's views still point at the old storage: repoint them at the placeholders
        fresh = rebuild()
        for f in _TENSOR_FIELDS:
            setattr(self.spec, f, getattr(fresh, f))
        self.spec.cache["released"] = True
        self._register_state_dict_hook(module, rebuild)
        return freed

    def _register_state_dict_hook(self, module: torch.nn.Module, rebuild) -> None:
        """While released, `state_dict()` still returns the real weights."""

        def fill_state_dict(mod, state_dict, prefix, local_metadata):
            # rebuild real tensors in the model's own layout: swap them in for the placeholders
            # just long enough to copy through the spec's views
            with self._swap_lock:
                real = self._swap_in_real()
                try:
                    self._fill_real(rebuild, real)
                finally:
                    for (m2, n2), (placeholder, _) in real.items():
                        getattr(m2, n2).data = placeholder
            names = {(id(sub), pn): (sub_name + "." if sub_name else "") + pn
                     for sub_name, sub in module.named_modules() for pn, _ in sub.named_parameters(recurse=False)}
            for (m2, n2), (_, tensor) in real.items():
                key = prefix + names[(id(m2), n2)]
                if key in state_dict:
                    state_dict[key] = tensor

        from .loading import refuse_loading

        self._hook = module.register_state_dict_post_hook(fill_state_dict)
        self._load_hook = refuse_loading(module, self.name)

    def _fill_real(self, rebuild, real: dict) -> None:
        """Write the exact original weights into the fresh storage `real` (from _swap_in_real)."""
        if self.origin is not None and not self.allow_build:
            from .loading import load_originals

            names = {self._full_names[key]: key for key in real}
            got = load_originals(self.origin, set(names))
            with torch.no_grad():
                for full, key in names.items():
                    real[key][1].copy_(got[full])
            return
        self._copy_into(rebuild(), self._unpacked())

    def _release_placeholders(self, module: torch.nn.Module, rebuild) -> int:
        """from_pretrained: the parameters already are placeholders (never loaded). Record them
        (and their full names, to read them back from the checkpoint) as released."""
        names = {id(sub): sub_name for sub_name, sub in module.named_modules()}
        self._full_names = {}
        for mod, name, p in list(self._owned_params(module, self.spec)):
            # a loaded parameter would be contiguous (the placeholder's own strides are 0)
            stride = tuple(torch.empty(p.shape, device="meta").stride())
            self._released.append((mod, name, p.shape, stride))
            # full names in the root model: the block's own path, then the path inside the block
            path = ".".join(x for x in (self.name, names.get(id(mod), ""), name) if x)
            self._full_names[(mod, name)] = path
        self.spec.cache["released"] = True
        self._register_state_dict_hook(module, rebuild)
        return 0

    def _swap_in_real(self) -> dict:
        """Give each released parameter fresh real storage; returns {(module, name): (old data, new)}."""
        swapped = {}
        for mod, name, shape, stride in self._released:
            p = getattr(mod, name)
            new = torch.empty_strided(shape, stride, dtype=p.dtype)
            swapped[(mod, name)] = (p.data, new)
            p.data = new
        return swapped

    def restore(self, rebuild: Callable[[], ExpertsSpec]) -> None:
        """Give the model its own weights back, bit-identical to before `release`, and free the
        packed copy (this runner is done)."""
        with self._swap_lock:
            if self._released:
                real = self._swap_in_real()
                try:
                    self._fill_real(rebuild, real)
                except BaseException:
                    for (m2, n2), (placeholder, _) in real.items():
                        getattr(m2, n2).data = placeholder  # still released: the model stays usable
                    raise
                fresh = rebuild()
                for f in _TENSOR_FIELDS:
                    setattr(self.spec, f, getattr(fresh, f))
                self.spec.cache.pop("released", None)
                self._released = []
        if self._hook is not None:
            # only now: had the weights not come back, state_dict() must still see the real ones
            self._hook.remove()
            self._load_hook.remove()
            self._hook = self._load_hook = None
        if self._entry is not None:
            self._entry.close()  # the mapping lives on while the view's buffer is referenced
            self._entry = None
        if self.handle is not None:
            torch_ops.release(self.handle)
            self.handle = None
        self.packed = None  # freed before the next block unpacks: peak memory stays one block

    @property
    def last_kernel(self) -> str | None:
        """The kernel the last call ran (decode or prefill), for reports."""
        return torch_ops.last_kernel(self.handle) if self.handle is not None else None

    def fast(self, hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        """``self(self.spec, hidden, idx, w)`` with the least Python on the way (its own checks,
        then torch_ops.call_bound, shared with the op's direct path), for what a transformers
        MoE block passes in inference: plain CPU tensors, contiguous, hidden [T, H] in the experts' dtype
        and not requiring grad, int32/int64 indices [T, K], fp32/bf16/fp16 weights [T, K];
        nothing observing the call (no dispatch or function mode), no identity experts, no
        recorder, and the block already run once (its BoundForward made). None for anything
        else: the caller then runs __call__, which handles every other case or raises the error
        naming the argument. The same kernel on the same inputs: the same bits.

        Why: with the caches a decode step leaves, each Python frame and torch op on the way to
        the kernel costs several times its hot time (benchmarks/bench_call_overhead.py)."""
        bound = self._bound()
        if (bound is None or type(hidden) is not torch.Tensor or type(idx) is not torch.Tensor
                or type(w) is not torch.Tensor or hidden.requires_grad or w.requires_grad or hidden.is_neg()
                or w.is_neg() or torch_ops._len_dispatch_modes() or torch_ops._function_mode_on()):
            return None
        threads = self._threads(hidden.shape[0] * idx.shape[1]) if hidden.dim() == 2 and idx.dim() == 2 else (
            self.threads or torch.get_num_threads())
        # shapes, dtypes, device and layout: checked there (None when the kernels cannot read them as they are)
        return torch_ops.call_bound(self.handle, bound, hidden, idx, w, threads)

    def _bound(self) -> tuple | None:
        """The experts' current torch_ops._bind entry, or None when a call must take __call__ (not
        run yet with these parameters, a recorder, identity experts)."""
        bound = torch_ops._BOUND.get(self.handle)
        if bound is None or bound[0] != self._params or self.recorder is not None or self.spec.n_identity:
            return None
        return bound

    def _threads(self, slots: int) -> int:
        """Threads for a call routing `slots` (rows x top-k) rows: one when the experts it can
        touch weigh less than SMALL_CALL_BYTES."""
        threads = self.threads or torch.get_num_threads()
        if threads > 1 and min(slots, self.spec.num_experts) * self.expert_bytes < SMALL_CALL_BYTES:
            threads = 1
        return threads

    def bound_for(self, dtype: torch.dtype, hidden: int, slots: int) -> tuple | None:
        """(BoundForward, threads) for a call that fast() would run on the kernel, made by native
        code that passes contiguous [rows, hidden] rows of `dtype`, int64 indices and weights
        itself (hi_na_moe.layers), or None. After the call the caller records the kernel's
        name (torch_ops._LAST_KERNEL)."""
        bound = self._bound()
        if bound is None or bound[1] is None or bound[2] is not dtype or bound[3] != hidden:
            return None
        return bound[1], self._threads(slots)

    def __call__(self, spec: ExpertsSpec, hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        check_routing(spec, hidden, idx, w)
        # detached: the kernels have no backward (training runs the reference path, see patching)
        dtype = spec.weight_dtype
        x = hidden if hidden.dtype is dtype else hidden.to(dtype)
        if x.requires_grad:
            x = x.detach()
        wf = w.detach() if w.requires_grad else w
        identity = None
        if spec.n_identity:
            is_id = idx >= spec.num_experts
            if bool(is_id.any()):
                n_total = spec.num_experts + spec.n_identity
                if bool((idx >= n_total).any()):  # not an identity expert: out of range
                    raise index_range_error(int(idx.max()), n_total)
                identity = (wf.float() * is_id).sum(-1, keepdim=True) * hidden.detach().float()
                idx = torch.where(is_id, torch.full_like(idx, -1), idx)
        # under torch.compile, get_num_threads() would break the graph: use the value at pack time
        threads = self.threads or (self._pack_threads if torch.compiler.is_compiling() else torch.get_num_threads())
        if threads > 1 and min(x.shape[0] * idx.shape[-1], spec.num_experts) * self.expert_bytes < SMALL_CALL_BYTES:
            threads = 1
        out = torch_ops.call(self.handle, x, idx, wf, self._params, threads)
        if identity is not None:
            out = (out.float() + identity).to(dtype)
        out = out if out.dtype == hidden.dtype else out.to(hidden.dtype)
        if self.recorder is not None:
            self.recorder(self.name, hidden, idx, w, out)
        return out


def choose(spec: ExpertsSpec, config: HinaConfig, dry_run: bool = False, name: str = "experts") -> Choice:
    """What runs `spec` under `config`. Raises ValueError when config.backend == "native" and no
    native kernel can run it. Nothing is packed here (NativeExperts.pack does that); choosing a
    native runner (not in a dry run) applies `config.pool` to the process-wide thread pool
    (HinaConfig.kernel_pool)."""
    if config.backend == "reference":
        return Choice(reference.experts_forward, "reference", "backend='reference' requested")
    why_not = native_unsupported_reason(spec, dry_run)
    if why_not is None:
        isa = _isa_name(config)
        weights, note = config.weights, None
        if weights == "lossless12" and spec.weight_dtype is not torch.bfloat16:
            weights = "lossless"
            note = f"stored as lossless: lossless12 packs bfloat16 weights, these are {spec.weight_dtype}"
        names = _kernel_names(isa, spec.weight_dtype, weights, config.qdot)
        store = None
        if weights not in LOSSLESS_FORMATS and config.cache and not dry_run:
            from .store import PackedStore

            store = PackedStore(config.store_root())
        runner = NativeExperts(spec, isa, config.threads, weights, config.group_size, store, name,
                               qdot=config.qdot, memory=config.memory)
        runner.format_note = note
        if not dry_run:
            native_module()[0].set_pool_backend(config.kernel_pool())
        return Choice(runner, kernel_label(isa, spec.weight_dtype, weights, config.qdot))
    if config.backend == "native":
        raise ValueError(f"backend='native' but this block cannot run natively: {why_not}")
    return Choice(reference.experts_forward, "reference", why_not)
