"""scope="all": gated MLPs in one native call (hi_na_moe.fastpath.mlp), and Qwen2-MoE's shared expert inside
the decoder layer's fused step and the stack's one call.

The layers below the MLP runner: the silu-times-up kernel (baseline build against PyTorch's
scalar loop, bit for bit; AVX-512 build within one rounding), the shared expert's sigmoid gate
(bit for bit against PyTorch's ops for as many rows as sigmoid_rows finds); then
the module against its own forward (within rounding), then the decode steps against the same
model on its own forwards (bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import greedy_decode
from torch import nn
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

import hi_na_moe
from hi_na_moe.fastpath import common, linear, stack
from hi_na_moe.core.native import native_kernels_available, native_module
from hi_na_moe.fastpath.mlp import sigmoid_rows, torch_scalar_values
from hi_na_moe.core.registry import patched_runner

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _native():
    return native_module()[0]


def _silu_mul(g: torch.Tensor, u: torch.Tensor, isa: str) -> torch.Tensor:
    out = torch.empty_like(g)
    _native().silu_mul_raw(CODES[g.dtype], isa, g.data_ptr(), u.data_ptr(), g.numel(), out.data_ptr())
    return out


def _scalar_loop(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (PyTorch's elementwise op) through its scalar loop on any build: on pieces of at most
    torch_scalar_values values."""
    return torch.cat([fn(p) for p in x.split(torch_scalar_values(x.dtype) or x.numel())])


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_scalar_values_is_where_pytorchs_loop_leaves_std_exp(dtype):
    # up to the limit, the op on many values is the op one value at a time (its scalar loop for
    # sure); one value past it, float32's vector exp shows (in about 4 % of the values here; the
    # rounding to bfloat16 / float16 hides it, in every value with PyTorch 2.13: sigmoid_rows)
    most = torch_scalar_values(dtype)
    n = most or 256
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(40 * (n + 1), generator=gen) * 6).to(dtype)
    for fn in (torch.sigmoid, F.silu):
        one = torch.cat([fn(v) for v in x.split(1)])
        assert torch.equal(torch.cat([fn(p) for p in x.split(n)]), one)
        # (on the builds whose vector width is known: elsewhere the limit is a lower bound)
        if dtype is torch.float32 and torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2"):
            assert not torch.equal(torch.cat([fn(p) for p in x.split(most + 1)]), one)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_baseline_build_is_pytorchs_scalar_loop_bit_for_bit(dtype):
    # PyTorch runs F.silu on fewer than 2 vectors' worth of values in its scalar loop: x / (1 +
    # std::exp(-x)) in float32, rounded to the dtype; then the product, rounded. How many values
    # that is depends on its build (torch_scalar_values: 31 float32 values on AVX-512, 15 on AVX2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        g = (torch.randn(40, generator=gen) * 6).to(dtype)
        u = torch.randn(40, generator=gen).to(dtype)
        assert torch.equal(_silu_mul(g, u, "generic"), _scalar_loop(F.silu, g) * u)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_silu_mul_other_builds_within_rounding_of_the_baseline(dtype, isa):
    if not _native().isa_supported(isa):
        pytest.skip(f"no {isa} here")
    gen = torch.Generator().manual_seed(2)
    g = torch.cat([torch.linspace(-90, 90, 5003), torch.randn(20011, generator=gen) * 4]).to(dtype)
    u = torch.randn(g.numel(), generator=gen).to(dtype)
    want, got = _silu_mul(g, u, "generic").float(), _silu_mul(g, u, isa).float()
    # float32: the vector exp is within ~2 ulp, so silu times u within a few; else one rounding
    ulp = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    assert ((got - want).abs() <= ulp * want.abs() + 1e-30).all()
    assert torch.isfinite(got).all() and torch.equal(got == 0, want == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_combine_is_the_blocks_sigmoid_product_and_sum_bit_for_bit(dtype):
    # up to as many rows as sigmoid_rows takes (float32: PyTorch's scalar loop; more rows: the
    # layers keep the block's own sigmoid, test_a_batch_past_pytorchs_scalar_sigmoid_...)
    gen = torch.Generator().manual_seed(3)
    for B in (1, 2, 7, sigmoid_rows(dtype) or 64):
        H = 96
        routed = torch.randn(B, H, generator=gen).to(dtype)
        shared = (torch.randn(B, H, generator=gen) * 3).to(dtype)
        logit = (torch.randn(B, 1, generator=gen) * 8).to(dtype)
        logit[0, 0] = -100.0 if B > 1 else logit[0, 0]  # saturated gates
        logit[-1, 0] = 100.0 if B > 2 else logit[-1, 0]
        want = routed + F.sigmoid(logit) * shared  # as Qwen2MoeSparseMoeBlock writes it
        out = torch.empty_like(routed)
        _native().shared_combine_raw(CODES[dtype], routed.data_ptr(), shared.data_ptr(), logit.data_ptr(), B, H,
                                     out.data_ptr())
        assert torch.equal(out, want)


def _qwen2moe(layers: int = 2, dtype=torch.bfloat16, hidden: int = 256):
    cfg = Qwen2MoeConfig(hidden_size=hidden, intermediate_size=512, moe_intermediate_size=64,
                         shared_expert_intermediate_size=384, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(cfg).eval().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_shared_expert_runs_in_one_native_call_within_rounding_of_its_own_forward(dtype, monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = _qwen2moe(dtype=dtype)
    se = model.model.layers[0].mlp.shared_expert
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        before = se(x)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        names = [f"model.layers.{i}.mlp.shared_expert" for i in range(2)]
        assert rep.mlps == names and not rep.mlps_differ
        assert "gated MLPs (shared experts, dense MLPs) with decode steps in one native call: 2" in str(rep)
        assert rep.to_dict()["mlps"] == names
        runner = patched_runner(se)
        calls = []
        run = runner._run
        runner._run = lambda x: calls.append(x.shape) or run(x)
        with torch.no_grad():
            got = se(x)
            own = runner.original(x)  # its own forward on the patched projections
        assert calls == [x.shape]
        tol = {torch.float32: 2.0**-17, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}[dtype]
        assert ((got.float() - own.float()).abs() <= tol * own.float().abs().amax(-1, keepdim=True)).all()
        assert (got.float() - before.float()).abs().max() <= 0.05 * before.float().abs().max()
        with torch.no_grad():  # more rows than a decode step: its own forward
            se(torch.randn(common.DECODE_MAX_ROWS + 1, 256).to(dtype))
        assert len(calls) == 1
    finally:
        hi_na_moe.disable_for_model(model)
    assert "forward" not in se.__dict__


def test_a_hook_or_a_replaced_projection_sends_the_mlp_to_its_own_forward(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = _qwen2moe(layers=1)
    se = model.model.layers[0].mlp.shared_expert
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        runner = patched_runner(se)
        calls = []
        run = runner._run
        runner._run = lambda x: calls.append(1) or run(x)
        x = torch.randn(1, 256).to(torch.bfloat16)
        seen = []
        h = se.down_proj.register_forward_hook(lambda *a: seen.append(1))
        with torch.no_grad():
            se(x)
        h.remove()
        assert seen == [1] and calls == []
        with torch.no_grad():
            se(x)
        assert calls == [1]
        old = se.act_fn
        se.act_fn = nn.GELU()  # a replaced part: not the module the probe saw
        try:
            with torch.no_grad():
                assert torch.equal(se(x), runner.original(x))
            assert calls == [1]
        finally:
            se.act_fn = old
    finally:
        hi_na_moe.disable_for_model(model)


def test_an_mlp_of_another_activation_or_wiring_keeps_its_own_forward(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = _qwen2moe(layers=2)
    model.model.layers[0].mlp.shared_expert.act_fn = nn.GELU()

    class Swapped(type(model.model.layers[1].mlp.shared_expert)):  # act on up, times gate
        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    model.model.layers[1].mlp.shared_expert.__class__ = Swapped
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert not rep.mlps and rep.mlps_differ == ["model.layers.0.mlp.shared_expert",
                                                     "model.layers.1.mlp.shared_expert"]
        assert "gated MLPs (shared experts, dense MLPs) with decode steps in one native call: 0; 2 take their own" in str(rep)
        # their layers still take the short path, the shared expert called as a module
        assert rep.layers == ["model.layers.0", "model.layers.1"]
        why = rep.stacks_loop_only["model"]
        assert why.startswith("model.layers.0: its MoE block's shared expert is not on the native MLP call")
    finally:
        hi_na_moe.disable_for_model(model)


def test_inspect_model_names_the_gated_mlps_enable_would_probe(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = _qwen2moe()
    rep = hi_na_moe.inspect_model(model, scope="all")
    names = [f"model.layers.{i}.mlp.shared_expert" for i in range(2)]
    assert rep.mlps == names and "2 gated MLP(s)" in str(rep)
    assert "forward" not in model.model.layers[0].mlp.shared_expert.__dict__
    enabled = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert enabled.mlps == rep.mlps
    finally:
        hi_na_moe.disable_for_model(model)


def _tier(isa: str) -> bool:
    return isa == "auto" or _native().isa_supported(isa)


@pytest.mark.vendor_tables
@pytest.mark.parametrize("weights,isa", [("lossless", "auto"), ("int4", "auto")]
                         + [("lossless", t) for t in ("avx2", "generic") if _tier(t)])
def test_qwen2_moe_decodes_in_one_native_call_bit_for_bit_with_its_own_forwards(weights, isa, tmp_path, monkeypatch):
    """Each tier: on Intel CPUs the generic one has no attention kernel (attention.kernel_tiers),
    so its steps take the layers' loop,
    each layer's second native call still running the shared expert."""
    from hi_na_moe.fastpath.attention import kernel_tiers

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = _qwen2moe()
    rep = hi_na_moe.enable_for_model(model, scope="all", weights=weights, cache_dir=str(tmp_path), isa=isa)
    one_call = _native().resolve_isa(isa) in kernel_tiers()  # "auto" may be HINA_MOE_ISA's tier
    try:
        fmt = {d.name: d.weights for d in rep.dense}
        assert fmt["model.layers.0.mlp.shared_expert_gate"] == "lossless"  # a gate: never quantised
        assert fmt["model.layers.0.mlp.shared_expert.down_proj"] == weights
        assert rep.mlps == [f"model.layers.{i}.mlp.shared_expert" for i in range(2)]
        assert not rep.stacks_loop_only if one_call else "no native attention kernel" in rep.stacks_loop_only["model"]
        layer = patched_runner(model.model.layers[0])
        shared = []
        native_fast = layer._native_fast
        layer._native_fast = lambda *a: shared.append(1) or native_fast(*a)
        runner = patched_runner(model.model)
        ones = []  # the steps the one native call ran
        run_one = runner._one_call

        def counted(*a):
            out = run_one(*a)
            ones.extend([1] if out is not None else [])
            return out

        runner._one_call = counted
        ids = torch.tensor([[3, 9, 4, 7], [5, 6, 7, 8]])
        got, c_got = greedy_decode(model, ids, 4)
        assert len(ones) == (4 if one_call else 0) and len(shared) == (0 if one_call else 4)
        # the same model with the stack and the layers on their own forwards (the MoE block's
        # own forward calling the patched shared expert, its gate, torch.sigmoid and the adds)
        saved = {"model": model.model.__dict__.pop("forward")}
        layers = model.model.layers
        for i, layer in enumerate(layers):
            saved[i] = layer.__dict__.pop("forward")
        try:
            want, c_want = greedy_decode(model, ids, 4)
        finally:
            model.model.forward = saved["model"]
            for i, layer in enumerate(layers):
                layer.forward = saved[i]
        assert len(ones) == (4 if one_call else 0)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        for a, b in zip(c_got.layers, c_want.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        # and the layers' loop (two native calls per layer) gives the same bits as the one call
        monkeypatch.setattr(stack, "ONE_CALL", False)
        loop, _ = greedy_decode(model, ids, 4)
        assert len(ones) == (4 if one_call else 0) and all(torch.equal(g, w) for g, w in zip(loop, got))
    finally:
        hi_na_moe.disable_for_model(model)


def _own_forwards(model, ids, steps):
    """greedy_decode with the stack and the layers on their own forwards (the MoE block's own
    forward calling the patched shared expert, its gate, torch.sigmoid and the adds)."""
    saved = {"model": model.model.__dict__.pop("forward")}
    layers = model.model.layers
    for i, layer in enumerate(layers):
        saved[i] = layer.__dict__.pop("forward")
    try:
        return greedy_decode(model, ids, steps)
    finally:
        model.model.forward = saved["model"]
        for i, layer in enumerate(layers):
            layer.forward = saved[i]


def test_sigmoid_rows_probe_finds_a_sigmoid_the_native_gate_does_not_give(monkeypatch):
    # the 16-bit dtypes' probe (its cache bypassed): PyTorch's sigmoid made another function past
    # its scalar loop, then everywhere
    sigmoid = torch.sigmoid
    for dt in (torch.bfloat16, torch.float16):
        most = torch_scalar_values(dt)
        if most is None:
            pytest.skip("PyTorch's baseline build: its scalar loop at any count")
        off = lambda x: (sigmoid(x).float() * (1 + 2**-6)).to(x.dtype)  # noqa: E731
        monkeypatch.setattr(torch, "sigmoid", lambda x: sigmoid(x) if x.numel() <= most else off(x))
        assert sigmoid_rows.__wrapped__(dt) == most
        monkeypatch.setattr(torch, "sigmoid", off)
        assert sigmoid_rows.__wrapped__(dt) == 0
        monkeypatch.setattr(torch, "sigmoid", sigmoid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_past_pytorchs_scalar_sigmoid_keeps_the_blocks_own_gate_bit_for_bit(dtype, monkeypatch):
    """The shared expert's sigmoid gate in the native call (shared_combine) is std::exp's, as
    PyTorch's scalar loop computes it; a float32 batch of two vectors' worth of rows or more (32
    on AVX-512, 16 on AVX2), which PyTorch's vector exp takes, runs the block's own torch.sigmoid
    instead, and stays bit for bit. bfloat16: where its probe (sigmoid_rows) finds every value
    alike (PyTorch 2.13's AVX-512 and AVX2 builds), a batch as large stays in the native call."""
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = _qwen2moe(dtype=dtype)
    most = sigmoid_rows(dtype)
    B = (most or 31) + 1  # (PyTorch's baseline build: its scalar loop at any count)
    ids = torch.randint(3, 300, (B, 3), generator=torch.Generator().manual_seed(6))
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        runner = patched_runner(model.model)
        ones = []
        run_one = runner._one_call
        runner._one_call = lambda *a: (lambda out: ones.append(out is not None) or out)(run_one(*a))
        got, c_got = greedy_decode(model, ids, 3)
        # past the limit the stack's one call cannot run the step (it has no shared expert outside it)
        assert ones == [most is None] * 3
        want, c_want = _own_forwards(model, ids, 3)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        for a, b in zip(c_got.layers, c_want.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    finally:
        hi_na_moe.disable_for_model(model)
