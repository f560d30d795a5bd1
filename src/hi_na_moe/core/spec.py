"""A normalised description of one set of routed experts: where the weights are, in which
layout, and what the gate/activation computes.

Shape letters (used the same way everywhere): T tokens, E experts, K top-k, H hidden,
I expert intermediate.

The spec holds *views* of the model's own parameters, never copies: building one costs nothing,
and the model's storage is untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import transformers.activations as ta
from torch import nn

INF = math.inf

# Activation names shared with the native kernels (csrc/include/hina_moe/moe.h).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2", "sigmoid_alpha", "identity")


@dataclass(frozen=True)
class GateSpec:
    """The gated activation in parametric form, the only form the native kernels run:

        g' = min(g, gate_limit);  u' = clamp(u, -up_limit, up_limit)
        h  = min(act(g'), post_act_limit) * (u' + up_offset)        (gated experts)
        h  = act(u)                                                 (experts without a gate)

    with act one of ACTIVATIONS (sigmoid_alpha: z * sigmoid(alpha * z), GPT-OSS's SwiGLU).
    """

    act: str
    alpha: float = 1.702
    gate_limit: float = INF
    up_limit: float = INF
    post_act_limit: float = INF
    up_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.act not in ACTIVATIONS:
            raise ValueError(f"activation {self.act!r} is not one of {ACTIVATIONS}")

    def describe(self) -> str:
        parts = [self.act]
        if self.act == "sigmoid_alpha":
            parts.append(f"alpha={self.alpha:g}")
        if self.gate_limit != INF or self.up_limit != INF:
            parts.append(f"limit={self.gate_limit:g}/{self.up_limit:g}")
        if self.post_act_limit != INF:
            parts.append(f"post_act_limit={self.post_act_limit:g}")
        if self.up_offset:
            parts.append(f"up_offset={self.up_offset:g}")
        return ",".join(parts)


def activation_name(act_fn: object) -> str | None:
    """Name of a transformers/torch activation module in the kernels' vocabulary, or None."""
    table: list[tuple[type, str]] = [
        (ta.SiLUActivation, "silu"),
        (nn.SiLU, "silu"),
        (ta.GELUTanh, "gelu_tanh"),
        (ta.NewGELUActivation, "gelu_tanh"),
        (ta.ReLUSquaredActivation, "relu2"),
        (nn.ReLU, "relu"),
        (ta.LinearActivation, "identity"),
        (nn.Identity, "identity"),
    ]
    for cls, name in table:
        if type(act_fn) is cls:
            return name
    if type(act_fn) is ta.GELUActivation:
        return "gelu"
    if type(act_fn) is nn.GELU:
        return "gelu_tanh" if getattr(act_fn, "approximate", "none") == "tanh" else "gelu"
    if act_fn is torch.nn.functional.silu:
        return "silu"
    return None


@dataclass
class ExpertsSpec:
    """Where the weights of E experts are and how to apply them.

    Weights are stored either as one fused gate_up tensor ([E, 2I, H], or [E, H, 2I] when
    `transposed`; gate and up halves concatenated, or interleaved row by row) or as separate
    gate and up tensors ([E, I, H], or [E, H, I] when transposed). `down` is [E, H, I], or
    [E, I, H] when `down_transposed`.
    """

    num_experts: int
    hidden: int
    intermediate: int
    down: torch.Tensor
    down_transposed: bool = False
    gate_up: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    up: torch.Tensor | None = None
    transposed: bool = False
    interleaved: bool = False
    has_gate: bool = True
    gate_up_bias: torch.Tensor | None = None  # [E, 2I] (layout as gate_up) or [E, I] without gate
    down_bias: torch.Tensor | None = None  # [E, H]
    # The model's own gate function on the fused gate_up output, when it has one (exact semantics
    # for the reference path). Otherwise the reference path applies `gate_spec`.
    apply_gate: Callable[[torch.Tensor], torch.Tensor] | None = None
    act_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Parametric form for the native kernels; None when the gate is not recognised.
    gate_spec: GateSpec | None = None
    gate_unrecognised: str | None = None  # why gate_spec is None
    post_expert_norm: nn.Module | None = None
    # Zero-computation experts (LongCat): indices E .. E+n_identity-1 return their input.
    n_identity: int = 0
    # Llama 4 scales each expert's *input* by its routing weight instead of its output.
    weight_on_input: bool = False
    # Per-spec cache (e.g. the packed native weights); never part of equality.
    cache: dict = field(default_factory=dict, compare=False, repr=False)
    # Experts held as separate modules (Switch Transformers, NLLB-MoE: an nn.Linear per expert):
    # per field ("up", "down", "gate_up_bias", "down_bias"), the E per-expert parameters
    # themselves. The field then holds a meta-device tensor of the stacked shape (its shape and
    # dtype, no data: reading it fails loudly); the stacked weights are gathered where they are
    # read (canonical), and released and restored parameter by parameter. No gate, not transposed.
    members: dict[str, tuple[torch.Tensor, ...]] | None = None

    def __post_init__(self) -> None:
        if self.members is not None and (self.has_gate or self.transposed or self.down_transposed
                                         or self.gate_up is not None or self.gate is not None):
            raise ValueError("ExpertsSpec.members describes experts without a gate, in the [E, I, H] up and "
                             "[E, H, I] down layout only")

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.down.dtype

    def weight_tensors(self) -> list[torch.Tensor]:
        if self.members is not None:
            return [t for ts in self.members.values() for t in ts]
        ts = [self.gate_up, self.gate, self.up, self.down, self.gate_up_bias, self.down_bias]
        return [t for t in ts if t is not None]

    def member(self, name: str, e: int) -> torch.Tensor | None:
        """Expert e's own tensor of field `name` (None when the field is)."""
        if self.members is not None and name in self.members:
            return self.members[name][e]
        t = getattr(self, name)
        return None if t is None else t[e]

    def _gathered(self, name: str) -> torch.Tensor | None:
        if name not in self.members:
            return None
        return torch.stack([t.detach() for t in self.members[name]])

    def write_members(self, up: torch.Tensor | None, down: torch.Tensor | None, up_bias: torch.Tensor | None,
                      down_bias: torch.Tensor | None) -> None:
        """Copy stacked canonical tensors (as canonical() and canonical_biases() give them) into
        the member parameters, expert by expert."""
        with torch.no_grad():
            for name, src in (("up", up), ("down", down), ("gate_up_bias", up_bias), ("down_bias", down_bias)):
                if src is None or name not in self.members:
                    continue
                dst = self.members[name]
                src = src.reshape(len(dst), *dst[0].shape)
                for e, d in enumerate(dst):
                    d.copy_(src[e])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())

    def with_(self, **changes) -> "ExpertsSpec":
        return replace(self, cache={}, **changes)

    # --- per-expert weight views, as F.linear wants them ([out, in]) ---
    def gate_up_weight(self, e: int) -> torch.Tensor:
        """[2I, H] (or [I, H] without gate) in the model's own output layout."""
        w = self.gate_up[e] if self.gate_up is not None else self.member("up", e)
        return w.t() if self.transposed else w

    def down_weight(self, e: int) -> torch.Tensor:
        w = self.member("down", e)
        return w.t() if self.down_transposed else w

    def canonical(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(gate [E, I, H] or None, up [E, I, H], down [E, H, I]) as views (maybe strided);
        gathered copies when the experts are separate modules (`members`)."""
        if self.members is not None:
            return None, self._gathered("up"), self._gathered("down")
        I = self.intermediate
        if self.gate_up is not None and self.has_gate:
            gu = self.gate_up.transpose(1, 2) if self.transposed else self.gate_up  # [E, 2I, H]
            if self.interleaved:
                gate, up = gu[:, 0::2, :], gu[:, 1::2, :]
            else:
                gate, up = gu[:, :I, :], gu[:, I:, :]
        else:
            src_up = self.gate_up if self.gate_up is not None else self.up
            up = src_up.transpose(1, 2) if self.transposed else src_up
            gate = None
            if self.has_gate:
                gate = self.gate.transpose(1, 2) if self.transposed else self.gate
        down = self.down.transpose(1, 2) if self.down_transposed else self.down
        return gate, up, down

    def canonical_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(gate_bias [E, I], up_bias [E, I], down_bias [E, H]) or Nones."""
        if self.members is not None:
            return None, self._gathered("gate_up_bias"), self._gathered("down_bias")
        b = self.gate_up_bias
        if b is None:
            return None, None, self.down_bias
        if not self.has_gate:
            return None, b, self.down_bias
        I = self.intermediate
        if self.interleaved:
            return b[:, 0::2], b[:, 1::2], self.down_bias
        return b[:, :I], b[:, I:], self.down_bias


def check_routing(spec: ExpertsSpec, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> None:
    """The checks every experts runner makes on its inputs before computing anything (cheap: no
    data is read; the index range is checked where the indices are read, see the runners).
    hidden [T, H] of a floating dtype; top_k_index [T, K] of an integer dtype; top_k_weights
    [T, K] of a floating dtype. Raises TypeError / ValueError naming the argument."""
    if not hidden.is_floating_point():
        raise TypeError(f"hi_na_moe: hidden_states must be floating point, got {hidden.dtype}")
    if hidden.dim() != 2 or hidden.shape[-1] != spec.hidden:
        raise ValueError(
            f"hi_na_moe: hidden_states has shape {tuple(hidden.shape)}, expected [tokens, {spec.hidden}] "
            "(the experts' hidden size)")
    if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype is torch.bool:
        raise TypeError(
            f"hi_na_moe: top_k_index must hold integer expert indices, got {top_k_index.dtype}; pass the router's "
            "top-k indices (e.g. torch.topk(...).indices)")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"hi_na_moe: top_k_index has shape {tuple(top_k_index.shape)}, expected [{hidden.shape[0]}, K] "
            "(one row of expert indices per token of hidden_states)")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"hi_na_moe: top_k_weights must be floating point, got {top_k_weights.dtype}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"hi_na_moe: top_k_weights has shape {tuple(top_k_weights.shape)}, expected {tuple(top_k_index.shape)} "
            "(the shape of top_k_index: one weight per routed expert)")


def index_range_error(bad: int, n_total: int) -> ValueError:
    return ValueError(
        f"hi_na_moe: top_k_index holds expert {bad}, but this block has {n_total} experts (valid: 0..{n_total - 1}; "
        "negative indices mean 'skip this slot')")


# What replaces an experts computation: run(spec, hidden [T, H], top_k_index [T, K],
# top_k_weights [T, K]) -> [T, H]. The reference path and the native runner both have this shape.
Runner = Callable[[ExpertsSpec, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
