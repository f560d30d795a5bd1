"""scope="all": the order in which the parts are patched (dense linears, then norms, routers,
attention, latent attention, gated MLPs, then decoder layers, stacks and causal LMs: each later
part's short path calls the runners patched before it), and undoing it."""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from torch import nn
from tqdm.auto import tqdm

from ..core.formats import LOSSLESS_FORMATS
from ..core.ops import _isa_name
from ..core.store import PackedStore
from .attention import NativeAttention, find_attention
from .common import _MISSING
from .layers import NativeLayer, find_layers
from .linear import (
    DenseReport,
    NativeLinear,
    _format_of,
    _shared_params,
    find_linears,
    fuse_groups,
    routing_linears,
    weight_read_directly,
)
from .mla import NativeMLA, find_mla
from .mlp import NativeMLP, find_mlps
from .norm import NativeNorm, find_norms
from .routers import NativeRouter, find_routers
from .stack import NativeCausalLM, NativeStack, find_causal_lms, find_stacks


class Part(Protocol):
    """One kind of module scope="all" runs natively after the linear layers. `find(model, cfg)`:
    (the candidates [(name, module)], names left to PyTorch without a probe); `make(name, module,
    its own forward, cfg, isa)`: a runner, which says whether it computes what the module does
    (`matches()`), runs in its place (`forward`) and undoes itself (`restore()`). `kind` is the
    report's key; `after_patching`: found only once the parts before it are patched (a layer's
    short path calls their runners, find_stacks looks for patched layers), where the others are
    all found on the model as loaded; `signature`: the patched forward reports the module's own
    signature (generate reads a causal LM's)."""

    kind: str
    after_patching: bool
    signature: bool

    def find(self, model: nn.Module, cfg) -> tuple[list[tuple[str, nn.Module]], list[str]]: ...

    def make(self, name: str, module: nn.Module, own_forward, cfg, isa: str): ...


@dataclass(frozen=True)
class _Part:
    kind: str
    find: Callable[[nn.Module, Any], tuple[list[tuple[str, nn.Module]], list[str]]]
    make: Callable[..., Any]
    after_patching: bool = False
    signature: bool = False


def _found(find):
    return lambda model, cfg: (find(model, cfg.dense_exclude), [])


# The parts in the order they are patched.
PARTS: tuple[Part, ...] = (
    _Part("norms", _found(find_norms), lambda name, m, fwd, cfg, isa: NativeNorm(name, m, fwd)),
    _Part("routers", lambda model, cfg: find_routers(model, cfg.dense_exclude),
          lambda name, m, fwd, cfg, isa: NativeRouter(name, m, fwd, isa, cfg.threads)),
    _Part("attention", _found(find_attention), lambda name, m, fwd, cfg, isa: NativeAttention(name, m, fwd, isa, cfg.threads)),
    _Part("attention_latent", _found(find_mla), lambda name, m, fwd, cfg, isa: NativeMLA(name, m, fwd, isa, cfg.threads)),
    _Part("mlps", _found(find_mlps), lambda name, m, fwd, cfg, isa: NativeMLP(name, m, fwd)),
    _Part("layers", _found(find_layers), lambda name, m, fwd, cfg, isa: NativeLayer(name, m, fwd), after_patching=True),
    _Part("stacks", _found(find_stacks), lambda name, m, fwd, cfg, isa: NativeStack(name, m, fwd), after_patching=True),
    _Part("causal_lms", _found(find_causal_lms), lambda name, m, fwd, cfg, isa: NativeCausalLM(name, m, fwd),
          after_patching=True, signature=True),
)


def _patch_linears(model: nn.Module, cfg, gate, inside: list[nn.Module], gated, isa: str, done: list) -> list[DenseReport]:
    """Pack and patch the linear layers (grouped where dense_fuse says), appending to `done`."""
    todo = find_linears(model, inside, cfg.dense_exclude)
    store = None
    if cfg.weights not in LOSSLESS_FORMATS and cfg.cache and todo:
        store = PackedStore(cfg.store_root())
    # a weight shared with another module (tied lm_head / embeddings) is never released, nor a
    # routing linear's: its router may read the weight itself (LongCat-Flash: F.linear(h.float(),
    # self.classifier.weight.float()), never calling the patched forward) and a few KiB save nothing
    shared = _shared_params(model)
    routing = routing_linears(model)
    groups = fuse_groups(todo, cfg, shared, routing) if cfg.dense_fuse else [[item] for item in todo]
    reports = []
    for members in tqdm(groups, desc=f"hi_na_moe: packing dense layers ({cfg.weights})", unit="layer",
                        leave=False, disable=None if len(groups) > 8 else True):
        fmt = _format_of(members[0][0], cfg, routing, members[0][1].weight.dtype)
        runner = NativeLinear(members, fmt, cfg.group_size, isa, cfg.threads, cfg.qdot, store, cfg.memory)
        for i, (_, m) in enumerate(members):
            old = m.__dict__.get("forward", _MISSING)
            m.forward = types.MethodType(gated(gate, runner.forward_of(i)), m)
            done.append((m, runner, old))
        readers = {i: weight_read_directly(model, n) for i, (n, _) in enumerate(members)}
        keep = set(range(len(members))) if cfg.keep_weights else {
            i for i, (n, m) in enumerate(members) if id(m.weight) in shared or n in routing or readers[i]}
        freed = runner.release(keep)
        group = runner.name if len(members) > 1 else None
        for i, (name, m) in enumerate(members):
            note = runner.format_note
            if readers[i] and not cfg.keep_weights:
                note = "; ".join(filter(None, (note, f"weight kept: {readers[i]} reads it itself")))
            reports.append(DenseReport(name, m.out_features, m.in_features, runner.weights, runner.kernel,
                                       runner.member_bytes(i), freed[i], runner.cache_event, group, note,
                                       runner.held))
    return reports


def patch(model: nn.Module, cfg, gate, inside: list[nn.Module], gated, parts: tuple[Part, ...] | None = None):
    """Pack and patch the linears of scope="all", then each of `parts` in order (PARTS: the
    RMSNorms, routers, attention and latent attention modules, gated MLPs, decoder layers, stacks
    and causal LMs); returns ([(module, runner, old forward)], linear reports, {part kind: (names
    patched, names left to PyTorch: their probe did not match, or their finder set them aside)}).
    On an error, what was patched is undone before it propagates."""
    parts = PARTS if parts is None else parts
    isa = _isa_name(cfg)
    done: list = []
    try:
        reports = _patch_linears(model, cfg, gate, inside, gated, isa, done)
        found = {p.kind: p.find(model, cfg) for p in parts if not p.after_patching}
        small = {}  # kind -> (names patched, names left to PyTorch)
        for part in parts:
            candidates, left = found[part.kind] if part.kind in found else part.find(model, cfg)
            more, names, differ = patch_probed(
                candidates, lambda name, m, fwd, part=part: part.make(name, m, fwd, cfg, isa), gate, gated,
                signature=part.signature)
            done += more
            small[part.kind] = (names, sorted(differ + left))
        for _, runner, _ in done:  # the layers' and stacks' probes called the attention modules
            calls = getattr(runner, "calls", None)
            if calls is not None and hasattr(calls, "declined"):
                calls.native = calls.declined = 0
    except BaseException:
        unpatch(done)
        raise
    return done, reports, small


def patch_probed(found: list[tuple[str, nn.Module]], make, gate, gated,
                 signature: bool = False) -> tuple[list, list[str], list[str]]:
    """Patch the small modules of `found` (norms, routers) whose runner `make(name, module, own
    forward)` says it matches what the module computes; returns (done, patched names, names left
    to PyTorch because their probe did not match). signature: the patched forward reports the
    own forward's signature (generate reads a causal LM's to see which arguments it takes)."""
    done, names, differ = [], [], []
    try:
        for name, m in found:
            old = m.__dict__.get("forward", _MISSING)
            own = m.forward
            runner = make(name, m, own)
            if not runner.matches():
                differ.append(name)
                continue
            fn = gated(gate, runner.forward)
            if signature and isinstance(own, types.MethodType):
                fn.__signature__ = inspect.signature(own.__func__)
            m.forward = types.MethodType(fn, m)
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
    outcome: dict[int, Exception | None] = {}  # per runner (a group's members share one)
    for item in reversed(done):
        m, runner, old = item
        if id(runner) not in outcome:
            try:
                runner.restore()
                outcome[id(runner)] = None
            except Exception as exc:
                outcome[id(runner)] = exc
        if outcome[id(runner)] is not None:
            # every member of a group that could not be restored stays patched: their weights
            # may still be released placeholders
            failed.append((item, outcome[id(runner)]))
            continue
        if old is _MISSING:
            m.__dict__.pop("forward", None)
        else:
            m.forward = old
    return failed[::-1]
