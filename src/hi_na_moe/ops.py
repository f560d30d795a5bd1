"""The experts op: choose, per MoE block, what computes it (native kernel or the reference)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import reference
from .hardware import native_kernels_available
from .config import HinaConfig
from .spec import ExpertsSpec

Runner = Callable[[ExpertsSpec, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Choice:
    runner: Runner
    kernel: str  # what runs: "reference" or a native kernel family name
    note: str | None = None  # why not native, when it is not


def kernel_plan(config: HinaConfig) -> dict[str, str]:
    """The kernel each path uses under `config`, for the capabilities report."""
    if config.backend == "reference" or not native_kernels_available():
        return {"decode": "reference", "prefill": "reference"}
    from .hardware import native_module

    native, _ = native_module()
    return dict(native.kernel_table())  # pragma: no cover - filled in with the native kernels


def choose(spec: ExpertsSpec, config: HinaConfig) -> Choice:
    """What runs `spec` under `config`. Raises ValueError when config.backend == "native" and no
    native kernel can run it."""
    if config.backend == "reference":
        return Choice(reference.experts_forward, "reference", "backend='reference' requested")
    why_not = native_unsupported_reason(spec)
    if why_not is None:  # pragma: no cover - the native kernels land with their own issue
        raise AssertionError("native kernels are not wired yet")
    if config.backend == "native":
        raise ValueError(f"backend='native' but this block cannot run natively: {why_not}")
    return Choice(reference.experts_forward, "reference", why_not)


def native_unsupported_reason(spec: ExpertsSpec) -> str | None:
    """None if a native kernel can run this block, else why not."""
    if not native_kernels_available():
        return "native expert kernels are not in this build yet (reference path)"
    return "native expert kernels are not wired yet (reference path)"
