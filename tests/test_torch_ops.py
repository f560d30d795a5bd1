"""torch.ops.hi_na_moe.experts (hi_na_moe.core.torch_ops): the native experts op as a torch.library
custom op, vs a direct PackedExperts.forward call (bit-for-bit), under inference_mode, traced by
torch.compile(fullgraph=True), and through torch.library.opcheck.

Run this file as a script (`python tests/test_torch_ops.py`) to print the per-call overhead of
the op vs a direct PackedExperts.forward at decode (T=1, H=2048, E=8, I=64, K=2, bf16).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time

import pytest
import torch

_native = pytest.importorskip("hi_na_moe._native", reason="native extension not built")
from hi_na_moe.core import torch_ops  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
# gpt-oss-like options: finite and infinite limits, up_offset, sigmoid_alpha
OPTS = dict(act="sigmoid_alpha", alpha=1.702, gate_limit=0.5, up_limit=math.inf,
            post_act_limit=math.inf, up_offset=1.0, weight_on_input=False)
ARG_ORDER = ("act", "alpha", "gate_limit", "up_limit", "post_act_limit", "up_offset", "weight_on_input")


def _problem(dtype, T=5, E=6, K=2, H=72, I=40, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return ((torch.rand(*shape, generator=gen) * 2 - 1) * scale).to(dtype)

    w = dict(
        gate=rnd(E, I, H, scale=2 / math.sqrt(H)), up=rnd(E, I, H, scale=2 / math.sqrt(H)),
        down=rnd(E, H, I, scale=2 / math.sqrt(I)),
        gate_bias=rnd(E, I, scale=0.5) if bias else None, up_bias=rnd(E, I, scale=0.5) if bias else None,
        down_bias=rnd(E, H, scale=0.5) if bias else None,
    )
    x = rnd(T, H)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)] or [torch.empty(0, K)])
    idx = idx.reshape(T, K).to(torch.int32)
    if T:
        idx[0, -1] = -1  # a skipped slot
    tw = torch.rand(T, K, generator=gen)
    return w, x, idx, tw


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: str(d).split(".")[-1])
def case(request):
    w, x, idx, tw = _problem(request.param)
    packed = _native.PackedExperts(w["gate"], w["up"], w["down"], w["gate_bias"], w["up_bias"],
                                   w["down_bias"], isa="auto")
    handle = torch_ops.register(packed)
    want = torch.full_like(x, float("nan"))
    kernel = packed.forward(x, idx, tw, want, num_threads=2, **OPTS)
    yield dict(packed=packed, handle=handle, x=x, idx=idx, w=tw, want=want, kernel=kernel)
    torch_ops.release(handle)


def _op_args(c, num_threads=2):
    return (c["x"], c["idx"], c["w"], c["handle"], *(OPTS[k] for k in ARG_ORDER), num_threads)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit (NaN-safe): compare the raw bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class _ForwardForbidden:
    """Stands in for a PackedExperts whose checked forward() must not run: bind() and the
    properties the direct path reads are the real block's."""

    def __init__(self, packed):
        self.packed, self.dtype, self.H = packed, packed.dtype, packed.H

    def bind(self, *args, **kwargs):
        return self.packed.bind(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise AssertionError("forward() ran")


@pytest.mark.parametrize("how", ["direct", "dispatch"])
def test_valid_calls_take_the_bound_path_and_others_reach_forward(case, how):
    """What the Python checks accept runs through the BoundForward with raw addresses, bit-equal
    to forward(); routing weights in bf16 go the same way, read exactly. What they refuse goes
    to the checked forward() (here a stand-in that raises), never to the raw call."""
    h = torch_ops.register(_ForwardForbidden(case["packed"]))
    try:
        opts = dict(OPTS, num_threads=2, dispatch=how == "dispatch")
        got = torch_ops.experts_op(h, case["x"], case["idx"], case["w"], **opts)
        assert _same(got, case["want"])
        w16 = case["w"].bfloat16()
        want16 = torch.empty_like(case["x"])
        case["packed"].forward(case["x"], case["idx"], w16.float(), want16, num_threads=2, **OPTS)
        assert _same(torch_ops.experts_op(h, case["x"], case["idx"], w16, **opts), want16)
        wrong = torch.float16 if case["x"].dtype != torch.float16 else torch.float32
        for bad in (case["x"].to(wrong), case["x"][:, 1:]):  # the experts' dtype, their H
            with pytest.raises(AssertionError, match="forward"):
                torch_ops.experts_op(h, bad, case["idx"], case["w"], **opts)
    finally:
        torch_ops.release(h)
    assert h not in torch_ops._BOUND


def test_schema_is_the_documented_one():
    s = str(torch.ops.hi_na_moe.experts.default._schema)
    # custom_op infers `int` arguments as SymInt (a superset of int: a handle that Dynamo made
    # dynamic still traces)
    assert s == ("hi_na_moe::experts(Tensor x, Tensor topk_idx, Tensor topk_w, SymInt handle, str act, "
                 "float alpha, float gate_limit, float up_limit, float post_act_limit, float up_offset, "
                 "bool weight_on_input, SymInt num_threads) -> Tensor")


def test_op_equals_direct_forward_bit_for_bit(case):
    got = torch.ops.hi_na_moe.experts.default(*_op_args(case))
    assert _same(got, case["want"])
    assert torch_ops.last_kernel(case["handle"]) == case["kernel"]
    # the CustomOpDef object and the helper (both its paths) give the same bits
    assert _same(torch_ops.experts(*_op_args(case)), case["want"])
    for dispatch in (None, True, False):
        got = torch_ops.experts_op(case["handle"], case["x"], case["idx"], case["w"], num_threads=2,
                                   dispatch=dispatch, **OPTS)
        assert _same(got, case["want"]), dispatch


def test_infinity_passes_through_the_float_args(case):
    # a finite limit far above every value gives the same bits as inf: inf was not mangled
    # (into nan/0, which would clamp everything) on the way through the schema
    w, x, idx, tw = _problem(case["x"].dtype, bias=False)
    packed = _native.PackedExperts(w["gate"], w["up"], w["down"])
    h = torch_ops.register(packed)
    try:
        kw = dict(act="silu", alpha=1.702, up_offset=0.0, weight_on_input=False, num_threads=1)
        a = torch_ops.experts_op(h, x, idx, tw, gate_limit=math.inf, up_limit=math.inf,
                                 post_act_limit=math.inf, dispatch=True, **kw)
        b = torch_ops.experts_op(h, x, idx, tw, gate_limit=1e30, up_limit=1e30, post_act_limit=1e30,
                                 dispatch=True, **kw)
        assert _same(a, b) and torch.isfinite(a.float()).all()
    finally:
        torch_ops.release(h)


def test_under_inference_mode(case):
    with torch.inference_mode():
        got = torch.ops.hi_na_moe.experts.default(*_op_args(case))
        assert got.is_inference()
        assert _same(got, case["want"])
        got = torch_ops.experts_op(case["handle"], case["x"], case["idx"], case["w"], num_threads=2, **OPTS)
        assert _same(got, case["want"])


def test_helper_normalises_index_and_weight_dtypes(case):
    c = case
    w64 = c["w"].double()
    got = torch_ops.experts_op(c["handle"], c["x"], c["idx"].to(torch.int16), w64, num_threads=2,
                               dispatch=True, **OPTS)
    assert _same(got, c["want"])
    got = torch_ops.experts_op(c["handle"], c["x"], c["idx"].long(), c["w"], num_threads=2, **OPTS)
    assert _same(got, c["want"])


def test_empty_batch():
    w, x, idx, tw = _problem(torch.bfloat16, T=0)
    h = torch_ops.register(_native.PackedExperts(w["gate"], w["up"], w["down"]))
    try:
        out = torch_ops.experts_op(h, x, idx, tw, dispatch=True)
        assert out.shape == x.shape and out.dtype == x.dtype
    finally:
        torch_ops.release(h)


def test_registry_release_and_stale_handles():
    w, x, idx, tw = _problem(torch.float32, bias=False)
    packed = _native.PackedExperts(w["gate"], w["up"], w["down"])
    h1, h2 = torch_ops.register(packed), torch_ops.register(packed)
    assert h1 != h2  # never reused
    assert torch_ops.get(h1) is packed
    assert torch_ops.release(h1) and not torch_ops.release(h1)
    for dispatch in (True, False):
        with pytest.raises(ValueError, match=rf"hi_na_moe: no packed experts registered under handle {h1}"):
            torch_ops.experts_op(h1, x, idx, tw, dispatch=dispatch)
    torch_ops.experts_op(h2, x, idx, tw)
    torch_ops.release(h2)
    with pytest.raises(TypeError, match="PackedExperts"):
        torch_ops.register(object())


def test_registry_releases_with_its_owner():
    w, *_ = _problem(torch.float32, bias=False)

    class Owner:
        pass

    owner = Owner()
    h = torch_ops.register(_native.PackedExperts(w["gate"], w["up"], w["down"]), owner=owner)
    assert h in torch_ops.registered_handles()
    del owner
    gc.collect()
    assert h not in torch_ops.registered_handles()


def test_bad_input_raises_the_bindings_value_error(case):
    with pytest.raises(ValueError, match="x has dtype"):
        torch_ops.experts_op(case["handle"], case["x"].double(), case["idx"], case["w"], dispatch=True)


def test_backward_raises_a_clear_error(case):
    x = case["x"].clone().requires_grad_()
    # grad-requiring inputs take the op (never the direct path), whose backward refuses clearly
    y = torch_ops.experts_op(case["handle"], x, case["idx"], case["w"], num_threads=2, **OPTS)
    assert y.requires_grad and _same(y.detach(), case["want"])
    with pytest.raises(RuntimeError, match=r"hi_na_moe::experts .*no backward.*reference path.*model\.train\(\)"):
        y.float().sum().backward()


def test_fake_tensor_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 72, dtype=torch.bfloat16)
        out = torch.ops.hi_na_moe.experts.default(
            x, torch.empty(7, 2, dtype=torch.int32), torch.empty(7, 2), 123456789, "silu", 1.702,
            math.inf, math.inf, math.inf, 0.0, False, 0)
        assert out.shape == (7, 72) and out.dtype == torch.bfloat16  # the handle is never looked up


def test_opcheck(case):
    # All four default checks (test_schema, test_autograd_registration, test_faketensor,
    # test_aot_dispatch_dynamic) with inputs that do not require grad: aot_dispatch then checks
    # the forward only, as there is no backward to compare against.
    torch.library.opcheck(torch.ops.hi_na_moe.experts.default, _op_args(case))
    # With a grad-requiring x only the registration check applies: test_aot_dispatch_dynamic
    # would run the backward, which intentionally raises (test_backward_raises_a_clear_error).
    args = (case["x"].clone().requires_grad_(), *_op_args(case)[1:])
    torch.library.opcheck(torch.ops.hi_na_moe.experts.default, args,
                          test_utils=("test_autograd_registration",))


def _fn(handle):
    def fn(x, idx, w):
        # the op between ordinary ops, so the graph has more than one node
        return torch_ops.experts_op(handle, x * 1, idx, w, num_threads=2, **OPTS) + 0
    return fn


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(case, backend):
    torch._dynamo.reset()
    fn = torch.compile(_fn(case["handle"]), fullgraph=True, backend=backend)
    assert _same(fn(case["x"], case["idx"], case["w"]), case["want"])
    with torch.inference_mode():
        assert _same(fn(case["x"], case["idx"], case["w"]), case["want"])


def test_torch_compile_traces_one_op_node(case):
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(_fn(case["handle"]), fullgraph=True, backend=backend)
    assert _same(fn(case["x"], case["idx"], case["w"]), case["want"])
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.hi_na_moe.experts.default) == 1


def test_torch_compile_handle_as_an_input():
    """One compiled function serving several blocks: the handle is an input (a SymInt in the
    graph once Dynamo makes it dynamic), not a constant baked into each graph."""
    torch._dynamo.reset()
    w, x, idx, tw = _problem(torch.float32, bias=False)
    handles = [torch_ops.register(_native.PackedExperts(w["gate"] * s, w["up"], w["down"])) for s in (1, 2, 3)]
    try:
        fn = torch.compile(lambda x, i, tw, h: torch_ops.experts_op(h, x, i, tw) * 1, fullgraph=True,
                           backend="aot_eager", dynamic=True)
        outs = [fn(x, idx, tw, h) for h in handles]
        for h, got in zip(handles, outs):
            assert _same(got, torch_ops.experts_op(h, x, idx, tw))
        assert not torch.equal(outs[0], outs[1])
    finally:
        for h in handles:
            torch_ops.release(h)


@pytest.mark.skipif(not os.environ.get("HINA_TEST_INDUCTOR"),
                    reason="inductor takes 20-40 s to compile on a 2-core machine; set HINA_TEST_INDUCTOR=1")
def test_torch_compile_inductor(case):
    torch._dynamo.reset()
    fn = torch.compile(_fn(case["handle"]), fullgraph=True, backend="inductor")
    assert _same(fn(case["x"], case["idx"], case["w"]), case["want"])


# --- overhead measurement (not a test: timing asserts would be flaky) --------------------------

class _NoOpPacked:
    """Stands in for PackedExperts to time the call path alone (no kernel)."""

    def forward(self, *args):
        return "noop"


def measure_overhead(stub: bool = False, calls: int = 1000, rounds: int = 30) -> dict[str, dict[str, float]]:
    """Median per-call time (us) of each way to run the op at decode (T=1, H=2048, E=8, I=64,
    K=2, bf16, 1 kernel thread), per grad mode. stub=True replaces the kernel by a no-op to time
    the call path alone. The cases are interleaved round by round so machine noise spreads
    evenly; the report is the median over rounds of each round's median."""
    torch.manual_seed(0)
    E, I, H, K = 8, 64, 2048, 2
    g = (torch.randn(E, I, H) * 0.02).bfloat16()
    d = (torch.randn(E, H, I) * 0.02).bfloat16()
    packed = _NoOpPacked() if stub else _native.PackedExperts(g, g, d)
    h = torch_ops.register(packed)
    x = torch.randn(1, H).bfloat16()
    idx = torch.randint(0, E, (1, K), dtype=torch.int32)
    w = torch.rand(1, K)
    out = torch.empty_like(x)
    inf = math.inf
    args = (x, idx, w, h, "silu", 1.702, inf, inf, inf, 0.0, False, 1)
    cases = {
        "direct packed.forward, preallocated out": lambda: packed.forward(
            x, idx, w, out, "silu", 1.702, inf, inf, inf, 0.0, False, 1),
        "direct packed.forward + torch.empty_like": lambda: packed.forward(
            x, idx, w, torch.empty_like(x), "silu", 1.702, inf, inf, inf, 0.0, False, 1),
        "torch.ops.hi_na_moe.experts.default": lambda: torch.ops.hi_na_moe.experts.default(*args),
        "experts_op(dispatch=True)": lambda: torch_ops.experts_op(h, x, idx, w, num_threads=1, dispatch=True),
        "experts_op (default: direct)": lambda: torch_ops.experts_op(h, x, idx, w, num_threads=1),
    }

    def run(f):
        ts = []
        for _ in range(calls):
            t = time.perf_counter_ns()
            f()
            ts.append(time.perf_counter_ns() - t)
        return statistics.median(ts)

    out_us = {}
    for mode, ctx in (("grad", torch.enable_grad), ("no_grad", torch.no_grad),
                      ("inference_mode", torch.inference_mode)):
        with ctx():
            for f in cases.values():
                for _ in range(300):
                    f()
            res: dict[str, list[float]] = {k: [] for k in cases}
            for _ in range(rounds):
                for k, f in cases.items():
                    res[k].append(run(f))
        out_us[mode] = {k: statistics.median(v) / 1e3 for k, v in res.items()}
    torch_ops.release(h)
    return out_us


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, kernel threads 1, "
          f"T=1 H=2048 E=8 I=64 K=2 bf16, isa {_native.resolve_isa()}")
    for stub in (False, True):
        print("\n== no-op stub instead of the kernel (call path only) ==" if stub else "== real kernel ==")
        for mode, res in measure_overhead(stub=stub).items():
            base = next(iter(res.values()))
            print(mode)
            for k, us in res.items():
                print(f"  {k:42s} {us:7.2f} us  ({us - base:+6.2f})")


def test_whole_enabled_model_compiles_without_graph_breaks():
    """torch.compile of a whole enabled model (the shipped one): same logits, and hi_na_moe adds
    no graph break (get_num_threads() is not called while compiling)."""
    from pathlib import Path

    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    import hi_na_moe

    model = AutoModelForCausalLM.from_pretrained(Path(__file__).resolve().parent.parent / "models" / "hina-tiny-moe").eval()
    ids = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    hi_na_moe.enable_for_model(model)
    try:
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="aot_eager")
        with torch.no_grad():
            out = compiled(ids).logits
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert float((out - ref).norm() / ref.norm()) < 1e-5
    finally:
        hi_na_moe.disable_for_model(model)
        torch._dynamo.reset()
