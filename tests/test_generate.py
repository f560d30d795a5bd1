"""hi_na_moe.generate (hi_na_moe.integrate.generate): model.generate's arguments and result with a
lean decode loop. Against model.generate on the same model (not enabled, scope="experts" and
scope="all", lossless weights): the same sequences token for token, greedy and seeded sampling
(temperature, top-k, top-p, min-p), batch 1 and batch 2 with left padding, end of sequence
(a finished row padded while the other goes on), max_new_tokens / max_length, what a streamer is
given; under scope="all" the loop's steps are the causal LM's native path; the model, its config
and generation config unchanged; and every call it does not handle runs model.generate
unchanged with one GenerateFallbackWarning naming why."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_models import olmoe

import hi_na_moe
from hi_na_moe.core.native import native_kernels_available
from hi_na_moe.core.registry import patched_runner
from hi_na_moe.fastpath import linear, stack
from hi_na_moe.integrate import generate as gen_mod
from hi_na_moe.integrate.generate import GenerateFallbackWarning

NEW = 12
PROMPT1 = torch.tensor([[3, 4, 5, 6, 7, 8]])
PROMPT2 = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
MASK2 = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
BATCHES = {"batch1": (PROMPT1, None), "batch2-left-padded": (PROMPT2, MASK2)}
SAMPLING = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.8),
    "temperature-top_k-top_p": dict(temperature=1.3, top_k=40, top_p=0.9),
    "min_p": dict(min_p=0.05),
}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(gen_mod, "_WARNED", set())  # "once per reason in the process": each test sees its first


def _model(scope: str, monkeypatch):
    """The tiny OLMoE (bf16) not enabled, or enabled with lossless weights under `scope`."""
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)  # (its dense layers are below the size worth packing)
    model = olmoe(layers=2, kv_heads=2)
    if scope != "none":
        if not native_kernels_available():
            pytest.skip("enabling needs the native kernels")
        rep = hi_na_moe.enable_for_model(model, scope=scope, weights="lossless", cache=False)
        assert rep.causal_lms == ([""] if scope == "all" else [])
    return model


@pytest.fixture(params=["none", "experts", "all"])
def model(request, monkeypatch):
    m = _model(request.param, monkeypatch)
    yield m
    if request.param != "none":
        hi_na_moe.disable_for_model(m)


def _both(model, seed, *args, **kw):
    """(model.generate, hi_na_moe.generate) of the same call, each from the same seed, the latter
    with fallback warnings as errors (a handled call must not fall back)."""
    torch.manual_seed(seed)
    want = model.generate(*args, **kw)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenerateFallbackWarning)
        got = hi_na_moe.generate(model, *args, **kw)
    return want, got


@pytest.mark.parametrize("batch", list(BATCHES))
def test_greedy_is_token_for_token_generate(model, batch):
    ids, mask = BATCHES[batch]
    want, got = _both(model, 0, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert want.shape == (ids.shape[0], ids.shape[1] + NEW)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert got.is_contiguous()
    # keyword input_ids, and the mask left out for an unpadded prompt (generate makes one of ones)
    if mask is None:
        want, got = _both(model, 0, input_ids=ids, max_new_tokens=NEW)
        assert torch.equal(got, want)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("how", list(SAMPLING))
def test_seeded_sampling_is_token_for_token_generate(model, batch, how):
    ids, mask = BATCHES[batch]
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=True, **SAMPLING[how])
    for seed in (1, 2):
        want, got = _both(model, seed, ids, **kw)
        assert torch.equal(got, want), f"seed {seed}"
    # the draws depend on the seed (else the comparison above could not tell a wrong draw)
    torch.manual_seed(1)
    a = hi_na_moe.generate(model, ids, **kw)
    torch.manual_seed(2)
    b = hi_na_moe.generate(model, ids, **kw)
    assert not torch.equal(a, b)


def _greedy_tokens(model, ids, mask, n):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[:, ids.shape[1]:]


def test_eos_stops_a_row_and_pads_it_until_all_stop(model):
    # batch 1: the end-of-sequence token is the greedy decode's 4th token: 4 new tokens, not NEW
    free = _greedy_tokens(model, PROMPT1, None, NEW)[0].tolist()
    eos = free[3]
    k = free.index(eos)  # (its first occurrence)
    want, got = _both(model, 0, PROMPT1, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want) and got.shape[1] == PROMPT1.shape[1] + k + 1
    # batch 2: row 0 ends first at a token row 1 does not produce before; row 0 is then padded
    rows = _greedy_tokens(model, PROMPT2, MASK2, NEW).tolist()
    pick = next((t, i) for i, t in enumerate(rows[0]) if t not in rows[1][: i + 2] and rows[0].index(t) == i)
    eos, at = pick
    pad = 7 if eos != 7 else 9
    want, got = _both(model, 0, PROMPT2, attention_mask=MASK2, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(got, want)
    new = got[:, PROMPT2.shape[1]:]
    assert new.shape[1] > at + 1 and new[0, at] == eos and (new[0, at + 1:] == pad).all()
    # a list of end-of-sequence tokens, and sampling: the same stops
    want, got = _both(model, 3, PROMPT2, attention_mask=MASK2, max_new_tokens=NEW, do_sample=True,
                      eos_token_id=[eos, rows[1][2]], pad_token_id=pad)
    assert torch.equal(got, want)


def test_lengths_max_new_tokens_and_max_length(model):
    for n in (1, 2, 5):
        want, got = _both(model, 0, PROMPT1, max_new_tokens=n, eos_token_id=None)
        assert torch.equal(got, want) and got.shape[1] == PROMPT1.shape[1] + n
    want, got = _both(model, 0, PROMPT2, attention_mask=MASK2, max_length=9, eos_token_id=None)
    assert torch.equal(got, want) and got.shape[1] == 9
    # the generation config's max_length (transformers' default 20: 20 new tokens after the prompt)
    want, got = _both(model, 0, PROMPT1, eos_token_id=None)
    assert torch.equal(got, want) and got.shape[1] == PROMPT1.shape[1] + 20
    # what generate refuses, refused the same (its own validation runs first)
    for bad in (dict(max_new_tokens=0), dict(max_length=PROMPT1.shape[1])):
        with pytest.raises(ValueError) as want_err:
            model.generate(PROMPT1, **bad)
        with pytest.raises(ValueError) as got_err:
            hi_na_moe.generate(model, PROMPT1, **bad)
        assert str(got_err.value) == str(want_err.value)


class _Recorder:
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


def test_a_streamer_gets_what_generate_gives_it(model):
    for ids, mask in BATCHES.values():
        a, b = _Recorder(), _Recorder()
        model.generate(ids, attention_mask=mask, max_new_tokens=5, streamer=a)
        hi_na_moe.generate(model, ids, attention_mask=mask, max_new_tokens=5, streamer=b)
        assert a.puts == b.puts and a.ended == b.ended == 1 and len(b.puts) == 6


def test_scope_all_steps_take_the_causal_lm_path_and_the_model_is_unchanged(monkeypatch):
    model = _model("all", monkeypatch)
    try:
        runner = patched_runner(model)
        assert isinstance(runner, stack.NativeCausalLM)
        calls, run = [], runner._run
        runner._run = lambda fast: calls.append(1) or run(fast)
        own = dict(model.__dict__)
        config, gen_config = model.config.to_dict(), model.generation_config.to_dict()
        for ids, mask in BATCHES.values():
            calls.clear()
            hi_na_moe.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
            assert len(calls) == NEW - 1  # every step after the prefill's token
        runner._run = run
        assert model.__dict__.keys() == own.keys() and all(model.__dict__[k] is own[k] for k in own)
        assert model.config.to_dict() == config and model.generation_config.to_dict() == gen_config
    finally:
        hi_na_moe.disable_for_model(model)


def test_a_non_model_is_a_clear_error():
    with pytest.raises(TypeError, match="GenerationMixin.*got Linear"):
        hi_na_moe.generate(torch.nn.Linear(2, 2), PROMPT1)


@pytest.mark.parametrize("kw, name", [
    (dict(num_beams=2), "num_beams=2"),
    (dict(return_dict_in_generate=True), "return_dict_in_generate=True"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores=True"),
    (dict(repetition_penalty=1.3), "`repetition_penalty`"),
    (dict(no_repeat_ngram_size=2), "`no_repeat_ngram_size`"),
    (dict(min_new_tokens=4), "min_new_tokens=4"),
    (dict(use_cache=False), "use_cache=False"),
    (dict(cache_implementation="static"), "`cache_implementation`"),
])
def test_what_it_does_not_handle_is_model_generate_with_one_warning(kw, name, monkeypatch):
    model = _model("all", monkeypatch)
    try:
        torch.manual_seed(0)
        want = model.generate(PROMPT2, attention_mask=MASK2, max_new_tokens=5, **kw)
        torch.manual_seed(0)
        with pytest.warns(GenerateFallbackWarning, match=f"runs model.generate unchanged.*{name}"):
            got = hi_na_moe.generate(model, PROMPT2, attention_mask=MASK2, max_new_tokens=5, **kw)
        assert type(got) is type(want)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert torch.equal(got.sequences, want.sequences)
        with warnings.catch_warnings():  # once: the same reason again is silent
            warnings.simplefilter("error", GenerateFallbackWarning)
            hi_na_moe.generate(model, PROMPT2, attention_mask=MASK2, max_new_tokens=5, **kw)
    finally:
        hi_na_moe.disable_for_model(model)


def test_a_setting_of_the_generation_config_it_does_not_handle_falls_back_before_any_forward(monkeypatch):
    model = _model("all", monkeypatch)
    try:
        model.generation_config.repetition_penalty = 1.3  # (as a generation_config.json could set it)
        want_stream, got_stream = _Recorder(), _Recorder()
        want = model.generate(PROMPT1, max_new_tokens=5, streamer=want_stream)
        runner = patched_runner(model)
        calls, run = [], runner._run
        runner._run = lambda fast: calls.append(1) or run(fast)
        with pytest.warns(GenerateFallbackWarning, match="RepetitionPenaltyLogitsProcessor.*generation config"):
            got = hi_na_moe.generate(model, PROMPT1, max_new_tokens=5, streamer=got_stream)
        runner._run = run
        assert torch.equal(got, want)
        assert got_stream.puts == want_stream.puts  # the prompt once: the first call never streamed
        assert len(calls) == 4  # model.generate's own steps only, none of a started loop
        # the same in a passed generation config
        model.generation_config.repetition_penalty = 1.0
        cfg = model.generation_config.__class__(**{**model.generation_config.to_dict(), "num_beams": 2})
        with pytest.warns(GenerateFallbackWarning, match="generation mode beam_search"):
            got = hi_na_moe.generate(model, PROMPT1, generation_config=cfg, max_new_tokens=5)
        assert torch.equal(got, model.generate(PROMPT1, generation_config=cfg, max_new_tokens=5))
    finally:
        hi_na_moe.disable_for_model(model)


def test_fallbacks_for_the_caller_own_cache_processors_and_positional_arguments(monkeypatch):
    from transformers import DynamicCache, LogitsProcessorList, TopKLogitsWarper

    model = _model("experts", monkeypatch)
    try:
        with pytest.warns(GenerateFallbackWarning, match="`past_key_values`"):
            got = hi_na_moe.generate(model, PROMPT1, max_new_tokens=3,
                                     past_key_values=DynamicCache(config=model.config))
        assert torch.equal(got, model.generate(PROMPT1, max_new_tokens=3))
        procs = LogitsProcessorList([TopKLogitsWarper(3)])
        with pytest.warns(GenerateFallbackWarning, match="`logits_processor` \\(not empty\\)"):
            hi_na_moe.generate(model, PROMPT1, max_new_tokens=3, logits_processor=procs)
        with pytest.warns(GenerateFallbackWarning, match="by position"):
            hi_na_moe.generate(model, PROMPT1, None, max_new_tokens=3)
        with warnings.catch_warnings():  # empty lists are the default's
            warnings.simplefilter("error", GenerateFallbackWarning)
            hi_na_moe.generate(model, PROMPT1, max_new_tokens=3, logits_processor=LogitsProcessorList(),
                               stopping_criteria=[])
            # a tokenizer (for stop strings) reaches generate's criteria, not the model's inputs
            got = hi_na_moe.generate(model, PROMPT1, max_new_tokens=3, tokenizer=object())
        assert torch.equal(got, model.generate(PROMPT1, max_new_tokens=3, tokenizer=object()))
    finally:
        hi_na_moe.disable_for_model(model)
