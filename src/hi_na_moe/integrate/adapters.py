"""Discovery of MoE blocks and the small per-family adapters.

One generic path covers every experts class that follows transformers' experts contract
(`@use_experts_implementation`, or the same `(hidden_states, top_k_index, top_k_weights)`
signature with 3-D expert weights): the model's own router runs untouched, and only the experts
computation is replaced. A family whose block does not separate router and experts gets a small
adapter that rebinds the *block's* forward and mirrors its original code line for line except for
the experts computation; each such adapter names the transformers class and version it mirrors.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import _default_apply_gate

from ..core.reference import apply_gate_spec
from ..core.spec import INF, ExpertsSpec, GateSpec, Runner, activation_name


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


# ---------------------------------------------------------------------------------------------
# Experts as separate modules: Switch Transformers and NLLB-MoE (transformers 5.23). Each expert
# is its own dense-act-dense module (an nn.Linear in, an activation, dropout, an nn.Linear out) in
# a ModuleDict keyed "expert_{e}". The spec lists each expert's parameters (ExpertsSpec.members):
# packing gathers them into one block; release and restore act on each parameter. The block's own
# router runs untouched (its capacity dropping, jitter, second-expert policy and the router logits
# transformers records from it for the z-loss and aux loss); the routing handed to the experts op
# is the one the experts module's own forward is found to compute on probe experts.
# ---------------------------------------------------------------------------------------------

def _separate_experts_spec(experts: nn.Module, num_experts: int, w_in: str, w_out: str,
                           act_attr: str) -> tuple[ExpertsSpec | None, str | None]:
    """The spec of `num_experts` experts experts["expert_{e}"] computing w_out(act(w_in(x)))
    (their dropout is the identity in eval; the cast before w_out is none when all weights share
    one dtype, which is required here)."""
    cls = type(experts).__name__
    if num_experts < 1:
        return None, f"the router has {num_experts} experts"
    try:
        mods = [experts[f"expert_{e}"] for e in range(num_experts)]
    except (KeyError, IndexError, TypeError) as exc:
        return None, f"{cls} does not hold experts 'expert_0'..'expert_{num_experts - 1}' ({exc!r})"
    lins = [getattr(x, n, None) for x in mods for n in (w_in, w_out)]
    odd = next((lin for lin in lins if type(lin) is not nn.Linear), None)
    if odd is not None:
        return None, (f"an expert's {w_in}/{w_out} is {type(odd).__name__}, not an nn.Linear (a quantised or "
                      "replaced layer): the experts op reads plain weight matrices")
    ins, outs = lins[0::2], lins[1::2]
    tensors = [t for lin in lins for t in (lin.weight, lin.bias) if t is not None]
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
    if len(dtypes) > 1:
        # e.g. a w_out kept in float32 in a bfloat16 model: the module casts its activations
        # between the two Linears, a packed block holds one dtype
        return None, f"the experts' {w_in}/{w_out} weights mix dtypes ({', '.join(dtypes)}); the experts op runs one"
    if not tensors[0].is_floating_point():
        return None, f"expert weights are {dtypes[0]}; the experts op takes floating-point weights"
    I, H = ins[0].weight.shape
    if any(lin.weight.shape != (I, H) for lin in ins) or any(lin.weight.shape != (H, I) for lin in outs):
        return None, f"the experts' {w_in}/{w_out} shapes differ between experts"
    for group in (ins, outs):
        if len({lin.bias is None for lin in group}) > 1:
            return None, f"some experts' {w_in}/{w_out} have a bias and others not"
    acts = [getattr(x, act_attr, None) for x in mods]
    act = activation_name(acts[0])
    if any(type(a) is not type(acts[0]) or activation_name(a) != act for a in acts):
        return None, "the experts' activations differ between experts"
    members = {"up": tuple(lin.weight for lin in ins), "down": tuple(lin.weight for lin in outs)}
    if ins[0].bias is not None:
        members["gate_up_bias"] = tuple(lin.bias for lin in ins)
    if outs[0].bias is not None:
        members["down_bias"] = tuple(lin.bias for lin in outs)
    dtype, E = tensors[0].dtype, num_experts

    def shape_only(*shape):
        return torch.empty(shape, dtype=dtype, device="meta")

    return ExpertsSpec(
        num_experts=E, hidden=H, intermediate=I, up=shape_only(E, I, H), down=shape_only(E, H, I), has_gate=False,
        gate_up_bias=shape_only(E, I) if "gate_up_bias" in members else None,
        down_bias=shape_only(E, H) if "down_bias" in members else None,
        act_fn=acts[0], gate_spec=GateSpec(act) if act else None,
        gate_unrecognised=None if act else f"activation {type(acts[0]).__name__} has no native kernel",
        members=members,
    ), None


class _ScaleTag(nn.Module):
    """A probe expert returning x * c: an output then tells which experts a token reached, with
    which weights."""

    def __init__(self, c: float):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x * self.c


def _probe_routing(experts: nn.Module, num_experts: int, inputs: tuple, candidates: dict) -> Callable | None:
    """The first of `candidates` ({name: routing(*inputs[1:]) -> (top_k_index, top_k_weights)})
    that computes what the experts module's own forward(*inputs) computes in eval, or None. The
    forward runs on a shallow copy of the module whose experts are _ScaleTag probes: the model's
    experts are neither run nor touched (this holds with their weights released or on the meta
    device)."""
    probe = copy.copy(experts)  # its own __dict__: the model's module keeps its experts and mode
    mods = dict(experts._modules)
    tags = [1.0 + (e + 1) / (num_experts + 1) for e in range(num_experts)]
    for e in range(num_experts):
        mods[f"expert_{e}"] = _ScaleTag(tags[e])
    probe.__dict__["_modules"] = mods
    probe.__dict__["training"] = False
    x = inputs[0]
    try:
        with torch.no_grad():
            want = type(experts).forward(probe, *inputs)
    except Exception:  # a forward that cannot run on the probe is not one we recognise
        return None
    if not isinstance(want, torch.Tensor) or want.shape != x.shape:
        return None
    c = torch.tensor(tags, dtype=torch.float64)
    for routing in candidates.values():
        idx, w = routing(*inputs[1:])
        got = torch.where(idx >= 0, w.double() * c[idx.clamp(min=0)], 0.0).sum(-1, keepdim=True) * x.double()
        if torch.allclose(want.double(), got, rtol=1e-5, atol=1e-7):
            return routing
    return None


def _own_experts(block: nn.Module, spec: ExpertsSpec, *args):
    """Training mode runs the experts module's own code: its dropout draws random numbers the
    packed kernels cannot reproduce (the router runs its own code in every mode)."""
    if spec.cache.get("released"):
        raise RuntimeError(
            f"hi_na_moe: {type(block).__name__} is in training mode, which runs its experts' own code (their "
            "dropout), but their weights are packed for the native kernels and released from the model; call "
            "model.eval() for inference, enable with keep_weights=True to train (keeps both copies), or call "
            "hi_na_moe.disable_for_model(model) first")
    return block.experts(*args)


def _switch_routing(selected_experts: torch.Tensor, routing_weights: torch.Tensor):
    """SwitchTransformersExperts' routing: the expert of a token's one-hot row ([T, 1, E]; a zero
    row when capacity dropped the token, whose output is then zero) times the router's
    probability of its top-1 expert ([T, 1])."""
    idx = torch.where(selected_experts.any(-1), selected_experts.argmax(-1), -1)
    return idx.view(-1, 1), routing_weights.view(-1, 1)


def _switch_checked_routing(m: nn.Module) -> Callable | None:
    E, T = int(m.router.num_experts), 9
    g = torch.Generator().manual_seed(0)
    x = torch.rand(T, 3, generator=g) + 0.5
    sel = torch.zeros(T, 1, E, dtype=torch.long)
    for t in range(T):
        if t % 3:  # every third token dropped by capacity
            sel[t, 0, (t * 5 + 1) % E] = 1
    w = torch.rand(T, 1, generator=g) * 0.6 + 0.2
    return _probe_routing(m.experts, E, (x, sel, w), {"one-hot top-1": _switch_routing})


def _switch_spec(m: nn.Module) -> tuple[ExpertsSpec | None, str | None]:
    if _switch_checked_routing(m) is None:
        return None, (f"{type(m.experts).__name__}.forward does not compute what the adapter mirrors (transformers "
                      "5.23: each token's one-hot top-1 expert times its router probability)")
    return _separate_experts_spec(m.experts, int(m.router.num_experts), "wi", "wo", "act")


def _switch_forward(match: BlockMatch, run: Runner) -> Callable:
    """Mirrors transformers 5.23 `SwitchTransformersSparseMLP.forward`: the router runs on the
    unflattened states (capacity counts per sequence) and returns the capacity-masked one-hot
    choice; the per-expert loop is the experts op."""
    spec = match.spec

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        selected_experts, routing_weights, _ = self.router(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_dim)
        selected_experts = selected_experts.view(-1, 1, self.router.num_experts)
        routing_weights = routing_weights.view(-1, 1)
        if self.training:
            hidden_states = _own_experts(self, spec, hidden_states, selected_experts, routing_weights)
        else:
            hidden_states = run(spec, hidden_states, *_switch_routing(selected_experts, routing_weights))
        return hidden_states.reshape(batch_size, sequence_length, hidden_dim)

    return forward


def _nllb_candidates(scale: float) -> dict[str, Callable]:
    """What NllbMoeExperts(hidden, router_mask, router_probs) may compute, as routings for the
    experts op; `scale` is its eval-mode token-dropout factor (1 - moe_token_dropout)."""

    def by_mask_value(router_mask, router_probs):
        # transformers 5.23 one-hot encodes the router's [T, E] top-1 mask *values*: expert 1 runs
        # where the mask is 1 (the kept top-1 expert, weighted by its probability) and expert 0
        # where it is 0 (weighted by the probability there: the kept top-2 expert's, zero elsewhere)
        p = router_probs.float()
        on = router_mask.to(torch.float32)
        w = torch.stack([(p * on).sum(-1), (p * (1 - on)).sum(-1)], -1)
        idx = torch.tensor([1, 0], device=p.device).expand_as(w)
        return torch.where(w != 0, idx, -1), w * scale

    def by_expert(router_mask, router_probs):
        # fairseq's NLLB-MoE (and transformers 4.x): each expert with a nonzero combine weight,
        # at most two a token (the kept top-1 and top-2)
        w, idx = router_probs.float().topk(min(2, router_probs.shape[-1]), dim=-1)
        return torch.where(w != 0, idx, -1), w * scale

    return {"by mask value": by_mask_value, "by expert": by_expert}


def _nllb_checked_routing(m: nn.Module) -> Callable | None:
    E, T = int(m.router.num_experts), 12
    drop = getattr(m.experts, "moe_token_dropout", 0.0)
    scale = 1.0 - drop if isinstance(drop, (int, float)) and drop > 0 else 1.0
    g = torch.Generator().manual_seed(0)
    x = torch.rand(T, 3, generator=g) + 0.5
    mask = torch.zeros(T, E, dtype=torch.long)
    probs = torch.zeros(T, E)
    for t in range(T):  # top-1 and top-2 each kept or dropped by capacity, in every combination
        a = (t * 7 + 2) % E
        b = (a + 1 + t % max(1, E - 1)) % E
        p1, p2 = 0.5 + 0.4 * float(torch.rand(1, generator=g)), 0.1 + 0.3 * float(torch.rand(1, generator=g))
        if t % 4 in (0, 2):
            mask[t, a] = 1
            probs[t, a] = p1
        if t % 4 in (0, 1) and b != a:
            probs[t, b] = p2
    return _probe_routing(m.experts, E, (x, mask, probs), _nllb_candidates(scale))


def _nllb_spec(m: nn.Module) -> tuple[ExpertsSpec | None, str | None]:
    if _nllb_checked_routing(m) is None:
        return None, (f"{type(m.experts).__name__}.forward matches neither routing the adapter knows (transformers "
                      "5.23's experts by top-1 mask value, or fairseq's by expert index)")
    return _separate_experts_spec(m.experts, int(m.router.num_experts), "fc1", "fc2", "act")


def _nllb_forward(match: BlockMatch, run: Runner) -> Callable:
    """Mirrors transformers 5.23 `NllbMoeSparseMLP.forward`: the router (top-2, expert capacity,
    second-expert policy, padding mask) runs untouched; its [T, E] top-1 mask and combine weights
    go to the experts op through the routing the experts module's own forward was found to
    compute (_nllb_candidates), its eval token-dropout factor folded into the weights."""
    spec = match.spec
    routing = _nllb_checked_routing(match.module)
    if routing is None:  # the experts' forward changed since discovery (_nllb_spec probed it)
        raise RuntimeError(f"hi_na_moe: {match.name}: {type(match.module.experts).__name__}.forward no longer "
                           "computes a routing the adapter knows; call enable_for_model again")

    def forward(self, hidden_states, padding_mask=None):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        top_1_mask, router_probs, _ = self.router(hidden_states, padding_mask)
        if self.training:
            hidden_states = _own_experts(self, spec, hidden_states, top_1_mask, router_probs)
        else:
            hidden_states = run(spec, hidden_states, *routing(top_1_mask, router_probs))
        return hidden_states.reshape(batch_size, sequence_length, hidden_dim)

    return forward


BLOCK_ADAPTERS["SwitchTransformersSparseMLP"] = (_switch_spec, _switch_forward)
BLOCK_ADAPTERS["NllbMoeSparseMLP"] = (_nllb_spec, _nllb_forward)
