"""scope="all": the model's dense linear layers (attention projections, shared experts, dense
MLPs, lm_head) on the experts' kernels, in the configured weight format.

Each `nn.Linear` outside the MoE experts is packed as an up-only block
(`PackedExperts.pack_linear`: the same panels, tiers, formats and threads as the experts; one
expert, identity activation, no down pass) and its forward is replaced by a call to it. Decode
(T = 1) is a weight stream, as for the experts: PyTorch's bf16 GEMV reaches about half the
bandwidth of our decode kernels on this machine (benchmarks/log/whole-model.md, the baselines of 2026-11-30).

Which layers: every `nn.Linear` (exactly that class) that is not inside an accelerated MoE
block's experts and not matched by `dense_exclude`, with at least 64 Ki weights (smaller ones
have no bytes worth a kernel call), and a shared expert's gate (`*.shared_expert_gate`, Qwen2-MoE's
Linear(H, 1)) whatever its size: the layer's fused decode step (hi_na_moe.fastpath.layers) computes it in
the same call as the experts, and can only give the module's bits with the module on the same
kernel. Layers matched by `dense_lossless` (default "lm_head") stay in the model's own dtype when
`weights` is int8/int4. Patterns are fnmatch patterns on the module's name in the model
("lm_head", "*.self_attn.*"). Linears that compute MoE routing (inside a router or gate module,
see routing_linears, and the shared experts' gates) are always lossless.

Small modules, for decode-sized inputs: RMSNorms (NativeNorm below) and the routers' logits
(hi_na_moe.fastpath.routers) run on native kernels too, each only after a probe shows the module computes
what the replacement does; the report names those left to PyTorch.

Memory and the store: a lossless layer is packed in memory, its own weight released (a
zero-byte placeholder) and rebuilt bit-exactly from the packed copy by disable and by
state_dict(). A quantised layer, with the config's cache on (the default), lives in the
packed-expert store like the experts: it is quantised and written there on the first enable
and loaded from there afterwards, copied or mapped as the config's memory says (keyed by a
hash of its weight and bias, the format and the tier),
next to an exact lossless backup of its originals; its own weight is then released and rebuilt
from that backup by disable and by state_dict(). With cache=False a quantised layer is
quantised at every enable and keeps its own weight (no backup to restore it from).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import re
import threading
from dataclasses import dataclass

import torch
from torch import nn

from ..core.checkpoint import refuse_loading
from ..core.formats import LOSSLESS_FORMATS, Format, decide_format
from ..core.memory import load_block
from ..core.native import native_module
from ..core.ops import _isa_name, _kernel_names
from ..core.registry import _patched_inner
from ..core.store import entry_key, tensor_identity
from .common import _matches

MIN_WEIGHTS = 1 << 16
# int8 / int4 layers (and groups) with an even number of outputs, at least PAIRED_MIN_ROWS, are
# packed paired (PackedExperts.pack_linear's paired: the rows' two halves as one gated expert's
# gate and up matrices): the same outputs bit for bit, streamed with two output rows per
# broadcast input, up to 5-8 % faster a byte (benchmarks/log/decode-step.md, 2026-12-05); False: one
# matrix. With REUSE_UNPAIRED, a layer whose one-matrix entry is in the store already (built
# before pairing) uses it rather than building a second copy beside it.
PAIRED = True
REUSE_UNPAIRED = True
PAIRED_MIN_ROWS = 64
SHARED_GATE = "shared_expert_gate"  # a shared expert's gate: run natively whatever its size


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
    group: str | None = None  # run in one call with its siblings (q/k/v, gate/up): the group's name
    note: str | None = None  # why it runs in another format than the config's (lossless12 that did not fit)
    memory: str | None = None  # from the store: "copied" into memory or "mapped" (config key memory)


def _format_of(name: str, cfg, routing: frozenset[str] = frozenset(), dtype: torch.dtype = torch.bfloat16) -> str:
    """The weight format the dense layer `name` (weights of `dtype`) runs in under `cfg`
    (decide_format; `routing`: routing_linears)."""
    return decide_format(cfg.weights, dtype, name=name, routing=name in routing,
                         dense_lossless=cfg.dense_lossless).format


_ROUTING_CLASS = re.compile(r"Router|(Gate|Gating)$")


def routing_linears(model: nn.Module) -> frozenset[str]:
    """Names of the linears that compute MoE routing (inside a module whose class is a router
    or a gate: DbrxRouter.layer, Gemma4TextRouter.proj, HunYuanMoEV1Gate.wg, ...), and the shared
    experts' gates. Their weights are a few KiB per layer and decide which experts run (or how
    much of the shared expert), so quantising them saves nothing worth a changed routing: they
    stay lossless whatever `weights` is."""
    found = set()
    for name, m in model.named_modules():
        if _ROUTING_CLASS.search(type(m).__name__):
            found.update(f"{name}.{n}" if name else n for n, sub in m.named_modules() if type(sub) is nn.Linear)
        elif type(m) is nn.Linear and name.rpartition(".")[2] == SHARED_GATE:
            found.add(name)
    return frozenset(found)


# attributes of a tensor that say nothing of its values (reading them off a released placeholder is fine)
_TENSOR_META = r"(?:dtype|device|shape|size|ndim|dim|numel|is_[a-z_]+|requires_grad|data_ptr|element_size|nbytes|itemsize)"


@functools.cache
def _class_sources(cls: type) -> str:
    """The source of the methods of cls and of its bases up to nn.Module, but initialisers
    (__init__, _init_weights, ...: they write weights before any packing) ("" where there is none)."""
    out = []
    for c in cls.__mro__:
        if c is object or c.__module__.startswith("torch."):
            continue
        for key, fn in vars(c).items():
            if "init" in key or not callable(fn):
                continue
            try:
                out.append(inspect.getsource(fn))
            except (OSError, TypeError):
                pass
    return "\n".join(out)


def weight_read_directly(model: nn.Module, name: str) -> str | None:
    """The name of a module above the linear `name` whose class's code reads `<child>.weight`
    itself (as a tensor, not its dtype or shape), else None. Such a weight must not be released:
    Jamba's Mamba mixer computes self.dt_proj.weight @ x, LongCat-Flash's router
    F.linear(h, self.classifier.weight.float()), neither calling the Linear."""
    parts = name.split(".")
    chain = [model]
    for part in parts[:-1]:
        chain.append(getattr(chain[-1], part, None))
        if chain[-1] is None:
            return None
    for i in range(len(chain) - 1, -1, -1):  # the parent first
        if _reads_weight(type(chain[i]), parts[-1]):
            return ".".join(parts[:i]) or "the model"
    return None


@functools.cache
def _reads_weight(cls: type, child: str) -> bool:
    """Whether cls's methods (_class_sources) read `.<child>.weight` as a tensor."""
    src = _class_sources(cls)
    for hit in re.finditer(rf"\.{re.escape(child)}\.weight\b(?!\s*\.\s*{_TENSOR_META}\b)", src):
        line = src[src.rfind("\n", 0, hit.start()) + 1:hit.start()]
        if not re.search(r"isinstance\([^()]*$", line):  # isinstance(self.x.weight, ...): a type test
            return True
    return False


PAIRED_FORMATS = tuple(f for f in Format if f.paired)


def paired(weights: str, rows: int) -> bool:
    """Whether a layer (or group) of `rows` outputs in `weights` is packed paired (PAIRED)."""
    return PAIRED and weights in PAIRED_FORMATS and rows % 2 == 0 and rows >= PAIRED_MIN_ROWS


def find_linears(model: nn.Module, inside: list[nn.Module], exclude: str,
                 devices: tuple[str, ...] = ("cpu",)) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the linears scope="all" runs, in module order."""
    skip = {id(m) for blk in inside for m in blk.modules()}
    found = []
    for name, m in model.named_modules():
        if (type(m) is nn.Linear and id(m) not in skip and not _matches(name, exclude)
                and (m.weight.numel() >= MIN_WEIGHTS or name.rpartition(".")[2] == SHARED_GATE)
                and m.weight.device.type in devices
                and m.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)):
            found.append((name, m))
    return found


class NativeLinear:
    """One nn.Linear, or a group of sibling linears that read the same input (q/k/v, gate/up),
    on the native kernels: pack (the group's weights stacked by rows into one block), the
    replacement forwards, release, restore.

    A group runs as one kernel call: the first member called with an input computes every
    member's output, and each other member called with that same tensor (the same object at the
    same address, holding the same bytes) takes its output from there, once. Any other call computes the
    group for its own input, so a model that feeds the members different inputs gets correct
    (if slower) results. The outputs are bit-identical to one call per layer: each output row
    is its own dot product over the input, accumulated in the same order."""

    def __init__(self, members: list[tuple[str, nn.Linear]], weights: str, group_size: int, isa: str,
                 threads: int, qdot: str, store=None, memory: str = "map"):
        self.members = members
        self.modules = [m for _, m in members]
        self.name = group_name([n for n, _ in members])
        self.weights, self.threads = weights, threads
        self.isa, self.group_size = isa, group_size
        w, b = self._stacked()
        self.paired = paired(weights, w.shape[0])
        self.bounds = []  # (start row, end row) of each member's outputs
        row = 0
        for m in self.modules:
            self.bounds.append((row, row + m.out_features))
            row += m.out_features
        # quantised layers live in the store (store.PackedStore), lossless ones in memory
        self.store = store if weights not in LOSSLESS_FORMATS else None
        self.format_note: str | None = None  # why stored as lossless when lossless12 was asked for
        self.cache_event: str | None = None
        self.memory = memory  # HinaConfig.memory: how a layer from the store is held (hi_na_moe.core.memory)
        self.held: str | None = None  # from the store: "copied" or "mapped"
        self._entry = None  # the store entry the packed layer is mapped from (None once copied)
        self._backup = None  # (key, entry name) of the exact originals in the store
        if self.store is None:
            self.packed = self._pack_now(w, b, weights)
        else:
            self._identity = tensor_identity([t for t in (w, b) if t is not None])
            if REUSE_UNPAIRED and self.paired and not self._stored(weights):
                # no paired entry yet: a one-matrix entry built before pairing is used, not copied
                self.paired = False
                self.paired = not self._stored(weights)
            self.packed, self._entry, self.cache_event = self._from_store(w, b, weights, self.name)
        if self.packed.weights != weights:  # lossless12 that did not fit these weights
            self.format_note = self.format_note or f"stored as {self.packed.weights}: {weights} did not fit"
            self.weights = self.packed.weights
        self.bound = self.packed.bind(qdot=qdot)
        self.dtype = w.dtype
        self.in_features, self.out_features = self.modules[0].in_features, row
        self.nbytes = self.packed.nbytes
        self.kernel = self.packed.kernel_name("decode", qdot)
        self._released: list[tuple] = []  # (member index, shape, stride) of released weights
        self._hooks: list = []
        self._lock = threading.Lock()
        self._outs = None  # a group's outputs not all taken: [input, its address, its bytes, outputs, taken]

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The members' weights (and biases, if they have them) stacked by rows, contiguous."""
        ws = [m.weight.detach() for m in self.modules]
        bs = [m.bias.detach() for m in self.modules if m.bias is not None]
        w = torch.cat(ws) if len(ws) > 1 else ws[0].contiguous()
        b = None if not bs else (torch.cat(bs) if len(bs) > 1 else bs[0].contiguous())
        return w, b

    def member_bytes(self, i: int) -> int:
        """Member i's share of the packed bytes (by rows; the shares add up to nbytes)."""
        lo, hi = self.bounds[i]
        share = self.nbytes * (hi - lo) // self.out_features
        return share + (self.nbytes - sum(self.nbytes * (h - l) // self.out_features for l, h in self.bounds)
                        if i == 0 else 0)

    # -- packing and the store ----------------------------------------------------------------
    def _pack_now(self, w: torch.Tensor, b: torch.Tensor | None, weights: str):
        pack = native_module()[0].PackedExperts.pack_linear
        try:
            return pack(w, b, isa=self.isa, num_threads=self.threads, weights=weights, group_size=self.group_size,
                        paired=self.paired and weights in PAIRED_FORMATS)
        except ValueError as exc:
            if weights != Format.LOSSLESS12:
                raise
            self.format_note = f"stored as lossless: {exc}"  # the plain copy, bit for bit too
            return pack(w, b, isa=self.isa, num_threads=self.threads, weights="lossless")

    def _expect(self, weights: str) -> dict:
        expect = {"layout_version": int(native_module()[0].PACKED_LAYOUT_VERSION), "weights": weights,
                  "isa": self.isa, "group_size": self.group_size if weights == Format.INT4 else 0, "up_only": True}
        if self.paired and weights in PAIRED_FORMATS:  # (an entry of one matrix keeps the key it had)
            expect["paired"] = True
        return expect

    def _key(self, weights: str) -> str:
        return entry_key(self._identity, kind="linear", **self._expect(weights))

    def _stored(self, weights: str) -> bool:
        """Whether the store has a file for this layer's entry in `weights` as self.paired packs it
        (readable or not: opening it says)."""
        return self.store.path_for(self._key(weights), self.name).exists()

    def _from_store(self, w, b, weights: str, name: str, hold: bool = True):
        """The packed layer in `weights` from the store, built and written there if absent,
        stale or corrupt. hold: the layer this runner runs, held as self.memory says
        (hi_na_moe.core.memory.load_block; self.held says how); else (an exact backup) only validated
        through the mapping. Returns (PackedExperts, the entry it is mapped from or None when
        copied, event)."""
        native, _ = native_module()

        def build():
            pe = self._pack_now(w, b, weights)
            meta = dict(native.header_info(pe.header), header=pe.header.hex(), layer=self.name,
                        **self._expect(weights))
            return meta, {"block": pe.data}

        entry, built, reason = self.store.get_or_build(self._key(weights), name, self._expect(weights), build)
        path = entry.path
        view, entry, held = load_block(native, entry, self.memory if hold else "map")
        if not view.up_only:
            if entry is not None:
                entry.close()
            raise RuntimeError(f"hi_na_moe: the store entry for {self.name!r} ({path}) is not a linear layer")
        if hold:
            self.held = held
        event = "reused" if not built else (f"rebuilt ({reason})" if reason else "built")
        return view, entry, event

    # -- the forward --------------------------------------------------------------------------
    def forward_of(self, i: int):
        """The replacement forward of member i (called as forward(module, x))."""
        if len(self.modules) == 1:
            return self.forward
        return functools.partial(self._member_forward, i)

    def forward(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        # the common inference call in few operations: with the caches a decode step leaves,
        # every torch op here costs ~30 us (benchmarks/studies/bench_call_overhead.py), and a step
        # calls every dense layer once
        if (type(x) is torch.Tensor and x.dtype is self.dtype and x.is_contiguous() and x.is_cpu
                and not x.requires_grad and not x.is_neg() and x.dim() >= 1 and x.shape[-1] == self.in_features
                and not (module.training and torch.is_grad_enabled())):
            out = torch.empty(x.shape[:-1] + (self.out_features,), dtype=self.dtype)
            # every thread, also for small layers: OLMoE's int4 attention projections (2.2 MB) on
            # one thread (the experts' ops.SMALL_CALL_BYTES rule) made a whole decode step 10-25 %
            # slower (benchmarks/log/, 2026-11-30)
            self.bound.linear(x.data_ptr(), x.numel() // self.in_features, out.data_ptr(),
                              self.threads or torch.get_num_threads())
            return out
        return self._forward_general(module, x)

    def _member_forward(self, i: int, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        # the same input as the group's last computation: the same tensor object, at the same
        # address, holding the same bytes (compared: inference tensors keep no version counter,
        # so an in-place change in between could not be seen otherwise)
        readable = type(x) is torch.Tensor and x.is_cpu and x.is_contiguous() and not x.is_neg()
        if readable:
            ptr, nbytes = x.data_ptr(), x.numel() * x.element_size()
            with self._lock:
                held = self._outs
                if (held is not None and held[0] is x and held[1] == ptr and not held[4][i]
                        and ctypes.string_at(ptr, nbytes) == held[2]):
                    held[4][i] = True
                    if all(held[4]):
                        self._outs = None  # every member has its output: drop the input and the rest
                    return held[3][i]
        full = self.forward(module, x)  # the whole group for x (or the general path's errors)
        outs = self.split(full)
        if readable and not full.requires_grad:
            taken = [False] * len(outs)
            taken[i] = True
            with self._lock:
                self._outs = [x, ptr, ctypes.string_at(ptr, nbytes), outs, taken]
        return outs[i]

    def split(self, full: torch.Tensor) -> list[torch.Tensor]:
        """A group's output (forward) as its members' outputs, each contiguous."""
        outs = []
        for lo, hi in self.bounds:
            o = full[..., lo:hi]
            outs.append(o if o.is_contiguous() else o.contiguous())  # one row: already contiguous
        return outs

    def _forward_general(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """Everything forward()'s first branch does not take: training with autograd, other
        dtypes, strided or lazily negated inputs, wrong shapes and devices (errors)."""
        if module.training and torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad):
            if self._released:
                raise RuntimeError(
                    f"hi_na_moe: gradients are requested through {self.name!r}, a linear layer packed for the "
                    "native kernels (scope='all') with its weight released; disable_for_model(model) first, or "
                    "enable with scope='experts' to train")
            # a group: every member's own F.linear, stacked, so that _member_forward slices it
            outs = [torch.nn.functional.linear(x, m.weight, m.bias) for m in self.modules]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
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
    def release(self, keep: set[int] = frozenset()) -> list[int]:
        """Free the members' own weights (except those whose index is in `keep`); they are
        rebuilt exactly from the packed copy (lossless) or from the backup written to the store
        first (quantised). Returns the bytes freed per member (all 0 for a quantised group
        without a store, which keeps its weights)."""
        freed = [0] * len(self.modules)
        todo = [i for i in range(len(self.modules)) if i not in keep]
        if not todo:
            return freed
        if self.weights not in LOSSLESS_FORMATS:
            if self.store is None:
                return freed
            w, b = self._stacked()
            backup = self.name + ".original"
            _, entry, _ = self._from_store(w, b, "lossless", backup, hold=False)
            entry.close()
            self._backup = (self._key("lossless"), backup)
        for i in todo:
            m = self.modules[i]
            p = m.weight
            freed[i] = p.numel() * p.element_size()
            self._released.append((i, p.shape, p.stride()))
            p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)

            def fill_state_dict(mod, state_dict, prefix, local_metadata, i=i):
                key = prefix + "weight"
                if key in state_dict:
                    state_dict[key] = self._unpacked(i)

            self._hooks.append(m.register_state_dict_post_hook(fill_state_dict))
            self._hooks.append(refuse_loading(m, self.members[i][0]))
        return freed

    def _unpacked(self, i: int) -> torch.Tensor:
        """Member i's exact original weight, in the module's own strides."""
        _, shape, stride = next(r for r in self._released if r[0] == i)
        out = torch.empty_strided(shape, stride, dtype=self.dtype)
        lo, hi = self.bounds[i]
        if self._backup is None:
            _, w, _, _, _, _ = self.packed.unpack()
            return out.copy_(torch.from_dlpack(w)[lo:hi])
        key, name = self._backup
        try:
            with self.store.open(key, name, expect=self._expect("lossless")) as entry:
                # unpack copies out of the mapping, so the entry can close right after
                view = native_module()[0].PackedExperts.view(bytes.fromhex(entry.meta["header"]),
                                                               entry.array("block", "uint8"))
                _, w, _, _, _, _ = view.unpack()
                return out.copy_(torch.from_dlpack(w)[lo:hi])
        except Exception as exc:
            raise RuntimeError(
                f"hi_na_moe: cannot restore the original weight of {self.members[i][0]!r}: its exact backup in "
                f"the packed-expert store is unreadable ({exc}). The layer keeps running on its {self.weights} "
                "copy; reload the model from its checkpoint to get the original.") from exc

    def restore(self) -> None:
        with self._lock:
            for i, _, _ in list(self._released):
                self.modules[i].weight.data = self._unpacked(i)
                self._released = [r for r in self._released if r[0] != i]
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self.packed = self.bound = None
            self._outs = None
            if self._entry is not None:
                self._entry.close()
                self._entry = None


# sibling linears that models call with one input tensor: run as one block (latent attention,
# hi_na_moe.fastpath.mla: the query and the compressed key-value projections of the hidden states)
FUSE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_proj", "kv_a_proj_with_mqa"),
               ("q_a_proj", "kv_a_proj_with_mqa"))


def group_name(names: list[str]) -> str:
    """'a.b.q_proj' for one layer; 'a.b.q_proj+k_proj+v_proj' for a group of siblings."""
    if len(names) == 1:
        return names[0]
    parent = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
    return parent + "+".join(n.rsplit(".", 1)[-1] for n in names)


def fuse_groups(found: list[tuple[str, nn.Linear]], cfg, shared: set[int],
                routing: frozenset[str] = frozenset()) -> list[list[tuple[str, nn.Linear]]]:
    """`found` (find_linears) in groups: sibling q/k/v and gate/up projections with the same
    input size, dtype, format and bias presence, none of them tied to another module, become
    one group; every other layer is a group of its own. Module order is kept."""
    by_name = dict(found)
    grouped: dict[str, list[str]] = {}
    for name, _ in found:
        parent, _, last = name.rpartition(".")
        for members in FUSE_GROUPS:
            if last != members[0]:
                continue
            names = [f"{parent}.{x}" if parent else x for x in members]
            mods = [by_name.get(n) for n in names]
            if any(m is None for m in mods):
                continue
            first = mods[0]
            if all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
                   and (m.bias is None) == (first.bias is None) and id(m.weight) not in shared
                   and _format_of(n, cfg, routing, m.weight.dtype) == _format_of(names[0], cfg, routing, first.weight.dtype)
                   for n, m in zip(names, mods)):
                for n in names:
                    grouped[n] = names
    groups, seen = [], set()
    for name, m in found:
        if name in seen:
            continue
        names = grouped.get(name, [name])
        seen.update(names)
        groups.append([(n, by_name[n]) for n in names])
    return groups


def _shared_params(model: nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds (tied lm_head and embeddings)."""
    seen: dict[int, int] = {}
    for _, prm in model.named_parameters(remove_duplicate=False):
        seen[id(prm)] = seen.get(id(prm), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def plan(model: nn.Module, cfg, inside: list[nn.Module]) -> list[DenseReport]:
    """What patch() would do, without packing (inspect_model): the layers, their format, the
    decode kernel and the packed bytes (from the planner: works on the meta device too)."""
    native, _ = native_module()
    isa = _isa_name(cfg)
    reports = []
    found = find_linears(model, inside, cfg.dense_exclude, devices=("cpu", "meta"))
    routing = routing_linears(model)
    groups = fuse_groups(found, cfg, _shared_params(model), routing) if cfg.dense_fuse else [[f] for f in found]
    group_of = {n: group_name([x for x, _ in g]) for g in groups if len(g) > 1 for n, _ in g}
    for name, m in found:
        fmt = _format_of(name, cfg, routing, m.weight.dtype)
        dt = str(m.weight.dtype).replace("torch.", "")
        two = paired(fmt, m.out_features)  # (a group's rows may pair where a member's alone do not: nearly equal bytes)
        header = native.PackedExperts.plan(dt, 1, m.in_features, m.out_features // 2 if two else m.out_features, two,
                                           gate_bias=two and m.bias is not None, up_bias=m.bias is not None,
                                           isa=isa, weights=fmt, group_size=cfg.group_size, up_only=True)
        reports.append(DenseReport(name, m.out_features, m.in_features, fmt,
                                   _kernel_names(isa, m.weight.dtype, fmt, cfg.qdot)["decode"],
                                   native.header_info(header)["nbytes"], 0, None, group_of.get(name)))
    return reports


# -- RMSNorm ----------------------------------------------------------------------------------
# A decode step calls every RMSNorm once per token (OLMoE-1B-7B: 65 per step) and PyTorch runs
# each as ~7 small ops; with the caches the weight streaming leaves behind they cost ~80 us per
# norm (benchmarks/bench_decode_breakdown.py). One native call replaces them for a few rows.


def patched_member(module: nn.Module):
    """(NativeLinear, member index) of a linear patched under scope="all" (index 0 when it runs
    alone), or None if it is not patched so."""
    inner = _patched_inner(module)
    if isinstance(inner, functools.partial) and len(inner.args) == 1:
        return inner.func.__self__, inner.args[0]
    runner = getattr(inner, "__self__", None)
    return (runner, 0) if isinstance(runner, NativeLinear) else None
