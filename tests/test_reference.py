"""The pure-PyTorch reference (the oracle for the kernels) against a per-token loop written
straight from the definition, on the layouts and corner cases the families do not all reach."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hi_na_moe.core import reference
from hi_na_moe.core.spec import ExpertsSpec, GateSpec


def _loop(gate, up, down, x, idx, w, act=F.silu, weight_on_input=False, n_identity=0):
    """out[t] = sum_k w * expert(x) for one token at a time: the definition, nothing else."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    E = gate.shape[0]
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e, wk = int(idx[t, k]), float(w[t, k])
            if e < 0:
                continue
            xt = x[t].double()
            if e >= E:
                out[t] += wk * xt
                continue
            scale = 1.0
            if weight_on_input:
                xt, scale = xt * wk, 1.0
            else:
                scale = wk
            h = act(gate[e].double() @ xt) * (up[e].double() @ xt)
            out[t] += scale * (down[e].double() @ h)
    return out


def _weights(E, H, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, I, H, generator=g) * 0.2, torch.randn(E, I, H, generator=g) * 0.2,
            torch.randn(E, H, I, generator=g) * 0.2)


CASES = [
    # (T, E, K, H, I)
    (1, 8, 2, 32, 16),   # decode: one token
    (7, 5, 5, 24, 12),   # K = E: every expert on every token
    (13, 7, 1, 20, 9),   # K = 1, prime E, odd sizes
    (0, 4, 2, 16, 8),    # empty batch
]


@pytest.mark.parametrize("T,E,K,H,I", CASES)
@pytest.mark.parametrize("layout", ["concat", "interleaved", "transposed", "separate"])
def test_layouts_match_definition(T, E, K, H, I, layout):
    gate, up, down = _weights(E, H, I)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.long)
    w = torch.rand(T, K, generator=g)
    if layout == "concat":
        spec = ExpertsSpec(E, H, I, gate_up=torch.cat([gate, up], 1), down=down, gate_spec=GateSpec("silu"))
    elif layout == "interleaved":
        gu = torch.stack([gate, up], 2).reshape(E, 2 * I, H)  # rows g0, u0, g1, u1, ...
        spec = ExpertsSpec(E, H, I, gate_up=gu, down=down, interleaved=True, gate_spec=GateSpec("silu"))
    elif layout == "transposed":
        spec = ExpertsSpec(E, H, I, gate_up=torch.cat([gate, up], 1).transpose(1, 2).contiguous(),
                           down=down.transpose(1, 2).contiguous(), transposed=True, down_transposed=True,
                           gate_spec=GateSpec("silu"))
    else:
        spec = ExpertsSpec(E, H, I, gate=gate, up=up, down=down, gate_spec=GateSpec("silu"))
    got = reference.experts_forward(spec, x, idx, w)
    want = _loop(gate, up, down, x, idx, w)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # canonical views give back the same matrices, whatever the storage layout
    cg, cu, cd = spec.canonical()
    assert torch.equal(cg, gate) and torch.equal(cu, up) and torch.equal(cd, down)


def test_skipped_slots_identity_experts_and_weight_on_input():
    E, H, I = 4, 16, 8
    gate, up, down = _weights(E, H, I)
    x = torch.randn(6, H)
    idx = torch.tensor([[0, -1], [5, 1], [4, 4], [-1, -1], [3, 2], [1, 0]])  # 4, 5 are identity experts
    w = torch.rand(6, 2)
    spec = ExpertsSpec(E, H, I, gate_up=torch.cat([gate, up], 1), down=down, gate_spec=GateSpec("silu"), n_identity=2)
    torch.testing.assert_close(reference.experts_forward(spec, x, idx, w).double(),
                               _loop(gate, up, down, x, idx, w, n_identity=2), rtol=1e-5, atol=1e-5)
    spec2 = ExpertsSpec(E, H, I, gate_up=torch.cat([gate, up], 1), down=down, gate_spec=GateSpec("silu"),
                        weight_on_input=True)
    idx2 = idx.clamp(-1, 3)
    torch.testing.assert_close(reference.experts_forward(spec2, x, idx2, w).double(),
                               _loop(gate, up, down, x, idx2, w, weight_on_input=True), rtol=1e-5, atol=1e-5)


def test_out_of_range_index_is_an_error():
    gate, up, down = _weights(3, 8, 4)
    spec = ExpertsSpec(3, 8, 4, gate=gate, up=up, down=down, gate_spec=GateSpec("silu"))
    with pytest.raises(ValueError, match="top_k_index holds expert 3, but this block has 3 experts"):
        reference.experts_forward(spec, torch.randn(2, 8), torch.tensor([[0, 3], [1, 2]]), torch.rand(2, 2))


@pytest.mark.parametrize("gs", [
    GateSpec("silu"),
    GateSpec("gelu_tanh", gate_limit=2.0, up_limit=3.0),
    GateSpec("sigmoid_alpha", alpha=1.702, gate_limit=7.0, up_limit=7.0, up_offset=1.0),  # GPT-OSS
    GateSpec("silu", post_act_limit=1.5, up_limit=2.0),  # Step 3.7: clamp after the activation
    GateSpec("relu2"),
])
def test_gate_spec_formula(gs):
    g, u = torch.randn(64) * 6, torch.randn(64) * 6
    act = {"silu": F.silu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "relu2": lambda z: F.relu(z) ** 2,
           "sigmoid_alpha": lambda z: z * torch.sigmoid(gs.alpha * z)}[gs.act]
    a = act(g.clamp(max=gs.gate_limit)).clamp(max=gs.post_act_limit)
    want = a * (u.clamp(-gs.up_limit, gs.up_limit) + gs.up_offset)
    torch.testing.assert_close(reference.apply_gate_spec(gs, g, u), want)
