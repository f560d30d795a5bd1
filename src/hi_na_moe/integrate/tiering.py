"""Setting up the memory tier (hi_na_moe.core.tier) for a model being enabled: which blocks it
holds, their routers for prediction, the NUMA node, and `hi_na_moe.stats(model)`."""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch import nn

from ..core import numa, ops
from ..core import tier as tier_mod
from ..core.formats import Scope
from ..core.native import native_module
from ..core.registry import patched_runner
from ..core.store import PackedStore
from ..fastpath import layers as layers_mod
from ..fastpath import routers as routers_mod
from ..fastpath.layers import NativeLayer

# model -> TierState, while enabled
_STATES: "weakref.WeakKeyDictionary[nn.Module, tier_mod.TierState]" = weakref.WeakKeyDictionary()
_TOPK_NAMES = ("top_k", "num_experts_per_tok", "moe_top_k", "num_selected_experts", "k")


def top_k_of(module: nn.Module) -> int | None:
    """The experts a token routes to, from the block or its router's plain settings."""
    for m in (module, *module.children()):
        for name in _TOPK_NAMES:
            v = getattr(m, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    cfg = getattr(module, "config", None)
    v = getattr(cfg, "num_experts_per_tok", None)
    return v if isinstance(v, int) and v > 0 else None


def router_of(module: nn.Module, spec) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [E, H], bias [E] or None) of the block's router when it is a plain linear map
    of the hidden state (what prediction applies to an earlier layer's input); else None."""
    E, H = spec.num_experts, spec.hidden
    for name, m in module.named_modules():
        if name.split(".")[0] in ("experts", "shared_expert", "shared_experts"):
            continue
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and tuple(w.shape) == (E, H) and w.device.type == "cpu":
            b = getattr(m, "bias", None)
            b = b if isinstance(b, torch.Tensor) and tuple(b.shape) == (E,) else None
            return w, b
    return None


def _near(model: nn.Module, name: str, module: nn.Module) -> list[nn.Module]:
    """The block's module, then its parent (a transformers experts module's router is its sibling)."""
    out = [module]
    if "." in name:
        try:
            out.append(model.get_submodule(name.rsplit(".", 1)[0]))
        except AttributeError:
            pass
    return out


def _top_k(model: nn.Module, match) -> int | None:
    for m in _near(model, match.name, match.module):
        k = top_k_of(m)
        if k is not None:
            return k
    return getattr(getattr(model, "config", None), "num_experts_per_tok", None)


def _router(model: nn.Module, match):
    for m in _near(model, match.name, match.module):
        found = router_of(m, match.spec)
        if found is not None:
            return found
    return None


def _decoder_layer(model: nn.Module, name: str) -> nn.Module | None:
    """The decoder layer holding the block `name`: its nearest ancestor with a
    post_attention_layernorm (the norm in front of the block's router)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            m = model.get_submodule(".".join(parts[:i]))
        except AttributeError:
            continue
        if isinstance(getattr(m, "post_attention_layernorm", None), nn.Module):
            return m
    return None


def rms_norm_of(norm: nn.Module, hidden: int) -> tuple[torch.Tensor, float] | None:
    """(weight [H], eps) when `norm` computes x / sqrt(mean(x^2) + eps) * weight, what the tier
    applies for refine; None for anything else (a norm with 1 + weight, a LayerNorm's mean, no
    weight). Checked on an input of nonzero mean, at the weight's precision."""
    w = getattr(norm, "weight", None)
    eps = next((v for v in (getattr(norm, "variance_epsilon", None), getattr(norm, "eps", None))
                if isinstance(v, float) and not isinstance(v, bool)), None)
    if (eps is None or not isinstance(w, torch.Tensor) or tuple(w.shape) != (hidden,) or w.device.type != "cpu"
            or w.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return None
    x = (torch.randn(4, hidden, generator=torch.Generator().manual_seed(0)) * 2 + 0.5).to(w.dtype)
    try:
        with torch.no_grad():
            got = norm(x)
    except Exception:  # (a norm that cannot take [T, H] rows is not one the tier can apply)
        return None
    xf = x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.detach().float()
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    if not torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
        return None
    return w.detach(), eps


def _other_bytes(model: nn.Module, matches: list) -> int:
    """Bytes of the model's parameters and buffers outside the tiered experts (dense weights,
    embeddings, norms): what the process holds besides the limit, before any KV cache."""
    experts = set()
    for m in matches:
        for t in m.spec.weight_tensors():
            experts.add(t.untyped_storage().data_ptr() if not t.is_meta else id(t))
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_meta:
            continue
        key = t.untyped_storage().data_ptr()
        if key in experts or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def setup(model: nn.Module, plans: list, cfg) -> tier_mod.TierState | None:
    """Before packing: plan the tier for the native expert blocks of `plans` ((match, choice)
    pairs, in layer order) and, when the limit needs it, create it and hand it to the runners."""
    limit = cfg.memory_limit_bytes() if getattr(cfg, "memory_limit", None) is not None else None
    if limit is None:
        return None
    native, _ = native_module()
    sizes, runners = [], []
    for match, choice in plans:
        r = choice.runner
        if not isinstance(r, ops.NativeExperts):
            continue
        sizes.append(tier_mod.block_size(native, match.name, match.spec, r.isa, r.weights, r.group_size,
                                         _top_k(model, match)))
        runners.append((match, r))
    p = tier_mod.plan(native, sizes, limit)
    if p is None:
        return None
    state = tier_mod.TierState(None, p)
    state.other_bytes = _other_bytes(model, [m for m, _ in runners])
    if not p.active:
        _STATES[model] = state
        return state
    tier = tier_mod.make_tier(native, p, cfg, len(runners))
    state.tier = tier
    node = getattr(cfg, "numa_node", None)
    if node is not None:
        topo = numa.Topology.read()
        numa.check_node(node, topo)
        status = numa.bind(tier.pool_address, tier.pool_bytes, node, topo)
        numa.pin_threads(node, topo)
        state.numa = status
    for _, r in runners:
        if r.store is None:  # lossless blocks are packed in memory without a limit
            if not cfg.cache:
                raise tier_mod.TierConfigError(
                    "memory_limit keeps the experts that do not fit in the packed-expert store: set cache=True "
                    "(HINA_MOE_CACHE=1), or remove memory_limit")
            r.store = PackedStore(cfg.store_root())
        r.tier = tier
    _STATES[model] = state
    return state


def finish(model: nn.Module, state: tier_mod.TierState | None, plans: list) -> None:
    """After packing: the routers prediction applies, by the layers the blocks were given."""
    if state is None or state.tier is None:
        return
    for match, choice in plans:
        r = choice.runner
        if getattr(r, "tier_layer", None) is None:
            continue
        state.layer_names[r.tier_layer] = match.name
        found = _router(model, match)
        k = _top_k(model, match)
        if found is None or k is None:
            continue
        w, b = found
        w = w.detach()
        if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            continue
        state.tier.set_router(r.tier_layer, w.contiguous(), None if b is None else b.detach().float().contiguous(), k)
        state.predicting.add(r.tier_layer)
        layer = _decoder_layer(model, match.name)
        if layer is None:
            continue
        state.decoder_layers[r.tier_layer] = layer
        norm = rms_norm_of(layer.post_attention_layernorm, match.spec.hidden)
        if norm is not None:
            state.tier.set_norm(r.tier_layer, norm[0].contiguous(), norm[1])
            state.refining.add(r.tier_layer)


def _refine_hook(tier, layer: int, hidden: int):
    def hook(module, args, output):
        h = output[0] if isinstance(output, (tuple, list)) else output
        if (isinstance(h, torch.Tensor) and h.dim() >= 1 and h.shape[-1] == hidden and h.device.type == "cpu"
                and h.dtype in (torch.float32, torch.bfloat16, torch.float16)):
            tier.layer_done(layer, h.detach().contiguous())
    return hook


def _native_step_with_experts(decoder_layer: nn.Module) -> bool:
    """Whether scope="all" runs the layer's decode steps in the native layer step with its
    experts inside, which hands the layer's output to layer_done (csrc/moe/layer_step.cpp)."""
    runner = patched_runner(decoder_layer)
    return (isinstance(runner, NativeLayer) and runner.moe is not None and runner.one_call_blocker() is None
            and layers_mod.FUSE_EXPERTS and routers_mod.NATIVE_SELECT)


def hook_layers(state: tier_mod.TierState | None, plans: list, cfg) -> None:
    """Where refine gets each layer's output from. scope="experts": a forward hook on each tiered
    block's decoder layer hands its output, the residual stream, to ExpertTier.layer_done.
    scope="all": the native layer step calls it, and a hook on a layer would send the decoder
    stack's steps through the modules' own forwards (hi_na_moe.fastpath.stack), so none is added;
    a layer that does not run its experts in that step gives refine nothing."""
    if state is None or state.tier is None or not tier_mod.REFINE:
        return
    if getattr(cfg, "scope", None) == Scope.ALL:
        state.refine_sources = {layer for layer, m in state.decoder_layers.items() if _native_step_with_experts(m)}
        return
    if not any(layer + j in state.refining for layer in state.decoder_layers for j in (1, 2)):
        return
    for match, choice in plans:
        layer = getattr(choice.runner, "tier_layer", None)
        if layer in state.decoder_layers:
            state.hooks.append(state.decoder_layers[layer].register_forward_hook(
                _refine_hook(state.tier, layer, match.spec.hidden)))
            state.refine_sources.add(layer)


def settle(state: tier_mod.TierState | None, plans: list, cfg=None) -> None:
    """The end of enable, after every probe forward: their uses forgotten and the counters zeroed
    (a user's first tokens are not weighed against them, and stats() counts the user's calls);
    then, with cfg.profile, the pool filled from that expert prior (warm)."""
    profile = getattr(cfg, "profile", "") if cfg is not None else ""
    if state is None or state.tier is None:
        if profile and state is not None:
            state.prior_note = f"profile {profile!r} not used: no memory tier ({state.plan.why})"
        return
    tier = state.tier
    hook_layers(state, plans, cfg)
    tier.drain()  # (no probe's read still under way)
    tier.forget_uses()
    tier.reset_stats()
    if profile:
        experts = {}
        for match, choice in plans:
            if getattr(choice.runner, "tier_layer", None) is not None:
                experts[choice.runner.tier_layer] = match.spec.num_experts
        warm(state, profile, experts)


def warm(state: tier_mod.TierState, profile: str, experts: dict[int, int]) -> None:
    """Fill the pool with the most frequent experts of profile-router's prior `profile` (the
    least frequent first, as demanded reads: the most frequent end up the most recently used),
    then zero the counters: the first tokens find them resident. The report says how many, how
    many bytes and how long."""
    tier = state.tier
    order = tier_mod.warm_order(tier_mod.read_prior(profile), state.layer_names, experts, tier.num_slots, profile)
    t0 = time.perf_counter()
    tier.warm([layer for layer, _ in order], [e for _, e in order])
    read = tier.stats()["bytes_read"]
    tier.reset_stats()
    state.prior_note = (f"profile {profile!r}: the pool starts with the prior's {len(order)} most frequent experts "
                        f"({tier_mod.format_bytes(read)} read at enable in {time.perf_counter() - t0:.2f} s)")


def report_lines(state: tier_mod.TierState | None) -> list[str]:
    if state is None:
        return []
    lines = [f"  memory tier: {state.plan.why}"]
    if state.other_bytes is not None:
        lines.append(f"    besides the limit the process holds {tier_mod.format_bytes(state.other_bytes)} of other weights "
                     "(dense layers, embeddings, norms), the KV cache (it grows with the context) and the runtime")
    if state.tier is not None:
        t = state.tier
        modes = {t.io_mode(i) for i in range(t.num_layers)}
        lines.append(f"    eviction {t.policy}; reads: {', '.join(sorted(modes))}; prediction for "
                     f"{len(state.predicting)} of {t.num_layers} layers, refined from the layer before's output "
                     f"for {_refined(state)}")
        if state.numa is not None:
            lines.append("    " + numa.describe(t.pool_address, t.pool_bytes, state.numa))
    if state.prior_note:
        lines.append("    " + state.prior_note)
    return lines


def _refined(state: tier_mod.TierState) -> str:
    """For how many layers refine runs, or why it does not."""
    if not tier_mod.REFINE:
        return "none (experimental tier.refine=off)"
    n = sum(1 for layer in state.refining if layer - 1 in state.refine_sources)
    why = "" if n == sum(1 for layer in state.predicting if layer > 0) else (
        " (the others: a layer without a router or a plain RMSNorm as its decoder layer's "
        "post_attention_layernorm, or after a layer whose experts do not run in scope='all''s native layer step)")
    return f"{n} of {state.tier.num_layers} layers{why}"


def drop(model: nn.Module) -> None:
    state = _STATES.pop(model, None)
    for h in state.hooks if state is not None else ():
        h.remove()


def tier_stats(model: nn.Module) -> dict[str, Any]:
    """The memory tier's part of hi_na_moe.stats(model): its counters (hits, misses, bytes_read,
    prefetch_precision, prefetch_recall, io_wait_s, ...; per layer under "layers"), or
    {"memory_tier": False, "why": ...} when the model runs without one."""
    state = _STATES.get(model)
    if state is None:
        return {"memory_tier": False, "why": "no memory_limit set, or hi_na_moe is not enabled on this model"}
    if state.tier is None:
        return {"memory_tier": False, "why": state.plan.why}
    return dict(memory_tier=True, **state.stats())
