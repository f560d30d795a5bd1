"""PackedExperts (the native fused-MoE op) vs a straightforward PyTorch oracle written here.

Parametrised over ["generic", *tiers this CPU has]; tiers the CPU lacks are skipped with a
reason. The oracle follows the contract in csrc/include/hina_moe/moe.h in float64.
"""

from __future__ import annotations

import functools
import math
import re
import zlib

import pytest
import torch

_native = pytest.importorskip("hi_na_moe._native", reason="native extension not built")
from hi_na_moe.core.reference import activation  # noqa: E402

ALL_TIERS = ["generic", "avx2", "avx512", "amx"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# max |out - ref| / max |ref|: fp32 accumulation-order noise; bf16/fp16: output rounding
# (plus h rounded to bf16 on the bf16 prefill paths: AMX tiles, AVX512-BF16 dot products).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.2e-2, torch.float16: 3e-3}


def tier_param(tier: str):
    supported = _native.isa_supported(tier)
    return pytest.param(
        tier,
        id=tier,
        marks=pytest.mark.skipif(not supported, reason=f"CPU lacks the '{tier}' tier"),
    )


TIERS = [tier_param(t) for t in ALL_TIERS]
BF16DOT = _native.cpu_features()["cpu"]["avx512bf16"]  # bf16 prefill on the avx512 tier: vdpbf16ps


# (T, E, K, H, I, options) -- each shape says why it exists.
CASES = {
    "decode_t1": ((1, 8, 2, 64, 32), {}),  # T = 1: decode
    "t_lt_tile": ((7, 4, 2, 64, 48), {}),  # T < tile rows (16): AMX row padding
    "tails": ((5, 6, 3, 100, 72), {}),  # H, I not multiples of 16/32/64
    "prime_e_k1": ((9, 7, 1, 48, 40), {}),  # prime E, K = 1
    "k_eq_e": ((4, 4, 4, 64, 32), {}),  # K = E
    "empty_experts": ((6, 16, 2, 64, 32), {"used": 3}),  # most experts get no tokens
    "skip_slots": ((8, 6, 3, 64, 48), {"skip_every": 4}),  # idx = -1 skips a slot
    "prefill_257": ((257, 8, 2, 96, 80), {}),  # T = 257: 32-row blocks + tail
    "stride_512": ((40, 3, 1, 256, 256), {}),  # row bytes multiple of 512: padded AMX strides
    "gelu": ((6, 4, 2, 80, 48), {"act": "gelu"}),
    "gelu_tanh": ((6, 4, 2, 80, 48), {"act": "gelu_tanh"}),
    "relu": ((6, 4, 2, 80, 48), {"act": "relu"}),
    "relu2_nogate": ((40, 4, 2, 64, 48), {"act": "relu2", "gated": False, "bias": True}),  # no gate
    "identity": ((6, 4, 2, 80, 48), {"act": "identity"}),
    "gpt_oss": (  # limits, up_offset, sigmoid_alpha, biases
        (6, 4, 2, 72, 56),
        {"act": "sigmoid_alpha", "bias": True, "gate_limit": 0.5, "up_limit": 0.7,
         "post_act_limit": 0.4, "up_offset": 1.0},
    ),
    "weight_on_input": ((48, 4, 1, 64, 48), {"woi": True}),  # Llama 4 scales the input
}


_act = activation  # the reference path's activations: the layer below the kernels


def oracle(prob: dict) -> torch.Tensor:
    """The semantics, in float64, one expert at a time."""
    x, idx, w = prob["x"], prob["idx"], prob["w"]
    o = prob["opts"]
    dt = x.dtype
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float64)
    for e in range(prob["up"].shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        wt = w[tok, slot].double()
        xin = x[tok]
        if o.get("woi"):
            xin = (w[tok, slot].float()[:, None] * xin.float()).to(dt)
            wt = torch.ones_like(wt)
        xin = xin.double()
        u = xin @ prob["up"][e].double().T
        if prob["up_bias"] is not None:
            u = u + prob["up_bias"][e].double()
        if prob["gate"] is not None:
            g = xin @ prob["gate"][e].double().T
            if prob["gate_bias"] is not None:
                g = g + prob["gate_bias"][e].double()
            g = g.clamp(max=o.get("gate_limit", math.inf))
            lim = o.get("up_limit", math.inf)
            u = u.clamp(-lim, lim)
            a = _act(o.get("act", "silu"), g, 1.702).clamp(max=o.get("post_act_limit", math.inf))
            h = a * (u + o.get("up_offset", 0.0))
        else:
            h = _act(o.get("act", "silu"), u, 1.702)
        y = h @ prob["down"][e].double().T
        if prob["down_bias"] is not None:
            y = y + prob["down_bias"][e].double()
        out.index_add_(0, tok, wt[:, None] * y)
    return out.to(dt)


@functools.lru_cache(maxsize=None)
def problem(case: str, dtype_name: str, seed: int = 0) -> dict:
    (T, E, K, H, I), o = CASES[case]
    dt = DTYPES[dtype_name]
    # crc32, not hash(): str hashes are salted per process, and a failure must replay
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}|{dtype_name}|{seed}".encode()))

    def rnd(*shape, scale=1.0):
        return ((torch.rand(*shape, generator=gen) * 2 - 1) * scale).to(dt)

    gated = o.get("gated", True)
    bias = o.get("bias", False)
    used = o.get("used", E)
    idx = torch.stack([torch.randperm(used, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    if K > used:
        raise AssertionError("bad case")
    if o.get("skip_every"):
        flat = idx.view(-1)
        flat[:: o["skip_every"]] = -1
    prob = {
        "gate": rnd(E, I, H, scale=2 / math.sqrt(H)) if gated else None,
        "up": rnd(E, I, H, scale=2 / math.sqrt(H)),
        "down": rnd(E, H, I, scale=2 / math.sqrt(I)),
        "gate_bias": rnd(E, I, scale=0.5) if (bias and gated) else None,
        "up_bias": rnd(E, I, scale=0.5) if bias else None,
        "down_bias": rnd(E, H, scale=0.5) if bias else None,
        "x": rnd(T, H),
        "idx": idx,
        "w": torch.rand(T, K, generator=gen) * 0.95 + 0.05,
        "opts": o,
    }
    prob["ref"] = oracle(prob)
    return prob


def fwd_kwargs(o: dict) -> dict:
    kw = {"act": o.get("act", "silu"), "weight_on_input": o.get("woi", False)}
    for k in ("gate_limit", "up_limit", "post_act_limit", "up_offset"):
        if k in o:
            kw[k] = o[k]
    return kw


@functools.lru_cache(maxsize=None)
def packed(case: str, dtype_name: str, tier: str):
    p = problem(case, dtype_name)
    return _native.PackedExperts(
        p["gate"], p["up"], p["down"], p["gate_bias"], p["up_bias"], p["down_bias"], isa=tier
    )


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-3)).item()


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tier", TIERS)
def test_forward_matches_torch(tier, case, dtype_name, path):
    p = problem(case, dtype_name)
    pe = packed(case, dtype_name, tier)
    out = torch.full_like(p["x"], float("nan"))  # out is overwritten, never accumulated into
    name = pe.forward(p["x"], p["idx"], p["w"], out, path=path, num_threads=2, **fwd_kwargs(p["opts"]))
    fmt = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype_name]
    assert re.fullmatch(rf"moe_{path}_{fmt}_(generic|avx2|avx512|amx|avx512bf16)", name), name
    if tier == "amx" and path == "prefill" and dtype_name == "bfloat16":
        assert name == "moe_prefill_bf16_amx"
    elif tier == "avx512" and path == "prefill" and dtype_name == "bfloat16" and BF16DOT:
        assert name == "moe_prefill_bf16_avx512bf16"  # bf16 x and h rows, as the AMX kernels
    elif tier != "amx":
        assert name.endswith("_" + tier)
    err = rel_err(out, p["ref"])
    assert err < TOL[p["x"].dtype], f"{name}: rel err {err:.3g}"


@pytest.mark.parametrize("tier", TIERS)
def test_auto_path_switches_on_rows_per_expert(tier):
    p = problem("prefill_257", "bfloat16")  # 514 rows over 8 experts: prefill
    pe = packed("prefill_257", "bfloat16", tier)
    out = torch.empty_like(p["x"])
    assert "_prefill_" in pe.forward(p["x"], p["idx"], p["w"], out)
    assert "_decode_" in pe.forward(p["x"][:1], p["idx"][:1], p["w"][:1], out[:1])
    # threshold is a parameter: a huge one keeps the decode path
    assert "_decode_" in pe.forward(p["x"], p["idx"], p["w"], out, prefill_min_tokens=10**9)
    if tier == _native.resolve_isa():
        assert pe.kernel_name("decode") == _native.kernel_table()["decode"]["bfloat16"]
        assert pe.kernel_name("prefill") == _native.kernel_table()["prefill"]["bfloat16"]


@pytest.mark.parametrize("tier", TIERS)
def test_thread_count_does_not_change_the_result(tier):
    p = problem("tails", "float32")
    pe = packed("tails", "float32", tier)
    outs = []
    for n in (1, 2, 3, 0):
        out = torch.empty_like(p["x"])
        pe.forward(p["x"], p["idx"], p["w"], out, num_threads=n)
        outs.append(out)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])  # deterministic: fixed expert order per output element


@pytest.mark.parametrize("tier", TIERS)
def test_in_place_out_is_x(tier):
    p = problem("prefill_257", "bfloat16")
    pe = packed("prefill_257", "bfloat16", tier)
    want = torch.empty_like(p["x"])
    pe.forward(p["x"], p["idx"], p["w"], want)
    buf = p["x"].clone()
    pe.forward(buf, p["idx"], p["w"], buf)  # x is read completely before out is written
    assert torch.equal(buf, want)


@pytest.mark.parametrize("tier", TIERS)
def test_int64_topk_idx_equals_int32(tier):
    p = problem("skip_slots", "bfloat16")
    pe = packed("skip_slots", "bfloat16", tier)
    a, b = torch.empty_like(p["x"]), torch.empty_like(p["x"])
    pe.forward(p["x"], p["idx"], p["w"], a)
    pe.forward(p["x"], p["idx"].long(), p["w"], b)
    assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["tails", "relu2_nogate", "gpt_oss"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("tier", TIERS)
def test_unpack_roundtrips_exactly(tier, dtype_name, case):
    p = problem(case, dtype_name)
    pe = packed(case, dtype_name, tier)
    assert (pe.E, pe.H, pe.I) == tuple(p["up"].shape[:1]) + (p["up"].shape[2], p["up"].shape[1])
    assert pe.dtype == dtype_name and pe.isa == tier and pe.has_gate == (p["gate"] is not None)
    assert pe.nbytes >= p["up"].numel() * p["up"].element_size() * (3 if pe.has_gate else 2)
    names = ["gate", "up", "down", "gate_bias", "up_bias", "down_bias"]
    for name, got in zip(names, pe.unpack()):
        want = p[name]
        if want is None:
            assert got is None, name
            continue
        t = torch.from_dlpack(got)
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert torch.equal(t.view(torch.uint8), want.contiguous().view(torch.uint8)), name  # bit-exact


def test_kernel_table_names_every_path_and_dtype():
    kt = _native.kernel_table()
    assert set(kt) == {"decode", "prefill"}
    assert _native.resolve_isa() in ALL_TIERS
    assert _native.DEFAULT_PREFILL_MIN_TOKENS > 0
    for path in ("decode", "prefill"):
        assert set(kt[path]) == set(DTYPES) | {"int8", "int4", "lossless12"}
        for name in kt[path].values():
            assert re.fullmatch(rf"moe_{path}_(f32|bf16|f16|int8|int4|l12)_(generic|avx2|avx512|amx|avx2dot|avxvnni|avx512vnni|avx512bf16)", name)
    for qdot in ("int", "expand"):  # the quantised formats' kernel family is selectable
        for path, per in _native.kernel_table(qdot).items():
            for fmt in ("int8", "int4"):
                dot = re.fullmatch(rf"moe_{path}_{fmt}_(genericdot|avx2dot|avxvnni|avx512vnni)", per[fmt]) is not None
                assert dot == (qdot == "int"), (qdot, per[fmt])
    if _native.resolve_isa() == "amx":
        assert kt["prefill"]["bfloat16"] == "moe_prefill_bf16_amx"
    # bf16 prefill on AVX-512 without AMX: the vdpbf16ps kernel where the CPU has AVX512-BF16,
    # lossless12 wrapping the same kernel; fp32 / fp16 models and decode keep the fp32 kernel
    if _native.resolve_isa() == "avx512":
        bf16dot = _native.cpu_features()["cpu"]["avx512bf16"]
        assert kt["prefill"]["bfloat16"] == ("moe_prefill_bf16_avx512bf16" if bf16dot else "moe_prefill_bf16_avx512")
        assert kt["prefill"]["lossless12"] == ("moe_prefill_l12_avx512bf16" if bf16dot else "moe_prefill_l12_avx512")
        assert kt["prefill"]["float32"] == "moe_prefill_f32_avx512"
        assert kt["decode"]["bfloat16"] == "moe_decode_bf16_avx512"


def test_env_override_lowers_the_auto_tier(monkeypatch):
    monkeypatch.setenv("HINA_MOE_ISA", "generic")
    assert _native.resolve_isa("auto") == "generic"
    p = problem("decode_t1", "float32")
    assert _native.PackedExperts(p["gate"], p["up"], p["down"]).isa == "generic"
    assert _native.kernel_table()["decode"]["float32"] == "moe_decode_f32_generic"


def test_isa_beyond_the_cpu_is_refused():
    p = problem("decode_t1", "float32")
    missing = [t for t in ALL_TIERS if not _native.isa_supported(t)]
    with pytest.raises(ValueError, match="unknown"):
        _native.PackedExperts(p["gate"], p["up"], p["down"], isa="avx9000")
    if not missing:
        pytest.skip("this CPU supports every tier; nothing to refuse")
    with pytest.raises(ValueError, match=missing[0]):
        _native.PackedExperts(p["gate"], p["up"], p["down"], isa=missing[0])


def _bad_forward_calls():
    p = problem("skip_slots", "bfloat16")
    x, idx, w = p["x"], p["idx"], p["w"]
    out = torch.empty_like(x)
    T, K = idx.shape
    big = idx.clone()
    big[2, 1] = 6  # == E
    return {
        "topk_idx": [
            lambda pe: pe.forward(x, big, w, out),
            lambda pe: pe.forward(x, idx.float(), w, out),
            lambda pe: pe.forward(x, idx[:-1], w, out),
            lambda pe: pe.forward(x, idx.t().contiguous().t(), w, out),  # not C-contiguous
        ],
        "x": [
            lambda pe: pe.forward(x.float(), idx, w, out),
            lambda pe: pe.forward(x[:, :-1].contiguous(), idx, w, out),
            lambda pe: pe.forward(torch.empty(T, 2 * x.shape[1], dtype=x.dtype)[:, ::2], idx, w, out),
        ],
        "topk_w": [
            lambda pe: pe.forward(x, idx, w.double(), out),
            lambda pe: pe.forward(x, idx, w[:-1], out),
        ],
        "out": [
            lambda pe: pe.forward(x, idx, w, out.float()),
            lambda pe: pe.forward(x, idx, w, out[:-1]),
        ],
        "act": [lambda pe: pe.forward(x, idx, w, out, act="swish")],
        "path": [lambda pe: pe.forward(x, idx, w, out, path="fast")],
        "num_threads": [lambda pe: pe.forward(x, idx, w, out, num_threads=-1)],
    }


@pytest.mark.parametrize("arg", list(_bad_forward_calls()))
def test_bad_forward_inputs_raise_value_error_naming_the_argument(arg):
    pe = packed("skip_slots", "bfloat16", "generic")
    for call in _bad_forward_calls()[arg]:
        with pytest.raises(ValueError, match=arg):
            call(pe)


def test_out_of_range_index_names_the_value():
    p = problem("skip_slots", "bfloat16")
    pe = packed("skip_slots", "bfloat16", "generic")
    idx = p["idx"].clone()
    idx[2, 1] = 6
    out = torch.zeros_like(p["x"])
    with pytest.raises(ValueError, match=r"topk_idx\[2, 1\] = 6"):
        pe.forward(p["x"], idx, p["w"], out)
    assert torch.count_nonzero(out) == 0  # rejected before anything is written


def test_bad_constructor_inputs_raise_value_error_naming_the_argument():
    p = problem("tails", "bfloat16")
    g, u, d = p["gate"], p["up"], p["down"]
    E, I, H = u.shape
    cases = [
        ("gate", lambda: _native.PackedExperts(g.float(), u, d)),
        ("gate", lambda: _native.PackedExperts(g[:, :-1].contiguous(), u, d)),
        ("down", lambda: _native.PackedExperts(g, u, d.transpose(1, 2))),
        ("down", lambda: _native.PackedExperts(g, u, d.transpose(1, 2).contiguous().transpose(1, 2))),
        ("up", lambda: _native.PackedExperts(g, u.double(), d)),
        ("up_bias", lambda: _native.PackedExperts(g, u, d, up_bias=torch.zeros(E, I + 1, dtype=u.dtype))),
        ("down_bias", lambda: _native.PackedExperts(g, u, d, down_bias=torch.zeros(E, H, dtype=torch.float32))),
        ("gate_bias", lambda: _native.PackedExperts(None, u, d, gate_bias=torch.zeros(E, I, dtype=u.dtype))),
    ]
    for arg, call in cases:
        with pytest.raises(ValueError, match=arg):
            call()


def test_k_zero_gives_zero_output():
    # K = 0 (no expert slot at all): an empty [T, 0] routing is valid and contributes nothing
    w = torch.randn(2, 8, 16)
    p = _native.PackedExperts(w, w, torch.randn(2, 16, 8))
    out = torch.full((3, 16), 7.0)
    p.forward(torch.randn(3, 16), torch.zeros(3, 0, dtype=torch.int32), torch.zeros(3, 0), out)
    assert torch.equal(out, torch.zeros(3, 16))
