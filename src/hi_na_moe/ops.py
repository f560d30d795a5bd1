"""The experts op: choose, per MoE block, what computes it (a native kernel or the reference),
and the native runner itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import reference
from .config import HinaConfig
from .hardware import native_kernels_available, native_module
from .spec import ExpertsSpec

Runner = Callable[[ExpertsSpec, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Choice:
    runner: Runner
    kernel: str  # what runs: "reference", or the native kernels' names ("moe_decode_bf16_avx512|...")
    note: str | None = None  # why not native, when it is not


def _isa_name(config: HinaConfig) -> str:
    """The tier the kernels run at: the config's, or for "auto" the best this machine has."""
    native, _ = native_module()
    return native.resolve_isa(config.isa)


def kernel_plan(config: HinaConfig) -> dict[str, str]:
    """The kernel each path uses for bf16 experts under `config`, for the capabilities report."""
    if config.backend == "reference" or not native_kernels_available():
        return {"decode": "reference", "prefill": "reference"}
    native, _ = native_module()
    # a one-expert probe pack answers for the configured tier exactly as a real block would
    w = torch.zeros(1, 16, 16, dtype=torch.bfloat16)
    probe = native.PackedExperts(w, w, w, isa=_isa_name(config))
    return {path: probe.kernel_name(path) for path in ("decode", "prefill")}


def native_unsupported_reason(spec: ExpertsSpec) -> str | None:
    """None if a native kernel can run this block, else why not (shown in the report)."""
    if not native_kernels_available():
        _, why = native_module()
        return f"native kernels not available in this build ({why or 'no PackedExperts'}): reference path"
    if spec.weight_dtype not in NATIVE_DTYPES:
        return f"expert weights are {spec.weight_dtype}; native kernels take float32/bfloat16/float16"
    if spec.gate_spec is None:
        return spec.gate_unrecognised or "gate not recognised"
    if spec.post_expert_norm is not None:
        return "post-expert norm runs per expert output; not fused in the native kernels yet"
    if any(t.device.type != "cpu" for t in spec.weight_tensors()):
        return "expert weights are not on the CPU"
    if any(t.is_meta for t in spec.weight_tensors()):
        return "expert weights are on the meta device"
    return None


class NativeExperts:
    """The experts of one block, packed once for the native kernels. Packing copies the weights
    into the kernels' layout (the model's own tensors stay as they are)."""

    def __init__(self, spec: ExpertsSpec, isa: str, threads: int):
        native, _ = native_module()
        gate, up, down = spec.canonical()
        gb, ub, db = spec.canonical_biases()
        c = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
        self.packed = native.PackedExperts(c(gate), c(up), c(down), c(gb), c(ub), c(db), isa=isa)
        self.threads = threads
        self.spec = spec
        g = spec.gate_spec
        self.kwargs = dict(act=g.act, alpha=g.alpha, gate_limit=g.gate_limit, up_limit=g.up_limit,
                           post_act_limit=g.post_act_limit, up_offset=g.up_offset,
                           weight_on_input=spec.weight_on_input)
        self.last_kernel: str | None = None

    def __call__(self, spec: ExpertsSpec, hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        T, H = hidden.shape
        dtype = spec.weight_dtype
        x = hidden.detach().to(dtype).contiguous()
        idx = idx.detach()
        if idx.dtype not in (torch.int32, torch.int64):
            idx = idx.long()
        idx = idx.contiguous()
        wf = w.detach().to(torch.float32).contiguous()
        identity = None
        if spec.n_identity:
            is_id = idx >= spec.num_experts
            if bool(is_id.any()):
                identity = (wf * is_id).sum(-1, keepdim=True) * hidden.detach().float()
                idx = torch.where(is_id, torch.full_like(idx, -1), idx)
        out = torch.empty(T, H, dtype=dtype)
        threads = self.threads or torch.get_num_threads()
        self.last_kernel = self.packed.forward(x, idx, wf, out, num_threads=threads, **self.kwargs)
        if identity is not None:
            out = (out.float() + identity).to(dtype)
        return out if out.dtype == hidden.dtype else out.to(hidden.dtype)


def choose(spec: ExpertsSpec, config: HinaConfig) -> Choice:
    """What runs `spec` under `config`. Raises ValueError when config.backend == "native" and no
    native kernel can run it."""
    if config.backend == "reference":
        return Choice(reference.experts_forward, "reference", "backend='reference' requested")
    why_not = native_unsupported_reason(spec)
    if why_not is None:
        runner = NativeExperts(spec, _isa_name(config), config.threads)
        kernel = f"{runner.packed.kernel_name('decode')}|{runner.packed.kernel_name('prefill')}"
        return Choice(runner, kernel)
    if config.backend == "native":
        raise ValueError(f"backend='native' but this block cannot run natively: {why_not}")
    return Choice(reference.experts_forward, "reference", why_not)
