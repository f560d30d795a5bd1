"""The native experts op as a ``torch.library`` custom op: ``torch.ops.hi_na_moe.experts``.

Why: a plain call into the nanobind extension is opaque to ``torch.compile`` (Dynamo cannot
trace it and breaks the graph) and has no fake (meta) implementation. As a custom op it is one
node in a traced graph, runs under ``torch.inference_mode()``, and has a shape function.

The packed weights are a C++ object (``_native.PackedExperts``), not a tensor, so they cannot be
an op argument. They live in a process-wide registry and the op takes an integer handle:

    handle = register(packed)            # strong reference, until release(handle)
    handle = register(packed, owner=obj) # ... or until `obj` is garbage-collected
    y = experts_op(handle, x, topk_idx, topk_w, act="silu", ..., num_threads=0)
    release(handle)

Handles are never reused (a monotonic counter), so a stale handle raises instead of silently
running another block's experts.

Schema (the float arguments are C++ doubles in the schema; ``math.inf`` passes through
unchanged and is narrowed to fp32 ``inf`` by the binding, so limits need no special encoding):

    hi_na_moe::experts(Tensor x, Tensor topk_idx, Tensor topk_w, SymInt handle, str act,
        float alpha, float gate_limit, float up_limit, float post_act_limit, float up_offset,
        bool weight_on_input, SymInt num_threads) -> Tensor

(custom_op infers Python ``int`` as ``SymInt``, a superset of ``int``: if Dynamo makes the
handle dynamic, e.g. one compiled MoE forward shared by every layer, it still traces.)

Semantics are those of ``PackedExperts.forward`` (csrc/include/hina_moe/moe.h) with
``path="auto"`` and the default prefill threshold; ``out`` ([T, H], x's dtype) is allocated
inside. Inputs, as any torch op takes them: x [T, H] in the experts' dtype, any strides;
topk_idx [T, K] of an integer dtype (int32/int64 as they are, others widened; negative = skip
the slot, >= E = ValueError naming topk_idx); topk_w [T, K] of a floating dtype (float32,
bfloat16 and float16 are read as they are, exactly; others are converted to float32). Non-contiguous inputs are copied (no-ops when contiguous). Anything else raises
before the kernel runs: TypeError for a float/bool topk_idx or a non-float topk_w, ValueError
(from the binding) naming the argument for a wrong x dtype or a wrong shape. T = 0 gives an
empty output. NaN/Inf propagate as in the reference (per token; never to other tokens).

Cost: the dispatcher round trip of a Python custom op is ~10-12 us per call under
inference_mode and ~17-21 us under no_grad on the development machine (2-core Xeon, noisy;
a kernel-free stub; see
``python tests/test_torch_ops.py``), a lot at decode. So ``experts_op`` calls the kernel
directly (bit-identical) unless something can observe the op: torch.compile / export tracing,
a tensor subclass or an active dispatch / function mode (make_fx, FakeTensorMode, ...), or
grad-requiring inputs. Compiled graphs always call the op.

Autograd: the kernels have no backward. The op's backward raises a RuntimeError naming
hi_na_moe and pointing at the reference path (the Python caller routes grad-requiring calls to
the reference path already; this is a second line of defence). Forward with grad-requiring
inputs is allowed, so an eval-mode forward under grad mode still works.

This module does not import the native extension: it only ever receives PackedExperts objects.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from typing import Any

import torch

__all__ = ["register", "release", "get", "last_kernel", "registered_handles", "experts", "experts_op", "call", "call_bound"]

_LOCK = threading.Lock()
_COUNTER = itertools.count(1)
_PACKED: dict[int, Any] = {}  # handle -> PackedExperts
_LAST_KERNEL: dict[int, str] = {}  # handle -> name of the kernel its last call ran
_QDOT: dict[int, str] = {}  # handle -> qdot mode its forwards run with
_BOUND: dict[int, tuple] = {}  # handle -> what _bind returns for its last parameters
# routing-weight dtypes the kernels read as they are, and their code for BoundForward
_W_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def register(packed: Any, owner: object | None = None, qdot: str = "auto") -> int:
    """Register packed experts; returns the handle the op takes. ``qdot`` is passed to every
    forward on the handle (``PackedExperts.forward(qdot=...)``: integer-dot or expansion kernels
    for int8/int4 weights).

    The registry holds a strong reference until ``release(handle)``. With ``owner`` (any
    weak-referenceable object, e.g. the ``NativeExperts`` that owns ``packed``), the handle is
    also released when ``owner`` is garbage-collected."""
    if not callable(getattr(packed, "forward", None)):
        raise TypeError(f"hi_na_moe: register() expects a _native.PackedExperts, got {type(packed).__name__}")
    with _LOCK:
        handle = next(_COUNTER)
        _PACKED[handle] = packed
        _QDOT[handle] = qdot
    if owner is not None:
        weakref.finalize(owner, release, handle)
    return handle


def release(handle: int) -> bool:
    """Drop the registry's reference. Returns whether the handle was registered (idempotent)."""
    with _LOCK:
        _LAST_KERNEL.pop(handle, None)
        _QDOT.pop(handle, None)
        _BOUND.pop(handle, None)
        return _PACKED.pop(handle, None) is not None


def get(handle: int) -> Any:
    """The PackedExperts registered under ``handle``; ValueError if none (never registered or
    released)."""
    try:
        return _PACKED[handle]
    except KeyError:
        raise ValueError(
            f"hi_na_moe: no packed experts registered under handle {handle} "
            "(released, or never registered with hi_na_moe.core.torch_ops.register)"
        ) from None


def last_kernel(handle: int) -> str | None:
    """Name of the native kernel the last eager (or compiled-graph) call on ``handle`` ran."""
    return _LAST_KERNEL.get(handle)


def registered_handles() -> list[int]:
    return list(_PACKED)


def _normalise(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor):
    """What the binding takes (C-contiguous, int32/int64 indices, float32/bfloat16/float16
    weights), from what a torch op accepts; a TypeError naming the argument for what cannot be
    meant as one."""
    if topk_idx.dtype not in (torch.int32, torch.int64):
        if topk_idx.is_floating_point() or topk_idx.is_complex() or topk_idx.dtype is torch.bool:
            raise TypeError(
                f"hi_na_moe: topk_idx must hold integer expert indices (int32 or int64), got {topk_idx.dtype}; "
                "pass the router's top-k indices, e.g. torch.topk(...).indices"
            )
        topk_idx = topk_idx.long()
    if topk_w.dtype not in _W_DTYPES:  # (a no-op .to() still costs ~1.8 us)
        if not topk_w.is_floating_point():
            raise TypeError(
                f"hi_na_moe: topk_w must hold floating-point routing weights (float32, bfloat16 or float16; other "
                f"float dtypes are converted), got {topk_w.dtype}"
            )
        topk_w = topk_w.float()
    # a lazy negation view (torch._neg_view) would reach the kernels as its negated memory
    # (compiled graphs go through the dispatcher, which resolves it; Dynamo cannot trace is_neg)
    if not torch.compiler.is_compiling():
        if x.is_neg():
            x = x.resolve_neg()
        if topk_w.is_neg():
            topk_w = topk_w.resolve_neg()
    return x.contiguous(), topk_idx.contiguous(), topk_w.contiguous()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _bind(handle: int, packed: Any, params: tuple) -> tuple:
    """(params, BoundForward, experts' torch dtype, H) for ``handle``, made on its first call
    with these parameters (and again if they change)."""
    if not hasattr(packed, "bind"):  # a stand-in registered by a test: forward() only
        return (params, None, None, None)
    entry = (params, packed.bind(*params, qdot=_QDOT.get(handle, "auto")), _DTYPES[packed.dtype], packed.H)
    with _LOCK:
        if handle in _PACKED:  # not released meanwhile
            _BOUND[handle] = entry
    return entry


def call_bound(handle: int, bound: tuple, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
               num_threads: int) -> torch.Tensor | None:
    """Run the experts' BoundForward (`bound`, a _bind entry) with raw addresses when the inputs
    are what the kernels read as they are: contiguous CPU tensors, x [T, H] in the experts'
    dtype, int32/int64 topk_idx [T, K], fp32/bf16/fp16 topk_w [T, K]. Returns the output, or
    None with nothing run for anything else (the caller then takes the checked path)."""
    idx_dtype = topk_idx.dtype
    w_code = _W_DTYPES.get(topk_w.dtype)
    if not (bound[1] is not None and x.dtype is bound[2] and x.dim() == 2 and x.shape[1] == bound[3] and x.is_cpu
            and topk_idx.is_cpu and topk_w.is_cpu and topk_idx.dim() == 2 and topk_idx.shape[0] == x.shape[0]
            and topk_w.shape == topk_idx.shape and w_code is not None
            and (idx_dtype is torch.int64 or idx_dtype is torch.int32)
            and x.is_contiguous() and topk_idx.is_contiguous() and topk_w.is_contiguous()):
        return None
    # empty_like: ~1.5 us here vs ~4-6 us for torch.empty(x.shape, dtype=x.dtype)
    out = torch.empty_like(x)
    _LAST_KERNEL[handle] = bound[1](
        x.data_ptr(), x.shape[0], topk_idx.data_ptr(), 64 if idx_dtype is torch.int64 else 32,
        topk_idx.shape[1], topk_w.data_ptr(), w_code, out.data_ptr(), num_threads)
    return out


def _run(x, topk_idx, topk_w, handle, act, alpha, gate_limit, up_limit, post_act_limit, up_offset,
         weight_on_input, num_threads) -> torch.Tensor:
    """The op's CPU kernel: look the experts up, allocate out, run the native forward.

    Inputs come from _normalise (contiguous; int32/int64 indices; float32/bf16/f16 weights). When their
    shapes, dtypes and device are what the experts take, the call goes through the experts'
    BoundForward with raw addresses (~10 us less per call than forward(), whose DLPack import
    of four arrays dominates a T=1 call); anything else goes to forward(), which raises the
    error naming the argument."""
    packed = _PACKED.get(handle)
    if packed is None:
        get(handle)  # raises the ValueError
    params = (act, alpha, gate_limit, up_limit, post_act_limit, up_offset, weight_on_input)
    bound = _BOUND.get(handle)
    if bound is None or bound[0] != params:
        bound = _bind(handle, packed, params)
    out = call_bound(handle, bound, x, topk_idx, topk_w, num_threads)
    if out is not None:
        return out
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _LAST_KERNEL[handle] = packed.forward(
        x, topk_idx, topk_w, out, act, alpha, gate_limit, up_limit, post_act_limit, up_offset,
        weight_on_input, num_threads, qdot=_QDOT.get(handle, "auto"),
    )
    return out


@torch.library.custom_op("hi_na_moe::experts", mutates_args=(), device_types="cpu")
def experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    handle: int,
    act: str,
    alpha: float,
    gate_limit: float,
    up_limit: float,
    post_act_limit: float,
    up_offset: float,
    weight_on_input: bool,
    num_threads: int,
) -> torch.Tensor:
    """out[T, H] = sum_k topk_w[t, k] * expert_{topk_idx[t, k]}(x[t]) with the packed experts
    registered under ``handle`` (see the module docstring)."""
    x, topk_idx, topk_w = _normalise(x, topk_idx, topk_w)
    return _run(x, topk_idx, topk_w, handle, act, alpha, gate_limit, up_limit, post_act_limit,
                up_offset, weight_on_input, num_threads)


@experts.register_fake
def _experts_fake(x, topk_idx, topk_w, handle, act, alpha, gate_limit, up_limit, post_act_limit,
                  up_offset, weight_on_input, num_threads):
    _normalise(x, topk_idx, topk_w)  # the same TypeErrors while tracing
    return x.new_empty(x.shape)


_NO_BACKWARD = (
    "hi_na_moe::experts (the native CPU MoE kernels) is inference-only and has no backward. "
    "Gradients come from hi_na_moe's pure-PyTorch reference path, which a patched MoE block uses "
    "when it is in training mode (model.train()) with grad enabled, and always with "
    "HinaConfig(backend='reference'). Reaching this backward means a grad-requiring call "
    "bypassed that routing (e.g. the op called directly)."
)


def _setup_context(ctx, inputs, output):
    pass


def _backward(ctx, grad):
    raise RuntimeError(_NO_BACKWARD)


experts.register_autograd(_backward, setup_context=_setup_context)


_len_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode_on = torch._C._is_torch_function_mode_enabled


def _can_bypass_dispatcher(x: torch.Tensor, topk_w: torch.Tensor) -> bool:
    """Plain eager call: nothing observes the op (no Dynamo/export tracing, no tensor subclass,
    no dispatch/function mode such as make_fx, FakeTensorMode or FlopCounterMode) and no
    gradient is wanted, so calling the kernel directly is indistinguishable from the op."""
    return (
        type(x) is torch.Tensor
        and type(topk_w) is torch.Tensor
        and not _len_dispatch_modes()
        and not _function_mode_on()
        and not (torch.is_grad_enabled() and (x.requires_grad or topk_w.requires_grad))
    )


def experts_op(
    handle: int,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    *,
    act: str = "silu",
    alpha: float = 1.702,
    gate_limit: float = math.inf,
    up_limit: float = math.inf,
    post_act_limit: float = math.inf,
    up_offset: float = 0.0,
    weight_on_input: bool = False,
    num_threads: int = 0,
    dispatch: bool | None = None,
) -> torch.Tensor:
    """Run the experts registered under ``handle`` on ``x`` [T, H] (already in the experts'
    dtype; ValueError from the binding otherwise) with the routing ``topk_idx``/``topk_w``
    [T, K]. Normalises as the op does (see the module docstring): integer indices int32/int64
    (other integer dtypes become int64; float or bool indices are a TypeError), floating
    weights float32, all three contiguous (no-ops when they already are).

    The keyword arguments are ``GateSpec``'s fields plus ``weight_on_input`` and
    ``num_threads``, so ``experts_op(h, x, idx, w, num_threads=n, **native.kwargs)`` works.

    ``dispatch``: None (default) goes through ``torch.ops.hi_na_moe.experts`` only when
    something can observe it (torch.compile / export tracing, a tensor subclass or dispatch /
    function mode, or grad-requiring inputs, so the op's no-backward error applies) and
    otherwise calls the same kernel directly, saving the dispatcher's ~10-20 us per call (see
    tests/test_torch_ops.py); the result is bit-identical either way. True / False force it (False also skips the
    no-backward guard: the output then simply carries no autograd history).
    Under torch.compile(fullgraph=True) this traces to a single op node."""
    params = (act, float(alpha), float(gate_limit), float(up_limit), float(post_act_limit), float(up_offset),
              bool(weight_on_input))
    return call(handle, x, topk_idx, topk_w, params, int(num_threads), dispatch)


def call(handle: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, params: tuple,
         num_threads: int, dispatch: bool | None = None) -> torch.Tensor:
    """``experts_op`` with its parameters as one tuple, ``(act, alpha, gate_limit, up_limit,
    post_act_limit, up_offset, weight_on_input)`` typed as the schema wants them (str, five
    floats, bool): what a caller that runs the same experts every step builds once."""
    x, topk_idx, topk_w = _normalise(x, topk_idx, topk_w)
    if torch.compiler.is_compiling():
        return torch.ops.hi_na_moe.experts.default(x, topk_idx, topk_w, handle, *params, num_threads)
    if dispatch is None:
        dispatch = not _can_bypass_dispatcher(x, topk_w)
    if dispatch:
        return torch.ops.hi_na_moe.experts.default(x, topk_idx, topk_w, handle, *params, num_threads)
    return _run(x, topk_idx, topk_w, handle, *params, num_threads)
