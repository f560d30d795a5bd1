"""scope="all" (hi_na_moe.fastpath.attention): decode steps of Llama-like attention modules on the native
rotary and attention kernels. The kernels against transformers' rotary embedding (bit for bit)
and a float64 attention (every tier here, strided caches, grouped-query heads); the patched
modules against their own forwards (the same cache contents, outputs within rounding) on the
families with a known form; and every call that must stay the module's own."""

from __future__ import annotations

import sys

import pytest
import torch
from tiny_models import UNBUILDABLE, build_tiny, olmoe
from transformers import DynamicCache
from transformers.models.olmoe.modeling_olmoe import apply_rotary_pos_emb

import hi_na_moe
from hi_na_moe.fastpath import attention
from hi_na_moe.integrate.families import moe_families
from hi_na_moe.core.native import native_kernels_available
from hi_na_moe.core.registry import patched_runner

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _native():
    from hi_na_moe import _native

    return _native


def _tiers():
    n = _native()
    return [t for t in ("generic", "avx2", "avx512", "amx") if n.isa_supported(t)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_is_transformers_rotate_half_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    for D in (64, 128, 6):
        x = (torch.randn(3, 5, D, generator=gen) * 4).to(dtype)
        k = torch.randn(3, 2, D, generator=gen).to(dtype)
        ang = torch.rand(3, 1, D // 2, generator=gen) * 100
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        want, _ = apply_rotary_pos_emb(x.unsqueeze(2), k.unsqueeze(2), cos, sin)
        out = torch.empty_like(x)
        _native().rope_rotate_half(x, cos[:, 0].contiguous(), sin[:, 0].contiguous(), out)
        assert torch.equal(out, want[:, :, 0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_raw_on_every_tier_and_thread_count_is_transformers_bit_for_bit(dtype):
    # the path prefill and decode calls take: many rows (a prompt's positions, split over
    # threads), the AVX-512 build for bfloat16, head sizes whose half is not a multiple of 16,
    # and values that overflow, infinities and NaNs
    gen = torch.Generator().manual_seed(1)
    code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]
    for D, rows in ((128, 700), (80, 33), (6, 5), (256, 40)):
        x = (torch.randn(rows, 3, D, generator=gen) * 4).to(dtype)
        x[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3e38]).to(dtype)
        ang = torch.rand(rows, 1, D // 2, generator=gen) * 100
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        cos[1, 0, 0] = float("nan")
        want, _ = apply_rotary_pos_emb(x.unsqueeze(2), x.unsqueeze(2), cos, sin)
        want = want[:, :, 0]
        c, s = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        for tier in _tiers():
            for threads in (1, 2):
                out = torch.full_like(x, 7)
                _native().rope_rotate_half_raw(x.data_ptr(), rows, 3, D, c.data_ptr(), s.data_ptr(), out.data_ptr(),
                                               code, tier, threads)
                same = (out == want) | (out.isnan() & want.isnan())
                assert bool(same.all()), (dtype, D, tier, threads)
                assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32)[~want.isnan()],
                                   want.view(torch.int16 if dtype != torch.float32 else torch.int32)[~want.isnan()])


def _reference(q, k, v, scale):
    groups = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(groups, 1)
    vv = v.double().repeat_interleave(groups, 1)
    p = torch.softmax((q.double().unsqueeze(2) @ kk.transpose(-1, -2)) * scale, dim=-1)
    return (p @ vv)[:, :, 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_decode_matches_a_float64_reference_on_every_tier(dtype):
    gen = torch.Generator().manual_seed(1)
    tol = {torch.bfloat16: 2**-7, torch.float16: 2**-9, torch.float32: 1e-5}[dtype]
    for D in (64, 128, 72):  # 72: no vector build for that head size, the baseline loops
        for S in (1, 5, 17, 300):
            for Hkv in (8, 2):
                q = torch.randn(2, 8, D, generator=gen).to(dtype)
                # a cache view into a longer buffer (StaticCache-like strides)
                kbuf = (torch.randn(2, Hkv, S + 7, D, generator=gen) * 2).to(dtype)
                vbuf = torch.randn(2, Hkv, S + 7, D, generator=gen).to(dtype)
                k, v = kbuf[:, :, :S], vbuf[:, :, :S]
                want = _reference(q, k, v, D**-0.5)
                for tier in _tiers():
                    for threads in (1, 2):
                        out = torch.empty_like(q)
                        _native().attention_decode(q, k, v, D**-0.5, out, threads, tier)
                        err = ((out.double() - want).abs().max() / want.abs().max()).item()
                        assert err <= tol, (tier, D, S, Hkv, threads, err)


def test_attention_decode_skips_masked_keys_on_every_tier():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 64, generator=gen).bfloat16()
    k = torch.randn(3, 2, 20, 64, generator=gen).bfloat16()
    v = torch.randn(3, 2, 20, 64, generator=gen).bfloat16()
    mask = torch.rand(3, 20, generator=gen) > 0.5
    mask[:, 0] = True
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, :, ~mask[0]] = float("nan")  # masked keys of row 0 must not be read
    poisoned_v[:, :, ~mask[0]] = float("nan")
    for tier in _tiers():
        for m in (mask, mask[:1]):  # per row, and one row for every batch row
            out = torch.empty_like(q)
            kk, vv = (poisoned_k, poisoned_v) if m.shape[0] == 1 else (k, v)
            _native().attention_decode(q, kk, vv, 0.125, out, 0, tier, m)
            for b in range(3):
                keep = m[min(b, m.shape[0] - 1)]
                want = _reference(q[b:b + 1], k[b:b + 1, :, keep], v[b:b + 1, :, keep], 0.125)
                assert ((out[b:b + 1].double() - want).abs().max() / want.abs().max()).item() <= 2**-7, tier
        out = torch.full_like(q, float("nan"))
        none = torch.zeros(3, 20, dtype=torch.bool)
        _native().attention_decode(q, k, v, 0.125, out, 0, tier, none)
        # nothing to attend to: zeros, what PyTorch's SDPA returns for such a row
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=none[:, None, None, :], scale=0.125, enable_gqa=True)
        assert torch.equal(out, torch.zeros_like(q)) and torch.equal(sdpa[:, :, 0], out)


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v, o: (q[0], k, v, o), "q must have shape"),
    (lambda q, k, v, o: (q, k[..., :4, :], v, o), "v has shape"),
    (lambda q, k, v, o: (q, k.transpose(2, 3).contiguous().transpose(2, 3), v, o), "k's last dimension"),
    (lambda q, k, v, o: (q[:, :3].contiguous(), k, v, o[:, :3].contiguous()), "multiple of k's"),
    (lambda q, k, v, o: (q, k.float(), v, o), "k has dtype float32"),
    (lambda q, k, v, o: (q, k, v, o.float()), "out has dtype float32"),
])
def test_attention_decode_errors_name_the_argument(bad, match):
    q, o = torch.randn(1, 4, 16).bfloat16(), torch.empty(1, 4, 16).bfloat16()
    k, v = torch.randn(1, 2, 6, 16).bfloat16(), torch.randn(1, 2, 6, 16).bfloat16()
    with pytest.raises(ValueError, match=match):
        q2, k2, v2, o2 = bad(q, k, v, o)
        _native().attention_decode(q2, k2, v2, 0.25, o2, 0, "auto")


def _olmoe(layers=2):
    return olmoe(layers=layers, kv_heads=2)  # grouped-query heads


_runner = patched_runner  # the NativeAttention behind a patched module


class _Count:
    """Counts the decode calls one runner takes on its native path."""

    def __init__(self, runner):
        self.calls = 0
        decode = runner._decode

        def counted(*args, **kwargs):
            self.calls += 1
            return decode(*args, **kwargs)

        runner._decode = counted


class _KernelCalls:
    """Counts one runner's calls of the native attention kernel."""

    def __init__(self, runner):
        self.native, self.calls = runner.native, 0
        runner.native = self

    def __getattr__(self, name):
        if name == "attention_decode_raw":
            self.calls += 1
        return getattr(self.native, name)


def _decode_inputs(model, att, B=1, past=6, seed=0, tables=torch.bfloat16, rot=None):
    """rot: the rotary dims of a head (tables of rot values a row), default head_dim."""
    gen = torch.Generator().manual_seed(seed)
    H, D = model.config.hidden_size, att.head_dim
    Hkv = att.k_proj.out_features // D
    h = torch.randn(B, 1, H, generator=gen).bfloat16()
    ang = torch.rand(B, 1, (rot or D) // 2, generator=gen) * 6
    emb = torch.cat([ang, ang], -1)
    k0 = torch.randn(B, Hkv, past, D, generator=gen).bfloat16()
    v0 = torch.randn(B, Hkv, past, D, generator=gen).bfloat16()

    def cache():
        c = DynamicCache()
        c.update(k0.clone(), v0.clone(), att.layer_idx)
        return c

    return h, (emb.cos().to(tables), emb.sin().to(tables)), cache


FAMILIES = {"olmoe": "qk norm on the projections", "mixtral": "no qk norm", "qwen2_moe": "no qk norm",
            "qwen3_moe": "qk norm per head", "ernie4_5_moe": "no qk norm", "glm4_moe": "no qk norm"}
# the rotary forms (and the dtype of the tables their rotary modules hand over) besides
# rotate_half in the model's dtype: ERNIE 4.5 rotates interleaved pairs in float32
ROPES = {"ernie4_5_moe": ("interleaved_f32", torch.float32)}
# the rotary dims of a head where fewer than head_dim (GLM-4.5's partial_rotary_factor 0.5 of 16)
ROTS = {"glm4_moe": 8}


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f in {x.model_type for x in moe_families()}])
def test_known_families_decode_on_the_kernels_with_the_same_cache(model_type):
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny model for {model_type}: {UNBUILDABLE[model_type]}")
    model = build_tiny(model_type, dtype=torch.bfloat16).model
    found = [n for n, _ in attention.find_attention(model, "")]
    assert found
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.attention == found and not rep.attention_differ
        assert "attention modules with decode steps on the native kernels" in str(rep)
        for name in found:
            att = dict(model.named_modules())[name]
            runner = _runner(att)
            assert runner.form == FAMILIES[model_type]
            rope, tables = ROPES.get(model_type, ("rotate_half", torch.bfloat16))
            assert (runner.rope, runner.table_dtype) == (rope, tables)
            rot = ROTS.get(model_type)
            assert runner.rot == (rot or runner.D)
            count = _Count(runner)
            for B in (1, 3):
                h, pe, cache = _decode_inputs(model, att, B=B, tables=tables, rot=rot)
                with torch.inference_mode():
                    c_ours, c_own = cache(), cache()
                    got, w = att(hidden_states=h, position_embeddings=pe, attention_mask=None,
                                 past_key_values=c_ours, position_ids=None, use_cache=True)
                    want, _ = type(att).forward(att, hidden_states=h, position_embeddings=pe, attention_mask=None,
                                                past_key_values=c_own)
                assert w is None
                lo, lw = c_ours.layers[att.layer_idx], c_own.layers[att.layer_idx]
                assert torch.equal(lo.keys, lw.keys) and torch.equal(lo.values, lw.values)
                assert ((got.float() - want.float()).abs() <= 2**-6 * want.float().abs().amax()).all()
            # a bool mask over the keys, as a StaticCache or a padded batch brings (7 = 6 cached + 1)
            h, pe, cache = _decode_inputs(model, att, B=2, seed=1, tables=tables, rot=rot)
            mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
            mask[0, ..., :3] = False
            with torch.inference_mode():
                got, _ = att(hidden_states=h, position_embeddings=pe, attention_mask=mask, past_key_values=cache())
                want, _ = type(att).forward(att, hidden_states=h, position_embeddings=pe, attention_mask=mask,
                                            past_key_values=cache())
            assert ((got.float() - want.float()).abs() <= 2**-6 * want.float().abs().amax()).all()
            assert count.calls == 3
    finally:
        hi_na_moe.disable_for_model(model)
    assert all("forward" not in dict(model.named_modules())[n].__dict__ for n in found)


def test_calls_that_are_not_a_plain_decode_step_run_the_modules_own_forward():
    model = _olmoe()
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        att = model.model.layers[0].self_attn
        count = _Count(_runner(att))
        h, pe, cache = _decode_inputs(model, att, B=2)
        mask = torch.zeros(2, 1, 1, 7, dtype=torch.bfloat16)
        big = torch.randn(2, 3, 256).bfloat16()  # prefill: three new tokens, with a float mask
        ang = torch.rand(2, 3, 32) * 6
        pe3 = (torch.cat([ang, ang], -1).cos().bfloat16(), torch.cat([ang, ang], -1).sin().bfloat16())
        calls = [
            dict(hidden_states=big, position_embeddings=pe3, attention_mask=torch.zeros(2, 1, 3, 9, dtype=torch.bfloat16)),
            dict(hidden_states=h, position_embeddings=pe, attention_mask=mask),
            dict(hidden_states=h, position_embeddings=pe, attention_mask=None, output_attentions=True),
            dict(hidden_states=h, position_embeddings=pe, attention_mask=None, some_new_argument=1),
        ]
        for kw in calls:
            with torch.inference_mode():
                c1, c2 = cache(), cache()
                got, _ = att(past_key_values=c1, **kw)
                want, _ = type(att).forward(att, past_key_values=c2, **kw)
            assert torch.equal(got, want)
        att.train()
        with torch.no_grad():
            got, _ = att(hidden_states=h, position_embeddings=pe, attention_mask=None, past_key_values=cache())
            want, _ = type(att).forward(att, hidden_states=h, position_embeddings=pe, attention_mask=None,
                                        past_key_values=cache())
        att.eval()
        assert torch.equal(got, want)
        assert count.calls == 0
        with torch.inference_mode():  # and a plain step does take the kernels
            att(hidden_states=h, position_embeddings=pe, attention_mask=None, past_key_values=cache())
            att(h, pe, None, None)  # positional, no cache: attention over the new token alone
            # one position for both rows (a batch decoded without position_ids): broadcast
            one = (pe[0][:1], pe[1][:1])
            got, _ = att(hidden_states=h, position_embeddings=one, attention_mask=None, past_key_values=cache())
            want, _ = type(att).forward(att, hidden_states=h, position_embeddings=one, attention_mask=None,
                                        past_key_values=cache())
        assert count.calls == 3
        assert ((got.float() - want.float()).abs() <= 2**-6 * want.float().abs().amax()).all()
    finally:
        hi_na_moe.disable_for_model(model)


class _PrefillCalls:
    """Counts one runner's calls of the native prefill kernel (and those that ran)."""

    def __init__(self, runner):
        self.native, self.calls, self.ran = runner.native, 0, 0
        runner.native = self

    def __getattr__(self, name):
        if name != "attention_prefill_raw":
            return getattr(self.native, name)

        def counted(*args):
            self.calls += 1
            done = self.native.attention_prefill_raw(*args)
            self.ran += bool(done)
            return done

        return counted


class _Declines:
    """The native module, but its prefill kernel declines every call."""

    def __init__(self, real):
        self.real = real

    def attention_prefill_raw(self, *args):
        return False

    def __getattr__(self, name):
        return getattr(self.real, name)


def _prefill_inputs(model, att, B, T, past, seed=0, tables=torch.bfloat16, rot=None):
    gen = torch.Generator().manual_seed(seed)
    H, D = model.config.hidden_size, att.head_dim
    Hkv = att.k_proj.out_features // D
    h = torch.randn(B, T, H, generator=gen).bfloat16()
    ang = torch.rand(B, T, (rot or D) // 2, generator=gen) * 6
    emb = torch.cat([ang, ang], -1)
    k0 = torch.randn(B, Hkv, past, D, generator=gen).bfloat16()
    v0 = torch.randn(B, Hkv, past, D, generator=gen).bfloat16()

    def cache():
        c = DynamicCache()
        if past:
            c.update(k0.clone(), v0.clone(), att.layer_idx)
        return c

    return h, (emb.cos().to(tables), emb.sin().to(tables)), cache


def _prefill_native(model) -> bool:
    att = next(m for _, m in attention.find_attention(model, ""))
    D = att.head_dim
    return attention.prefill_kernel("auto", D, att.q_proj.out_features // D, att.k_proj.out_features // D)


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f in {x.model_type for x in moe_families()}])
def test_known_families_prefill_on_the_kernel_with_the_same_cache(model_type):
    # a prompt (fresh cache, no mask: causal), a later chunk of one (cached positions and a bool
    # mask; row 1 left-padded, its first query attending nothing), and no cache at all
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny model for {model_type}: {UNBUILDABLE[model_type]}")
    model = build_tiny(model_type, dtype=torch.bfloat16).model
    native = _prefill_native(model)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        found = rep.attention
        assert found and rep.attention_prefill == (found if native else [])
        assert rep.attention_prefill_math == attention.prefill_math("auto")
        line = ("prefill calls: 2 of 2 with their attention on the native AVX512-BF16 kernel" if native
                else "prefill calls: their own forward (prefill attention at this tier: ")
        assert line in str(rep)
        for name in found:
            att = dict(model.named_modules())[name]
            calls = _PrefillCalls(_runner(att))
            for B, T, past, masked in ((2, 13, 0, False), (2, 30, 6, True), (1, 5, 0, False)):
                h, pe, cache = _prefill_inputs(model, att, B, T, past, seed=T,
                                               tables=ROPES.get(model_type, (None, torch.bfloat16))[1],
                                               rot=ROTS.get(model_type))
                mask = None
                if masked:
                    mask = torch.ones(B, 1, T, past + T, dtype=torch.bool).tril(past)
                    mask[1, :, :, :past + 1] = False
                with torch.inference_mode():
                    c_ours, c_own = (cache(), cache()) if T != 5 else (None, None)
                    got, w = att(hidden_states=h, position_embeddings=pe, attention_mask=mask,
                                 past_key_values=c_ours, position_ids=None, use_cache=True)
                    want, _ = type(att).forward(att, hidden_states=h, position_embeddings=pe, attention_mask=mask,
                                                past_key_values=c_own)
                assert w is None and got.shape == want.shape
                if c_ours is not None:
                    lo, lw = c_ours.layers[att.layer_idx], c_own.layers[att.layer_idx]
                    assert torch.equal(lo.keys, lw.keys) and torch.equal(lo.values, lw.values)
                err = (got.float() - want.float()).abs().max()
                assert err <= 2**-6 * want.float().abs().amax(), (model_type, B, T, past, float(err))
                if masked:  # the query attending nothing: zeros through o_proj, as SDPA gives
                    assert torch.equal(got[1, 0], want[1, 0])
            assert (calls.calls, calls.ran) == ((3, 3) if native else (0, 0))
    finally:
        hi_na_moe.disable_for_model(model)


def test_prefill_switch_and_declined_calls_take_the_modules_own_forward(monkeypatch):
    model = _olmoe()
    if not _prefill_native(model):
        pytest.skip("no native prefill attention on this CPU (AVX512-BF16 on an AMD CPU)")
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        att = model.model.layers[0].self_attn
        runner = _runner(att)
        calls = _PrefillCalls(runner)
        h, pe, cache = _prefill_inputs(model, att, 2, 9, 0)
        own = []
        orig = runner.original

        def counted(*a, **k):
            own.append(1)
            return orig(*a, **k)

        runner.original = counted
        monkeypatch.setattr(attention, "PREFILL", False)
        with torch.inference_mode():
            got, _ = att(hidden_states=h, position_embeddings=pe, attention_mask=None, past_key_values=cache())
            want, _ = type(att).forward(att, hidden_states=h, position_embeddings=pe, attention_mask=None,
                                        past_key_values=cache())
        assert torch.equal(got, want) and calls.calls == 0 and len(own) == 1
        monkeypatch.setattr(attention, "PREFILL", True)
        # a float mask, and a bool mask per head: the module's own forward
        for mask in (torch.zeros(2, 1, 9, 9, dtype=torch.bfloat16), torch.ones(2, 4, 9, 9, dtype=torch.bool)):
            with torch.inference_mode():
                att(hidden_states=h, position_embeddings=pe, attention_mask=mask, past_key_values=cache())
        assert calls.calls == 0 and len(own) == 3
        # the kernel declining (here: told it cannot) leaves the attention to SDPA on the same inputs
        monkeypatch.setattr(calls, "native", _Declines(calls.native))
        with torch.inference_mode():
            got, _ = att(hidden_states=h, position_embeddings=pe, attention_mask=None, past_key_values=cache())
        assert calls.calls == 1 and calls.ran == 0 and len(own) == 3
        assert ((got.float() - want.float()).abs() <= 2**-6 * want.float().abs().amax()).all()
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("case", ["float32 model", "generic tier"])
def test_prefill_kernel_not_taken_where_it_does_not_apply(case):
    model = olmoe(layers=1, kv_heads=2, dtype=torch.bfloat16 if case == "generic tier" else torch.float32)
    kwargs = {"isa": "generic"} if case == "generic tier" else {}
    rep = hi_na_moe.enable_for_model(model, scope="all", **kwargs)
    try:
        assert rep.attention and rep.attention_prefill == []
        assert "prefill calls: their own forward" in str(rep)
        if case == "generic tier":
            assert rep.attention_prefill_math.startswith("PyTorch's SDPA (a fallback:")
    finally:
        hi_na_moe.disable_for_model(model)


def test_an_attention_of_no_known_form_is_left_to_pytorch_and_named():
    from transformers.models.olmoe.modeling_olmoe import OlmoeAttention

    class ScaledAttention(OlmoeAttention):  # doubles its output: no form reproduces it
        def forward(self, *args, **kwargs):
            out, w = super().forward(*args, **kwargs)
            return out * 2, w

    model = _olmoe()
    old = model.model.layers[1].self_attn
    new = ScaledAttention(model.config, layer_idx=1).to(torch.bfloat16)
    new.load_state_dict(old.state_dict())
    model.model.layers[1].self_attn = new
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.attention == ["model.layers.0.self_attn"]
        assert rep.attention_differ == ["model.layers.1.self_attn"]
        assert "forward" not in new.__dict__
        assert "1 left to PyTorch (no known form, e.g. model.layers.1.self_attn)" in str(rep)
    finally:
        hi_na_moe.disable_for_model(model)


def test_static_cache_and_padded_batches_decode_on_the_kernels():
    from transformers import StaticCache

    model = _olmoe()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
    am = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        want = model.generate(ids, attention_mask=am, **kw)
        want_static = model.generate(ids[1:], past_key_values=StaticCache(config=model.config, max_cache_len=32), **kw)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        count = _Count(_runner(model.model.layers[0].self_attn))
        with torch.inference_mode():
            got = model.generate(ids, attention_mask=am, **kw)
            assert count.calls == 4  # the padded batch's decode steps
            got_static = model.generate(ids[1:], past_key_values=StaticCache(config=model.config, max_cache_len=32),
                                        **kw)
            assert count.calls == 8
        for g, w in ((got, want), (got_static, want_static)):
            for a, b in zip(g.logits, w.logits):
                assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)


def test_a_batch_of_many_sequences_decodes_on_the_kernels_close_to_transformers():
    """24 sequences, some left-padded (the decode paths took 16 at most before 2026-12-05): every
    decode step of generate on the attention kernel, the logits within rounding of the model's own."""
    model = _olmoe()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 200, (24, 6), generator=gen)
    am = torch.ones_like(ids)
    am[::3, :2] = 0  # every third row left-padded
    ids[am == 0] = 0
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        want = model.generate(ids, attention_mask=am, **kw)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        count = _Count(_runner(model.model.layers[0].self_attn))
        with torch.inference_mode():
            got = model.generate(ids, attention_mask=am, **kw)
        assert count.calls == 3  # every decode step after the prompt's
        for a, b in zip(got.logits, want.logits):
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.vendor_tables
@pytest.mark.parametrize("table", ["this CPU's", "Intel's"])
def test_below_the_kernels_tiers_sdpa_does_the_math_and_the_report_says_so(table, monkeypatch):
    # Intel's table sends the generic tier to SDPA on any CPU: the fallback is tested everywhere
    if table == "Intel's":
        monkeypatch.setattr(attention, "kernel_tiers", lambda: attention.INTEL_TIERS)
    tiers = [t for t in _tiers() if t not in attention.kernel_tiers()]
    if not tiers:
        pytest.skip("every tier of this CPU runs the native kernel (AMD: attention.AMD_TIERS)")
    model = _olmoe()
    ids = torch.tensor([[3, 9, 27, 81, 115, 17, 51, 7]])
    with torch.inference_mode():
        want = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    rep = hi_na_moe.enable_for_model(model, scope="all", isa=tiers[-1])
    try:
        assert f"PyTorch's SDPA (a fallback: the native kernel has no vector build for tier {tiers[-1]})" in str(rep)
        runner = _runner(model.model.layers[0].self_attn)
        assert not runner.kernel
        count, kernel = _Count(runner), _KernelCalls(runner)
        # on want's tokens: the third step's top two logits are within one bfloat16 rounding of
        # each other (0.0030 apart in a float32 copy of the model), so a greedy path of its own
        # can take the other token there (SDPA under PyTorch's AVX2 or baseline build rounds both
        # to 0.8203125, and argmax takes the lower index), and every later step's logits differ
        got = _forced_logits(model, want.sequences[:, :-1], ids.shape[1])
        assert count.calls == 3 and kernel.calls == 0  # the decode path, with SDPA for the math
        for a, b in zip(got, want.logits, strict=True):
            assert ((a - b.float()).norm() / b.float().norm()).item() < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("table", ["INTEL_TIERS", "AMD_TIERS"])
def test_the_avx2_kernel_leaves_long_caches_to_sdpa_on_intel_only(table, monkeypatch):
    if "avx2" not in _tiers():
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setattr(attention, "kernel_tiers", lambda: getattr(attention, table))
    intel = table == "INTEL_TIERS"
    model = _olmoe(layers=1)
    rep = hi_na_moe.enable_for_model(model, scope="all", isa="avx2")
    try:
        assert ("the native AVX2 kernel up to 512 cached positions, PyTorch's SDPA beyond" in str(rep)) == intel
        assert "the native AVX2 kernel" in str(rep)
        att = model.model.layers[0].self_attn
        runner = _runner(att)
        kernel = _KernelCalls(runner)
        for past, calls in ((20, 1), (600, 1 if intel else 2)):
            h, pe, cache = _decode_inputs(model, att, past=past)
            with torch.inference_mode():
                got, _ = att(hidden_states=h, position_embeddings=pe, attention_mask=None, past_key_values=cache())
                want, _ = type(att).forward(att, hidden_states=h, position_embeddings=pe, attention_mask=None,
                                            past_key_values=cache())
            assert kernel.calls == calls  # 21 positions: the kernel; 601: SDPA on Intel's table
            assert ((got.float() - want.float()).abs() <= 2**-6 * want.float().abs().amax()).all()
    finally:
        hi_na_moe.disable_for_model(model)


def _gpt_oss(seed=0):
    """A tiny GPT-OSS (eager attention, sinks, half-width rotary tables, a sliding layer of
    window 64 and a full one) with sinks large enough to matter."""
    model = build_tiny("gpt_oss", dtype=torch.bfloat16, seed=seed).model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-3.0, 3.0, layer.self_attn.sinks.numel()))
    return model


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """transformers' eager form of a bool mask: 0 where attended, the dtype's lowest value elsewhere."""
    return torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, torch.finfo(torch.bfloat16).min)


def _half_tables(pe):
    D = pe[0].shape[-1]
    return pe[0][..., :D // 2].contiguous(), pe[1][..., :D // 2].contiguous()


def test_gpt_oss_attention_with_sinks_half_tables_and_eager_masks_on_the_kernels():
    """GPT-OSS's attention (eager: additive masks; sinks; cos/sin of half the head size) on the
    decode and prefill kernels: the same cache, outputs within rounding of its own forward, sinks
    that matter, a sliding-window mask, and the SDPA fallback's sinks."""
    if "gpt_oss" in UNBUILDABLE:
        pytest.skip(f"no tiny gpt_oss: {UNBUILDABLE['gpt_oss']}")
    model = _gpt_oss()
    assert model.config._attn_implementation == "eager"
    found = [n for n, _ in attention.find_attention(model, "")]
    assert len(found) == 2
    rep = hi_na_moe.enable_for_model(model, scope="all")
    native_prefill = _prefill_native(model)
    try:
        assert rep.attention == found and not rep.attention_differ
        assert rep.attention_prefill == (found if native_prefill else [])

        def close(got, want, rows=None):
            if rows is not None:
                got, want = got[rows], want[rows]
            return bool(((got.float() - want.float()).abs() <= 2**-6 * want.float().abs().amax()).all())

        for name in found:
            att = dict(model.named_modules())[name]
            runner = _runner(att)
            assert runner.sinks and runner.half_table and runner.eager
            count, kernel = _Count(runner), _KernelCalls(runner)
            # decode: no mask, an all-zero additive mask, one hiding keys of row 0
            h, pe, cache = _decode_inputs(model, att, B=2)
            pe = _half_tables(pe)
            hidden = torch.ones(2, 1, 1, 7, dtype=torch.bool)
            hidden[0, ..., [1, 4]] = False
            for mask in (None, _additive(torch.ones(2, 1, 1, 7, dtype=torch.bool)), _additive(hidden)):
                with torch.inference_mode():
                    c_ours, c_own = cache(), cache()
                    got, w = att(hidden_states=h, position_embeddings=pe, attention_mask=mask, past_key_values=c_ours)
                    want, ww = type(att).forward(att, hidden_states=h, position_embeddings=pe, attention_mask=mask,
                                                 past_key_values=c_own)
                    # the sinks matter: without them the output is far off
                    runner.sinks = False
                    off, _ = att(hidden_states=h, position_embeddings=pe, attention_mask=mask, past_key_values=cache())
                    runner.sinks = True
                assert w is None and ww is not None
                lo, lw = c_ours.layers[att.layer_idx], c_own.layers[att.layer_idx]
                assert torch.equal(lo.keys, lw.keys) and torch.equal(lo.values, lw.values)
                assert close(got, want) and not close(off, want)
            assert count.calls == 6 and kernel.calls == 6
            # the sinks changed in place after enable: the next call uses the new values
            with torch.no_grad():
                att.sinks.mul_(-1.5)
            with torch.inference_mode():
                got, _ = att(hidden_states=h, position_embeddings=pe, attention_mask=None, past_key_values=cache())
                want, _ = type(att).forward(att, hidden_states=h, position_embeddings=pe, attention_mask=None,
                                            past_key_values=cache())
            assert close(got, want) and kernel.calls == 7
            # the SDPA fallback (no kernel at a tier) adds the sinks too
            runner.kernel = False
            with torch.inference_mode():
                got, _ = att(hidden_states=h, position_embeddings=pe, attention_mask=_additive(hidden),
                             past_key_values=cache())
                want, _ = type(att).forward(att, hidden_states=h, position_embeddings=pe,
                                            attention_mask=_additive(hidden), past_key_values=cache())
            runner.kernel = True
            assert kernel.calls == 7 and close(got, want)
            if not native_prefill:
                continue
            # prefill: a prompt's causal mask, and a chunk after 6 cached positions with a sliding
            # window of 8 and row 1 left-padded (its first query attends nothing: excluded, eager
            # gives the values' mean there, a padding position's output)
            calls = _PrefillCalls(runner)
            for B, T, past in ((2, 30, 0), (2, 40, 6)):
                h, pe, cache = _prefill_inputs(model, att, B, T, past, seed=T)
                pe = _half_tables(pe)
                pos = torch.arange(past + T)
                q = pos[past:, None]
                band = (pos[None, :] <= q) & (pos[None, :] > q - 8)
                mask = band.expand(B, 1, T, past + T).clone()
                if past:
                    mask[1, :, :, :past + 1] = False
                rows = mask.any(-1).reshape(B, T)
                with torch.inference_mode():
                    c_ours, c_own = cache(), cache()
                    got, _ = att(hidden_states=h, position_embeddings=pe, attention_mask=_additive(mask),
                                 past_key_values=c_ours)
                    want, _ = type(att).forward(att, hidden_states=h, position_embeddings=pe,
                                                attention_mask=_additive(mask), past_key_values=c_own)
                lo, lw = c_ours.layers[att.layer_idx], c_own.layers[att.layer_idx]
                assert torch.equal(lo.keys, lw.keys) and torch.equal(lo.values, lw.values)
                assert close(got, want, rows), (name, B, T, past)
            assert (calls.calls, calls.ran) == (2, 2)
    finally:
        hi_na_moe.disable_for_model(model)


def test_eager_calls_the_kernels_cannot_reproduce_are_the_modules_own():
    """Under eager: an additive bias that is not a mask, a prompt without a mask (eager attends
    every key), and a call while transformers captures the attention weights run the module's own
    forward, and the weights it returns reach the caller."""
    model = _gpt_oss()
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        att = model.model.layers[1].self_attn
        count = _Count(_runner(att))
        h, pe, cache = _decode_inputs(model, att, B=2)
        pe = _half_tables(pe)
        bias = torch.zeros(2, 1, 1, 7, dtype=torch.bfloat16)
        bias[..., 3] = -1.5  # a bias, not a mask
        with torch.inference_mode():
            got, w = att(hidden_states=h, position_embeddings=pe, attention_mask=bias, past_key_values=cache())
        assert count.calls == 0 and w is not None
        if _prefill_native(model):
            hp, pp, cp = _prefill_inputs(model, att, 1, 9, 0)
            with torch.inference_mode():
                _, w = att(hidden_states=hp, position_embeddings=_half_tables(pp), attention_mask=None,
                           past_key_values=cp())
            assert w is not None
        ids = torch.tensor([[3, 9, 27, 81, 115, 17]])
        with torch.inference_mode():
            out = model(ids, output_attentions=True)
        assert len(out.attentions) == 2 and all(a is not None for a in out.attentions)
        assert count.calls == 0
    finally:
        hi_na_moe.disable_for_model(model)


def _forced_logits(model, seq: torch.Tensor, prompt: int) -> list[torch.Tensor]:
    """The last-position logits of a prefill of seq[:, :prompt] and of one decode step per later
    token of seq (teacher forcing: both runs see the same tokens, so a near-tie that greedy
    decoding would break either way cannot make them diverge)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(seq[:, :prompt], past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1].float()]
        for i in range(prompt, seq.shape[1]):
            out = model(seq[:, i:i + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float())
    return logits


def test_gpt_oss_decodes_alike_past_its_sliding_window():
    """A whole tiny GPT-OSS: a 70-token prompt (beyond the sliding layer's window of 64) and
    decode steps, with and without hi_na_moe: close logits at every step, and the attention
    modules' decode steps on the native path."""
    model = _gpt_oss(seed=1)
    seq = torch.randint(3, 250, (1, 76), generator=torch.Generator().manual_seed(0))
    want = _forced_logits(model, seq, 70)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.layers == ["model.layers.0", "model.layers.1"]  # the decoder layers' short paths
        counts = [_Count(_runner(layer.self_attn)) for layer in model.model.layers]
        got = _forced_logits(model, seq, 70)
        assert [c.calls for c in counts] == [6, 6]
        for a, b in zip(got, want):
            assert ((a - b).norm() / b.norm()).item() < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_ernie_rotates_interleaved_pairs_in_float32_on_the_kernel(dtype):
    """ERNIE 4.5 (interleaved pairs, float32 math on float32 tables): the whole model's logits
    close to its own with every attention module's decode steps on the native path (the probe
    took the keys bit for bit), and the kernel bit for bit the module's formula on extreme
    values, rows split over threads."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import apply_rotary_pos_emb as ernie_rope

    if "ernie4_5_moe" in UNBUILDABLE:
        pytest.skip(f"no tiny ernie4_5_moe: {UNBUILDABLE['ernie4_5_moe']}")
    gen = torch.Generator().manual_seed(4)
    code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for D, rows in ((128, 300), (6, 3)):
            x = (torch.randn(rows, 3, D, generator=gen) * 4).to(dt)
            x[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 6e4]).to(dt)
            ang = torch.rand(rows, 1, D // 2, generator=gen) * 100
            emb = torch.cat([ang, ang], -1)
            cos, sin = emb.cos(), emb.sin()  # float32, as ERNIE's rotary module keeps them
            want, _ = ernie_rope(x.unsqueeze(2), x.unsqueeze(2), cos, sin)
            want = want[:, :, 0]
            c, s = cos[:, 0].contiguous(), sin[:, 0].contiguous()
            for threads in (1, 2):
                out = torch.full_like(x, 7)
                _native().rope_interleaved_f32_raw(x.data_ptr(), rows, 3, D, c.data_ptr(), s.data_ptr(), D,
                                                   out.data_ptr(), code[dt], threads)
                bits = torch.int32 if dt == torch.float32 else torch.int16
                nan = want.isnan()  # NaN where the module has one (its payload is PyTorch's business)
                assert torch.equal(out.isnan(), nan), (dt, D, threads)
                assert torch.equal(out.view(bits)[~nan], want.view(bits)[~nan]), (dt, D, threads)
    model = build_tiny("ernie4_5_moe", dtype=dtype).model
    with torch.no_grad():  # a score correction that matters (its router's biased form runs natively too)
        for layer in model.model.layers:
            statics = getattr(getattr(layer.mlp, "gate", None), "moe_statics", None)
            if statics is not None:
                statics.e_score_correction_bias.copy_(torch.randn(statics.e_score_correction_bias.shape,
                                                                  generator=gen) * 0.3)
    seq = torch.randint(3, 120, (1, 20), generator=gen)
    want = _forced_logits(model, seq, 12)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert len(rep.attention) == model.config.num_hidden_layers and not rep.attention_differ
        assert rep.routers and not rep.routers_differ and not rep.routers_select_pytorch
        runners = [_runner(layer.self_attn) for layer in model.model.layers]
        assert all(r.rope == "interleaved_f32" and r.table_dtype == torch.float32 for r in runners)
        counts = [_Count(r) for r in runners]
        got = _forced_logits(model, seq, 12)
        assert [c.calls for c in counts] == [8] * len(runners)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for a, b in zip(got, want):
            assert ((a - b).norm() / b.norm()).item() < tol
    finally:
        hi_na_moe.disable_for_model(model)


def test_an_eager_llama_like_model_decodes_on_the_kernels():
    """OLMoE loaded with attn_implementation="eager" (additive masks, no sinks, full tables)."""
    model = _olmoe()
    model.set_attn_implementation("eager")
    seq = torch.tensor([[3, 9, 27, 81, 115, 17, 51, 7, 350, 404, 315, 394]])
    want = _forced_logits(model, seq, 8)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert len(rep.attention) == 2 and not rep.attention_differ
        runner = _runner(model.model.layers[0].self_attn)
        assert runner.eager and not runner.sinks and not runner.half_table
        count = _Count(runner)
        got = _forced_logits(model, seq, 8)
        assert count.calls == 4
        for a, b in zip(got, want):
            assert ((a - b).norm() / b.norm()).item() < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)


def test_whole_model_decode_with_native_attention_stays_close_and_generates_alike():
    model = _olmoe()
    ids = torch.tensor([[3, 9, 27, 81, 115, 17, 51, 7]])
    with torch.inference_mode():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        runner = _runner(model.model.layers[0].self_attn)
        if not runner.kernel:
            pytest.skip("this tier has no build of the kernel here: SDPA does the math (the test above)")
        assert f"attention math: {attention.math_kernel(runner.isa)}" in str(rep)
        assert "the native " in attention.math_kernel(runner.isa)
        count = _Count(_runner(model.model.layers[0].self_attn))
        got = _forced_logits(model, want.sequences[:, :-1], ids.shape[1])  # want's tokens: a near tie (above)
        assert count.calls == 5  # every decode step after the prompt
        for a, b in zip(got, want.logits, strict=True):
            assert ((a - b.float()).norm() / b.float().norm()).item() < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
