"""scope="all" (hi_na_moe.fastpath.stack.NativeCausalLM): a causal LM's decode steps as its stack's step
and its lm_head called straight. Against the same enabled model on the causal LM's own forward
(which then calls the stack and the lm_head as modules): the same logits and cache, bit for bit,
with a loop of forwards and with generate; generate still sees the own forward's signature; and
every call the path must not take (labels, tuples, a tensor logits_to_keep, outputs asked for,
hooks on what it skips, parts replaced, training) runs the own forward."""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_models import UNBUILDABLE, build_tiny, greedy_decode, olmoe
from transformers import DynamicCache

import hi_na_moe
from hi_na_moe.fastpath import linear, stack
from hi_na_moe.integrate.families import moe_families
from hi_na_moe.core.native import native_kernels_available
from hi_na_moe.core.registry import patched_runner

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")


class _Count:
    """Counts the decode calls that took the causal LM's path (calls), and the stack's one calls
    that ran the lm_head at their end (heads)."""

    def __init__(self, model):
        self.calls = self.heads = 0
        runner = patched_runner(model)
        assert isinstance(runner, stack.NativeCausalLM)
        run, one_call = runner._run, runner.stack._one_call

        def counted(fast, _run=run):
            self.calls += 1
            return _run(fast)

        def counted_one_call(*args, _one_call=one_call):
            out = _one_call(*args)
            self.heads += out is not None and out[2] is not None
            return out

        runner._run, runner.stack._one_call = counted, counted_one_call


def _own(model, on: bool, saved: dict) -> None:
    """The causal LM on its own forward (on) or back on the patched one."""
    if on:
        saved["forward"] = model.__dict__.pop("forward")
    else:
        model.forward = saved["forward"]


def _same(model, ids, steps=3, attention_mask=None, taken=True, heads=True):
    count = _Count(model)
    got, c_got = greedy_decode(model, ids, steps, attention_mask)
    assert count.calls == (steps if taken else 0) and count.heads == (steps if taken and heads else 0)
    saved: dict = {}
    _own(model, True, saved)
    try:
        want, c_want = greedy_decode(model, ids, steps, attention_mask)
    finally:
        _own(model, False, saved)
    assert all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want))
    for a, b in zip(c_got.layers, c_want.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("model_type", [f for f in ("olmoe", "mixtral", "qwen2_moe", "qwen3_moe")
                                        if f in {x.model_type for x in moe_families()}])
def test_known_families_decode_through_the_causal_lm_path_bit_for_bit(model_type, monkeypatch):
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny model for {model_type}: {UNBUILDABLE[model_type]}")
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = build_tiny(model_type, dtype=torch.bfloat16).model.eval()
    if getattr(model.config, "sliding_window", None):
        model.config.sliding_window = None
    own_signature = inspect.signature(model.forward)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.causal_lms == [""] and not rep.causal_lms_differ
        assert "causal LMs with decode steps as their stack's step and lm_head, called straight: 1" in str(rep)
        assert rep.to_dict()["causal_lms"] == [""]
        # generate reads the forward's signature (logits_to_keep, attention_mask, position_ids)
        assert inspect.signature(model.forward) == own_signature and model._supports_logits_to_keep()
        _same(model, torch.tensor([[3, 9, 4, 7]]))
        _same(model, torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]]), attention_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
    finally:
        hi_na_moe.disable_for_model(model)
    assert "forward" not in model.__dict__ and inspect.signature(model.forward) == own_signature


@pytest.mark.parametrize("kind", ["dynamic-cache", "static-cache-padded"])
def test_generate_takes_the_causal_lm_path_and_gives_the_same_tokens(kind, monkeypatch):
    from transformers import StaticCache

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    if kind == "dynamic-cache":
        ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
        mask = torch.ones_like(ids)
    else:
        ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        count = _Count(model)
        runner = patched_runner(model)
        own_calls = []

        def own(*args, _own=runner.original, **kwargs):
            own_calls.append(kwargs.get("logits_to_keep"))
            return _own(*args, **kwargs)

        runner.original = own

        def run():
            with torch.inference_mode():
                cache = StaticCache(config=model.config, max_cache_len=32) if kind != "dynamic-cache" else None
                return model.generate(ids, attention_mask=mask, past_key_values=cache, **kw)

        got = run()
        # the prompt's forward is the own, with logits_to_keep=1 from generate (the signature it
        # reads is the own forward's); the 4 steps after it take the path
        assert own_calls == [1] and count.calls == 4
        saved: dict = {}
        _own(model, True, saved)
        try:
            want = run()
        finally:
            _own(model, False, saved)
        assert count.calls == 4
        assert torch.equal(got.sequences, want.sequences)
        assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits))
    finally:
        hi_na_moe.disable_for_model(model)


class _Spy(torch.nn.Module):
    def __init__(self, inner, calls):
        super().__init__()
        self.inner, self.calls = inner, calls

    def forward(self, *args, **kwargs):
        self.calls.append(1)
        return self.inner(*args, **kwargs)


def test_calls_the_path_must_not_take_run_the_own_forward(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        count = _Count(model)
        ids = torch.tensor([[3, 4, 5, 6]])
        seen = []
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(ids, past_key_values=cache, use_cache=True)  # a prompt: the own forward
            assert count.calls == 0
            nxt = torch.tensor([[9]])
            step = dict(past_key_values=cache, use_cache=True)
            out = model(nxt, labels=torch.tensor([[1]]), **step)
            assert out.loss is not None
            assert isinstance(model(nxt, return_dict=False, **step), tuple)
            model(nxt, logits_to_keep=torch.tensor([0]), **step)
            model(nxt, output_router_logits=True, **step)
            model(nxt, output_hidden_states=True, **step)
            model(nxt, some_new_argument=1, **step)
            for part in (model.model, model.lm_head):
                handle = part.register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
                model(nxt, **step)
                handle.remove()
            assert count.calls == 0 and seen == ["OlmoeModel", "Linear"]
            out = model(nxt, **step)
            assert count.calls == 1 and set(out.keys()) == {"logits", "past_key_values"}
            # parts replaced after enable: the own forward calls the new ones
            calls = []
            head = model.lm_head
            model.lm_head = _Spy(head, calls)
            model(nxt, **step)
            model.lm_head = head
            patched = model.model.__dict__["forward"]
            model.model.forward = lambda *a, _f=patched, **k: (calls.append(2), _f(*a, **k))[1]
            model(nxt, **step)
            model.model.forward = patched
            assert count.calls == 1 and calls == [1, 2]
            model(nxt, logits_to_keep=1, **step)
            model(nxt, return_dict=True, **step)
            assert count.calls == 3
            model.config.return_dict = False  # the config's: a tuple, from the own forward
            try:
                assert isinstance(model(nxt, **step), tuple) and count.calls == 3
            finally:
                model.config.return_dict = True
        model.train()  # training mode (the own forward, whatever its modules do with it)
        with torch.no_grad():
            model(nxt, **step)
        assert count.calls == 3
        model.eval()
        with torch.no_grad():
            model(nxt, **step)
        assert count.calls == 4
    finally:
        hi_na_moe.disable_for_model(model)


def test_the_path_is_off_by_the_switch_and_for_an_lm_head_left_to_pytorch(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2)
    monkeypatch.setattr(stack, "CAUSAL_LM", False)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.stacks == ["model"] and rep.causal_lms == [] and "causal LMs" not in str(rep)
    finally:
        hi_na_moe.disable_for_model(model)
    monkeypatch.setattr(stack, "CAUSAL_LM", True)
    # lm_head excluded from packing: the path calls it as a module, same bits
    rep = hi_na_moe.enable_for_model(model, scope="all", dense_exclude="lm_head")
    try:
        assert rep.causal_lms == [""] and "lm_head" not in {d.name for d in rep.dense}
        assert patched_runner(model).head_runner is None
        _same(model, torch.tensor([[3, 9, 4, 7]]), heads=False)
    finally:
        hi_na_moe.disable_for_model(model)


def test_the_lm_head_runs_in_the_one_call_after_the_final_norm(monkeypatch):
    """The lm_head at the end of the stack's one call (HEAD_IN_CALL): the same logits bit for bit
    as the own forward; its runner's forward after the call when the final norm is a module call
    (a hook on the norm) or with HEAD_IN_CALL False; int8 and int4 heads (paired too)."""
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    ids = torch.tensor([[3, 9, 4, 7], [5, 6, 7, 8]])
    for weights in ("lossless", "int8", "int4"):
        model = olmoe(layers=2)
        hi_na_moe.enable_for_model(model, scope="all", weights=weights, cache=False)
        try:
            _same(model, ids)
            seen = []
            handle = model.model.norm.register_forward_hook(lambda m, i, o: seen.append(1))
            try:
                _same(model, ids, heads=False)
            finally:
                handle.remove()
            assert seen
            monkeypatch.setattr(stack, "HEAD_IN_CALL", False)
            _same(model, ids, heads=False)
            monkeypatch.setattr(stack, "HEAD_IN_CALL", True)
            _same(model, ids)
        finally:
            hi_na_moe.disable_for_model(model)


def test_a_step_plan_refuses_a_head_it_cannot_run():
    from hi_na_moe.core.native import native_module

    native = native_module()[0]
    g = torch.Generator().manual_seed(0)
    E, H, I = 2, 64, 32
    w = [torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)]
    plan = native.StepPlan(1)
    with pytest.raises(ValueError, match="linear block"):
        plan.set_head(native.PackedExperts(*w).bind(), 2)
    plan.set_head(None)  # (none: allowed)


def test_inspect_model_lists_the_causal_lm(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2)
    planned = hi_na_moe.inspect_model(model, scope="all")
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert planned.causal_lms == rep.causal_lms == [""]
    finally:
        hi_na_moe.disable_for_model(model)


def test_output_objects_are_the_constructors_or_built_by_it():
    from dataclasses import dataclass

    from transformers.modeling_outputs import BaseModelOutputWithPast, MoeCausalLMOutputWithPast
    from transformers.utils import ModelOutput

    logits, cache = torch.randn(1, 1, 8), DynamicCache()
    for cls, names in ((MoeCausalLMOutputWithPast, ("logits", "past_key_values")),
                       (BaseModelOutputWithPast, ("last_hidden_state", "past_key_values"))):
        outputs = stack.Outputs(cls, names)
        assert outputs.fast
        got, want = outputs.build(logits, cache), cls(**dict(zip(names, (logits, cache))))
        assert type(got) is cls and list(got.keys()) == list(want.keys()) == list(names)
        assert list(got.__dict__) == list(want.__dict__)
        assert all(got.__dict__[k] is want.__dict__[k] for k in want.__dict__)
        assert got[0] is logits and got.to_tuple() == (logits, cache) and getattr(got, names[0]) is logits

    @dataclass
    class Counted(ModelOutput):  # bookkeeping of its own in __post_init__: its constructor builds it
        logits: torch.Tensor | None = None
        past_key_values: object = None

        def __post_init__(self):
            super().__post_init__()
            self.__dict__["made"] = True

    outputs = stack.Outputs(Counted, ("logits", "past_key_values"))
    assert not outputs.fast and outputs.build(logits, cache).made
    # names out of field order: the constructor, with each value under its own name
    outputs = stack.Outputs(MoeCausalLMOutputWithPast, ("past_key_values", "logits"))
    got = outputs.build(cache, logits)
    assert not outputs.fast and got.logits is logits and got.past_key_values is cache
