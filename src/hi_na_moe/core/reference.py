"""Pure-PyTorch routed-experts computation: obviously correct, every layout and gate variant.

It is the oracle every native kernel is tested against, the fallback where no native kernel
fits (the enable report then says "reference"), and the baseline for bench/debug.

Accumulation is in fp32 and the result is cast to the input dtype once (as transformers'
grouped_mm/batched_mm paths do); the per-expert matmuls run in the weights' dtype, like the
model's own eager code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import ExpertsSpec, GateSpec, check_routing, index_range_error


def activation(name: str, z: torch.Tensor, alpha: float = 1.702) -> torch.Tensor:
    """The activations the kernels implement, by their names in spec.ACTIVATIONS."""
    if name == "silu":
        return F.silu(z)
    if name == "gelu":
        return F.gelu(z)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if name == "relu":
        return F.relu(z)
    if name == "relu2":
        return torch.square(F.relu(z))
    if name == "sigmoid_alpha":
        return z * torch.sigmoid(z * alpha)
    if name == "identity":
        return z
    raise ValueError(f"unknown activation {name!r}")


def apply_gate_spec(spec: GateSpec, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation in parametric form (see GateSpec), in the inputs' dtype."""
    if spec.gate_limit != float("inf"):
        gate = gate.clamp(max=spec.gate_limit)
    if spec.up_limit != float("inf"):
        up = up.clamp(min=-spec.up_limit, max=spec.up_limit)
    a = activation(spec.act, gate, spec.alpha)
    if spec.post_act_limit != float("inf"):
        a = a.clamp(max=spec.post_act_limit)
    if spec.up_offset:
        up = up + spec.up_offset
    return a * up


def _split(spec: ExpertsSpec, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if spec.interleaved:
        return gu[..., 0::2], gu[..., 1::2]
    return gu.chunk(2, dim=-1)


def expert_forward(spec: ExpertsSpec, e: int, x: torch.Tensor) -> torch.Tensor:
    """One expert on the rows of x ([n, H] in the weight dtype) → [n, H] in the weight dtype."""
    if spec.gate_up is not None or not spec.has_gate:
        bias = spec.member("gate_up_bias", e)
        gu = F.linear(x, spec.gate_up_weight(e), bias)
        if not spec.has_gate:
            h = spec.act_fn(gu) if spec.act_fn is not None else apply_gate_spec(spec.gate_spec, gu, gu)
        elif spec.apply_gate is not None:
            h = spec.apply_gate(gu)
        else:
            h = apply_gate_spec(spec.gate_spec, *_split(spec, gu))
    else:
        g_w = spec.gate[e].t() if spec.transposed else spec.gate[e]
        u_w = spec.up[e].t() if spec.transposed else spec.up[e]
        h = apply_gate_spec(spec.gate_spec, F.linear(x, g_w), F.linear(x, u_w))
    bias = spec.member("down_bias", e)
    y = F.linear(h, spec.down_weight(e), bias)
    if spec.post_expert_norm is not None:
        y = spec.post_expert_norm(y)
    return y


def experts_forward(
    spec: ExpertsSpec, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]); indices < 0 are skipped.

    hidden: [T, H]; top_k_index: [T, K] (int); top_k_weights: [T, K] (float). Returns [T, H] in
    hidden's dtype.
    """
    check_routing(spec, hidden, top_k_index, top_k_weights)
    T, H = hidden.shape
    K = top_k_index.shape[-1]
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    if T == 0 or K == 0:
        return out.to(hidden.dtype)
    n_total = spec.num_experts + spec.n_identity
    flat_e = top_k_index.reshape(-1)
    flat_w = top_k_weights.reshape(-1)
    if bool((flat_e >= n_total).any()):
        raise index_range_error(int(flat_e.max()), n_total)
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e.clamp(min=-1) + 1, minlength=n_total + 1).tolist()
    tokens = order // K
    start = counts[0]  # skipped slots (index < 0) sort first
    x_w = hidden.to(spec.weight_dtype)
    for e, n in enumerate(counts[1:]):
        if n == 0:
            continue
        rows = slice(start, start + n)
        start += n
        t_idx = tokens[rows]
        w = flat_w[order[rows]].unsqueeze(-1)
        xs = x_w[t_idx]
        if e >= spec.num_experts:  # zero-computation (identity) expert
            y = hidden[t_idx].float() * w.float()
        elif spec.weight_on_input:
            y = expert_forward(spec, e, (xs * w).to(xs.dtype)).float()
        else:
            y = expert_forward(spec, e, xs).float() * w.float()
        out.index_add_(0, t_idx, y)
    return out.to(hidden.dtype)


def trim_routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, trim) -> tuple[torch.Tensor, torch.Tensor]:
    """`trim` (a hi_na_moe.core.trim.Trim) applied to [T, K] routing: (int64 indices with the dropped
    slots -1, float32 weights). The oracle of the native RoutingTrim (csrc/experts/trim.cpp), with
    the same float32 operations in the same order, so the two agree bit for bit.

    A token's valid slots are those with an index >= 0, ranked by weight (descending; equal
    weights by slot). "fixed" keeps the `keep` best; "adaptive" keeps a slot while its weight is
    at least threshold x an even share of the token's routing weight (with renorm the valid
    weights' sum / K, without 1 / K), and the `min_k` best whatever their weight. With renorm, the
    kept weights are scaled by (sum of the valid weights) / (sum of the kept ones). Sums run in
    slot order. A token with a NaN weight is left whole."""
    idx = top_k_index.to(torch.int64)
    v = top_k_weights.float()
    K = idx.shape[-1]
    valid = idx >= 0
    slot = torch.arange(K, device=idx.device)
    # before[t, i, j]: valid slot i ranks before slot j
    a_i, a_j = v.unsqueeze(-1), v.unsqueeze(-2)
    before = ((a_i > a_j) | ((a_i == a_j) & (slot[:, None] < slot[None, :]))) & valid.unsqueeze(-1)
    rank = before.sum(dim=-2)
    zero = torch.zeros((), dtype=torch.float32)
    total = torch.zeros(idx.shape[:-1], dtype=torch.float32)
    for j in range(K):  # in slot order, one float32 add at a time
        total = total + torch.where(valid[..., j], v[..., j], zero)
    if trim.mode == "fixed":
        keep = rank < trim.keep
    else:
        ref = total if trim.renorm else torch.ones_like(total)
        bar = (torch.tensor(trim.threshold, dtype=torch.float32) * ref) / torch.tensor(float(K), dtype=torch.float32)
        keep = (v >= bar.unsqueeze(-1)) | (rank < trim.min_k)
    whole = (torch.isnan(v) & valid).any(dim=-1, keepdim=True)
    keep = valid & (keep | whole)
    if trim.renorm:
        kept = torch.zeros(idx.shape[:-1], dtype=torch.float32)
        for j in range(K):
            kept = kept + torch.where(keep[..., j], v[..., j], zero)
        scale = torch.where((kept != total) & ~whole.squeeze(-1), total / kept, torch.ones_like(total))
        v = torch.where(keep, v * scale.unsqueeze(-1), v)
    return torch.where(keep, idx, torch.full_like(idx, -1)), v
