"""hi_na_moe.generate(model, ...): model.generate's arguments and result, with a lean decode loop.

Why: beyond the forward, transformers' generate() spends time of its own on every decode step:
input preparation (two `model.device` walks over the parameters), position_ids and the attention
mask grown by torch.cat, stopping criteria as tensors and a tensor max for the stop check, and
LogitsProcessorList's inspect.signature of every processor. 0.12-0.16 ms a step on a 2-core
Zen 4 (benchmarks/log/decode-step.md, "generate() against a loop of forwards: where the per-step
difference goes (2026-12-07)"); none of it is hi_na_moe's.

How, without touching the model: the call is model.generate itself with a `custom_generate`
callable, transformers' own hook for a decoding loop. So transformers resolves the arguments and
the generation config, validates them, makes the attention mask, position_ids and the cache,
and builds the logits processors and stopping criteria exactly as for any call; only the loop
after that is this module's:
- the prefill is transformers' own (GenerationMixin._prefill, as its _sample calls it);
- each step is one model call with the new tokens, the cache, use_cache, logits_to_keep and,
  only when a row is padded, the attention mask and position_ids: views of a mask made once for
  the whole call and of positions computed once, where generate grows both by torch.cat a step.
  Without padding generate drops the mask and every row's position is the cache's length, which
  the model's forward computes itself. The cache is the DynamicCache generate made: under
  scope="all" its layers take each new position in place in contiguous buffers
  (hi_na_moe.fastpath.kv_cache) and the step runs as one native call (hi_na_moe.fastpath.stack);
- the token is picked as _sample picks it: the last row's logits copied to float32, the logits
  processors generate built (temperature, top-k, top-p, min-p: called directly, without the
  list's signature inspection), then argmax, or softmax and torch.multinomial from the global
  generator (so a seeded call draws the same tokens);
- end of sequence and max_length are checked on the picked tokens in Python; a finished row
  gets the pad token, as generate gives it.

What it handles: decoder-only transformers models on the CPU whose generate, _sample, _prefill,
prepare_inputs_for_generation and _update_model_kwargs_for_generation are transformers' own;
greedy and multinomial sampling with one sequence a prompt; the arguments in _PASSED and the
values in _ONLY; a fresh DynamicCache. Anything else (beam search, assisted decoding, a cache of
the caller's, logits processors or stopping criteria of the caller's or from the generation
config other than those above, return_dict_in_generate, output_scores, ...) runs model.generate
unchanged, and a GenerateFallbackWarning says so once per reason. A reason seen only after
transformers' preparation (say, a repetition_penalty in the model's generation_config.json) is
found before the first forward; model.generate is then called again, unchanged (the streamer is
handed to the first call only at the decoding stage, so it sees the prompt once).
"""

from __future__ import annotations

import threading
import warnings

import torch
from transformers import DynamicCache
from transformers.generation import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

__all__ = ["GenerateFallbackWarning", "generate"]


class GenerateFallbackWarning(UserWarning):
    """hi_na_moe.generate ran model.generate unchanged; the message names the argument or setting why."""


# arguments handed to model.generate as given: every value of theirs is handled (what they make
# generate build is checked again at the decoding stage, _unhandled_prepared)
_PASSED = frozenset((
    "inputs", "input_ids", "attention_mask", "generation_config", "max_new_tokens", "max_length", "do_sample",
    "temperature", "top_k", "top_p", "min_p", "eos_token_id", "pad_token_id", "bos_token_id", "streamer", "tokenizer",
))
_EMPTY = object()  # (_ONLY: None or an empty list)
# arguments handled at these values only (None: the generation config's, checked at the decoding stage)
_ONLY = {
    "use_cache": (None, True), "num_beams": (None, 1), "num_return_sequences": (None, 1),
    "return_dict_in_generate": (None, False), "output_scores": (None, False), "output_logits": (None, False),
    "output_attentions": (None, False), "output_hidden_states": (None, False), "synced_gpus": (None, False),
    "min_length": (None, 0), "min_new_tokens": (None, 0), "logits_processor": _EMPTY, "stopping_criteria": _EMPTY,
}
# the logits processors generate builds for these settings, called as its list calls a processor
# of two arguments; any other (from the generation config) is a fallback
_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
# the generation config's fields that would make the loop's result differ if set (checked once
# transformers prepared the call)
_FLAGS = ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions", "output_hidden_states",
          "token_healing", "is_assistant")
# what generate's model kwargs may hold for the loop: what it made itself for a plain call
_MODEL_KWARGS = frozenset(("attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep"))
# GenerationMixin's methods whose behaviour the loop reproduces: a model overriding one falls back
_OWN_METHODS = ("generate", "_sample", "_prefill", "prepare_inputs_for_generation",
                "_update_model_kwargs_for_generation")

_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


class _Unhandled(Exception):
    """Raised inside model.generate, before any forward, when the prepared call is not one the loop handles."""

    def __init__(self, key: str, reason: str):
        super().__init__(reason)
        self.key, self.reason = key, reason


def _fallback(key: str, reason: str) -> None:
    """Warn, once per key in the process, that model.generate runs unchanged, and why."""
    with _WARNED_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(f"hi_na_moe.generate runs model.generate unchanged (its own decode loop): {reason}",
                  GenerateFallbackWarning, stacklevel=3)


def _unhandled_call(model, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """(key, reason) when this call is not one the loop handles, from the model and the
    arguments alone; None when it may be (the decoding stage checks the rest)."""
    cls = type(model)
    for name in _OWN_METHODS:
        if not hasattr(GenerationMixin, name) or getattr(cls, name, None) is not getattr(GenerationMixin, name):
            return name, f"{cls.__name__}.{name} is not transformers' GenerationMixin.{name}"
    if getattr(model.config, "is_encoder_decoder", False):
        return "is_encoder_decoder", f"{cls.__name__} is an encoder-decoder model"
    if len(args) > 1:
        return "positional", "arguments after `inputs` are passed by position (pass them by name)"
    for name, value in kwargs.items():
        if name in _PASSED:
            continue
        allowed = _ONLY.get(name)
        if allowed is None:
            return name, f"the argument `{name}`"
        if allowed is _EMPTY:
            if value is not None and len(value):
                return name, f"the argument `{name}` (not empty)"
        elif not any(value is a or (a is not None and type(value) in (bool, int) and value == a) for a in allowed):
            return name, f"the argument `{name}={value!r}`"
    device = getattr(model, "device", None)
    if getattr(device, "type", None) != "cpu":
        return "device", f"the model is on {device}, not the CPU"
    return None


def _unhandled_prepared(input_ids, processors, criteria, generation_config, model_kwargs) -> tuple[str, str] | None:
    """(key, reason) when the call transformers prepared is not one the loop handles, else None."""
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return "mode", f"the generation mode {mode.value} (from the generation config)"
    for flag in _FLAGS:
        if getattr(generation_config, flag, None):
            return flag, f"{flag}={getattr(generation_config, flag)!r} (from the generation config)"
    for field, ok in (("num_return_sequences", (None, 1)), ("cache_implementation", (None, "dynamic")),
                      ("prefill_chunk_size", (None,))):
        value = getattr(generation_config, field, None)
        if value not in ok:
            return field, f"{field}={value!r} (from the generation config)"
    extra = sorted(model_kwargs.keys() - _MODEL_KWARGS)
    if extra:
        return "model_kwargs", f"model inputs {extra}"
    if model_kwargs.get("use_cache") is not True:
        return "use_cache", f"use_cache={model_kwargs.get('use_cache')!r} (from the generation config)"
    cache = model_kwargs.get("past_key_values")
    if type(cache) is not DynamicCache or cache.offloading or cache.get_seq_length() != 0:
        return "cache", f"the cache generate prepared ({type(cache).__name__}) is not a fresh DynamicCache"
    if model_kwargs.get("logits_to_keep", 1) != 1:
        return "logits_to_keep", f"logits_to_keep={model_kwargs['logits_to_keep']!r}"
    for p in processors:
        if type(p) not in _PROCESSORS:
            name = type(p).__name__
            return f"processor:{name}", f"the logits processor {name} (from the generation config)"
    lengths = [c for c in criteria if type(c) is MaxLengthCriteria]
    for c in criteria:
        if type(c) not in (MaxLengthCriteria, EosTokenCriteria):
            name = type(c).__name__
            return f"criterion:{name}", f"the stopping criterion {name} (from the generation config)"
    if len(lengths) != 1 or sum(type(c) is EosTokenCriteria for c in criteria) > 1:
        return "criteria", "not one max_length criterion and at most one end-of-sequence criterion"
    if (type(input_ids) is not torch.Tensor or input_ids.dim() != 2 or input_ids.dtype is not torch.int64
            or not input_ids.is_cpu):
        return "input_ids", "input_ids are not a 2-D int64 CPU tensor"
    return None


def _decode(model, input_ids: torch.Tensor, processors, criteria, generation_config, streamer, model_kwargs: dict):
    """The decoding stage (module docstring): the sequences [B, prompt + new] as generate returns them."""
    why = _unhandled_prepared(input_ids, processors, criteria, generation_config, model_kwargs)
    if why is not None:
        raise _Unhandled(*why)
    if streamer is not None:  # (generate puts the prompt before its decoding stage; it was not given the streamer)
        streamer.put(input_ids.cpu())
    B, L0 = input_ids.shape
    max_len = next(c for c in criteria if type(c) is MaxLengthCriteria).max_length
    eos_crit = next((c for c in criteria if type(c) is EosTokenCriteria), None)
    eos = None if eos_crit is None else frozenset(eos_crit.eos_token_id.reshape(-1).tolist())
    pad = getattr(generation_config, "_pad_token_tensor", None)  # (generate's: the pad token, else the first eos)
    if eos is not None and pad is None:
        raise _Unhandled("pad_token_id", "an end-of-sequence token without a pad token")
    pad = None if pad is None else int(pad)
    procs = list(processors)
    sample = generation_config.do_sample is True
    cache = model_kwargs["past_key_values"]

    # generate's _sample: the prefill, then the do-while loop (at least one token)
    outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    logits = outputs.logits
    del outputs
    steps = max(max_len - L0, 1)
    call = {"past_key_values": cache, "use_cache": True, "return_dict": True}
    if "logits_to_keep" in model_kwargs:
        call["logits_to_keep"] = model_kwargs["logits_to_keep"]
    mask = model_kwargs.get("attention_mask")  # (None without padding: generate dropped a mask of ones)
    positions = None
    if mask is not None:
        full = mask.new_ones((B, L0 + steps))
        full[:, :L0] = mask
        pos = model_kwargs.get("position_ids")
        if pos is not None:  # step k's positions, as generate grows them: the prompt's last + k; [steps, B, 1]
            positions = (pos[:, -1:] + torch.arange(1, steps + 1, dtype=pos.dtype)).t().contiguous().unsqueeze(-1)
    seq = None
    if procs:  # the processors get the sequences so far, as generate's list gives them
        seq = torch.empty((B, L0 + steps), dtype=input_ids.dtype)
        seq[:, :L0] = input_ids
    tokens = []
    finished = [False] * B
    done = None  # the finished rows as a bool tensor, once one of several rows finished
    cur = L0
    softmax, multinomial, argmax = torch.nn.functional.softmax, torch.multinomial, torch.argmax
    while True:
        scores = logits[:, -1].to(copy=True, dtype=torch.float32)
        if procs:
            now = seq[:, :cur]
            for p in procs:
                scores = p(now, scores)
        nxt = multinomial(softmax(scores, dim=-1), num_samples=1).squeeze(1) if sample else argmax(scores, dim=-1)
        if done is not None:
            nxt = nxt.masked_fill(done, pad)
        tokens.append(nxt)
        if seq is not None:
            seq[:, cur] = nxt
        cur += 1
        if streamer is not None:
            streamer.put(nxt)
        if eos is not None:
            if B == 1:
                if int(nxt) in eos:
                    break
            else:
                new = [i for i, t in enumerate(nxt.tolist()) if not finished[i] and t in eos]
                if new:
                    for i in new:
                        finished[i] = True
                    if all(finished):
                        break
                    done = torch.tensor(finished)
        if cur >= max_len:
            break
        if mask is not None:
            call["attention_mask"] = full[:, :cur]
            if positions is not None:
                call["position_ids"] = positions[cur - L0 - 1]
        logits = model(input_ids=nxt.unsqueeze(1), **call).logits
    if streamer is not None:
        streamer.end()
    return torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)


def generate(model, *args, **kwargs):
    """model.generate(*args, **kwargs) with a lean decode loop (module docstring): the same
    arguments and the same result, a LongTensor [batch, prompt + new tokens] of the same tokens
    (greedy, and seeded sampling with temperature / top_k / top_p / min_p). A call it does not
    handle runs model.generate unchanged, with a GenerateFallbackWarning naming why (once per
    reason in the process). The model is never changed."""
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"hi_na_moe.generate expects a transformers model that generates (a GenerationMixin), "
                        f"got {type(model).__name__}")
    why = _unhandled_call(model, args, kwargs)
    if why is not None:
        _fallback(*why)
        return model.generate(*args, **kwargs)
    streamer = kwargs.pop("streamer", None)

    # transformers passes the decoding stage the model as `self`; `tokenizer` is named so that
    # generate hands it on (a custom loop's own keywords) rather than to the model
    def decode(self, input_ids, logits_processor, stopping_criteria, generation_config, tokenizer=None, **model_kwargs):
        return _decode(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs)

    try:
        return model.generate(*args, custom_generate=decode, **kwargs)
    except _Unhandled as e:
        _fallback(e.key, e.reason)
        if streamer is not None:
            kwargs["streamer"] = streamer
        return model.generate(*args, **kwargs)
