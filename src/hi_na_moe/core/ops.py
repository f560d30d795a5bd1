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
from .checkpoint import load_originals, refuse_loading
from .config import DEFAULT_GROUP_SIZE, HinaConfig
from .formats import LOSSLESS_FORMATS, Format, decide_format
from . import tier as tier_mod
from .memory import load_block
from .native import native_kernels_available, native_module
from .spec import ExpertsSpec, Runner, check_routing, index_range_error
from .store import PackedStore, entry_key, tensor_identity

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
    if weights == Format.LOSSLESS:
        return str(dtype).replace("torch.", "")
    if weights == Format.LOSSLESS12:
        return str(dtype).replace("torch.", "") + "-lossless12"
    return "int4-g%d" % group_size if weights == Format.INT4 else weights


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

# --- released parameters: any read of their values is an error --------------------------------
# A released parameter keeps its object (modules, tied references and optimisers hold it) and its
# shape and dtype, but its values are gone: its class is switched to a subclass whose
# __torch_function__ lets through what says nothing of the values and raises on everything else.
# So code that reads it while the block runs on its packed copy (a forward that began before
# enable_for_model on another thread, `model.half()`, a pickle) gets an error naming it, never
# the placeholder's zeros.

# what reads no values: the result is returned as it is (so are the is_*() queries but is_nonzero)
_RELEASED_META = frozenset({
    "shape", "dtype", "device", "layout", "ndim", "requires_grad", "requires_grad_", "is_leaf", "grad", "grad_fn",
    "names", "itemsize", "nbytes", "size", "dim", "stride", "numel", "nelement", "element_size", "data_ptr",
    "storage_offset", "untyped_storage", "is_contiguous", "is_floating_point", "is_complex", "is_signed",
    "get_device", "__hash__", "__len__", "_has_compatible_shallow_copy_type", "retain_grad", "register_hook",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_sparse_csr", "is_quantized", "is_mkldnn", "is_nested",
    "is_xpu", "is_mps", "is_xla", "is_ipu", "is_mtia", "is_vulkan", "is_maia", "_is_view", "is_inference",
})
# views: computed on a meta-device twin (no storage is touched), returned as released tensors
_RELEASED_VIEWS = frozenset({
    "data", "detach", "view", "view_as", "reshape", "flatten", "unflatten", "transpose", "t", "T", "mT",
    "permute", "movedim", "narrow", "select", "unsqueeze", "squeeze", "expand", "expand_as", "as_strided",
    "chunk", "split", "unbind", "__getitem__",
})
_RELEASED_ATTR = "_hi_na_moe_released"  # the released tensor's name, for the error
_RELEASED_CLASSES: dict[type, type] = {}


def _released_name(args) -> str:
    for a in args:
        if isinstance(a, (tuple, list)):
            name = _released_name(a)
            if name:
                return name
        elif isinstance(a, torch.Tensor) and _RELEASED_ATTR in getattr(a, "__dict__", {}):
            return a.__dict__[_RELEASED_ATTR]
    return ""


def _meta_twin(t):
    """A released tensor's layout on the meta device (other arguments as they are)."""
    if not (isinstance(t, torch.Tensor) and _RELEASED_ATTR in getattr(t, "__dict__", {})):
        return t
    with torch._C.DisableTorchFunctionSubclass():
        shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
        span = offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else offset
        return torch.empty(span, dtype=t.dtype, device="meta").as_strided(shape, stride, offset)


def _meta_layout(t):
    """A released tensor as a meta-device tensor of its layout, dtype and requires_grad (anything
    else as it is)."""
    if not is_released(t):
        return t
    with torch._C.DisableTorchFunctionSubclass():
        twin = _meta_twin(t)
        return twin.requires_grad_(t.requires_grad) if t.is_floating_point() else twin


def _from_twin(out, name: str):
    """A view op's meta-device result as released tensors (no storage) named `name`."""
    if isinstance(out, (tuple, list)):
        return type(out)(_from_twin(x, name) for x in out)
    if isinstance(out, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            out = _hollow(tuple(out.shape), out.stride(), out.storage_offset(), out.dtype).as_subclass(
                _released_class(torch.Tensor))
        out.__dict__[_RELEASED_ATTR] = name
    return out


def _unchanged_by(what: str, t: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether conversion `what` (t.to(...), t.cpu(), t.float(), t.contiguous(), ...) returns t
    itself (as `model.to("cpu")` on a CPU model does), judged from the arguments alone."""
    with torch._C.DisableTorchFunctionSubclass():
        if what == "to":
            try:
                device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a tensor argument (t.to(other)): judged by its device and dtype
                other = next((a for a in args if isinstance(a, torch.Tensor)), None)
                device, dtype, memory_format = getattr(other, "device", None), getattr(other, "dtype", None), None
            return ((device is None or torch.device(device) == t.device) and (dtype is None or dtype == t.dtype)
                    and not kwargs.get("copy", False) and memory_format in (None, torch.preserve_format))
        if what == "cpu":
            return t.device.type == "cpu"
        if what == "contiguous":
            return t.is_contiguous(memory_format=kwargs.get("memory_format", args[0] if args else torch.contiguous_format))
        dtypes = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}
        if what in dtypes:
            return t.dtype == dtypes[what]
        if what == "type_as":
            return bool(args) and getattr(args[0], "dtype", None) == t.dtype
    return False


def _released_torch_function(cls, func, types, args=(), kwargs=None):
    """A released tensor's __torch_function__: metadata as it is, views as released tensors, and
    an error for anything that would read its values (it has none: its storage holds zero bytes)."""
    kwargs = kwargs or {}
    what = getattr(func, "__name__", "")
    if what in ("__get__", "__set__"):  # a property: named by its descriptor
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        if what == "__set__" and attr in ("requires_grad", "grad"):
            what = "shape"  # as harmless as reading it
        elif what == "__set__" and attr == "data" and len(args) == 2 and args[1] is args[0]:
            return None  # Module._apply's `param.data = fn(param)` where fn changed nothing
        elif what == "__get__":
            what = attr
        else:
            what = attr + " ="
    name = _released_name([*args, *kwargs.values()]) or "an expert weight"
    if what in _RELEASED_META or (what.startswith(("is_", "_is_")) and what != "is_nonzero"):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if what == "__repr__":
        with torch._C.DisableTorchFunctionSubclass():
            return f"<{name}: released by hi_na_moe while enabled; shape={tuple(args[0].shape)}, dtype={args[0].dtype}>"
    if what in _RELEASED_VIEWS:
        try:
            out = func(*[_meta_twin(a) for a in args], **{k: _meta_twin(v) for k, v in kwargs.items()})
        except Exception:  # noqa: BLE001 - not a view of the released tensor alone (e.g. indexed by a CPU tensor)
            out = None
        if out is not None:
            return _from_twin(out, name)
    elif args and isinstance(args[0], torch.Tensor) and _unchanged_by(what, args[0], args[1:], kwargs):
        return args[0]
    raise RuntimeError(
        f"hi_na_moe: {name!r} is released while hi_na_moe runs its block on a packed copy, so `{what or func}` cannot "
        "read it. If a forward that began before enable_for_model on another thread reads it, enable between "
        "forwards (or with keep_weights=True); otherwise call hi_na_moe.disable_for_model(model) first, which gives "
        "the weights back bit for bit")


def _released_class(cls: type) -> type:
    """The released counterpart of tensor class `cls` (a subclass with the same layout, so that
    a parameter's __class__ can be switched to it and back)."""
    sub = _RELEASED_CLASSES.get(cls)
    if sub is None:
        sub = type(f"Released{cls.__name__}", (cls,), {
            "__torch_function__": classmethod(_released_torch_function), "__module__": __name__,
            "__doc__": "A tensor released by hi_na_moe while enabled: its values cannot be read (ops._released_torch_function)"})
        _RELEASED_CLASSES[cls] = sub
    return sub


def is_released(t: torch.Tensor) -> bool:
    """Whether `t` is a parameter (or a view of one) released by hi_na_moe while enabled."""
    return _RELEASED_ATTR in getattr(t, "__dict__", {})


def _storage_key(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage().data_ptr()


def storage_holders(root: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str, str]]]:
    """Per storage (its data pointer), every (module, attribute name, dotted name) of a parameter
    or buffer of `root` held in it: whether a block's expert weights are anyone else's too."""
    out: dict[int, list] = {}
    for prefix, mod in root.named_modules(remove_duplicate=False):
        for name, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if isinstance(t, torch.Tensor):
                with torch._C.DisableTorchFunctionSubclass():
                    if t.untyped_storage().nbytes() == 0:
                        continue
                out.setdefault(_storage_key(t), []).append((mod, name, f"{prefix}.{name}" if prefix else name))
    return out


def _storage_like(nbytes: int, align: int) -> torch.UntypedStorage:
    """New storage of `nbytes` whose data pointer is `align` modulo 64, as the original's was: a
    parameter loaded from a safetensors file sits at the file's offsets, and PyTorch's CPU
    kernels (MKL's GEMMs among them) may round otherwise on memory aligned otherwise."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0 or t.data_ptr() % 64 == align:
        return t.untyped_storage()
    buf = bytearray(nbytes + 64)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=(align - base) % 64).untyped_storage()


def _hollow(shape: tuple, stride: tuple, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor with this layout over zero bytes of storage: what a released parameter holds. It
    has no values to read, and PyTorch refuses to make a view of it (its bounds check), so even a
    kernel that got past _released_torch_function cannot compute on it unawares."""
    span = offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
    storage = torch.UntypedStorage(span * torch.empty((), dtype=dtype).element_size())
    t = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
    storage.resize_(0)
    return t


@dataclass
class _Released:
    """One released parameter: the object itself, where the model holds it, its class and its
    layout in its original storage (storage `group` of the runner's `_groups`)."""

    param: torch.nn.Parameter
    module: torch.nn.Module
    name: str
    cls: type
    dtype: torch.dtype
    group: int
    shape: tuple
    stride: tuple
    offset: int


class NativeExperts:
    """The experts of one block, packed once for the native kernels.

    Packing copies the weights into the kernels' layout (lossless), or quantises them (int8 /
    int4). `release` then frees the model's own copy (its parameters keep their shape and dtype,
    backed by a zero-byte placeholder) so that enabling does not double resident memory;
    `restore` rebuilds them bit-exactly: from the packed copy when it is lossless, else from an
    exact backup in the packed-expert store. While released, `state_dict()` of the block still
    returns the real weights (a state-dict hook rebuilds them), so saving a model is never
    corrupted. Quantised blocks are loaded from the store when the config's cache is on (copied
    or mapped: hi_na_moe.core.memory).
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
        self.memory = memory  # HinaConfig.memory: how a block from the store is held (hi_na_moe.core.memory)
        self.held: str | None = None  # from the store: "copied" or "mapped" (hi_na_moe.core.memory.load_block)
        self._identity: str | None = None
        self._entry = None  # the store entry the packed block is mapped from (None once copied)
        self._backup = None  # (key, name) of the exact originals in the store, for restore
        self._released: list[_Released] = []  # released parameters, in order
        self._groups: list[tuple[int, int]] = []  # their original storages: (bytes, data pointer % 64)
        self._views: dict = {}  # spec slot -> (group, shape, stride, offset) of its tensor
        self._full_names: dict[int, str] = {}  # from_pretrained: released index -> name in the checkpoint
        self.kept_note: str | None = None  # why release kept the weights (tied to another part of the model)
        self._grave: list[torch.Tensor] = []  # the released originals' data, until bury()
        self._hook = self._load_hook = None  # state_dict / load_state_dict hooks while released
        # the released parameters' storage is swapped by state_dict() (briefly) and restore():
        # one at a time, or two threads would leave each other's tensors behind
        self._swap_lock = threading.RLock()
        # quality measurements: called as recorder(name, hidden, idx, w, out) after each call
        self.recorder: Callable | None = None
        # hi_na_moe.from_pretrained: the weights were never loaded; they live in the checkpoint
        # (checkpoint.CheckpointOrigin), the packed block in the store under the checkpoint's key
        self.origin = None
        self.allow_build = True  # False: the store entry must exist (the weights are placeholders)
        self.preset_sqnr: float | None = None
        self.preset_event: str | None = None
        # why the block is stored in another format than asked for (lossless12 that did not fit)
        self.format_note: str | None = None
        # the memory tier (hi_na_moe.core.tier): set before pack() when the packed experts exceed
        # memory_limit; the block's experts then live there (self.held == "tiered")
        self.tier = None
        self.tier_layer: int | None = None
        # fewer experts a token (hi_na_moe.core.trim.Trim, HinaConfig.top_k): set before pack(); the
        # native op applies it to every call once packed (blocks with identity experts: __call__)
        self.trim = None

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
            if weights != Format.LOSSLESS12:
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
        native, _ = native_module()
        if self._identity is None:
            if self.origin is not None:
                self._identity = f"checkpoint:{self.origin.identity}:{self.name}"
            else:
                self._identity = tensor_identity([t for t in self._tensors() if t is not None])
        return entry_key(self._identity, weights=weights, group_size=self.group_size if weights == Format.INT4 else 0,
                         isa=self.isa, layout_version=int(native.PACKED_LAYOUT_VERSION))

    def _expect(self, weights: str) -> dict:
        native, _ = native_module()
        return {"layout_version": int(native.PACKED_LAYOUT_VERSION), "weights": weights, "isa": self.isa,
                "group_size": self.group_size if weights == Format.INT4 else 0}

    def _from_store(self, weights: str, name: str, hold: bool = True):
        """The packed block for `weights`, from the store (built and written there if absent,
        stale or corrupt). hold: the block this runner runs, held as self.memory says
        (hi_na_moe.core.memory.load_block; self.held says how); else (an exact backup) only validated
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
            info = native.header_info(pe.header)
            meta = dict(info, header=pe.header.hex(), block=self.name, **self._expect(weights))
            if weights == self.weights and hold:  # the memory tier checks each expert read against these
                meta["tier_crc32c"] = tier_mod.expert_crcs(native, pe.data, info)
            return meta, {"block": pe.data}

        entry, built, reason = self.store.get_or_build(self._key(weights), name, self._expect(weights), build)
        if hold and self.tier is not None:
            view, self.tier_layer = tier_mod.load_tiered(native, entry, self.tier)
            self.held = "tiered"
            event = "reused" if not built else (f"rebuilt ({reason})" if reason else "built")
            return view, None, event
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
            self._apply_trim()
            return
        if self.tier is not None and self.store is None:
            raise ValueError("hi_na_moe: memory_limit keeps experts in the packed-expert store: cache must be on")
        if ((self.lossless and self.origin is None) or self.store is None) and self.tier is None:
            self.packed = self._pack_now(self._tensors(), self.weights)
        else:
            self.packed, self._entry, self.cache_event = self._from_store(self.weights, self.name)
        self._settle_format()
        self.expert_bytes = self.packed.nbytes // max(1, self.spec.num_experts)
        # the custom op (torch.ops.hi_na_moe.experts) takes a handle, not the C++ object
        self.handle = torch_ops.register(self.packed, owner=self, qdot=self.qdot)
        if not self.lossless:
            self.sqnr_db = self.measure_sqnr()
        self._apply_trim()

    def _apply_trim(self) -> None:
        """Set self.trim on the packed block (after the SQNR probe, which compares full routing) and
        start its routing counts from zero."""
        if self.trim is not None and not self.spec.n_identity:
            self.packed.set_trim(*self.trim.native_args())
        self.packed.routing_counts(reset=True)

    def routing_counts(self) -> tuple[int, int]:
        """(tokens, expert slots) this block's kernels have run since it was packed: slots / tokens
        is the experts a token used (after the trim). (0, 0) before pack()."""
        return self.packed.routing_counts() if self.packed is not None else (0, 0)

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
    def _owned_params(module: torch.nn.Module, spec: ExpertsSpec) -> list:
        """[(module, name, parameter)] of the parameters of `module` that a spec tensor covers
        completely (a full view of them), each parameter once. A parameter only partly used by
        the spec (LongCat's zero-expert rows) is kept."""
        out, seen = [], set()
        with torch._C.DisableTorchFunctionSubclass():
            full = {(t.untyped_storage().data_ptr(), t.data_ptr(), t.numel())
                    for t in spec.weight_tensors() if not t.is_meta}
            for mod in module.modules():
                for name, p in mod.named_parameters(recurse=False):
                    if id(p) not in seen and (p.untyped_storage().data_ptr(), p.data_ptr(), p.numel()) in full:
                        seen.add(id(p))
                        out.append((mod, name, p))
        return out

    @staticmethod
    def _spec_slots(spec: ExpertsSpec):
        """(slot, tensor) of every tensor the spec reads: its fields, and its members when the
        experts are separate modules."""
        for f in _TENSOR_FIELDS:
            t = getattr(spec, f)
            if t is not None:
                yield f, t
        for name, ts in (getattr(spec, "members", None) or {}).items():
            for i, t in enumerate(ts):
                yield ("members", name, i), t

    def _unpacked(self):
        """The exact original weights: unpacked from the packed copy (lossless) or the backup."""
        if self.origin is not None and not self.allow_build:
            raise AssertionError("checkpoint-backed blocks restore by parameter name (_fill_real)")
        if self.lossless and self.held != "tiered":
            source = self.packed
        else:
            key, name = (self._key(self.weights), self.name) if self.lossless else self._backup
            native, _ = native_module()
            try:
                with self.store.open(key, name, expect=self._expect(self.weights if self.lossless else "lossless")) as entry:
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

    def release(self, module: torch.nn.Module, rebuild: Callable[[], ExpertsSpec], holders: dict | None = None) -> int:
        """Free the model's own copy of the weights the packed copy holds; returns bytes freed.
        Quantised blocks first write an exact backup of the originals to the store (none: the
        originals stay, and 0 is returned). `holders` (storage_holders of the whole model): a
        block whose weights some other part of the model holds too (tied weights) keeps them,
        and `kept_note` says why (0 is returned).

        From here on a read of a released parameter is an error (_released_torch_function): it
        is marked released before its values are replaced by the placeholder."""
        if self.origin is not None and not self.allow_build:
            return self._release_placeholders(module, rebuild)
        owned = self._owned_params(module, self.spec)
        self.kept_note = self._why_kept(module, owned, holders)
        if self.kept_note is not None or not owned:
            return 0
        if not self.lossless:
            if self.store is None:
                return 0
            name = self.name + ".original"
            _, entry, _ = self._from_store("lossless", name, hold=False)
            entry.close()
            self._backup = (self._key("lossless"), name)
        groups: dict[int, int] = {}
        with torch._C.DisableTorchFunctionSubclass():
            for mod, name, p in owned:
                st = p.untyped_storage()
                if st.data_ptr() not in groups:
                    groups[st.data_ptr()] = len(self._groups)
                    self._groups.append((st.nbytes(), st.data_ptr() % 64))
                self._released.append(_Released(p, mod, name, type(p), p.dtype, groups[st.data_ptr()],
                                                tuple(p.shape), p.stride(), p.storage_offset()))
            # where the spec's tensors are in those storages, to fill fresh copies through them
            self._views = {slot: (groups[t.untyped_storage().data_ptr()], tuple(t.shape), t.stride(),
                                  t.storage_offset())
                           for slot, t in self._spec_slots(self.spec)
                           if not t.is_meta and t.untyped_storage().data_ptr() in groups}
        paths = {id(sub): sub_name for sub_name, sub in module.named_modules()}
        for r in self._released:
            path = ".".join(x for x in (self.name, paths.get(id(r.module), ""), r.name) if x)
            r.param.__class__ = _released_class(r.cls)
            r.param.__dict__[_RELEASED_ATTR] = path
        # its values go, its sizes and strides stay: a PyTorch kernel that was already reading it
        # on another thread when it was marked (a forward begun before enable) never sees its
        # metadata torn, and keeps reading the original storage, which lives on in _grave until
        # bury() (after the next block is packed)
        with torch._C.DisableTorchFunctionSubclass():
            for r in self._released:
                self._grave.append(r.param.data)
                r.param.data = _hollow(r.shape, r.stride, r.offset, r.dtype)
        # the spec's views still point at the old storage: repoint them, at meta-device twins of
        # the released ones (their shape, strides, dtype and requires_grad: what the runner and
        # torch.compile's tracing read of them; no values, and not the released tensors, whose
        # every access would go through _released_torch_function)
        fresh = rebuild()
        for f in _TENSOR_FIELDS:
            setattr(self.spec, f, _meta_layout(getattr(fresh, f)))
        if getattr(fresh, "members", None) is not None:
            self.spec.members = {k: tuple(_meta_layout(t) for t in ts) for k, ts in fresh.members.items()}
        self.spec.cache["released"] = True
        self._register_state_dict_hook(module, rebuild)
        return sum(nbytes for nbytes, _ in self._groups)

    def bury(self) -> None:
        """Free the storage release took from the parameters (kept a little longer for kernels
        already reading it: enable calls this once the next block is packed, or at its end)."""
        self._grave = []

    def _why_kept(self, module: torch.nn.Module, owned: list, holders: dict | None) -> str | None:
        """Why the block's weights cannot be released (None: they can). Released weights come back
        into storage of their own, laid out as before: that is the original layout only when
        nothing but these parameters was in it. A tensor elsewhere in the model in the same
        storage (another block's tied experts, as DiffusionGemma's encoder and decoder share
        theirs) would read the placeholder, or stop sharing after restore."""
        mine = {(id(mod), name) for mod, name, _ in owned}
        with torch._C.DisableTorchFunctionSubclass():
            sizes: dict[int, list] = {}
            for mod, name, p in owned:
                if is_released(p):
                    return f"expert weight {name!r} is already released by another enabled block: kept in memory"
                st = p.untyped_storage()
                sizes.setdefault(st.data_ptr(), [st.nbytes(), 0])[1] += p.numel() * p.element_size()
                for m2, n2, full in (holders or {}).get(st.data_ptr(), ()):
                    if (id(m2), n2) not in mine:
                        return (f"expert weights shared with {full!r} (tied weights): kept in memory while "
                                "enabled, not released")
        for nbytes, used in sizes.values():
            if nbytes > used:
                return (f"expert weights are views into a larger tensor ({nbytes} bytes of storage for {used} "
                        "bytes of weights): kept in memory while enabled, not released")
        return None

    def _register_state_dict_hook(self, module: torch.nn.Module, rebuild) -> None:
        """While released, `state_dict()` still returns the real weights: fresh copies, never
        attached to the model (whose parameters stay released throughout)."""

        def fill_state_dict(mod, state_dict, prefix, local_metadata):
            with self._swap_lock:
                if not self._released:
                    return
                tensors = {id(r.param): t for r, t in zip(self._released, self._fresh())}
            for sub_name, sub in module.named_modules(remove_duplicate=False):
                for pn, p in sub._parameters.items():
                    key = prefix + (sub_name + "." if sub_name else "") + pn
                    if id(p) in tensors and key in state_dict:
                        state_dict[key] = tensors[id(p)]


        self._hook = module.register_state_dict_post_hook(fill_state_dict)
        self._load_hook = refuse_loading(module, self.name)

    def _fresh(self) -> list[torch.Tensor]:
        """New tensors holding the exact original values of the released parameters (in their
        order), laid out as the originals were: shapes, strides, storage offsets, which of them
        shared a storage, each storage's size and its alignment modulo 64. Not attached to the
        model."""
        storages = [_storage_like(nbytes, align) for nbytes, align in self._groups]

        def over(group, shape, stride, offset, dtype):
            return torch.empty(0, dtype=dtype).set_(storages[group], offset, shape, stride)

        tensors = [over(r.group, r.shape, r.stride, r.offset, r.dtype) for r in self._released]
        if self.origin is not None and not self.allow_build:
            got = load_originals(self.origin, set(self._full_names.values()))
            with torch.no_grad():
                for i, t in enumerate(tensors):
                    t.copy_(got[self._full_names[i]])
            return tensors
        # the spec again, over the fresh storages (a tensor of it not released: written to a scratch copy)
        changes: dict = {}
        with torch._C.DisableTorchFunctionSubclass():
            for slot, t in self._spec_slots(self.spec):
                view = self._views.get(slot)
                if view is None and t.is_meta:
                    continue  # a stacked field of separate experts' members: shape only
                new = over(*view, t.dtype) if view is not None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                if isinstance(slot, tuple):
                    members = changes.setdefault("members", {k: list(v) for k, v in self.spec.members.items()})
                    members[slot[1]][slot[2]] = new
                else:
                    changes[slot] = new
        if "members" in changes:
            changes["members"] = {k: tuple(v) for k, v in changes["members"].items()}
        self._copy_into(self.spec.with_(**changes), self._unpacked())
        return tensors

    def _release_placeholders(self, module: torch.nn.Module, rebuild) -> int:
        """from_pretrained: the parameters already are placeholders (never loaded). Record them
        (and their full names, to read them back from the checkpoint) as released, and mark them
        so that reading one is an error."""
        names = {id(sub): sub_name for sub_name, sub in module.named_modules()}
        self._full_names = {}
        for mod, name, p in self._owned_params(module, self.spec):
            # a loaded parameter would be contiguous (the placeholder's own strides are 0), in
            # storage of its own from PyTorch's allocator
            stride = tuple(torch.empty(p.shape, device="meta").stride())
            self._groups.append((p.numel() * p.element_size(), torch.empty(1).data_ptr() % 64))
            # full names in the root model: the block's own path, then the path inside the block
            path = ".".join(x for x in (self.name, names.get(id(mod), ""), name) if x)
            self._full_names[len(self._released)] = path
            self._released.append(_Released(p, mod, name, type(p), p.dtype, len(self._groups) - 1,
                                            tuple(p.shape), stride, 0))
            p.__class__ = _released_class(type(p))
            p.__dict__[_RELEASED_ATTR] = path
        self.spec.cache["released"] = True
        self._register_state_dict_hook(module, rebuild)
        return 0

    def restore(self, rebuild: Callable[[], ExpertsSpec]) -> None:
        """Give the model its own weights back, bit-identical to before `release` and laid out as
        they were, and free the packed copy (this runner is done). The values are complete before
        any parameter gets them; a parameter is marked released until its data is whole, so a
        read meanwhile (a forward that began before enable, on another thread) is an error,
        never a half-restored tensor."""
        with self._swap_lock:
            if self._released:
                tensors = self._fresh()  # an error here leaves the block released and working
                for r, t in zip(self._released, tensors):
                    with torch._C.DisableTorchFunctionSubclass():
                        r.param.data = t
                    r.param.__class__ = r.cls
                    r.param.__dict__.pop(_RELEASED_ATTR, None)
                fresh = rebuild()
                for f in _TENSOR_FIELDS:
                    setattr(self.spec, f, getattr(fresh, f))
                if getattr(fresh, "members", None) is not None:
                    self.spec.members = fresh.members
                self.spec.cache.pop("released", None)
                self._released, self._groups, self._views = [], [], {}
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
        the kernel costs several times its hot time (benchmarks/studies/bench_call_overhead.py)."""
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
        itself (hi_na_moe.fastpath.layers), or None. After the call the caller records the kernel's
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
        if spec.n_identity and self.trim is not None:  # identity experts count as chosen: trimmed here
            idx, wf = reference.trim_routing(idx, wf, self.trim)
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


def apply_pool(config: HinaConfig) -> None:
    """Point the native kernels' process-wide thread pool at `config.pool` (HinaConfig.kernel_pool);
    enable_for_model and the ExpertsInterface path call it once they run a block natively."""
    native_module()[0].set_pool_backend(config.kernel_pool())


def choose(spec: ExpertsSpec, config: HinaConfig, dry_run: bool = False, name: str = "experts") -> Choice:
    """What runs `spec` under `config`. Raises ValueError when config.backend == "native" and no
    native kernel can run it. Nothing is packed here (NativeExperts.pack does that), and nothing
    process-wide is set (enable_for_model applies config.pool to the native thread pool).
    The format: decide_format."""
    if config.backend == "reference":
        return Choice(reference.experts_forward, "reference", "backend='reference' requested")
    why_not = native_unsupported_reason(spec, dry_run)
    if why_not is None:
        isa = _isa_name(config)
        decision = decide_format(config.weights, spec.weight_dtype)
        weights, note = decision.format, decision.why
        names = _kernel_names(isa, spec.weight_dtype, weights, config.qdot)
        store = None
        if weights not in LOSSLESS_FORMATS and config.cache and not dry_run:
            store = PackedStore(config.store_root())
        runner = NativeExperts(spec, isa, config.threads, weights, config.group_size, store, name,
                               qdot=config.qdot, memory=config.memory)
        runner.format_note = note
        return Choice(runner, kernel_label(isa, spec.weight_dtype, weights, config.qdot))
    if config.backend == "native":
        raise ValueError(f"backend='native' but this block cannot run natively: {why_not}")
    return Choice(reference.experts_forward, "reference", why_not)
