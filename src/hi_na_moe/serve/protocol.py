"""The OpenAI request bodies the server takes, checked field by field.

A field the server does not implement is refused with a 400 naming it, unless it holds its
neutral value (n=1, echo=false, presence_penalty=0, ...): a client that sends the defaults works,
and nobody gets a silently ignored option. Unknown fields are refused too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engine import SamplingParams

__all__ = ["RequestError", "Limits", "Completion", "parse_completion", "parse_chat"]


class RequestError(ValueError):
    """A bad request: the HTTP status, the message and the field (OpenAI's `param`) it is about."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 4096  # the most a request may ask for
    default_max_tokens: int = 256  # chat requests without max_tokens (completions default to 16, as OpenAI's)
    max_prompt_tokens: int = 8192
    max_prompts: int = 16  # prompts in one completions request
    max_stop: int = 4


@dataclass
class Completion:
    """A checked request: its prompts (strings or token ids), sampling and streaming options."""

    prompts: list  # of str or list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None
    continuous_usage: bool = False
    chat: bool = False
    messages: list | None = None


# field -> the neutral values accepted and ignored
_NEUTRAL: dict[str, tuple] = {
    "n": (1, None), "best_of": (1, None), "echo": (False, None), "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logit_bias": (None, {}),
    "suffix": (None, ""), "user": None, "parallel_tool_calls": None, "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none"), "service_tier": None, "store": (None, False), "metadata": None,
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "ignore_eos"}
_COMPLETION = _COMMON | {"prompt"}
_CHAT = _COMMON | {"messages", "max_completion_tokens"}
_ROLES = ("system", "user", "assistant", "developer")


def _check_fields(body: Any, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for k, v in body.items():
        if k in known:
            continue
        if k in _NEUTRAL:
            ok = _NEUTRAL[k]
            if ok is None or k == "user" or any(v == o and type(v) is type(o) or v is o for o in ok):
                continue
            raise RequestError(f"{k}={v!r} is not supported by this server (only its default is)", k)
        raise RequestError(f"unknown field {k!r}", k)
    return body


def _int(body: dict, key: str, default, lo: int, hi: int | None = None):
    v = body.get(key, default)
    if v is None:
        return default
    if type(v) is not int:
        raise RequestError(f"{key} must be an integer, got {v!r}", key)
    if v < lo or (hi is not None and v > hi):
        raise RequestError(f"{key} must be between {lo} and {hi}, got {v}" if hi is not None else
                           f"{key} must be >= {lo}, got {v}", key)
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if type(v) not in (int, float):
        raise RequestError(f"{key} must be a number, got {v!r}", key)
    if not (lo < v <= hi if lo_open else lo <= v <= hi):
        raise RequestError(f"{key} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def _common(body: dict, limits: Limits, default_max: int, max_key: str = "max_tokens") -> tuple:
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if len(stop) > limits.max_stop:
        raise RequestError(f"stop holds {len(stop)} strings, at most {limits.max_stop} are allowed", "stop")
    if any(not s for s in stop):
        raise RequestError("stop strings must not be empty", "stop")
    max_tokens = _int(body, max_key, default_max, 1, limits.max_tokens)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if type(stream) is not bool:
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or not opts.keys() <= {"include_usage", "continuous_usage_stats"}:
            raise RequestError("stream_options must be an object with include_usage", "stream_options")
        if not stream:
            raise RequestError("stream_options is only allowed with stream=true", "stream_options")
        include_usage = opts.get("include_usage", False)
        continuous = opts.get("continuous_usage_stats", False)
        if type(include_usage) is not bool or type(continuous) is not bool:
            raise RequestError("stream_options.include_usage and continuous_usage_stats must be true or false",
                               "stream_options")
        include_usage = (include_usage, continuous)
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise RequestError(f"seed must be an integer, got {seed!r}", "seed")
    ignore_eos = body.get("ignore_eos", False)
    if type(ignore_eos) is not bool:
        raise RequestError(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    params = SamplingParams(max_tokens=max_tokens, temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
                            top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                            seed=None if seed is None else seed & 0x7FFF_FFFF_FFFF_FFFF,
                            stop=tuple(stop), ignore_eos=ignore_eos)
    return params, stream, include_usage, model


def parse_completion(body: Any, limits: Limits) -> Completion:
    body = _check_fields(body, _COMPLETION)
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        prompts = [p]
    elif isinstance(p, list) and p and all(type(t) is int for t in p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in p):
        prompts = list(p)
    else:
        raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of such lists "
                           "(none empty)", "prompt")
    if len(prompts) > limits.max_prompts:
        raise RequestError(f"prompt holds {len(prompts)} prompts, at most {limits.max_prompts} are allowed", "prompt")
    params, stream, usage, model = _common(body, limits, 16)
    return Completion(prompts, params, stream, bool(usage and usage[0]), model, continuous_usage=bool(usage and usage[1]))


def parse_chat(body: Any, limits: Limits) -> Completion:
    body = _check_fields(body, _CHAT)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise RequestError(f"messages[{i}] must be an object with a role of {', '.join(_ROLES)}", f"messages[{i}].role")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise RequestError(f"messages[{i}] has fields this server does not take: {', '.join(sorted(extra))}",
                               f"messages[{i}]")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                raise RequestError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                   "are supported", f"messages[{i}].content")
            c = "".join(x["text"] for x in c)
        if not isinstance(c, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise RequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    params, stream, usage, model = _common(body, limits, limits.default_max_tokens, key)
    return Completion([], params, stream, bool(usage and usage[0]), model, chat=True, messages=out,
                      continuous_usage=bool(usage and usage[1]))
