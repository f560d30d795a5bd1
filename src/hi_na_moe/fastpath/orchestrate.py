"""scope="all": the order in which the parts are patched (dense linears, then norms, routers,
attention, latent attention, gated MLPs, then decoder layers, stacks and causal LMs: each later
part's short path calls the runners patched before it), and undoing it."""

from __future__ import annotations

import inspect
import types

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


def patch(model: nn.Module, cfg, gate, inside: list[nn.Module], gated):
    """Pack and patch the linears of scope="all", then the RMSNorms, the routers, the attention
    modules (hi_na_moe.fastpath.attention; latent attention: hi_na_moe.fastpath.mla) and the gated MLPs
    (hi_na_moe.fastpath.mlp), then the decoder layers (hi_na_moe.fastpath.layers); returns ([(module, runner, old
    forward)], linear reports, {"norms": (names patched, names whose probe did not match),
    "routers", "attention", "attention_latent", "mlps", "layers", "stacks": (the same)}). On an error, what was patched is undone before it propagates."""

    isa = _isa_name(cfg)
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
    done, reports = [], []
    try:
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
        small = {}  # kind -> (names patched, names left to PyTorch)
        routers, unfit = find_routers(model, cfg.dense_exclude)
        for kind, found, make, left in (
                ("norms", find_norms(model, cfg.dense_exclude), NativeNorm, []),
                ("routers", routers, lambda name, m, fwd: NativeRouter(name, m, fwd, isa, cfg.threads), unfit),
                ("attention", find_attention(model, cfg.dense_exclude),
                 lambda name, m, fwd: NativeAttention(name, m, fwd, isa, cfg.threads), []),
                ("attention_latent", find_mla(model, cfg.dense_exclude),
                 lambda name, m, fwd: NativeMLA(name, m, fwd, isa, cfg.threads), []),
                ("mlps", find_mlps(model, cfg.dense_exclude), NativeMLP, [])):
            more, names, differ = patch_probed(found, make, gate, gated)
            done += more
            small[kind] = (names, sorted(differ + left))
        # last, in this order: a layer's short path calls the runners patched above, and a
        # stack's loop the layers' short paths (find_stacks looks for patched layers)
        for kind, find, make in (("layers", find_layers, NativeLayer), ("stacks", find_stacks, NativeStack),
                                 ("causal_lms", find_causal_lms, NativeCausalLM)):
            more, names, differ = patch_probed(find(model, cfg.dense_exclude), make, gate, gated,
                                               signature=kind == "causal_lms")
            done += more
            small[kind] = (names, sorted(differ))
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
