"""Discovery of MoE blocks and the small per-family adapters.

One generic path covers every experts class that follows transformers' experts contract
(`@use_experts_implementation`, or the same `(hidden_states, top_k_index, top_k_weights)`
signature with 3-D expert weights): the model's own router runs untouched, and only the experts
computation is replaced. A family whose block does not separate router and experts gets a small
adapter that rebinds the *block's* forward and mirrors its original code line for line except for
the experts computation; each such adapter names the transformers class and version it mirrors.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .reference import apply_gate_spec
from .spec import INF, ExpertsSpec, GateSpec, Runner, activation_name


@dataclass
class BlockMatch:
    """One MoE block found in a model."""

    name: str  # dotted module path
    module: nn.Module  # the module whose forward is rebound
    adapter: str  # which path handles it
    spec: ExpertsSpec | None  # None when it cannot be accelerated
    reason: str | None = None  # why not, when spec is None
    # Builds the replacement forward for `module`, given the experts runner.
    make_forward: Callable[["BlockMatch", Runner], Callable] | None = None
    # Builds the spec again from the module's current parameters (after their storage changed).
    rebuild: Callable[[], ExpertsSpec | None] | None = None


# ---------------------------------------------------------------------------------------------
# Gate recognition: turn a model's own gate code into the parametric GateSpec, and prove it.
# ---------------------------------------------------------------------------------------------

def _probe_split(gu: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (gu[..., 0::2], gu[..., 1::2]) if interleaved else gu.chunk(2, dim=-1)


def _gate_matches(apply_gate: Callable, spec: GateSpec, interleaved: bool) -> bool:
    """Compare the model's gate function with `spec` on values spanning every clamp region."""
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(8, 64, generator=g) * 12.0
    try:
        want = apply_gate(gu)
    except Exception:  # a gate that cannot run on a plain fp32 probe is not one we recognise
        return False
    got = apply_gate_spec(spec, *_probe_split(gu, interleaved))
    return want.shape == got.shape and torch.allclose(want.float(), got.float(), rtol=1e-5, atol=1e-5)


def _scalar_attr(module: nn.Module, *names: str) -> float | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
            return float(value)
    return None


def recognise_gate(module: nn.Module, interleaved: bool) -> tuple[GateSpec | None, str | None]:
    """The parametric form of `module._apply_gate` (or act(gate)*up), verified numerically."""
    from transformers.integrations.moe import _default_apply_gate

    act_fn = getattr(module, "act_fn", None)
    act = activation_name(act_fn) if act_fn is not None else None
    own_gate = getattr(type(module), "_apply_gate", None)
    if own_gate is None or own_gate is _default_apply_gate:
        if act is None:
            return None, f"activation {type(act_fn).__name__} has no native kernel"
        return GateSpec(act), None
    limit = _scalar_attr(module, "limit", "swiglu_limit")
    limit = INF if limit is None or math.isnan(limit) else limit
    alpha = _scalar_attr(module, "alpha", "swiglu_alpha") or 1.702
    candidates = []
    for name in dict.fromkeys([act, "silu"]):
        if name is None:
            continue
        candidates += [
            GateSpec(name, gate_limit=limit, up_limit=limit),  # clamp, then act(gate) * up
            GateSpec(name, post_act_limit=limit, up_limit=limit),  # act(gate) clamped afterwards
        ]
    candidates.append(GateSpec("sigmoid_alpha", alpha=alpha, gate_limit=limit, up_limit=limit, up_offset=1.0))
    bound = own_gate.__get__(module)
    for cand in candidates:
        if _gate_matches(bound, cand, interleaved):
            return cand, None
    return None, f"custom gate {type(module).__name__}._apply_gate matches no native activation form"


# ---------------------------------------------------------------------------------------------
# Experts-level paths: rebind the experts module's forward(hidden, top_k_index, top_k_weights).
# ---------------------------------------------------------------------------------------------

def experts_forward_factory(match: BlockMatch, run: Runner) -> Callable:
    spec = match.spec

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        if hidden_states.dim() == 2:  # what transformers' MoE blocks pass (a reshape costs ~1-3 us)
            return run(spec, hidden_states, top_k_index, top_k_weights)
        shape = hidden_states.shape
        out = run(spec, hidden_states.reshape(-1, shape[-1]), top_k_index, top_k_weights)
        return out.reshape(shape)

    return forward


def _is_interface_experts(m: nn.Module) -> bool:
    """Instances of classes decorated with transformers' `@use_experts_implementation`."""
    return all(hasattr(m, a) for a in ("has_gate", "is_transposed", "is_concatenated", "has_bias")) and (
        isinstance(getattr(m, "down_proj", None), torch.Tensor)
    )


def spec_from_interface(m: nn.Module) -> tuple[ExpertsSpec | None, str | None]:
    has_gate, transposed = bool(m.has_gate), bool(m.is_transposed)
    interleaved = not bool(m.is_concatenated)
    gu = m.gate_up_proj if has_gate else m.up_proj
    down = m.down_proj
    if gu is None or down is None or gu.dim() != 3 or down.dim() != 3:
        return None, "expert weights are not 3-D tensors"
    E = gu.shape[0]
    H, I2 = (gu.shape[1], gu.shape[2]) if transposed else (gu.shape[2], gu.shape[1])
    I = I2 // 2 if has_gate else I2
    bias_gu = bias_down = None
    if m.has_bias:
        bias_gu = m.gate_up_proj_bias if has_gate else m.up_proj_bias
        bias_down = m.down_proj_bias
    gate_spec, why = (None, None)
    apply_gate = None
    if has_gate:
        gate_spec, why = recognise_gate(m, interleaved)
        apply_gate = m._apply_gate
    else:
        act = activation_name(getattr(m, "act_fn", None))
        gate_spec = GateSpec(act) if act else None
        why = None if act else f"activation {type(getattr(m, 'act_fn', None)).__name__} has no native kernel"
    spec = ExpertsSpec(
        num_experts=E, hidden=H, intermediate=I, gate_up=gu, down=down, transposed=transposed,
        down_transposed=transposed, interleaved=interleaved, has_gate=has_gate,
        gate_up_bias=bias_gu, down_bias=bias_down, apply_gate=apply_gate,
        act_fn=getattr(m, "act_fn", None), gate_spec=gate_spec, gate_unrecognised=why,
        post_expert_norm=m.post_expert_norm if getattr(m, "has_post_expert_norm", False) else None,
    )
    return spec, None


def _takes_top_k(m: nn.Module) -> bool:
    try:
        params = inspect.signature(type(m).forward).parameters
    except (TypeError, ValueError):
        return False
    return "top_k_index" in params and "top_k_weights" in params


def spec_from_structure(m: nn.Module) -> tuple[ExpertsSpec | None, str | None]:
    """Experts classes with the contract's signature but without the decorator (Step 3.7, LongCat
    Flash, DBRX in transformers 5.23): read the layout from the weights' shapes."""
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3:
        # gate_up [E', 2I, H] and down [E, H, I]; E' > E when zero-computation experts exist.
        E, H, I = down.shape
        if gu.shape[1:] != (2 * I, H):
            return None, f"unrecognised expert weight shapes gate_up {tuple(gu.shape)} / down {tuple(down.shape)}"
        n_identity = int(getattr(m, "zero_expert_num", 0) or 0)
        if gu.shape[0] - E not in (0, n_identity):
            return None, f"gate_up has {gu.shape[0]} experts but down has {E}"
        gate_spec, why = recognise_gate(m, interleaved=False)
        return ExpertsSpec(
            num_experts=E, hidden=H, intermediate=I, gate_up=gu[:E], down=down,
            apply_gate=m._apply_gate if hasattr(type(m), "_apply_gate") else None,
            gate_spec=gate_spec, gate_unrecognised=why, n_identity=n_identity,
        ), None
    mlp = getattr(m, "mlp", None)
    if mlp is not None and all(isinstance(getattr(mlp, n, None), torch.Tensor) for n in ("w1", "v1", "w2")):
        # DBRX: w1 (gate), v1 (up) [E*I, H]; w2 [E*I, H] used as x @ w2_e, i.e. down transposed.
        E = int(m.num_experts)
        H = mlp.w1.shape[1]
        I = mlp.w1.shape[0] // E
        act = activation_name(mlp.activation_fn)
        return ExpertsSpec(
            num_experts=E, hidden=H, intermediate=I, gate=mlp.w1.view(E, I, H), up=mlp.v1.view(E, I, H),
            down=mlp.w2.view(E, I, H), down_transposed=True,
            gate_spec=GateSpec(act) if act else None,
            gate_unrecognised=None if act else f"activation {type(mlp.activation_fn).__name__} has no native kernel",
        ), None
    return None, "experts module with an unrecognised weight layout"


# ---------------------------------------------------------------------------------------------
# Block-level adapters, for families whose block mixes routing and experts in one forward.
# ---------------------------------------------------------------------------------------------

def _llama4_forward(match: BlockMatch, run: Runner) -> Callable:
    """Mirrors transformers 5.23 `Llama4TextMoe.forward`. Llama 4 scales each expert's *input*
    by the sigmoid router score; the router's top-k set is recovered with the same `torch.topk`
    call the router makes on the same logits, so the choice is identical."""
    spec = match.spec

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_scores, router_logits = self.router(hidden_states)
        top_k_index = torch.topk(router_logits, self.router.top_k, dim=1).indices
        top_k_weights = router_scores.gather(1, top_k_index)
        routed_out = run(spec, hidden_states, top_k_index, top_k_weights)
        out = self.shared_expert(hidden_states)
        out.add_(routed_out)
        return out, router_logits

    return forward


def _llama4_spec(m: nn.Module) -> tuple[ExpertsSpec | None, str | None]:
    ex = m.experts
    gu, down = ex.gate_up_proj, ex.down_proj  # [E, H, 2I], [E, I, H]
    E, H, I2 = gu.shape
    act = activation_name(ex.act_fn)
    return ExpertsSpec(
        num_experts=E, hidden=H, intermediate=I2 // 2, gate_up=gu, down=down, transposed=True,
        down_transposed=True, gate_spec=GateSpec(act) if act else None,
        gate_unrecognised=None if act else f"activation {type(ex.act_fn).__name__} has no native kernel",
        weight_on_input=True,
    ), None


def _jetmoe_forward(match: BlockMatch, run: Runner) -> Callable:
    """Mirrors transformers 5.23 `JetMoeMoE.forward`. Its router returns tokens already sorted
    per expert; the [T, K] routing is read back from those outputs (no routing math redone)."""
    spec = match.spec

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        index_sorted, _, batch_gates, expert_size, _ = self.router(layer_input)
        T, K = layer_input.shape[0], self.router.top_k
        sorted_experts = torch.repeat_interleave(
            torch.arange(len(expert_size), device=layer_input.device),
            torch.tensor(expert_size, device=layer_input.device),
        )
        top_k_index = torch.empty(T * K, dtype=torch.long, device=layer_input.device)
        top_k_index[index_sorted] = sorted_experts
        top_k_weights = torch.empty(T * K, dtype=batch_gates.dtype, device=layer_input.device)
        top_k_weights[index_sorted] = batch_gates
        out = run(spec, layer_input, top_k_index.view(T, K), top_k_weights.view(T, K))
        return out.view(bsz, length, self.input_size) + self.bias

    return forward


def _jetmoe_spec(m: nn.Module) -> tuple[ExpertsSpec | None, str | None]:
    gu, down = m.input_linear.weight, m.output_linear.weight  # [E, 2I, H], [E, H, I]
    E, I2, H = gu.shape
    act = activation_name(m.activation)
    return ExpertsSpec(
        num_experts=E, hidden=H, intermediate=I2 // 2, gate_up=gu, down=down,
        gate_spec=GateSpec(act) if act else None,
        gate_unrecognised=None if act else f"activation {type(m.activation).__name__} has no native kernel",
    ), None


def _doge_forward(match: BlockMatch, run: Runner) -> Callable:
    """Mirrors transformers 5.23 `DogeCDMoE.forward`: its product-key routing code is kept as the
    model wrote it (it is inline in the block, there is no router module to call); the retrieval
    experts (rank-1: act(x . down_embed[e]) * up_embed[e]) go through the experts op."""
    import torch.nn.functional as F

    spec = match.spec

    def forward(self, hidden_states, **kwargs):
        bsz, seq_len, _ = hidden_states.shape
        router_logits = self.router_gate(hidden_states).view(2, bsz * seq_len, -1)
        (scores_x, scores_y), (indices_x, indices_y) = router_logits.topk(self.num_keys, dim=-1)
        all_scores = scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)
        all_indices = indices_x.unsqueeze(-1) * self.num_keys + indices_y.unsqueeze(-2)
        all_scores = all_scores.view(*all_scores.shape[:-2], -1)
        all_indices = all_indices.view(*all_indices.shape[:-2], -1)
        scores, position_indices = all_scores.topk(self.top_k, dim=-1)
        indices = all_indices.gather(-1, position_indices)
        routing_weights = F.softmax(scores, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        flat = hidden_states.view(bsz * seq_len, -1)
        experts_states = run(spec, flat, indices, routing_weights).view(bsz, seq_len, -1)
        hidden_states = self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))
        hidden_states = hidden_states + experts_states
        return hidden_states, router_logits

    return forward


def _doge_spec(m: nn.Module) -> tuple[ExpertsSpec | None, str | None]:
    # Each retrieval expert is a rank-1 MLP without gate: up = down_embed[e] ([1, H]), act,
    # down = up_embed[e] ([H, 1]).
    down_embed, up_embed = m.down_embed.weight, m.up_embed.weight  # [E, H] each
    E, H = down_embed.shape
    act = activation_name(m.act_fn)
    return ExpertsSpec(
        num_experts=E, hidden=H, intermediate=1, up=down_embed.view(E, 1, H), down=up_embed.view(E, H, 1),
        has_gate=False, act_fn=m.act_fn, gate_spec=GateSpec(act) if act else None,
        gate_unrecognised=None if act else f"activation {type(m.act_fn).__name__} has no native kernel",
    ), None


# class name -> (spec builder, forward factory); a block adapter claims the whole block.
BLOCK_ADAPTERS: dict[str, tuple[Callable, Callable]] = {
    "Llama4TextMoe": (_llama4_spec, _llama4_forward),
    "JetMoeMoE": (_jetmoe_spec, _jetmoe_forward),
    "DogeCDMoE": (_doge_spec, _doge_forward),
}

# Blocks recognised as routed-expert blocks that stay native, and why.
NATIVE_ONLY: dict[str, str] = {
    "JetMoeMoA": "mixture of attention heads (MoA): attention experts stay native",
    "SwitchTransformersSparseMLP": "encoder-decoder family: experts are separate Linear modules (not accelerated yet)",
    "NllbMoeSparseMLP": "encoder-decoder family: experts are separate Linear modules (not accelerated yet)",
}


def _router_experts_block(model: nn.Module, router_name: str) -> tuple[str, nn.Module]:
    """The experts module next to the router the user named."""
    try:
        router = model.get_submodule(router_name)
    except AttributeError:
        raise ValueError(
            f"router_name={router_name!r}: no such submodule in {type(model).__name__}; "
            "pass the dotted path printed by `print(model)` (e.g. 'model.layers.0.mlp.gate')"
        ) from None
    parent_name = router_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    for child_name, child in parent.named_children():
        if child is router:
            continue
        if _is_interface_experts(child) or spec_from_structure(child)[0] is not None:
            return (f"{parent_name}.{child_name}" if parent_name else child_name), child
    raise ValueError(
        f"router_name={router_name!r}: its parent {type(parent).__name__} has no experts module next to the "
        "router with 3-D expert weights (gate_up_proj [E, 2I, H] and down_proj [E, H, I]) called as "
        "experts(hidden_states, top_k_index, top_k_weights); hi_na_moe cannot tell which computation to replace"
    )


def discover(model: nn.Module, router_name: str | None = None) -> list[BlockMatch]:
    """Every MoE block in `model`, accelerated or not, in module order."""
    matches: list[BlockMatch] = []
    claimed: set[int] = set()
    extra: dict[int, str] = {}
    if router_name is not None:
        name, experts = _router_experts_block(model, router_name)
        extra[id(experts)] = name
    for name, m in model.named_modules():
        if id(m) in claimed:
            continue
        cls = type(m).__name__
        if cls in NATIVE_ONLY:
            matches.append(BlockMatch(name, m, f"block:{cls}", None, NATIVE_ONLY[cls]))
            claimed.update(id(c) for c in m.modules())
            continue
        if cls in BLOCK_ADAPTERS:
            adapter, (build, factory) = f"block:{cls}", BLOCK_ADAPTERS[cls]
        elif _is_interface_experts(m):
            adapter, build, factory = "experts-interface", spec_from_interface, experts_forward_factory
        elif _takes_top_k(m) or id(m) in extra:
            adapter, build, factory = "experts-structural", spec_from_structure, experts_forward_factory
        else:
            continue
        spec, why = build(m)
        matches.append(BlockMatch(name, m, adapter, spec, why, factory if spec else None,
                                  rebuild=lambda m=m, build=build: build(m)[0]))
        claimed.update(id(c) for c in m.modules())
    return matches
