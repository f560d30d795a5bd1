"""scope="all" (hi_na_moe.fastpath.stack): a decoder stack's decode steps as one loop over its layers'
short paths. Against the same enabled model with the stack on its own forward: the same logits
and cache, bit for bit, on the families the tiny models cover, with generate and its masks; and
every call that must stay the stack's own (prefill, padding, other caches, outputs asked for,
hooks on a layer, a layer replaced, training)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import UNBUILDABLE, build_tiny, greedy_decode, olmoe
from transformers import DynamicCache

import hi_na_moe
from hi_na_moe.fastpath import linear
from hi_na_moe.integrate.families import moe_families
from hi_na_moe.core.native import native_kernels_available, native_module
from hi_na_moe.core.registry import patched_runner

def _native_isa(tier: str) -> bool:
    return native_kernels_available() and native_module()[0].isa_supported(tier)


pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")
FAMILIES = ("olmoe", "mixtral", "qwen2_moe", "qwen3_moe", "aria")


class _Count:
    """Counts the stack's decode calls that ran its loop (loops), those of them that ran
    every layer in one native call (one_calls), and of those the ones with the final norm inside
    (normed)."""

    def __init__(self, model):
        self.loops = self.one_calls = self.normed = 0
        runner = patched_runner(model.model)
        hidden, one_call = runner._hidden, runner._one_call

        def counted(*args, _hidden=hidden):  # (the causal LM's decode path calls it too)
            self.loops += 1
            return _hidden(*args)

        def counted_one_call(*args, _one_call=one_call):
            out = _one_call(*args)
            self.one_calls += out is not None
            self.normed += out is not None and out[1] is not None
            return out

        runner._hidden, runner._one_call = counted, counted_one_call


def _own(model, on: bool, saved: dict) -> None:
    m = model.model
    if on:
        saved["forward"] = m.__dict__.pop("forward")
    else:
        m.forward = saved["forward"]




def _same(model, ids, steps=4, attention_mask=None, loops=True):
    count = _Count(model)
    got, c_got = greedy_decode(model, ids, steps, attention_mask)
    assert count.loops == (steps if loops else 0)
    saved: dict = {}
    _own(model, True, saved)
    try:
        want, c_want = greedy_decode(model, ids, steps, attention_mask)
    finally:
        _own(model, False, saved)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for a, b in zip(c_got.layers, c_want.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    return count


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f in {x.model_type for x in moe_families()}])
def test_known_families_decode_in_one_loop_bit_for_bit(model_type, monkeypatch):
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny model for {model_type}: {UNBUILDABLE[model_type]}")
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = build_tiny(model_type, dtype=torch.bfloat16).model.eval()
    if getattr(model.config, "sliding_window", None):  # the tiny Mixtral's (windowed: the tests below)
        model.config.sliding_window = None
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.stacks == ["model"] and not rep.stacks_differ and not rep.stacks_rotary_module
        assert "decoder stacks with decode steps as one loop over those layers: 1 ('model')" in str(rep)
        # every layer in one native call, Qwen2-MoE's shared expert included
        assert not rep.stacks_loop_only and "with a DynamicCache or StaticCache every layer in one native call: 1" in str(rep)
        count = _same(model, torch.tensor([[3, 9, 4, 7]]))
        assert count.one_calls == count.normed == 4  # the final norm inside the call too
        count = _same(model, torch.tensor([[3, 9, 4, 7], [5, 6, 7, 8]]), 3,
                      attention_mask=torch.ones(2, 4, dtype=torch.long))
        assert count.one_calls == 3
        # padding: the mask the stack's own forward would build, over the keys
        count = _same(model, torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]]), 3,
                      attention_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        assert count.one_calls == 3
        # a batch of 20 sequences, a quarter padded (more than the 16 the decode paths took
        # before 2026-12-05): still the one call, the own forward's bits
        ids = torch.randint(3, 90, (20, 4), generator=torch.Generator().manual_seed(2))
        mask = torch.ones_like(ids)
        mask[::4, :2] = 0
        count = _same(model, ids.masked_fill(mask == 0, 0), 2, attention_mask=mask)
        assert count.one_calls == 2
    finally:
        hi_na_moe.disable_for_model(model)
    assert "forward" not in model.model.__dict__


@pytest.mark.parametrize("kind", ["dynamic-cache", "static-cache-padded"])
def test_generate_takes_the_one_call_and_gives_the_same_tokens(kind, monkeypatch):
    from transformers import StaticCache

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    if kind == "dynamic-cache":
        ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
        mask = torch.ones_like(ids)
    else:  # generate prepares a 4-D mask over the StaticCache's buffer
        ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        count = _Count(model)

        def run():
            with torch.inference_mode():
                cache = StaticCache(config=model.config, max_cache_len=32) if kind != "dynamic-cache" else None
                return model.generate(ids, attention_mask=mask, past_key_values=cache, **kw)

        got = run()
        assert count.loops == 4  # every step after the prompt's
        assert count.one_calls == 4  # a StaticCache's buffers too, under generate's mask
        saved: dict = {}
        _own(model, True, saved)
        try:
            want = run()
        finally:
            _own(model, False, saved)
        assert count.loops == 4
        assert torch.equal(got.sequences, want.sequences)
        assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits))
    finally:
        hi_na_moe.disable_for_model(model)


def test_calls_the_loop_must_not_take_run_the_stacks_own_forward(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        count = _Count(model)
        ids = torch.tensor([[3, 4, 5, 6]])
        layer = model.model.layers[1]
        seen = []
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(ids, past_key_values=cache, use_cache=True)  # prefill
            nxt = torch.tensor([[9]])
            step = dict(past_key_values=cache, use_cache=True)
            model(nxt, output_hidden_states=True, **step)  # outputs asked for
            model(nxt, output_router_logits=True, **step)
            model(nxt, some_new_argument=1, **step)
            model(nxt, past_key_values=cache, use_cache=False)
            handle = layer.register_forward_hook(lambda m, i, o: seen.append("layer"))
            model(nxt, **step)
            handle.remove()
            handle = layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append("gate"))
            model(nxt, **step)
            handle.remove()
            assert count.loops == 0 and seen == ["layer", "gate"]
            model(nxt, **step)
            assert count.loops == 1
            # a layer replaced after enable: the stack's own loop calls the new one
            calls = []
            model.model.layers[1] = _Spy(layer, calls)
            model(nxt, **step)
            assert count.loops == 1 and calls == [1]
            model.model.layers[1] = layer
            model(nxt, **step)
            assert count.loops == 2
        with torch.no_grad():
            grad_cache = DynamicCache(config=model.config)
            model(ids, past_key_values=grad_cache, use_cache=True)
        out = model(torch.tensor([[9]]), past_key_values=grad_cache, use_cache=True)  # autograd records it
        assert count.loops == 2 and out.logits.shape[1] == 1
        model.model.layers[0].train()  # a layer in training mode
        with torch.no_grad():
            model(nxt, **step)
        assert count.loops == 2
        model.eval()
        with torch.no_grad():
            model(nxt, **step)
        assert count.loops == 3
    finally:
        hi_na_moe.disable_for_model(model)


def test_the_final_norm_runs_in_the_call_unless_something_would_see_it_skipped(monkeypatch):
    from hi_na_moe.fastpath import stack

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2)
    ids = torch.tensor([[3, 9, 4, 7]])
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert _same(model, ids, 3).normed == 3
        norm = model.model.norm
        seen = []
        handle = norm.register_forward_hook(lambda m, i, o: seen.append(1))  # the module is called, same bits
        try:
            count = _same(model, ids, 3)
        finally:
            handle.remove()
        assert count.one_calls == 3 and count.normed == 0 and len(seen) == 2 * (1 + 3)
        patched = norm.__dict__["forward"]
        norm.forward = lambda x, _f=patched: _f(x)  # a forward set after enable
        try:
            count = _same(model, ids, 3)
        finally:
            norm.forward = patched
        assert count.one_calls == 3 and count.normed == 0
        assert _same(model, ids, 2).normed == 2
        monkeypatch.setattr(stack, "FINAL_NORM", False)
        count = _same(model, ids, 2)
        assert count.one_calls == 2 and count.normed == 0
    finally:
        hi_na_moe.disable_for_model(model)


def test_a_steps_input_is_gathered_natively_unless_the_embedding_would_be_seen(monkeypatch):
    """The step's embedding rows are copied natively into a buffer of the thread's (NativeStack._embed):
    the same bits; a hook on the embedding, or an id outside its table (IndexError, as natively),
    takes the module's call; and no tensor a step returns is one of the buffers the next step
    overwrites."""
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2)
    ids = torch.tensor([[3, 9, 4, 7]])
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        runner = patched_runner(model.model)
        gathered = []
        embed = runner._embed
        monkeypatch.setattr(runner, "_embed", lambda i: gathered.append(embed(i)) or gathered[-1])
        assert _same(model, ids, 3).normed == 3
        assert len(gathered) == 3 and all(g is gathered[0] for g in gathered)  # one buffer, every step
        emb = model.model.embed_tokens
        seen = []
        handle = emb.register_forward_hook(lambda m, i, o: seen.append(o))
        try:
            count = _same(model, ids, 3)
        finally:
            handle.remove()
        assert count.one_calls == 3 and len(seen) == 2 * (1 + 3)  # the module's call: fresh outputs
        assert len({id(t) for t in seen}) == len(seen)
        # an id beyond the table: the embedding's own error
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(ids, past_key_values=cache, use_cache=True)
            with pytest.raises(IndexError):
                model(torch.tensor([[model.config.vocab_size]]), past_key_values=cache, use_cache=True)
        # what a step returns, or hands a hook, outlives the next step: the base model's last
        # hidden states with the final norm in the call, and with it a module whose hook keeps
        # its input (the last layer's output)
        for hooked in (False, True):
            inputs = []
            handle = (model.model.norm.register_forward_hook(lambda m, i, o: inputs.append(i[0])) if hooked
                      else None)
            try:
                cache = DynamicCache(config=model.config)
                with torch.inference_mode():
                    model.model(ids, past_key_values=cache, use_cache=True)
                    first = model.model(torch.tensor([[5]]), past_key_values=cache, use_cache=True).last_hidden_state
                    kept = [t.clone() for t in [first, *inputs]]
                    model.model(torch.tensor([[6]]), past_key_values=cache, use_cache=True)
                assert all(torch.equal(a, b) for a, b in zip([first, *inputs], kept)) and len(kept) == 1 + 2 * hooked
            finally:
                if handle is not None:
                    handle.remove()
    finally:
        hi_na_moe.disable_for_model(model)


class _Spy(torch.nn.Module):
    def __init__(self, inner, calls):
        super().__init__()
        self.inner, self.calls = inner, calls

    def forward(self, *args, **kwargs):
        self.calls.append(1)
        return self.inner(*args, **kwargs)


def _cache_kinds(model, cache) -> set[str]:
    return {type(layer).__name__ for layer in cache.layers}


def test_a_windowed_stack_takes_the_steps_whose_keys_are_all_in_the_window(monkeypatch):
    """Mixtral with a window of 8 (no layer_types: every layer windowed). With the cache generate
    makes (DynamicCache(config=...): the layers keep the window's keys) every step is the loop's,
    past the window too; with a plain DynamicCache (keeping every key) the steps past the window
    and those with padding are the stack's own forward's. The same logits and cache, bit for bit."""
    from transformers import MixtralConfig, MixtralForCausalLM

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                        sliding_window=8, pad_token_id=0)
    model = MixtralForCausalLM(cfg).eval().bfloat16()
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.layers and rep.stacks == ["model"] and not rep.stacks_differ
        runner = patched_runner(model.model)
        assert runner.window == 8 and runner.windowed == (0, 1)
        _same(model, torch.tensor([[3, 9, 4, 7]]), steps=12)  # 4 past the window
        assert _cache_kinds(model, DynamicCache(config=model.config)) == {"DynamicSlidingWindowLayer"}

        count = _Count(model)
        ids = torch.tensor([[3, 9, 4, 7]])
        with torch.inference_mode():
            for cache_args, loops in (({}, 4), ({"config": model.config}, 12)):
                cache, count.loops = DynamicCache(**cache_args), 0
                saved: dict = {}
                out = model(ids, past_key_values=cache, use_cache=True)
                logits = []
                for _ in range(12):  # positions 4..15: in a window of 8 up to position 7
                    out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
                    logits.append(out.logits)
                assert count.loops == loops
                _own(model, True, saved)
                try:
                    cache2 = DynamicCache(**cache_args)
                    out = model(ids, past_key_values=cache2, use_cache=True)
                    for want in logits:
                        out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache2, use_cache=True)
                        assert torch.equal(out.logits, want)
                finally:
                    _own(model, False, saved)
        _same(model, torch.tensor([[0, 9, 4, 7], [3, 9, 4, 7]]), steps=2, loops=False,  # padding: the own forward
              attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    finally:
        hi_na_moe.disable_for_model(model)

    # layers typed full beside the window, which Mixtral's forward windows all the same: the probe
    # looks past the window and sees it
    model.config.layer_types = ["full_attention"] * 2
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.layers and rep.stacks == [] and rep.stacks_differ == ["model"]
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("isa", [t for t in ("avx2", "auto") if t == "auto" or _native_isa(t)])
def test_gpt_oss_decodes_in_one_native_call_past_its_sliding_window(isa, monkeypatch):
    """GPT-OSS (layers typed sliding and full, attention sinks, half-width rotary tables, eager
    attention, a router child named router, biases): the probe looks past the window of its
    sliding layer to see its full layer unmasked; every decode step then runs in one native call,
    past the window too (the sliding layer's keys appended in place, its view moving on), bit for
    bit the stack's own forward, its loop over the layers, and the cache's own update."""
    from hi_na_moe.fastpath import kv_cache

    if "gpt_oss" in UNBUILDABLE:
        pytest.skip(f"no tiny gpt_oss: {UNBUILDABLE['gpt_oss']}")
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = build_tiny("gpt_oss", dtype=torch.bfloat16, seed=1).model.eval()
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    window = model.config.sliding_window
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-3.0, 3.0, layer.self_attn.sinks.numel()))
    rep = hi_na_moe.enable_for_model(model, scope="all", isa=isa)
    try:
        assert rep.stacks == ["model"] and not rep.stacks_differ and not rep.stacks_loop_only
        runner = patched_runner(model.model)
        assert runner.windowed == (0,)
        ids = torch.randint(3, 250, (1, window - 2), generator=torch.Generator().manual_seed(0))
        count = _same(model, ids, steps=6)  # 4 steps past the window
        assert count.one_calls == 6
        _by_layer(model, ids, 6)
        two = torch.randint(3, 250, (2, window + 3), generator=torch.Generator().manual_seed(1))
        got, c_got = greedy_decode(model, two, 4)
        monkeypatch.setattr(kv_cache, "IN_PLACE", False)
        want, c_want = greedy_decode(model, two, 4)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        for a, b in zip(c_got.layers, c_want.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            assert a.get_seq_length() == b.get_seq_length()
    finally:
        hi_na_moe.disable_for_model(model)


def test_ernie_decodes_in_one_call_with_its_dense_layer_biased_router_and_shared_experts(monkeypatch):
    """ERNIE 4.5 (interleaved float32 rotary form, a dense first layer, ungated shared experts, a
    float32 router choosing with a score-correction bias): its stack's decode steps run in one
    native call, its rotary module's float32 outputs read from the table, bit for bit the stack's
    own forward and its loop over the layers' two native calls, with a mask of padding too."""
    if "ernie4_5_moe" in UNBUILDABLE:
        pytest.skip(f"no tiny ernie4_5_moe: {UNBUILDABLE['ernie4_5_moe']}")
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = build_tiny("ernie4_5_moe", dtype=torch.bfloat16).model.eval()
    with torch.no_grad():  # a score correction that matters
        bias = model.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias
        bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.stacks == ["model"] and not rep.stacks_differ and not rep.stacks_rotary_module
        assert not rep.stacks_loop_only
        # the dense layer's MLP and the MoE block (the biased float32 router, the shared experts
        # added) on the native calls
        first, moe = patched_runner(model.model.layers[0]), patched_runner(model.model.layers[1]).moe
        assert first.moe is None and first.dense is not None
        assert moe is not None and moe.shared and moe.router.biased and moe.router.dtype == torch.float32
        assert moe.shared_native is not None and moe.shared_native[1] is None
        assert all(patched_runner(layer).step is not None for layer in model.model.layers)
        runner = patched_runner(model.model)
        ids = torch.tensor([[3, 9, 4, 7], [5, 6, 7, 8]])
        count = _same(model, ids, steps=5)
        assert count.one_calls == 5 and runner.rope.cos is not None and runner.rope.cos.dtype == torch.float32
        _by_layer(model, ids, 4)
        count = _same(model, torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]]), 3,
                      attention_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        assert count.one_calls == 3
        # the bias changed in place after enable: read at every step, in the call too
        with torch.no_grad():
            bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
        count = _same(model, ids, steps=3)
        assert count.one_calls == 3
    finally:
        hi_na_moe.disable_for_model(model)


_GROUPED = {"n_group": 2, "topk_group": 1}
_SIGMOID_ROUTERS = {"glm4_moe": ("sigmoid-group-topk, float32 logits", _GROUPED),
                    "dots1": ("sigmoid-group-topk, float32 logits", _GROUPED),
                    "solar_open": ("sigmoid-group-topk, float32 logits", _GROUPED),
                    "minimax_m2": ("sigmoid-topk, bias argument", {}),
                    "hy_v3": ("sigmoid-topk, bias argument, float32 logits, +1e-20, scaled", {})}


@pytest.mark.parametrize("model_type", list(_SIGMOID_ROUTERS))
def test_sigmoid_routers_decode_in_one_call_bit_for_bit(model_type, monkeypatch):
    """Sigmoid routers with a score-correction bias that matters, beside shared experts and
    dense first layers, decode in one native call, bit for bit the stack's own forward and its
    loop, padding included: DeepSeek-V3's form (two expert groups of which one is kept, float32
    logits from a bf16 weight) in GLM-4.5 (its partial rotary too), dots.llm1 and Solar Open; the
    bias as the router's argument, the block's buffer, in MiniMax-M2 and Hunyuan-V3."""
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny {model_type}: {UNBUILDABLE[model_type]}")
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    form, overrides = _SIGMOID_ROUTERS[model_type]
    model = build_tiny(model_type, dtype=torch.bfloat16, **overrides).model.eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.stacks == ["model"] and not rep.stacks_differ and not rep.stacks_loop_only
        assert rep.routers and not rep.routers_differ and not rep.routers_select_pytorch
        moe = [patched_runner(layer).moe for layer in model.model.layers if patched_runner(layer).moe is not None]
        assert moe and all(m.router.form_name == form for m in moe)
        # a dense layer (first_k_dense_replace) in the call too
        assert all(patched_runner(layer).dense is not None for layer in model.model.layers
                   if patched_runner(layer).moe is None)
        ids = torch.tensor([[3, 9, 4, 7], [5, 6, 7, 8]])
        assert _same(model, ids, steps=4).one_calls == 4
        _by_layer(model, ids, 3)
        count = _same(model, torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]]), 3,
                      attention_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        assert count.one_calls == 3
        # the biases changed in place after enable: read at the next step, in the one call too
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
        assert _same(model, ids, steps=3).one_calls == 3
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("model_type", ["qwen3_omni_moe", "qwen3_vl_moe", "glm4v_moe", "deepseek_ocr2"])
def test_multimodal_text_decoders_take_the_one_call(model_type, monkeypatch):
    """The text decoders of multimodal families (their steps are the text families' above): the
    report names a decoder stack that takes the one native call, none that differs or loops."""
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny {model_type}: {UNBUILDABLE[model_type]}")
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = build_tiny(model_type, dtype=torch.bfloat16).model.eval()
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert len(rep.stacks) == 1 and not rep.stacks_differ and not rep.stacks_loop_only
        assert "with a DynamicCache or StaticCache every layer in one native call: 1" in str(rep)
    finally:
        hi_na_moe.disable_for_model(model)


def test_dense_layers_beside_moe_layers_run_in_the_one_call(monkeypatch):
    """Qwen2-MoE with mlp_only_layers (dense MLPs in some layers, as DeepSeek's first_k_dense_replace
    and ERNIE's first layer): every layer in one native call, bit for bit the stack's own forward
    and its loop."""
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = build_tiny("qwen2_moe", dtype=torch.bfloat16, mlp_only_layers=[0]).model.eval()
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.stacks == ["model"] and not rep.stacks_differ and not rep.stacks_loop_only
        assert patched_runner(model.model.layers[0]).dense is not None
        ids = torch.tensor([[3, 9, 4, 7]])
        assert _same(model, ids, steps=4).one_calls == 4
        _by_layer(model, ids, 3)
    finally:
        hi_na_moe.disable_for_model(model)


def test_layers_of_another_kind_keep_the_stacks_own_forward():
    """A layer_types entry other than full or sliding attention (chunked, linear, ...), or a
    sliding layer with no window: not a stack this loop takes."""
    from types import SimpleNamespace

    from hi_na_moe.fastpath.stack import PROBE_WINDOW, NativeStack

    def w(**kw):
        return NativeStack._windowed(SimpleNamespace(**kw), 3)

    assert w() == (0, ()) and w(sliding_window=0, layer_types=["full_attention"] * 3) == (0, ())
    assert w(sliding_window=16) == (16, (0, 1, 2))
    assert w(sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"]) == (16, (0, 2))
    assert w(sliding_window=PROBE_WINDOW + 1, layer_types=["sliding_attention", "full_attention",
                                                          "full_attention"]) == (PROBE_WINDOW + 1, (0, 1, 2))
    assert w(layer_types=["sliding_attention", "full_attention", "full_attention"]) is None
    assert w(sliding_window=16, layer_types=["chunked_attention", "full_attention", "full_attention"]) is None
    assert w(layer_types=["full_attention", "linear_attention", "full_attention"]) is None
    assert w(layer_types=["full_attention"] * 2) is None


def _by_layer(model, ids, steps, one_call=True, attention_mask=None):
    """greedy_decode with the stack's one native call (count.one_calls: every step, or with
    one_call False none) and with its loop over the layers' short paths: the same logits and
    cache, bit for bit."""
    from hi_na_moe.fastpath import stack

    count = _Count(model)
    got, c_got = greedy_decode(model, ids, steps, attention_mask)
    assert count.one_calls == (steps if one_call else 0)
    stack.ONE_CALL = False
    try:
        want, c_want = greedy_decode(model, ids, steps, attention_mask)
    finally:
        stack.ONE_CALL = True
    assert count.one_calls == (steps if one_call else 0) and count.loops == 2 * steps
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for a, b in zip(c_got.layers, c_want.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.vendor_tables
@pytest.mark.parametrize("isa", [t for t in ("generic", "avx2", "auto") if t == "auto" or _native_isa(t)])
@pytest.mark.parametrize("weights", ["lossless", "int4"])
def test_one_native_call_is_the_layers_short_paths_bit_for_bit(weights, isa, monkeypatch, tmp_path):
    """Past the KV buffers' regrowth (kv_cache: 256 positions beyond the prompt), two rows,
    quantised experts and linears, each tier (on Intel CPUs the generic one has no attention
    kernel: the layers' loop; attention.kernel_tiers); then a norm weight replaced after enable (the layer is set again in a new
    plan) and settings that take the step back to the layers' loop."""
    from hi_na_moe.fastpath import routers
    from hi_na_moe.fastpath.attention import kernel_tiers

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    rep = hi_na_moe.enable_for_model(model, scope="all", weights=weights, cache_dir=str(tmp_path), isa=isa)
    try:
        one_call = native_module()[0].resolve_isa(isa) in kernel_tiers()  # "auto" may be HINA_MOE_ISA's tier
        assert rep.stacks_loop_only == ({} if one_call else {
            "model": "model.layers.0: no native attention kernel at tier generic (PyTorch's SDPA does the math)"})
        _by_layer(model, torch.tensor([[5, 6, 7]]), 260, one_call)
        _by_layer(model, torch.tensor([[5, 6, 7], [9, 10, 11]]), 3, one_call)
        _by_layer(model, torch.tensor([[0, 6, 7], [9, 10, 11]]), 3, one_call,  # a padded row
                  attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
        if not one_call:
            return
        stack_runner = patched_runner(model.model)
        plan = stack_runner._plan
        with torch.no_grad():
            model.model.layers[1].post_attention_layernorm.weight = torch.nn.Parameter(
                torch.rand(512).bfloat16() + 0.5)
        _by_layer(model, torch.tensor([[5, 6, 7]]), 3)
        assert stack_runner._plan is not plan and stack_runner._plan[1] != plan[1]
        # a layer's arguments are the last step's (the same dict) until something they hold changes
        layer = patched_runner(model.model.layers[0])
        args = layer.plan_args(torch.bfloat16, 1)
        assert layer.plan_args(torch.bfloat16, 1) is args and layer.plan_args(torch.bfloat16, 2) is not args
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            assert layer.plan_args(torch.bfloat16, 1)["num_threads"] == torch.get_num_threads() != threads
        finally:
            torch.set_num_threads(threads)
        assert layer.plan_args(torch.bfloat16, 1) == args
        count = _Count(model)
        monkeypatch.setattr(routers, "NATIVE_SELECT", False)  # the layers' loop, with PyTorch's selection
        greedy_decode(model, torch.tensor([[5, 6, 7]]), 2)
        assert count.loops == 2 and count.one_calls == 0
    finally:
        hi_na_moe.disable_for_model(model)


def test_the_step_trace_covers_the_one_call_op_by_op_or_is_empty_in_a_release_build(monkeypatch):
    """_native.take_step_trace: a tuning build's timeline of decode_layers (bench_step_gaps.py
    --ops reads it); a release build records nothing."""
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    native = native_module()[0]
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    hi_na_moe.enable_for_model(model, weights="int4", scope="all")
    try:
        count = _Count(model)
        native.take_step_trace()  # whatever came before
        greedy_decode(model, torch.tensor([[3, 4, 5, 6]]), 3)
        events = native.take_step_trace()
        assert count.one_calls == 3
        if not native.step_trace_compiled():
            assert events == []
            return
        per_layer = ["norm", "qkv", "rope_kv", "attention", "o_proj", "add_norm", "router", "select",
                     "experts_prep", "experts_gate_up", "experts_quant_h", "experts_down", "experts", "add"]
        # (the causal LM's lm_head at the call's end: NativeCausalLM, HEAD_IN_CALL)
        step = [(layer, op) for layer in range(2) for op in per_layer] + [(-1, "final_norm"), (-1, "lm_head")]
        assert [(layer, op) for layer, op, _, _ in events] == step * 3
        assert all(t0 <= t1 for _, _, t0, t1 in events)
        for i in range(3):  # within a call the ops follow each other without a gap
            call = events[i * len(step):(i + 1) * len(step)]
            assert all(a[3] == b[2] for a, b in zip(call, call[1:]))
        assert native.take_step_trace() == []
    finally:
        hi_na_moe.disable_for_model(model)


def test_the_step_trace_splits_a_dense_mlp_and_a_shared_expert_into_their_linears(monkeypatch):
    """Qwen2-MoE with a dense first layer: the trace names a gated MLP's two linears (the dense
    layer's mlp_*, the shared expert's shared_*) and the shared expert's sigmoid gate apart,
    which is how bench_step_gaps.py --ops gives each its bytes and rate."""
    native = native_module()[0]
    if not native.step_trace_compiled():
        pytest.skip("a release build records no step trace (the test above checks that)")
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = build_tiny("qwen2_moe", dtype=torch.bfloat16, mlp_only_layers=[0]).model.eval()
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        native.take_step_trace()
        greedy_decode(model, torch.tensor([[3, 9, 4, 7]]), 2)
        events = native.take_step_trace()
        attn = ["norm", "qkv", "rope_kv", "attention", "o_proj", "add_norm"]
        dense_layer = attn + ["mlp_gate_up", "mlp_down", "add"]
        moe_layer = attn + ["router", "select", "experts_prep", "experts_gate_up", "experts_quant_h", "experts_down",
                            "experts", "shared_gate_up", "shared_down", "shared_gate", "add"]
        n = model.config.num_hidden_layers
        step = ([(0, op) for op in dense_layer] + [(i, op) for i in range(1, n) for op in moe_layer]
                + [(-1, "final_norm"), (-1, "lm_head")])
        assert [(layer, op) for layer, op, _, _ in events] == step * 2
    finally:
        hi_na_moe.disable_for_model(model)
