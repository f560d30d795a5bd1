"""Which runner a patched module runs: read off the gated forward enable put on it
(integrate.patching._gated sets its `inner`)."""

from __future__ import annotations

import functools

from torch import nn


def _patched_inner(module: nn.Module):
    """What the gated forward patched onto `module` runs (_gated's `inner`), or None."""
    return getattr(getattr(module.__dict__.get("forward"), "__func__", None), "inner", None)


def patched_runner(module: nn.Module):
    """The runner behind a small module patched under scope="all" (a NativeNorm, NativeRouter or
    NativeAttention; a single dense layer's NativeLinear), or None if it is not patched so."""
    inner = _patched_inner(module)
    if isinstance(inner, functools.partial):  # a member of a dense group (NativeLinear.forward_of)
        inner = inner.func
    return getattr(inner, "__self__", None)


def decode_call_counts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Per attention module patched under scope="all" (hi_na_moe.fastpath.attention, hi_na_moe.fastpath.mla): (decode
    calls its native path took, decode calls it left to the module's own forward) since enable.
    Calls a decoder layer's or stack's native path makes past the module are in neither."""
    out = {}
    for name, m in model.named_modules():
        calls = getattr(patched_runner(m), "calls", None)
        if calls is not None and hasattr(calls, "declined"):
            out[name] = (calls.native, calls.declined)
    return out


def patched_experts(module: nn.Module):
    """The NativeExperts behind an experts module patched with its short path (_fast_first), or None."""
    return getattr(_patched_inner(module), "runner", None)
