"""scope="all" (hi_na_moe.fastpath.mla): decode steps of multi-head latent attention modules (DeepSeek-V2/V3
and the families built on them) on the native absorbed kernel. The kernel against the keys and
values transformers makes (a float64 attention over them, every tier); the patched modules
against their own forwards on the same packed projections (the same cache contents, logits
within rounding at every teacher-forced step) for each family and rotary form, with padded
batches, eager masks and quantised weights; and the modules left to their own forward."""

from __future__ import annotations

import copy
import dataclasses
import sys

import pytest
import torch
from tiny_models import UNBUILDABLE, build_tiny
from transformers import DynamicCache

import hi_na_moe
from hi_na_moe.fastpath import attention, kv_cache, linear, mla, orchestrate, stack
from hi_na_moe.core.native import native_kernels_available, native_module
from hi_na_moe.core.registry import decode_call_counts, patched_runner
from hi_na_moe.fastpath.linear import patched_member

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _native():
    from hi_na_moe import _native

    return _native


def _tiers():
    return [t for t in ("generic", "avx2", "avx512", "amx") if _native().isa_supported(t)]


def _expanded_reference(q_nope, q_pe, w, latent, k_pe, scale, mask=None):
    """What transformers computes, in float64: every head's keys [W_k c, k_pe] and values W_v c."""
    H, Dn = q_nope.shape[1], q_nope.shape[2]
    wd = w.double().view(H, -1, w.shape[-1])
    keys = torch.einsum("hdl,bsl->bhsd", wd[:, :Dn], latent.double())
    values = torch.einsum("hel,bsl->bhse", wd[:, Dn:], latent.double())
    scores = (torch.einsum("bhd,bhsd->bhs", q_nope.double(), keys)
              + torch.einsum("bhd,bsd->bhs", q_pe.double(), k_pe.double())) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhs,bhse->bhe", scores.softmax(-1), values)


@pytest.mark.parametrize("dtype", list(CODES), ids=str)
def test_mla_kernel_is_the_expanded_attention_on_every_tier(dtype):
    gen = torch.Generator().manual_seed(0)
    B, H, Dn, Dr, L, Dv = 2, 3, 32, 16, 72, 24
    for S in (1, 9, 40):
        q = torch.randn(B, H, Dn + Dr, generator=gen).to(dtype)  # nope then rope, as the projection gives
        w = (torch.randn(H * (Dn + Dv), L, generator=gen) * 0.2).to(dtype)
        buf_c = torch.randn(B, S + 4, L, generator=gen).to(dtype)  # a longer buffer: strided positions
        buf_k = torch.randn(B, S + 4, Dr, generator=gen).to(dtype)
        latent, k_pe = buf_c[:, :S], buf_k[:, :S]
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[1, ::2] = False
        mask[1, -1] = True
        for mk in (None, mask):
            want = _expanded_reference(q[..., :Dn], q[..., Dn:], w, latent, k_pe, 0.125, mk)
            for tier in _tiers():
                for threads in (1, 2):
                    out = torch.full((B, H, Dv), 7.0).to(dtype)
                    _native().mla_decode_raw(
                        CODES[dtype], q.data_ptr(), q.stride(0), q.stride(1), q.data_ptr() + Dn * q.element_size(),
                        q.stride(0), q.stride(1), w.data_ptr(), latent.data_ptr(), latent.stride(0),
                        latent.stride(1), k_pe.data_ptr(), k_pe.stride(0), k_pe.stride(1), out.data_ptr(), B, H, S, Dn,
                        Dr, L, Dv, 0.125, 0 if mk is None else mk.data_ptr(), 0 if mk is None else mk.stride(0),
                        threads, tier)
                    err = ((out.double() - want).abs().max() / want.abs().max()).item()
                    assert err < {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-9}[dtype], (
                        S, mk is not None, tier, threads, err)


def _tiny(model_type: str, dtype, **overrides):
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny {model_type}: {UNBUILDABLE[model_type]}")
    return build_tiny(model_type, dtype, **overrides).model


def _forced_logits(model, seq: torch.Tensor, prompt: int, mask: torch.Tensor | None = None):
    """The last-position logits of a prefill of seq[:, :prompt] and of one decode step per later
    token (teacher forcing), and the cache."""
    cache = DynamicCache(config=model.config)
    kw = {} if mask is None else {"attention_mask": mask[:, :prompt]}
    with torch.inference_mode():
        out = model(seq[:, :prompt], past_key_values=cache, use_cache=True, **kw)
        logits = [out.logits[:, -1].float()]
        for i in range(prompt, seq.shape[1]):
            kw = {} if mask is None else {"attention_mask": mask[:, :i + 1]}
            out = model(seq[:, i:i + 1], past_key_values=cache, use_cache=True, **kw)
            logits.append(out.logits[:, -1].float())
    return logits, cache


class _Count:
    """Counts the calls a runner's decode (or prefill) path takes."""

    def __init__(self, runner, method: str = "_decode"):
        self.calls = 0
        call = getattr(runner, method)

        def counted(*args, **kwargs):
            self.calls += 1
            return call(*args, **kwargs)

        setattr(runner, method, counted)


class _OneCalls:
    """Counts the decode steps the stacks ran in their one native call."""

    def __init__(self, stacks):
        self.calls = 0
        for st in stacks:
            call = st._one_call

            def counted(*args, _call=call, **kwargs):
                out = _call(*args, **kwargs)
                self.calls += out is not None
                return out

            st._one_call = counted


def _mla_modules(model):
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "kv_b_proj")]


def _compare_with_own_forward(model, monkeypatch, seq, prompt, mask=None, tol=2e-2, inspect=None, **enable):
    """Enable scope="all" on model and on a copy whose MLA modules keep their own forward (the
    same packed projections under them): the first layer's cache contents bit for bit, and close
    logits at every teacher-forced step. Returns the enabled model's report and its runners
    (inspect(runners), if given, runs before the models are disabled)."""
    twin = copy.deepcopy(model)
    monkeypatch.setattr(mla, "FAMILIES", frozenset())
    rep_twin = hi_na_moe.enable_for_model(twin, scope="all", **enable)
    monkeypatch.undo()
    rep = hi_na_moe.enable_for_model(model, scope="all", **enable)
    try:
        assert rep_twin.attention_latent == []
        names = [n for n, _ in _mla_modules(model)]
        assert names and rep.attention_latent == names, str(rep)
        runners = [patched_runner(m) for _, m in _mla_modules(model)]
        counts = [_Count(r) for r in runners]
        prefills = [_Count(r, "_prefill") for r in runners]
        # a decoder layer whose parts are all on the native calls' runners makes its queries and
        # cache entries in the first native call and runs the kernel in the second (_latent_pre)
        layer_runners = [patched_runner(model.get_submodule(n.rsplit(".", 1)[0])) for n in names]
        in_layers = [_Count(r, "_latent_pre") if r is not None else None for r in layer_runners]
        # or, all layers at once, in the stack's one native call (hi_na_moe.fastpath.stack)
        stacks = [patched_runner(model.get_submodule(n)) for n in rep.stacks]
        one_calls = _OneCalls(stacks)
        want, want_cache = _forced_logits(twin, seq, prompt, mask)
        got, got_cache = _forced_logits(model, seq, prompt, mask)
        steps = [c.calls + (0 if n is None else n.calls) + one_calls.calls for c, n in zip(counts, in_layers)]
        assert steps == [seq.shape[1] - prompt] * len(counts)
        # the prompt on the native prefill kernel where it runs (bfloat16, AVX512-BF16 on AMD)
        assert [c.calls for c in prefills] == [int(r.prefill) for r in runners]
        assert rep.attention_latent_prefill == [n for n, r in zip(names, runners) if r.prefill]
        # the decoder layers' short paths call the runners straight: no module call to count
        layers = rep.layers == [n.rsplit(".", 1)[0] for n in names]
        own = 0 if layers else seq.shape[1] - prompt
        assert decode_call_counts(model) == {n: (own, 0) for n in names}
        if seq.shape[1] > prompt:  # the latent and rope keys appended in place (hi_na_moe.fastpath.kv_cache)
            assert all(kv_cache._SLOTS.get(got_cache.layers[m.layer_idx]) is not None for _, m in _mla_modules(model))
        # the first latent attention layer's cache bit for bit (the same inputs); later layers'
        # inputs went through the attention above them, within rounding (padding positions left
        # out: a query attending nothing gives zeros on the kernels and eager's mean of the values,
        # which no one reads). (Kimi-Linear's cache holds its linear-attention layers too.)
        for i, (_, m) in enumerate(_mla_modules(model)):
            a, b = want_cache.layers[m.layer_idx], got_cache.layers[m.layer_idx]
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                if i == 0:
                    assert torch.equal(x, y)
                    continue
                if mask is not None:
                    x, y = (t[mask[:, :t.shape[2]].bool()[:, None, :]] for t in (x, y))
                assert ((x.float() - y.float()).norm() / y.float().norm()) < tol
        for a, b in zip(got, want):
            assert ((a - b).norm() / b.norm()).item() < tol
        # (for callers: the layers' runners, and how many decode steps each ran in its native calls)
        _compare_with_own_forward.layers = layer_runners
        _compare_with_own_forward.in_layers = [0 if n is None else n.calls for n in in_layers]
        _compare_with_own_forward.one_calls = one_calls.calls
        if inspect is not None:
            inspect(runners)
        return rep, runners
    finally:
        hi_na_moe.disable_for_model(model)
        hi_na_moe.disable_for_model(twin)


@pytest.mark.parametrize("model_type, overrides, rope", [
    ("deepseek_v2", {}, "complex"),
    ("deepseek_v2", {"q_lora_rank": None}, "complex"),  # q_proj, as DeepSeek-V2-Lite
    ("deepseek_v3", {"rope_interleave": True}, "interleaved"),
    ("deepseek_v3", {"rope_interleave": False}, "rotate_half"),
    ("glm4_moe_lite", {}, None),
    ("youtu", {}, None),
    ("axk1", {}, None),
    ("minicpm3", {}, "rotate_half"),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mla_families_decode_on_the_kernel_with_the_same_cache(model_type, overrides, rope, dtype, monkeypatch):
    linear.MIN_WEIGHTS, old = 0, linear.MIN_WEIGHTS
    try:
        model = _tiny(model_type, dtype, **overrides)
        seq = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(1))
        rep, runners = _compare_with_own_forward(model, monkeypatch, seq, 7)
        if rope is not None:
            assert {r.rope for r in runners} == {rope}
        # q_proj (or q_a_proj) and kv_a_proj_with_mqa packed as one group, called once
        assert all(r._fused for r in runners)
        if dtype is torch.bfloat16 and attention.prefill_kernel(runners[0].isa, runners[0].Dn + runners[0].Dr,
                                                                  runners[0].H, runners[0].H):
            assert all(r.prefill for r in runners)
            assert "with their attention on the native AVX512-BF16 kernel" in str(rep)
        # every decoder layer on its short path (hi_na_moe.fastpath.layers), the stack on its loop over them;
        # MiniCPM3's layers scale their residual branches (scale_depth): their own forward
        layer_names = [n.rsplit(".", 1)[0] for n in rep.attention_latent]
        if model_type == "minicpm3":
            assert rep.layers == [] and rep.layers_differ == layer_names
        else:
            assert rep.layers == layer_names and rep.stacks == ["model"]
        assert "latent attention (MLA) modules with decode steps on the native absorbed kernel: 2" in str(rep)
    finally:
        linear.MIN_WEIGHTS = old


@pytest.mark.parametrize("model_type, overrides", [
    ("deepseek_v2", {"qk_rope_head_dim": 32, "head_dim": 32}),  # the complex form: 16 pairs, PyTorch's vectorised product
    ("deepseek_v2", {"qk_rope_head_dim": 32, "head_dim": 32, "q_lora_rank": None}),
    ("deepseek_v3", {"rope_interleave": True}),
    ("deepseek_v3", {"rope_interleave": False}),
])
@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "layer-calls"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decoder_layers_run_latent_attention_in_their_native_calls(model_type, overrides, dtype, one_call,
                                                                   monkeypatch):
    """With every part on the native calls' runners, a decoder layer's decode step makes the
    queries, the latent and the rope key in its first native call and runs the absorbed kernel in
    its second (hi_na_moe.fastpath.layers._latent_pre): the layer's probe asked for its own forward's bits,
    and the model's logits stay close to the modules' own forward at every step."""
    linear.MIN_WEIGHTS, old = 0, linear.MIN_WEIGHTS
    try:
        model = _tiny(model_type, dtype, **overrides)
        seq = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(4))
        mask = torch.ones(2, 11, dtype=torch.long)
        mask[0, :2] = 0  # a left-padded row: the kernel reads the mask
        stack.ONE_CALL = one_call
        rep, runners = _compare_with_own_forward(model, monkeypatch, seq, 6, mask)
        layers = _compare_with_own_forward.layers
        assert len(layers) == len(runners) and all(r.latent_step is not None for r in layers)
        # every step in the stack's one native call (hi_na_moe.fastpath.stack: decode_layers), or in each
        # layer's two
        assert rep.stacks == ["model"] and _compare_with_own_forward.one_calls == (11 - 6) * one_call
        assert _compare_with_own_forward.in_layers == [(11 - 6) * (not one_call)] * len(runners)
    finally:
        linear.MIN_WEIGHTS = old
        stack.ONE_CALL = True


def test_a_complex_rotary_of_few_pairs_keeps_the_layers_step_in_python(monkeypatch):
    """Under 16 pairs a head, PyTorch's complex product runs its scalar loop, whose FMA the native
    calls do not reproduce: the layers keep latent attention in their Python step."""
    linear.MIN_WEIGHTS, old = 0, linear.MIN_WEIGHTS
    try:
        model = _tiny("deepseek_v2", torch.float32)  # qk_rope_head_dim 8: 4 pairs
        seq = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(5))
        rep, runners = _compare_with_own_forward(model, monkeypatch, seq, 6)
        layers = _compare_with_own_forward.layers
        assert layers and all(r is not None and r.latent_step is None for r in layers)
        assert _compare_with_own_forward.in_layers == [0] * len(runners)
        assert _compare_with_own_forward.one_calls == 0
    finally:
        linear.MIN_WEIGHTS = old


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_padded_batches_and_eager_masks_decode_on_the_kernel(impl, monkeypatch):
    model = _tiny("deepseek_v3", torch.bfloat16)
    model.config._attn_implementation = impl
    for m in model.modules():
        if getattr(m, "config", None) is not None:
            m.config._attn_implementation = impl
    seq = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0  # row 1 left-padded
    _compare_with_own_forward(model, monkeypatch, seq, 6, mask)


@pytest.mark.parametrize("min_weights", [None, 0], ids=["modules", "one-call"])
def test_a_static_cache_decodes_on_the_kernel_through_its_mask(min_weights):
    """A StaticCache hands the attention its whole buffers and a bool mask over them: the kernel
    reads the kept positions only; logits close to the module's own at every step. With every
    projection packed (MIN_WEIGHTS 0), the steps run in the stack's one native call, which writes
    the latent and rope key into the buffers itself (kv_cache.static_slot)."""
    from transformers import StaticCache

    model = _tiny("deepseek_v3", torch.bfloat16)
    twin = copy.deepcopy(model)
    seq = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(8))
    old = linear.MIN_WEIGHTS
    linear.MIN_WEIGHTS = old if min_weights is None else min_weights
    try:
        rep = hi_na_moe.enable_for_model(model, scope="all")
    finally:
        linear.MIN_WEIGHTS = old
    try:
        runners = [patched_runner(m) for _, m in _mla_modules(model)]
        counts = [_Count(r) for r in runners]
        one_calls = _OneCalls([patched_runner(model.get_submodule(n)) for n in rep.stacks])

        def run(m):
            cache = StaticCache(config=m.config, max_cache_len=16)
            out = []
            with torch.inference_mode():
                o = m(seq[:, :6], past_key_values=cache, use_cache=True)
                out.append(o.logits[:, -1].float())
                for i in range(6, 10):
                    o = m(seq[:, i:i + 1], past_key_values=cache, use_cache=True)
                    out.append(o.logits[:, -1].float())
            return out

        got, want = run(model), run(twin)
        assert rep.attention_latent
        if min_weights is None:
            assert [c.calls for c in counts] == [4] * len(counts)
        else:
            assert one_calls.calls == 4 and [c.calls for c in counts] == [0] * len(counts)
        for a, b in zip(got, want):
            assert ((a - b).norm() / b.norm()).item() < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("weights, group", [("int8", 64), ("int4", 32), ("int4", 64)])
# (float32 on the modules' decode path only: whether a float32 MoE layer takes its native calls
# depends on the probe's data, since the native router's float32 weights can differ from PyTorch's
# by an ulp, which float32 outputs keep and the layer's bit-for-bit probe refuses; seen on this
# tiny shape at int4/64 with the dense copy)
@pytest.mark.parametrize("dtype, path", [(torch.bfloat16, "one-call"), (torch.bfloat16, "layer-calls"),
                                         (torch.bfloat16, "modules"), (torch.float32, "modules")], ids=str)
def test_quantised_kv_b_proj_is_read_as_its_codes_and_scales(weights, group, path, dtype, monkeypatch):
    """scope="all" with int8 / int4: the kernels read a packed kv_b_proj as its codes and scales
    (mla.QuantWeight, exactly the packed values) in the modules' decode path, the layers' native
    calls and the stack's one call; logits close to the modules' own forward over the same packed
    layers at every step, and the report counts the codes' bytes, not a dense copy's (the generic
    tier: a dense copy, its codes kernel slower; tested in C++). (float32 with qdot "expand": the
    integer dot products quantise kv_b_proj's input in the module's own forward, 1e-3 away from
    the float32 latent the absorbed kernel reads, which float32's probe tolerance does not take.)"""
    codes_read = native_module()[0].resolve_isa("auto") != "generic"
    linear.MIN_WEIGHTS, old = 0, linear.MIN_WEIGHTS
    parts = orchestrate.PARTS
    try:
        model = _tiny("deepseek_v3", dtype, rope_interleave=True, kv_lora_rank=64)
        seq = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(6))
        mask = torch.ones(2, 11, dtype=torch.long)
        mask[0, :2] = 0
        stack.ONE_CALL = path == "one-call"
        if path == "modules":  # no decoder layer on the native calls: each module's decode path
            orchestrate.PARTS = tuple(dataclasses.replace(p, find=lambda *a: ([], [])) if p.kind == "layers" else p
                                      for p in parts)
        m = _mla_modules(model)[0][1]

        def inspect(runners):
            assert all(r.reads_codes() == codes_read for r in runners)
            # the codes and scales are the packed layer's values: unpack() gives them rounded to the
            # dtype (as the dense copy holds them)
            deq = torch.from_dlpack(patched_member(m.kv_b_proj)[0].packed.unpack()[1])
            w = runners[0]._weight()
            assert torch.equal((w.float() if codes_read else w).to(dtype), deq)

        qdot = "expand" if dtype is torch.float32 else "auto"
        rep, runners = _compare_with_own_forward(model, monkeypatch, seq, 6, mask, inspect=inspect, weights=weights,
                                                 group_size=group, cache=False, qdot=qdot)
        rows, L = m.kv_b_proj.out_features, m.kv_b_proj.in_features
        codes = rows * L if weights == "int8" else rows * L // 2
        scales = rows * 4 if weights == "int8" else rows * (L // group) * 4  # float32 scales
        if codes_read:
            assert rep.attention_latent_quant == len(runners)
            assert rep.attention_latent_bytes == (codes + scales) * len(runners)
            assert "of them the quantised layers' codes and scales" in str(rep)
        else:
            assert rep.attention_latent_quant == 0 and rep.attention_latent_bytes == rows * L * dtype.itemsize * len(runners)
        if path == "one-call":
            assert _compare_with_own_forward.one_calls == 11 - 6
        elif path == "layer-calls":
            assert _compare_with_own_forward.in_layers == [11 - 6] * len(runners)
        else:
            assert rep.layers == [] and [c for c in _compare_with_own_forward.in_layers if c] == []
    finally:
        linear.MIN_WEIGHTS = old
        stack.ONE_CALL = True
        orchestrate.PARTS = parts


@pytest.mark.parametrize("weights, group, rank", [("int4", 64, 96), ("lossless12", 64, 64)])
def test_other_packed_kv_b_proj_is_read_through_a_dense_copy(weights, group, rank, monkeypatch):
    """A packed kv_b_proj the codes form does not take (int4 groups that do not divide the rank, a
    lossless format) is read through a dense copy of what its forward computes, reported so."""
    linear.MIN_WEIGHTS, old = 0, linear.MIN_WEIGHTS
    try:
        model = _tiny("deepseek_v3", torch.bfloat16, rope_interleave=True, kv_lora_rank=rank)
        seq = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(3))
        rep, runners = _compare_with_own_forward(model, monkeypatch, seq, 6, weights=weights, group_size=group,
                                                 cache=False)
        m = _mla_modules(model)[0][1]
        copy_bytes = m.kv_b_proj.out_features * m.kv_b_proj.in_features * 2
        assert rep.attention_latent_quant == 0
        assert rep.attention_latent_bytes == copy_bytes * len(runners)
        assert "MiB of kv_b_proj copies it reads" in str(rep) and "codes and scales" not in str(rep)
    finally:
        linear.MIN_WEIGHTS = old


def test_a_kv_b_proj_left_to_pytorch_is_read_in_place_at_every_call():
    """kv_b_proj excluded from the dense kernels keeps its own weight: the kernel reads it where it
    is (no copy), so a change to it shows at the next step, as in the module's own forward."""
    model = _tiny("deepseek_v3", torch.float32)
    twin = copy.deepcopy(model)
    seq = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(4))
    rep = hi_na_moe.enable_for_model(model, scope="all", dense_exclude="*kv_b_proj")
    try:
        assert rep.attention_latent and rep.attention_latent_bytes == 0
        with torch.no_grad():
            for a, b in zip(_mla_modules(model), _mla_modules(twin)):
                a[1].kv_b_proj.weight.mul_(-0.5)
                b[1].kv_b_proj.weight.mul_(-0.5)
        got, _ = _forced_logits(model, seq, 5)
        want, _ = _forced_logits(twin, seq, 5)
        for a, b in zip(got, want):
            assert ((a - b).norm() / b.norm()).item() < 1e-3
    finally:
        hi_na_moe.disable_for_model(model)


def test_calls_that_are_not_a_plain_decode_step_are_the_modules_own():
    model = _tiny("deepseek_v2", torch.bfloat16)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        name, m = _mla_modules(model)[0]
        runner = patched_runner(m)
        count = _Count(runner)
        cfg = model.config
        rot = model.model.rotary_emb
        h = torch.randn(1, 3, cfg.hidden_size).to(torch.bfloat16)
        pe = rot(h, torch.arange(3)[None])
        with torch.no_grad():
            m(hidden_states=h, position_embeddings=pe, attention_mask=None, past_key_values=DynamicCache())
            m(hidden_states=h[:, :1], position_embeddings=pe[:, :1], attention_mask=None, past_key_values=None,
              output_attentions=True)
            n = attention._MAX_BATCH + 1
            many = torch.randn(n, 1, cfg.hidden_size).to(torch.bfloat16)
            m(hidden_states=many, position_embeddings=pe[:, :1].expand(n, 1, -1), attention_mask=None)
        assert count.calls == 0  # a prefill, attention weights asked for, more sequences than a decode batch
        with torch.no_grad():
            m(hidden_states=h[:, :1], position_embeddings=pe[:, :1], attention_mask=None, past_key_values=None)
        assert count.calls == 1
    finally:
        hi_na_moe.disable_for_model(model)


def test_decode_calls_refused_at_runtime_are_counted():
    """A module whose probe matched but whose decode calls its native path refuses (GLM-4.5's state
    before 2026-12-02, with the attention's tables) shows as native 0 in decode_call_counts."""
    model = _tiny("deepseek_v2", torch.bfloat16)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        mods = _mla_modules(model)
        patched_runner(mods[0][1])._fast_args = lambda *a, **k: None  # every call refused
        seq = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(6))
        _forced_logits(model, seq, 6)
        counts = decode_call_counts(model)
        # the second layer's short path calls its runner straight (no module call to count)
        assert counts[mods[0][0]] == (0, 3) and counts[mods[1][0]] == (0, 0)
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_latent_attention_of_other_forms_is_not_taken(model_type):
    """Families whose MLA module adds what a probe at a few positions cannot see (top-k indexers)
    are no candidates."""
    model = _tiny(model_type, torch.float32)
    assert _mla_modules(model)
    assert mla.find_mla(model, "") == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mistral4s_query_scale_is_taken_from_the_calls_positions(dtype, monkeypatch):
    """Mistral 4 scales its query by a factor of the position (1 below the original context):
    decode steps past the original context run in the decoder layers' native calls with the
    module's factor, the logits close to its own forward's at every step, the first layer's cache
    bit for bit; the factor matters (the module alone, with and without it)."""
    linear.MIN_WEIGHTS, old = 0, linear.MIN_WEIGHTS
    try:
        model = _tiny("mistral4", dtype)
        orig = model.config.rope_parameters["original_max_position_embeddings"]
        twin = copy.deepcopy(model)
        monkeypatch.setattr(mla, "FAMILIES", frozenset())
        hi_na_moe.enable_for_model(twin, scope="all")
        monkeypatch.undo()
        rep = hi_na_moe.enable_for_model(model, scope="all")
        names = [n for n, _ in _mla_modules(model)]
        assert rep.attention_latent == names
        runners = [patched_runner(m) for _, m in _mla_modules(model)]
        assert all(r.q_scale is not None and not r.prefill for r in runners)
        # the decoder layers' native calls scale the query too, and the stack's one call (its
        # router's form, softmax in the model's dtype with V3's group choice, native in both
        # dtypes: routers' "softmax-group-topk in the logits' dtype")
        layers = [patched_runner(model.get_submodule(n.rsplit(".", 1)[0])) for n in names]
        assert all(r is not None and r.latent_step is not None for r in layers) and len(rep.stacks) == 1
        counts = [_Count(r) for r in runners]
        in_layers = [_Count(r, "_latent_pre") for r in layers]
        one_calls = _OneCalls([patched_runner(model.get_submodule(n)) for n in rep.stacks])
        seq = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(6))
        start = 200 * orig - 3  # far past the original context (a factor of 1.53), crossing a step of it

        def run(m):
            cache = DynamicCache(config=m.config)
            pos = torch.arange(start, start + seq.shape[1]).expand(2, -1)
            def last(o):  # (the tiny Mistral 4 is the bare model: its hidden states)
                return (o.logits if hasattr(o, "logits") else o.last_hidden_state)[:, -1].float()

            with torch.inference_mode():
                out = [last(m(seq[:, :5], position_ids=pos[:, :5], past_key_values=cache, use_cache=True))]
                for i in range(5, seq.shape[1]):
                    out.append(last(m(seq[:, i:i + 1], position_ids=pos[:, i:i + 1], past_key_values=cache,
                                      use_cache=True)))
            return out, cache

        got, got_cache = run(model)
        want, want_cache = run(twin)
        assert [c.calls + one_calls.calls for c in in_layers] == [seq.shape[1] - 5] * len(layers)
        assert [c.calls for c in counts] == [0] * len(counts)
        assert one_calls.calls == seq.shape[1] - 5
        a, b = want_cache.layers[0], got_cache.layers[0]
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for g, w in zip(got, want):
            assert ((g - w).norm() / w.norm()).item() < 2e-2
        # the factor matters (the tiny model's residual stream hides it, so the module alone): its
        # own forward at a far position, against the decode path with and without the factor
        r, m = runners[1], _mla_modules(model)[1][1]
        gen = torch.Generator().manual_seed(9)
        h = torch.randn(2, 1, r.hidden, generator=gen).to(dtype)
        pe = r._tables(r.rope, torch.rand(2, 1, r.Dr // 2, generator=gen) * 6.3)
        c0 = torch.randn(2, 1, 6, r.L, generator=gen).to(dtype) * 4
        k0 = torch.randn(2, 1, 6, r.Dr, generator=gen).to(dtype) * 4
        pos = torch.tensor([[500 * orig], [7]])
        fn, beta, _ = r.q_scale

        def cache():
            c = DynamicCache()
            c.update(c0.clone(), k0.clone(), m.layer_idx)
            return c

        with torch.no_grad():
            own = r.original(hidden_states=h, position_embeddings=pe, attention_mask=None, position_ids=pos,
                             past_key_values=cache())[0].float()
            scaled = r._decode(m, h, pe, cache(), None, fn(pos, beta, orig).to(dtype))[0].float()
            plain = r._decode(m, h, pe, cache(), None, None)[0].float()
        tol = attention._OUT_RTOL[dtype] * own.abs().amax()
        assert ((scaled - own).abs() <= tol).all() and ((plain[0] - own[0]).abs() > tol).any()
        assert torch.equal(plain[1], scaled[1])  # (row 1 inside the original context: a factor of 1)
    finally:
        linear.MIN_WEIGHTS = old
        hi_na_moe.disable_for_model(model)
        hi_na_moe.disable_for_model(twin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_longcats_lora_scales_are_applied_as_its_module_applies_them(dtype, monkeypatch):
    """LongCat-Flash (two *MLA modules a decoder layer) scales the query and the normed latent by
    fixed factors: the same cache bit for bit and close logits as its own forward; the factors
    are read from the module at each call."""
    linear.MIN_WEIGHTS, old = 0, linear.MIN_WEIGHTS
    try:
        model = _tiny("longcat_flash", dtype)
        seq = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(3))
        rep, runners = _compare_with_own_forward(model, monkeypatch, seq, 6)
        assert len(runners) == 2 * len(model.model.layers) and all(r.lora_scales for r in runners)
        m = _mla_modules(model)[0][1]
        assert m.mla_scale_q_lora != 1.0 and m.mla_scale_kv_lora != 1.0
    finally:
        linear.MIN_WEIGHTS = old


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kimi_linears_mla_without_rotary_embedding_decodes_on_the_kernel(dtype, monkeypatch):
    """Kimi-Linear's MLA layers (between its linear-attention layers) rotate nothing and take no
    position embeddings: the form "none", the same cache bit for bit and close logits."""
    linear.MIN_WEIGHTS, old = 0, linear.MIN_WEIGHTS
    try:
        model = _tiny("kimi_linear", dtype)
        seq = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(4))
        rep, runners = _compare_with_own_forward(model, monkeypatch, seq, 6)
        assert runners and {r.rope for r in runners} == {"none"}
    finally:
        linear.MIN_WEIGHTS = old


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bailing_hybrids_output_gate_is_applied_as_its_module_applies_it(dtype, monkeypatch):
    """Bailing-hybrid (Ling 3.0) gates each head's output by sigmoid(g_proj(h)) before o_proj:
    the same cache bit for bit and close logits, on both the decode and the prefill paths."""
    linear.MIN_WEIGHTS, old = 0, linear.MIN_WEIGHTS
    try:
        model = _tiny("bailing_hybrid", dtype)
        seq = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(5))
        rep, runners = _compare_with_own_forward(model, monkeypatch, seq, 6)
        assert runners and all(r.output_gate for r in runners)
    finally:
        linear.MIN_WEIGHTS = old


def test_the_fallback_computes_what_the_kernel_does():
    """The absorbed attention in PyTorch ops (for caches handing back tensors the kernel does not
    read) against the kernel."""
    model = _tiny("deepseek_v2", torch.float32)
    name, m = _mla_modules(model)[0]
    runner = mla.NativeMLA(name, m, m.forward)
    gen = torch.Generator().manual_seed(5)
    B, S = 2, 6
    q = torch.randn(B, runner.H, 1, runner.Dn + runner.Dr, generator=gen)
    q_nope, q_pe = q[..., :runner.Dn], q[..., runner.Dn:].contiguous()
    latent = torch.randn(B, 1, S, runner.L, generator=gen)
    k_pe = torch.randn(B, 1, S, runner.Dr, generator=gen)
    w = runner._weight()
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[1, ..., :2] = False
    for mk in (None, mask):
        a = torch.empty(B, 1, runner.H * runner.Dv)
        runner._absorbed_torch(q_nope, q_pe, w, latent, k_pe, mk, m.scaling, a)
        want = _expanded_reference(q_nope[:, :, 0], q_pe[:, :, 0], w, latent[:, 0], k_pe[:, 0], m.scaling,
                                   None if mk is None else mk[:, 0, 0])
        assert ((a.view(B, runner.H, -1).double() - want).abs().max() / want.abs().max()).item() < 1e-5


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
