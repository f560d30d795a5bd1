"""Quantised experts (int8 / int4) through the binding, both kernel families (qdot): every tier's
kernel vs the generic kernel of the same family (integer dot: the exact emulation of moe.h's
activation quantisation, so the comparison is tight), the integer dot vs the lossless model by
SQNR, hypothesis shapes on the best tier, and the qdot config key.

Tiers the CPU lacks are skipped; HINA_MOE_ISA is not needed: each PackedExperts names its tier.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

_native = pytest.importorskip("hi_na_moe._native", reason="native extension not built")

import hi_na_moe  # noqa: E402
from hi_na_moe.core.config import ConfigError, HinaConfig  # noqa: E402
from test_native_kernels import CASES, TIERS, fwd_kwargs, problem, rel_err  # noqa: E402

FORMATS = [("int8", 64), ("int4", 32), ("int4", 64), ("int4", 128)]
DOT = r"(genericdot|avx2dot|avxvnni|avx512vnni)"
# Cases through both families; each says why in test_native_kernels.CASES, plus:
QCASES = ["decode_t1", "t_lt_tile", "tails", "prime_e_k1", "k_eq_e", "empty_experts", "skip_slots",
          "relu2_nogate", "gelu", "gpt_oss", "weight_on_input", "past_block", "past_block_t1"]
CASES.setdefault("past_block", ((5, 4, 2, 161, 97), {"act": "gelu_tanh"}))  # H, I one past a 32-k block
CASES.setdefault("past_block_t1", ((1, 4, 2, 33, 65), {"bias": True}))  # T = 1, one past a block + biases
# fp32: the families' kernels follow the generic one's fp order (integer dot: exactly, up to
# the activation epilogue); bf16 adds the output rounding.
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.2e-2}


def _pack(p: dict, tier: str, weights: str, group: int):
    return _native.PackedExperts(p["gate"], p["up"], p["down"], p["gate_bias"], p["up_bias"],
                                 p["down_bias"], isa=tier, weights=weights, group_size=group)


def _run(pe, p: dict, path: str, qdot: str):
    out = torch.full_like(p["x"], float("nan"))
    name = pe.forward(p["x"], p["idx"], p["w"], out, path=path, num_threads=2, qdot=qdot, **fwd_kwargs(p["opts"]))
    return out, name


def sqnr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    err = float((got.double() - ref.double()).pow(2).sum())
    sig = float(ref.double().pow(2).sum())
    return math.inf if err == 0 else 10 * math.log10(max(sig, 1e-300) / err)


@pytest.mark.parametrize("qdot", ["int", "expand"])
@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("weights,group", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("case", QCASES)
@pytest.mark.parametrize("tier", [t for t in TIERS if t.values[0] != "generic"])
def test_tier_matches_generic_of_its_family(tier, case, weights, group, dtype_name, path, qdot):
    p = problem(case, dtype_name)
    gen_out, gen_name = _run(_pack(p, "generic", weights, group), p, path, qdot)
    out, name = _run(_pack(p, tier, weights, group), p, path, qdot)
    fmt = weights
    if qdot == "int":
        assert re.fullmatch(rf"moe_{path}_{fmt}_genericdot", gen_name), gen_name
        assert re.fullmatch(rf"moe_{path}_{fmt}_{DOT}", name), name
        assert name.endswith(("avx2dot", "avxvnni")) if tier == "avx2" else not name.endswith("genericdot")
    else:
        assert gen_name == f"moe_{path}_{fmt}_generic"
        assert re.fullmatch(rf"moe_{path}_{fmt}_(avx2|avx512|amx)", name), name
    amx_tiles = name == f"moe_prefill_{fmt}_amx" and dtype_name == "bfloat16"  # x, h, w in bf16
    err = rel_err(out, gen_out)
    assert err < (4e-2 if amx_tiles else TOL[p["x"].dtype]), f"{name} vs {gen_name}: rel err {err:.3g}"


@pytest.mark.parametrize("weights,group", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("case", QCASES)
def test_integer_dot_stays_near_the_lossless_model(case, weights, group):
    """W8A8 / W4A8 (generic emulation: every tier equals it, above) vs the float64 oracle of the
    unquantised weights, and vs the expansion family (weights-only quantisation)."""
    p = problem(case, "float32")
    pe = _pack(p, "generic", weights, group)
    db_int = sqnr_db(_run(pe, p, "decode", "int")[0], p["ref"])
    db_exp = sqnr_db(_run(pe, p, "decode", "expand")[0], p["ref"])
    # uniform random weights: int8 weights alone ~ 44-48 dB, with x and h quantised too ~ 37-38
    # dB (the loss varies with the draw: up to 10 dB where biases dominate the signal); int4 is
    # limited by its weights (~ 15-20 dB), the activations cost it little.
    floor, lost = (30.0, 12.0) if weights == "int8" else (12.0, 2.0)
    assert db_int >= floor and db_int >= db_exp - lost, (db_int, db_exp)


@pytest.mark.parametrize("tier", [t for t in TIERS if t.values[0] != "generic"])
def test_qdot_int_is_deterministic_across_threads_and_splits(tier):
    p = problem("prefill_257", "bfloat16")
    for weights, group in (("int8", 64), ("int4", 32)):
        pe = _pack(p, tier, weights, group)
        outs = []
        for n, split in ((1, "static"), (2, "dynamic"), (3, "dynamic"), (2, "static")):
            for path in ("decode", "prefill"):
                out = torch.empty_like(p["x"])
                pe.forward(p["x"], p["idx"], p["w"], out, num_threads=n, split=split, path=path, qdot="int")
                outs.append((path, out))
        for path in ("decode", "prefill"):
            same = [o for pth, o in outs if pth == path]
            assert all(torch.equal(o, same[0]) for o in same[1:]), (tier, weights, path)


@pytest.mark.parametrize("tier", [t for t in TIERS if t.values[0] != "generic"])
def test_qdot_int_is_batch_invariant(tier):
    """Activations are quantised per token, so a token's output does not depend on the other
    tokens of the call: the T = 1 decode calls equal the batched prefill call bit for bit."""
    p = problem("skip_slots", "float32")
    for weights, group in (("int8", 64), ("int4", 64)):
        pe = _pack(p, tier, weights, group)
        batch = torch.empty_like(p["x"])
        pe.forward(p["x"], p["idx"], p["w"], batch, path="prefill", qdot="int")
        for t in range(p["x"].shape[0]):
            one = torch.empty_like(p["x"][t:t + 1])
            name = pe.forward(p["x"][t:t + 1], p["idx"][t:t + 1], p["w"][t:t + 1], one, qdot="int")
            assert "_decode_" in name and torch.equal(one, batch[t:t + 1]), (tier, weights, t, name)


def test_qdot_is_validated_and_ignored_for_lossless():
    p = problem("decode_t1", "float32")
    pe = _pack(p, "generic", "int8", 64)
    out = torch.empty_like(p["x"])
    with pytest.raises(ValueError, match="qdot 'fast' is unknown; expected auto, int or expand"):
        pe.forward(p["x"], p["idx"], p["w"], out, qdot="fast")
    lossless = _native.PackedExperts(p["gate"], p["up"], p["down"], isa="generic")
    a, b = torch.empty_like(p["x"]), torch.empty_like(p["x"])
    assert lossless.forward(p["x"], p["idx"], p["w"], a, qdot="int") == "moe_decode_f32_generic"
    lossless.forward(p["x"], p["idx"], p["w"], b, qdot="expand")
    assert torch.equal(a, b)
    # auto on the generic tier: the expansion kernels (the integer dot only when asked for)
    assert pe.kernel_name("decode") == "moe_decode_int8_generic"
    assert pe.kernel_name("decode", "int") == "moe_decode_int8_genericdot"


def test_auto_picks_the_integer_dot_where_the_tier_has_it():
    best = _native.resolve_isa()
    kt = _native.kernel_table()
    feats = _native.cpu_features()
    if best == "generic":
        pytest.skip("no SIMD tier here")
    cpu = feats["cpu"]
    dot = ("avx512vnni" if best in ("avx512", "amx") and cpu["avx512vnni"]
           else "avxvnni" if cpu["avx_vnni"] else "avx2dot")
    for fmt in ("int8", "int4"):
        assert kt["decode"][fmt] == f"moe_decode_{fmt}_{dot}"
        # the AMX prefill of bf16 models keeps its bf16 tiles
        assert kt["prefill"][fmt] == (f"moe_prefill_{fmt}_amx" if best == "amx" else f"moe_prefill_{fmt}_{dot}")


def test_config_key_and_env(monkeypatch):
    assert HinaConfig().qdot == "auto"
    with pytest.raises(ConfigError, match="'qdot'.*'expnad'.*did you mean 'expand'"):
        HinaConfig(qdot="expnad")
    from tiny_models import build_tiny

    tiny = build_tiny("olmoe", torch.float32)
    for qdot, pattern in (("int", DOT), ("expand", r"(generic|avx2|avx512|amx)")):
        monkeypatch.setenv("HINA_MOE_QDOT", qdot)
        rep = hi_na_moe.inspect_model(tiny.model, weights="int8")
        for b in rep.accelerated:
            assert all(re.fullmatch(rf"moe_(decode|prefill)_int8_{pattern}", k) for k in b.kernel.split("|")), b.kernel


# ---- hypothesis: random shapes on the best tier, integer dot vs its generic emulation ----

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BEST = _native.resolve_isa()


@st.composite
def qproblems(draw):
    T = draw(st.integers(1, 12))
    E = draw(st.integers(1, 6))
    K = draw(st.integers(1, E))
    H = draw(st.integers(1, 140))
    I = draw(st.integers(1, 140))
    gated = draw(st.booleans())
    fmt = draw(st.sampled_from(FORMATS))
    dt = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    act = draw(st.sampled_from(["silu", "gelu", "gelu_tanh", "relu", "relu2", "sigmoid_alpha", "identity"]))
    bias = draw(st.booleans())
    woi = draw(st.booleans())
    path = draw(st.sampled_from(["decode", "prefill"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return (T, E, K, H, I, gated, fmt, dt, act, bias, woi, path, seed)


@pytest.mark.skipif(BEST == "generic", reason="no SIMD tier here")
@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(qproblems())
def test_integer_dot_random_shapes_on_the_best_tier(case):
    T, E, K, H, I, gated, (weights, group), dt, act, bias, woi, path, seed = case
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return ((torch.rand(*shape, generator=gen) * 2 - 1) * scale).to(dt)

    p = {
        "gate": rnd(E, I, H, scale=2 / math.sqrt(H)) if gated else None,
        "up": rnd(E, I, H, scale=2 / math.sqrt(H)),
        "down": rnd(E, H, I, scale=2 / math.sqrt(I)),
        "gate_bias": rnd(E, I, scale=0.5) if bias and gated else None,
        "up_bias": rnd(E, I, scale=0.5) if bias else None,
        "down_bias": rnd(E, H, scale=0.5) if bias else None,
        "x": rnd(T, H),
        "idx": torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].to(torch.int32).contiguous(),
        "w": torch.rand(T, K, generator=gen) * 0.95 + 0.05,
        "opts": {"act": act, "woi": woi},
    }
    want, gname = _run(_pack(p, "generic", weights, group), p, path, "int")
    got, name = _run(_pack(p, BEST, weights, group), p, path, "int")
    assert gname.endswith("genericdot") and re.fullmatch(rf"moe_{path}_{weights}_{DOT}", name), (gname, name)
    err = rel_err(got, want)
    assert err < TOL[dt], f"{name}: rel err {err:.3g} vs genericdot ({case})"
