"""Dense linear layers on the experts' kernels (PackedExperts.pack_linear / linear): against
torch.nn.functional.linear on every tier this machine has, fp32/bf16/fp16, with and without
bias, decode (T=1) and prefill shapes, and widths that end one element past a panel; the
quantised formats against F.linear on their own dequantised weights (unpack)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

_native = pytest.importorskip("hi_na_moe._native", reason="native extension not built")

TIERS = [t for t in ("generic", "avx2", "avx512", "amx") if _native.isa_supported(t)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (out_features, in_features, why)
SHAPES = [(16, 32, "one panel, one k block"), (17, 40, "one past a panel, k not a multiple of 32"),
          (130, 72, "several panels, odd k"), (2048, 256, "a wide layer: many work items")]


def _layer(out_f, in_f, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / in_f ** 0.5).to(dtype)
    b = (torch.randn(out_f, generator=g) * 0.1).to(dtype) if bias else None
    return w, b


def _close(got, want, dtype, rtol_bf16=1e-2):
    """The kernels accumulate in fp32 in another order than PyTorch and round once: compare
    relative to the output's scale at the dtype's precision."""
    tol = {torch.float32: 1e-5, torch.bfloat16: rtol_bf16, torch.float16: 2e-3}[dtype]
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("T", [1, 3, 40])
def test_linear_matches_torch(tier, dtype, shape, T):
    out_f, in_f, _ = shape
    for bias in (False, True):
        w, b = _layer(out_f, in_f, dtype, bias, seed=out_f + in_f + T)
        pe = _native.PackedExperts.pack_linear(w, b, isa=tier)
        assert pe.up_only and pe.E == 1 and pe.I == out_f and pe.H == in_f
        x = torch.randn(T, in_f, generator=torch.Generator().manual_seed(T)).to(dtype)
        out = torch.full((T, out_f), float("nan"), dtype=dtype)
        name = pe.linear(x, out, num_threads=2)
        assert name.startswith("moe_")
        _close(out, F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype), dtype)
        # the raw-address entry gives the same bits
        raw = torch.empty_like(out)
        pe.bind().linear(x.data_ptr(), T, raw.data_ptr(), 2)
        assert torch.equal(raw, out)


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("qdot", ["expand", "int"])
def test_quantised_linear_matches_its_dequantised_weights(weights, qdot):
    w, b = _layer(130, 128, torch.bfloat16, True, seed=3)
    pe = _native.PackedExperts.pack_linear(w, b, weights=weights)
    _, wq, _, _, bq, _ = (torch.from_dlpack(a) if a is not None else None for a in pe.unpack())
    assert wq.shape == w.shape and torch.equal(bq, b)
    for T in (1, 24):
        x = torch.randn(T, 128, generator=torch.Generator().manual_seed(T)).bfloat16()
        out = torch.empty(T, 130, dtype=torch.bfloat16)
        pe.linear(x, out, num_threads=2, qdot=qdot)
        # the integer dot also quantises x per token (blocks of 32, 8 bits)
        _close(out, F.linear(x.float(), wq.float(), bq.float()).bfloat16(), torch.bfloat16,
               rtol_bf16=1e-2 if qdot == "expand" else 3e-2)


def test_lossless_linear_unpacks_exactly():
    w, b = _layer(33, 70, torch.bfloat16, True, seed=1)
    pe = _native.PackedExperts.pack_linear(w, b)
    gate, up, down, gb, ub, db = pe.unpack()
    assert gate is None and down is None and gb is None and db is None
    assert torch.equal(torch.from_dlpack(up), w) and torch.equal(torch.from_dlpack(ub), b)
    assert _native.header_info(pe.header)["up_only"]


def test_blocks_refuse_the_other_entry():
    w, _ = _layer(16, 32, torch.float32, False, seed=0)
    lin = _native.PackedExperts.pack_linear(w)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="linear"):
        lin.forward(x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), torch.empty(2, 32))
    g = torch.randn(2, 8, 32)
    experts = _native.PackedExperts(g, g, torch.randn(2, 32, 8))
    with pytest.raises(ValueError, match="pack_linear"):
        experts.linear(x, torch.empty(2, 8))


@pytest.mark.parametrize("bad, match", [
    (lambda w: (w[None], None), r"weight must have shape \[out_features, in_features\]"),
    (lambda w: (w, torch.zeros(3)), r"bias has shape \[3\], expected \[16\]"),
    (lambda w: (w, torch.zeros(16, dtype=torch.float64)), "bias has dtype"),
    (lambda w: (w.double(), None), "weight has dtype float64"),
])
def test_pack_linear_errors_name_the_argument(bad, match):
    w, _ = _layer(16, 32, torch.float32, False, seed=0)
    with pytest.raises(ValueError, match=match):
        _native.PackedExperts.pack_linear(*bad(w))


def test_linear_call_errors_name_the_argument():
    w, _ = _layer(16, 32, torch.bfloat16, False, seed=0)
    pe = _native.PackedExperts.pack_linear(w)
    x = torch.randn(4, 32).bfloat16()
    with pytest.raises(ValueError, match=r"x has shape \[4, 31\], expected \[4, 32\]"):
        pe.linear(x[:, 1:].contiguous(), torch.empty(4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out has shape \[4, 15\], expected \[4, 16\]"):
        pe.linear(x, torch.empty(4, 15, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x has dtype float32"):
        pe.linear(x.float(), torch.empty(4, 16, dtype=torch.bfloat16))
    out = torch.empty(0, 16, dtype=torch.bfloat16)
    assert pe.linear(torch.empty(0, 32, dtype=torch.bfloat16), out).startswith("moe_")
