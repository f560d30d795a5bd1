"""scope="all": the model's dense linear layers (attention projections, shared experts, dense
MLPs, lm_head) on the experts' kernels, in the configured weight format.

Each `nn.Linear` outside the MoE experts is packed as an up-only block
(`PackedExperts.pack_linear`: the same panels, tiers, formats and threads as the experts; one
expert, identity activation, no down pass) and its forward is replaced by a call to it. Decode
(T = 1) is a weight stream, as for the experts: PyTorch's bf16 GEMV reaches about half the
bandwidth of our decode kernels on this machine (benchmarks/RESULTS.md, session 4 baselines).

Which layers: every `nn.Linear` (exactly that class) that is not inside an accelerated MoE
block's experts and not matched by `dense_exclude`, with at least 64 Ki weights (smaller ones,
such as a shared expert's 1-output gate, have no bytes worth a kernel call). Layers matched by
`dense_lossless` (default "lm_head") stay in the model's own dtype when `weights` is int8/int4.
Patterns are fnmatch patterns on the module's name in the model ("lm_head", "*.self_attn.*").

Memory: a lossless layer's own weight is released (a zero-byte placeholder) and rebuilt
bit-exactly from the packed copy by disable and by state_dict(); a quantised layer keeps its
own weight (no exact backup of dense layers in the store yet), so int8/int4 with scope="all"
costs the dense weights once more.
"""

from __future__ import annotations

import fnmatch
import threading
import types
from dataclasses import dataclass

import torch
from torch import nn

MIN_WEIGHTS = 1 << 16


@dataclass
class DenseReport:
    name: str
    out_features: int
    in_features: int
    weights: str  # the format it runs in
    kernel: str  # the decode kernel's name
    packed_bytes: int  # what a decode step reads for this layer
    released_bytes: int


def _matches(name: str, patterns: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p.strip()) for p in patterns.split(",") if p.strip())


def _format_of(name: str, cfg) -> str:
    """The weight format the dense layer `name` runs in under `cfg`."""
    return "lossless" if cfg.weights == "lossless" or _matches(name, cfg.dense_lossless) else cfg.weights


def find_linears(model: nn.Module, inside: list[nn.Module], exclude: str,
                 devices: tuple[str, ...] = ("cpu",)) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the linears scope="all" runs, in module order."""
    skip = {id(m) for blk in inside for m in blk.modules()}
    found = []
    for name, m in model.named_modules():
        if (type(m) is nn.Linear and id(m) not in skip and not _matches(name, exclude)
                and m.weight.numel() >= MIN_WEIGHTS and m.weight.device.type in devices
                and m.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)):
            found.append((name, m))
    return found


class NativeLinear:
    """One nn.Linear on the native kernels: pack, the replacement forward, release, restore."""

    def __init__(self, name: str, module: nn.Linear, weights: str, group_size: int, isa: str, threads: int,
                 qdot: str):
        from .hardware import native_module

        self.name, self.module = name, module
        self.weights, self.threads = weights, threads
        native, _ = native_module()
        w = module.weight.detach()
        b = module.bias.detach() if module.bias is not None else None
        self.packed = native.PackedExperts.pack_linear(
            w.contiguous(), None if b is None else b.contiguous(), isa=isa, num_threads=threads,
            weights=weights, group_size=group_size)
        self.bound = self.packed.bind(qdot=qdot)
        self.dtype = w.dtype
        self.in_features, self.out_features = module.in_features, module.out_features
        self.nbytes = self.packed.nbytes
        self.kernel = self.packed.kernel_name("decode", qdot)
        self._released = False
        self._hook = None
        self._lock = threading.Lock()

    # -- the forward --------------------------------------------------------------------------
    def forward(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        # the common inference call in few operations: with the caches a decode step leaves,
        # every torch op here costs ~30 us (benchmarks/bench_call_overhead.py), and a step
        # calls every dense layer once
        if (type(x) is torch.Tensor and x.dtype is self.dtype and x.is_contiguous() and x.is_cpu
                and not x.requires_grad and not x.is_neg() and x.dim() >= 1 and x.shape[-1] == self.in_features
                and not (module.training and torch.is_grad_enabled())):
            out = torch.empty(x.shape[:-1] + (self.out_features,), dtype=self.dtype)
            # every thread, also for small layers: OLMoE's int4 attention projections (2.2 MB) on
            # one thread (the experts' ops.SMALL_CALL_BYTES rule) made a whole decode step 10-25 %
            # slower (benchmarks/RESULTS.md, session 5)
            self.bound.linear(x.data_ptr(), x.numel() // self.in_features, out.data_ptr(),
                              self.threads or torch.get_num_threads())
            return out
        return self._forward_general(module, x)

    def _forward_general(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """Everything forward()'s first branch does not take: training with autograd, other
        dtypes, strided or lazily negated inputs, wrong shapes and devices (errors)."""
        if module.training and torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad):
            if self._released:
                raise RuntimeError(
                    f"hi_na_moe: gradients are requested through {self.name!r}, a linear layer packed for the "
                    "native kernels (scope='all') with its weight released; disable_for_model(model) first, or "
                    "enable with scope='experts' to train")
            return torch.nn.functional.linear(x, module.weight, module.bias)
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"hi_na_moe: {self.name}: input has shape {tuple(x.shape)}; the layer takes "
                             f"[..., {self.in_features}]")
        if not x.is_cpu:
            raise ValueError(f"hi_na_moe: {self.name}: input is on {x.device}; the layer runs on the CPU")
        x2 = x.detach().to(self.dtype).resolve_neg().contiguous()
        out = torch.empty(x.shape[:-1] + (self.out_features,), dtype=self.dtype)
        self.bound.linear(x2.data_ptr(), x2.numel() // self.in_features, out.data_ptr(),
                          self.threads or torch.get_num_threads())
        return out if out.dtype is x.dtype else out.to(x.dtype)

    # -- memory -------------------------------------------------------------------------------
    def release(self) -> int:
        """Lossless layers: free the module's own weight (rebuilt exactly from the packed copy).
        Returns the bytes freed (0 for quantised layers, which keep theirs)."""
        if self.weights != "lossless":
            return 0
        p = self.module.weight
        freed = p.numel() * p.element_size()
        self._shape, self._stride = p.shape, p.stride()
        p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)
        self._released = True

        def fill_state_dict(mod, state_dict, prefix, local_metadata):
            key = prefix + "weight"
            if key in state_dict:
                state_dict[key] = self._unpacked()

        self._hook = self.module.register_state_dict_post_hook(fill_state_dict)
        return freed

    def _unpacked(self) -> torch.Tensor:
        _, w, _, _, _, _ = self.packed.unpack()
        return torch.empty_strided(self._shape, self._stride, dtype=self.dtype).copy_(torch.from_dlpack(w))

    def restore(self) -> None:
        with self._lock:
            if self._released:
                self.module.weight.data = self._unpacked()
                self._released = False
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self.packed = self.bound = None


def plan(model: nn.Module, cfg, inside: list[nn.Module]) -> list[DenseReport]:
    """What patch() would do, without packing (inspect_model): the layers, their format, the
    decode kernel and the packed bytes (from the planner: works on the meta device too)."""
    from .hardware import native_module
    from .ops import _isa_name, _kernel_names

    native, _ = native_module()
    isa = _isa_name(cfg)
    reports = []
    for name, m in find_linears(model, inside, cfg.dense_exclude, devices=("cpu", "meta")):
        fmt = _format_of(name, cfg)
        dt = str(m.weight.dtype).replace("torch.", "")
        header = native.PackedExperts.plan(dt, 1, m.in_features, m.out_features, False, up_bias=m.bias is not None,
                                           isa=isa, weights=fmt, group_size=cfg.group_size, up_only=True)
        reports.append(DenseReport(name, m.out_features, m.in_features, fmt,
                                   _kernel_names(isa, m.weight.dtype, fmt, cfg.qdot)["decode"],
                                   native.header_info(header)["nbytes"], 0))
    return reports


def patch(model: nn.Module, cfg, gate, inside: list[nn.Module], gated) -> tuple[list, list[DenseReport]]:
    """Pack and patch the linears of scope="all"; returns ([(module, runner, old forward)], reports).
    On an error, what was patched is undone before it propagates."""
    from tqdm.auto import tqdm

    from .ops import _isa_name

    isa = _isa_name(cfg)
    todo = find_linears(model, inside, cfg.dense_exclude)
    # a weight shared with another module (tied lm_head / embeddings) is never released
    seen: dict[int, int] = {}
    for _, prm in model.named_parameters(remove_duplicate=False):
        seen[id(prm)] = seen.get(id(prm), 0) + 1
    done, reports = [], []
    try:
        for name, m in tqdm(todo, desc=f"hi_na_moe: packing dense layers ({cfg.weights})", unit="layer",
                            leave=False, disable=None if len(todo) > 8 else True):
            fmt = _format_of(name, cfg)
            runner = NativeLinear(name, m, fmt, cfg.group_size, isa, cfg.threads, cfg.qdot)
            old = m.__dict__.get("forward", _MISSING)
            m.forward = types.MethodType(gated(gate, runner.forward), m)
            done.append((m, runner, old))
            freed = 0 if cfg.keep_weights or seen.get(id(m.weight), 0) > 1 else runner.release()
            reports.append(DenseReport(name, m.out_features, m.in_features, fmt, runner.kernel, runner.nbytes, freed))
    except BaseException:
        unpatch(done)
        raise
    return done, reports


_MISSING = object()


def unpatch(done: list) -> None:
    for m, runner, old in reversed(done):
        runner.restore()
        if old is _MISSING:
            m.__dict__.pop("forward", None)
        else:
            m.forward = old
