"""Input validation at every boundary: the binding's PackedExperts.forward, the custom op
torch.ops.hi_na_moe.experts (and its helper experts_op), and an enabled model's MoE block.

The contract (README, "Guarantees"): every input either gives the output native transformers
(or the reference path, where transformers has no equivalent) gives, or raises before anything
is computed, naming the argument and what to do. The binding copies nothing (wrong layouts are
errors); the op and enabled blocks accept what a torch op / the native block accepts (any
strides, index and weight dtypes convertible without loss of meaning) and refuse the rest.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

_native = pytest.importorskip("hi_na_moe._native", reason="native extension not built")

import hi_na_moe  # noqa: E402
from hi_na_moe.integrate import adapters
from hi_na_moe.core import reference
from hi_na_moe.core import torch_ops  # noqa: E402
from hi_na_moe.core.spec import ExpertsSpec, GateSpec  # noqa: E402
from tiny_models import build_tiny  # noqa: E402

# H, I not multiples of 16/32: padded panel rows and k-tails in every kernel
E, I, H, K = 6, 40, 72, 2
NAN, INF = float("nan"), float("inf")


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale):
        return ((torch.rand(*shape, generator=g) * 2 - 1) * scale).to(dtype)

    return rnd(E, I, H, scale=2 / math.sqrt(H)), rnd(E, I, H, scale=2 / math.sqrt(H)), rnd(E, H, I, scale=2 / math.sqrt(I))


def _routing(T, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    return idx.to(torch.int64).reshape(T, K), torch.rand(T, K, generator=g)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def experts(request):
    dtype = request.param
    gate, up, down = _weights(dtype)
    packed = _native.PackedExperts(gate, up, down)
    spec = ExpertsSpec(E, H, I, gate=gate, up=up, down=down, gate_spec=GateSpec("silu"))
    handle = torch_ops.register(packed)
    yield dict(dtype=dtype, packed=packed, spec=spec, handle=handle)
    torch_ops.release(handle)


def _x(T, dtype, seed=2):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _binding(ex, x, idx, w, **kw):
    out = torch.full((x.shape[0], H), 7.0, dtype=ex["dtype"])
    ex["packed"].forward(x, idx, w, out, **kw)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def assert_like(ours: torch.Tensor, want: torch.Tensor, dtype=torch.float32):
    """Same shape and dtype, NaN in the same places, +-inf in the same places with the same sign,
    the finite rest within the dtype's rounding."""
    assert ours.shape == want.shape and ours.dtype == want.dtype
    assert torch.equal(ours.isnan(), want.isnan()), "NaN positions differ"
    assert torch.equal(ours.isinf(), want.isinf()), "inf positions differ"
    assert torch.equal(ours[ours.isinf()], want[want.isinf()]), "inf signs differ"
    fin = ours.isfinite()
    a, b = ours[fin].double(), want[fin].double()
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    elif b.numel():  # half precision: max error relative to the output's scale (rounding of h)
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()


# ---------------------------------------------------------------------------------------------
# The binding: PackedExperts.forward reads its arguments as they are, or refuses them.


def _bad_binding_calls(dtype):
    T = 5
    x, (idx, w) = _x(T, dtype), _routing(T)
    other = torch.float16 if dtype == torch.float32 else torch.float32
    big = idx.clone()
    big[3, 1] = E
    huge = idx.clone()
    huge[1, 0] = 2 ** 33  # as int32 this would read as expert 0
    ro_out = np.zeros((T, H), np.float32)
    ro_out.setflags(write=False)
    return [
        # (argument named in the error, error type, message pattern, call(packed, out))
        ("x", ValueError, rf"x has dtype {str(other)[6:]}, expected {str(dtype)[6:]} \(the experts' dtype\); convert x",
         lambda pe, out: pe.forward(x.to(other), idx, w, out)),
        ("x", ValueError, "x must be C-contiguous", lambda pe, out: pe.forward(x.t().contiguous().t(), idx, w, out)),
        ("x", ValueError, "x must be C-contiguous",
         lambda pe, out: pe.forward(torch.cat([x, x], 1)[:, ::2], idx, w, out)),  # sliced with a stride
        ("x", ValueError, r"x has shape \[5, 71\], expected \[5, 72\]", lambda pe, out: pe.forward(x[:, 1:].contiguous(), idx, w, out)),
        ("x", TypeError, "x must be a CPU array .* got torch.Tensor on device meta",
         lambda pe, out: pe.forward(torch.empty(T, H, dtype=dtype, device="meta"), idx, w, out)),
        ("x", TypeError, "x must be a CPU array .* got list", lambda pe, out: pe.forward(x.tolist(), idx, w, out)),
        ("x", ValueError, "x is a torch tensor with its negative bit set.*resolve_neg",
         lambda pe, out: pe.forward(torch._neg_view(x), idx, w, out)),
        ("topk_idx", ValueError, "topk_idx has dtype float32, expected int32 or int64",
         lambda pe, out: pe.forward(x, idx.float(), w, out)),
        ("topk_idx", ValueError, "topk_idx has dtype bool", lambda pe, out: pe.forward(x, idx.bool(), w, out)),
        ("topk_idx", ValueError, "topk_idx has dtype int16", lambda pe, out: pe.forward(x, idx.short(), w, out)),
        ("topk_idx", ValueError, r"topk_idx\[3, 1\] = 6 is out of range: the experts have E = 6",
         lambda pe, out: pe.forward(x, big, w, out)),
        ("topk_idx", ValueError, r"topk_idx\[1, 0\] = 8589934592 is out of range",
         lambda pe, out: pe.forward(x, huge, w, out)),
        ("topk_idx", ValueError, "topk_idx must be C-contiguous",
         lambda pe, out: pe.forward(x, idx.t().contiguous().t(), w, out)),
        ("topk_w", ValueError, r"topk_w has dtype float64, expected float32, bfloat16 or float16",
         lambda pe, out: pe.forward(x, idx, w.double(), out)),
        ("topk_w", ValueError, r"topk_w has dtype int32", lambda pe, out: pe.forward(x, idx, idx.int(), out)),
        ("topk_w", ValueError, r"topk_w has shape \[5, 3\], expected \[5, 2\]",
         lambda pe, out: pe.forward(x, idx, torch.rand(T, K + 1), out)),
        ("topk_w", ValueError, r"topk_w has shape \[4, 2\], expected \[5, 2\]", lambda pe, out: pe.forward(x, idx, w[1:], out)),
        ("topk_w", ValueError, "topk_w must be C-contiguous", lambda pe, out: pe.forward(x, idx, w.t().contiguous().t(), out)),
        ("topk_w", ValueError, "topk_w is a torch tensor with its negative bit set",
         lambda pe, out: pe.forward(x, idx, torch._neg_view(w), out)),
        ("out", TypeError, "out must be a writable CPU array",
         lambda pe, out: pe.forward(x.float().numpy(), idx.numpy(), w.numpy(), ro_out)),
    ]


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
def test_routing_weights_in_half_precision_are_read_exactly(experts, w_dtype):
    """bf16/f16 routing weights (what routers hand over in bf16/f16 models) are read as they are:
    the same output as the same values converted to float32 first, from forward() and from the
    unchecked BoundForward that torch_ops uses."""
    dtype, pe = experts["dtype"], experts["packed"]
    g = torch.Generator().manual_seed(5)
    T, K = 7, 2
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.randint(0, 6, (T, K), generator=g)
    w = torch.rand(T, K, generator=g).to(w_dtype)
    want, got, bound = (torch.empty(T, H, dtype=dtype) for _ in range(3))
    pe.forward(x, idx, w.float(), want)
    pe.forward(x, idx, w, got)
    pe.bind()(x.data_ptr(), T, idx.data_ptr(), 64, K, w.data_ptr(), {torch.bfloat16: 1, torch.float16: 2}[w_dtype],
              bound.data_ptr(), 0)
    assert torch.equal(got, want) and torch.equal(bound, want)


@pytest.mark.parametrize("case", range(len(_bad_binding_calls(torch.float32))))
def test_binding_refuses_what_it_cannot_read_as_is(experts, case):
    arg, error, match, call = _bad_binding_calls(experts["dtype"])[case]
    out = torch.full((5, H), 7.0, dtype=experts["dtype"])
    with pytest.raises(error, match=match) as info:
        call(experts["packed"], out)
    assert arg in str(info.value)
    assert bool((out == 7.0).all()), "out was written before the error"


def test_binding_negative_indices_skip_the_slot(experts):
    # moe.h: e < 0 skips the slot, whatever its weight; equal to routing it with weight 0
    T = 6
    x, (idx, w) = _x(T, experts["dtype"]), _routing(T)
    skip, zero_w = idx.clone(), w.clone()
    skip[1, 0], skip[4, 1] = -1, -(2 ** 40)
    zero_w[1, 0] = zero_w[4, 1] = 0.0
    w_skip = w.clone()
    w_skip[1, 0] = w_skip[4, 1] = NAN  # never read for a skipped slot
    idx_zero = torch.where(skip < 0, torch.zeros_like(skip), skip)
    assert _same_bits(_binding(experts, x, skip, w_skip), _binding(experts, x, idx_zero, zero_w))


def test_binding_empty_batch(experts):
    out = torch.empty(0, H, dtype=experts["dtype"])
    name = experts["packed"].forward(torch.empty(0, H, dtype=experts["dtype"]), torch.empty(0, K, dtype=torch.int64),
                                     torch.empty(0, K), out)
    assert name.startswith("moe_")


# ---------------------------------------------------------------------------------------------
# The custom op (both ways in: through the dispatcher, and experts_op's direct call).


def _op(ex, x, idx, w, how):
    if how == "op":
        return torch.ops.hi_na_moe.experts.default(x, idx, w, ex["handle"], "silu", 1.702, math.inf, math.inf,
                                                   math.inf, 0.0, False, 0)
    return torch_ops.experts_op(ex["handle"], x, idx, w, dispatch=(how == "dispatch"))


HOW = ["op", "dispatch", "direct"]


@pytest.mark.parametrize("how", HOW)
def test_op_takes_any_strides_and_lazy_views(experts, how):
    T = 9
    x, (idx, w) = _x(T, experts["dtype"]), _routing(T)
    want = _op(experts, x, idx, w, how)
    assert _same_bits(want, _binding(experts, x, idx, w))
    variants = {
        "x transposed": (x.t().contiguous().t(), idx, w),
        "x sliced with a stride": (torch.stack([x, x], 2)[..., 0], idx, w),
        "x with an offset": (torch.cat([x[:1], x])[1:], idx, w),
        "x negative-bit view": (torch._neg_view(-x), idx, w),
        "topk_idx transposed": (x, idx.t().contiguous().t(), w),
        "topk_w transposed": (x, idx, w.t().contiguous().t()),
        "topk_w negative-bit view": (x, idx, torch._neg_view(-w)),
    }
    for what, args in variants.items():
        assert _same_bits(_op(experts, *args, how), want), what


@pytest.mark.parametrize("how", HOW)
def test_op_converts_index_and_weight_dtypes_or_refuses_them(experts, how):
    T = 7
    x, (idx, w) = _x(T, experts["dtype"]), _routing(T)
    want = _op(experts, x, idx, w, how)
    for i in (idx.int(), idx.short(), idx.to(torch.uint8)):  # integer indices: widened as they are
        assert _same_bits(_op(experts, x, i, w, how), want), i.dtype
    assert _same_bits(_op(experts, x, idx, w.double(), how), want)  # fp64 -> fp32 is exact here
    wb = w.bfloat16()
    assert _same_bits(_op(experts, x, idx, wb, how), _op(experts, x, idx, wb.float(), how))
    for bad in (idx.float(), idx.double(), idx.bool()):
        with pytest.raises(TypeError, match=rf"topk_idx must hold integer expert indices .* got {bad.dtype}"):
            _op(experts, x, bad, w, how)
    with pytest.raises(TypeError, match="topk_w must hold floating-point routing weights .* got torch.int64"):
        _op(experts, x, idx, (w * 10).long(), how)
    other = torch.float16 if experts["dtype"] == torch.float32 else torch.float32
    with pytest.raises(ValueError, match="x has dtype .*expected .*the experts' dtype"):
        _op(experts, x.to(other), idx, w, how)


@pytest.mark.parametrize("how", HOW)
def test_op_index_range_and_shapes(experts, how):
    T = 5
    x, (idx, w) = _x(T, experts["dtype"]), _routing(T)
    big = idx.clone()
    big[2, 0] = E
    with pytest.raises(ValueError, match=r"topk_idx\[2, 0\] = 6 is out of range"):
        _op(experts, x, big, w, how)
    neg = idx.clone()
    neg[2, 0] = -1
    zero_w = w.clone()
    zero_w[2, 0] = 0.0
    assert _same_bits(_op(experts, x, neg, w, how), _op(experts, x, torch.where(neg < 0, 0, neg), zero_w, how))
    with pytest.raises(ValueError, match=r"topk_w has shape \[5, 3\], expected \[5, 2\]"):
        _op(experts, x, idx, torch.rand(T, K + 1), how)
    with pytest.raises(ValueError, match=r"topk_idx has shape \[4, 2\], expected \[5, 2\]"):
        _op(experts, x, idx[1:], w[1:], how)
    with pytest.raises(ValueError, match=r"x has shape \[5, 73\]"):
        _op(experts, torch.cat([x, x[:, :1]], 1), idx, w, how)


def _nan_inf_case(dtype):
    """Tokens with NaN / +inf / -inf in x, and NaN / inf routing weights; token 0 stays clean."""
    T = 8
    x, (idx, w) = _x(T, dtype), _routing(T)
    x[1, 5] = NAN
    x[2, 0] = INF
    x[3, H - 1] = -INF
    x[4] = INF
    w[5, 1] = NAN
    w[6, 0] = INF  # out = inf * y: +-inf by the sign of each y element
    w[7, 1] = -INF
    return x, idx, w


@pytest.mark.parametrize("how", ["binding", *HOW])
def test_nan_and_inf_propagate_as_in_the_reference(experts, how):
    x, idx, w = _nan_inf_case(experts["dtype"])
    want = reference.experts_forward(experts["spec"], x, idx, w)
    ours = _binding(experts, x, idx, w) if how == "binding" else _op(experts, x, idx, w, how)
    assert want[0].isfinite().all() and want[6].isinf().any()  # the case is what it claims
    assert_like(ours, want, experts["dtype"])


@pytest.mark.parametrize("how", HOW)
def test_empty_batch_gives_an_empty_output(experts, how):
    x, (idx, w) = torch.empty(0, H, dtype=experts["dtype"]), _routing(0)
    out = _op(experts, x, idx, w, how)
    assert out.shape == (0, H) and out.dtype == experts["dtype"]


def test_huge_batch(experts):
    # T = 8192 on a tiny layer: every path (prefill tiles, routing metadata) at a large T
    T = 8192
    x, (idx, w) = _x(T, experts["dtype"]), _routing(T)
    assert_like(_op(experts, x, idx, w, "direct"), reference.experts_forward(experts["spec"], x, idx, w),
                experts["dtype"])


# ---------------------------------------------------------------------------------------------
# An enabled model's MoE blocks, against the same block run natively by transformers.

# layouts: experts interface (concatenated / interleaved+transposed+bias), block adapters
# (input-weighted Llama 4, JetMoE's sorted router), identity experts (LongCat), DBRX's views
FAMILIES = ["olmoe", "gpt_oss", "nemotron_h", "llama4", "jetmoe", "longcat_flash", "dbrx"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request):
    return build_tiny(request.param)


def _match(model):
    return next(m for m in adapters.discover(model) if m.spec is not None)


def _block(model):
    """The MoE block (router + experts) of the first accelerated match."""
    m = _match(model)
    return m.module if m.adapter.startswith("block:") else model.get_submodule(m.name.rpartition(".")[0])


def _run(fn):
    try:
        with torch.no_grad():
            out = fn()
    except Exception as exc:  # noqa: BLE001 - compared with the native block's behaviour
        return exc
    return out[0] if isinstance(out, tuple) else out


def _block_cases(H):
    g = torch.Generator().manual_seed(5)
    nan = torch.randn(1, 7, H, generator=g)
    nan[0, 1, 3], nan[0, 3, 0], nan[0, 4, H - 1] = NAN, INF, -INF
    nan[0, 5] = INF
    return {
        "T=1": torch.randn(1, 1, H, generator=g),
        "T=0": torch.randn(1, 0, H, generator=g),
        "transposed": torch.randn(1, H, 6, generator=g).transpose(1, 2),
        "sliced with a stride": torch.randn(1, 6, 2 * H, generator=g)[..., ::2],
        "NaN and inf tokens": nan,
        "T=8192": torch.randn(1, 8192, H, generator=g) * 0.5,
    }


def _assert_same_as_native(ours, native, what):
    if isinstance(native, Exception) or isinstance(ours, Exception):
        assert type(ours) is type(native), f"{what}: native gave {native!r}, enabled gave {ours!r}"
        return
    assert_like(ours, native)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_enabled_block_behaves_as_native(tiny, backend):
    model = tiny.model
    block = _block(model)
    cases = _block_cases(_match(model).spec.hidden)
    native = {k: _run(lambda h=h: block(h)) for k, h in cases.items()}
    hi_na_moe.enable_for_model(model, backend=backend)
    try:
        for k, h in cases.items():
            _assert_same_as_native(_run(lambda h=h: block(h)), native[k], k)
    finally:
        hi_na_moe.disable_for_model(model)
    assert isinstance(native["NaN and inf tokens"], torch.Tensor) and native["NaN and inf tokens"].isnan().any()


def _experts_cases(spec, dtype):
    """(hidden, top_k_index, top_k_weights) for the experts module itself (fixed routing)."""
    Hs, Es, T = spec.hidden, spec.num_experts, 6
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, Hs, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(Es, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g)
    return {
        "plain": (x, idx, w),
        "int32 indices": (x, idx.int(), w),
        "bf16 weights": (x, idx, w.bfloat16()),
        "transposed": (x.t().contiguous().t(), idx.t().contiguous().t(), w.t().contiguous().t()),
        "sliced": (torch.stack([x, x], 2)[..., 1], idx, torch.stack([w, w], 2)[..., 0]),
        "T=0": (x[:0], idx[:0], w[:0]),
    }


EXPERTS_FAMILIES = ["olmoe", "gpt_oss", "nemotron_h", "longcat_flash"]  # experts-level adapters


@pytest.mark.parametrize("model_type", EXPERTS_FAMILIES)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_enabled_experts_module_behaves_as_native(model_type, backend):
    model = build_tiny(model_type).model
    match = _match(model)
    ex = match.module
    cases = _experts_cases(match.spec, match.spec.weight_dtype)
    native = {k: _run(lambda a=a: ex(*a)) for k, a in cases.items()}
    # where transformers refuses a form (e.g. int32 indices: one_hot wants int64), the enabled
    # block may refuse it too, or compute what transformers computes on the canonical form
    canonical = {k: _run(lambda a=a: ex(a[0].contiguous(), a[1].long(), a[2].float())) for k, a in cases.items()}
    hi_na_moe.enable_for_model(model, backend=backend)
    try:
        for k, a in cases.items():
            ours = _run(lambda a=a: ex(*a))
            want = canonical[k] if isinstance(native[k], Exception) and not isinstance(ours, Exception) else native[k]
            _assert_same_as_native(ours, want, k)
        x, idx, w = cases["plain"]
        # negative index: the slot is skipped (transformers has no such convention: compared
        # with routing the slot to expert 0 with weight 0)
        neg, zw = idx.clone(), w.clone()
        neg[1, 1], zw[1, 1] = -1, 0.0
        assert_like(_run(lambda: ex(x, neg, w)), _run(lambda: ex(x, torch.where(neg < 0, 0, neg), zw)))
        # what cannot be meant: an error naming the argument, before anything runs
        with pytest.raises(TypeError, match="top_k_index must hold integer expert indices"):
            ex(x, idx.float(), w)
        with pytest.raises(TypeError, match="top_k_weights must be floating point"):
            ex(x, idx, (w > 0.5).long())
        with pytest.raises(ValueError, match=r"top_k_weights has shape \(6, 1\), expected \(6, 2\)"):
            ex(x, idx, w[:, :1])
        with pytest.raises(ValueError, match=r"top_k_index has shape \(5, 2\), expected \[6, K\]"):
            ex(x, idx[1:], w[1:])
        n_total = match.spec.num_experts + match.spec.n_identity
        big = idx.clone()
        big[2, 1] = n_total  # LongCat: one past its identity experts, never one of them
        with pytest.raises(ValueError, match=rf"(topk_idx\[2, 1\] = {n_total} is out of range)|"
                                             rf"(top_k_index holds expert {n_total}, but this block has {n_total})"):
            ex(x, big, w)
    finally:
        hi_na_moe.disable_for_model(model)


# Two kernel deviations from torch's NaN semantics were found by these tests and fixed (the
# clamps of the AVX-512 h_vec returned the limit for a NaN gate/up, and relu/relu2 mapped NaN to
# 0 on every tier): the tests below pin them.


@pytest.mark.parametrize("model_type", EXPERTS_FAMILIES)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_enabled_experts_propagate_nan_and_inf_as_native(model_type, backend):
    model = build_tiny(model_type).model
    match = _match(model)
    ex = match.module
    x, idx, w = _experts_cases(match.spec, match.spec.weight_dtype)["plain"]
    x, w = x.clone(), w.clone()
    x[1, 2], x[2] = NAN, INF  # with finite routing weights: only the experts can propagate them
    w[3, 0], w[4, 1] = NAN, INF
    native = _run(lambda: ex(x, idx, w))
    hi_na_moe.enable_for_model(model, backend=backend)
    try:
        ours = _run(lambda: ex(x, idx, w))
    finally:
        hi_na_moe.disable_for_model(model)
    assert native[1].isnan().all() and native[0].isfinite().all()
    assert_like(ours, native)


def _tiers():
    return [t for t in ("generic", "avx2", "avx512", "amx") if _native.isa_supported(t)]


# NaN through every activation form and both clamps, at the binding, per tier, path and activation form
@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("form", ["silu", "silu+limits", "sigmoid_alpha+limits", "relu", "relu2 no gate", "relu no gate"])
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_kernels_propagate_nan_like_torch(tier, form, path):
    act, _, rest = form.partition("+")
    act = act.split()[0]
    gated, limits = "no gate" not in form, rest == "limits"
    gate, up, down = _weights(torch.float32)
    pe = _native.PackedExperts(gate if gated else None, up, down, isa=tier)
    x, (idx, w) = _x(3, torch.float32), _routing(3)
    x[0, 3] = NAN  # every g and u of token 0 is NaN: its whole output row must be NaN
    kw = dict(act=act, gate_limit=7.0, up_limit=7.0) if limits else dict(act=act)
    out = torch.empty(3, H)
    pe.forward(x, idx, w, out, path=path, **kw)
    spec = ExpertsSpec(E, H, I, gate=gate if gated else None, up=up, down=down, has_gate=gated,
                       gate_spec=GateSpec(act, gate_limit=7.0 if limits else INF, up_limit=7.0 if limits else INF),
                       # without a gate the reference needs the plain activation h = act(u)
                       act_fn=None if gated else (lambda u: reference.activation(act, u, 1.702)))
    want = reference.experts_forward(spec, x, idx, w)
    assert want[0].isnan().all()
    assert_like(out, want)


def test_enabled_experts_accept_other_float_dtypes_for_hidden():
    # transformers' own experts refuse a hidden dtype other than the weights'; the enabled block
    # computes in the weights' dtype and returns the caller's dtype
    model = build_tiny("olmoe").model
    match = _match(model)
    ex = match.module
    x, idx, w = _experts_cases(match.spec, torch.float32)["plain"]
    dtypes = (torch.float64, torch.bfloat16)
    want = {dt: _run(lambda dt=dt: ex(x.to(dt).float(), idx, w)).to(dt) for dt in dtypes}  # native
    hi_na_moe.enable_for_model(model)
    try:
        for dt in dtypes:
            got = _run(lambda dt=dt: ex(x.to(dt), idx, w))
            assert got.dtype == dt
            assert_like(got, want[dt], dt)
    finally:
        hi_na_moe.disable_for_model(model)
