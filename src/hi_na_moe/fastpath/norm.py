"""scope="all": RMSNorm modules on the native kernel for decode-sized inputs."""

from __future__ import annotations

import torch
from torch import nn

from ..core.native import native_module
from .common import _DTYPE_CODES, DECODE_MAX_ROWS, _matches

# a probe result may differ from the module's own by this much (relative): the sum of squares
# is added in another order, so an rsqrt can differ in its last bit and round h differently
_NORM_RTOL = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _norm_eps(m: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(m, attr, None)
        if isinstance(v, float) and v >= 0:
            return v
    return None


def find_norms(model: nn.Module, exclude: str, devices: tuple[str, ...] = ("cpu",)) -> list[tuple[str, nn.Module]]:
    """(name, module) of the RMSNorm candidates: a class named *RMSNorm with a float `eps` or
    `variance_epsilon`, one 1-D `weight` parameter (on `devices`, float dtype) and nothing else.
    What such a module computes is still checked (NativeNorm.matches) before it is patched."""
    found = []
    for name, m in model.named_modules():
        if not type(m).__name__.endswith("RMSNorm") or _matches(name, exclude) or _norm_eps(m) is None:
            continue
        params = dict(m.named_parameters(recurse=True))
        if set(params) != {"weight"} or any(True for _ in m.buffers()):
            continue
        w = params["weight"]
        if w.dim() == 1 and w.device.type in devices and w.dtype in _DTYPE_CODES and w.numel() > 0:
            found.append((name, m))
    return found


class NativeNorm:
    """One RMSNorm module on the native kernel (hina_moe rms_norm) for decode-sized inputs."""

    weights = "lossless"

    def __init__(self, name: str, module: nn.Module, original_forward):
        self.name, self.module = name, module
        self.native = native_module()[0]
        self.eps = _norm_eps(module)
        self.n = module.weight.numel()
        self.original = original_forward  # the module's own forward (bound)

    def matches(self) -> bool:
        """Whether the module computes what the kernel does: both run on a probe of rows at
        scales from 1e-3 to 1e3, with the module's own weight; every value within the dtype's
        rounding of the module's own output."""
        w = self.module.weight.detach()
        gen = torch.Generator().manual_seed(7)
        scale = torch.logspace(-3, 3, 7).unsqueeze(1)
        x = (torch.randn(7, self.n, generator=gen) * scale).to(w.dtype)
        with torch.no_grad():
            try:
                want = self.original(x)
            except Exception:
                return False
            if not isinstance(want, torch.Tensor) or want.shape != x.shape or want.dtype != x.dtype:
                return False
            got = torch.empty_like(x)
            self.native.rms_norm(x, w.contiguous(), self.eps, got)
        diff = (got.float() - want.float()).abs()
        return bool((diff <= _NORM_RTOL[w.dtype] * want.float().abs() + 1e-30).all())

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if (type(x) is torch.Tensor and x.dtype is w.dtype and x.is_cpu
                and x.dim() >= 1 and x.shape[-1] == self.n and x.numel() <= DECODE_MAX_ROWS * self.n
                and not x.requires_grad and not x.is_neg() and w.numel() == self.n and w.is_contiguous() and w.is_cpu
                and not (module.training and torch.is_grad_enabled() and w.requires_grad)):
            # rows of another tensor (latent attention's latent, a split of its projection's output)
            # are copied, so that every decode-sized input gets the kernel's bits
            x = x if x.is_contiguous() else x.contiguous()
            out = torch.empty(x.shape, dtype=x.dtype)
            self.native.rms_norm_raw(x.data_ptr(), x.numel() // self.n, self.n, w.data_ptr(), self.eps,
                                     out.data_ptr(), _DTYPE_CODES[x.dtype])
            return out
        return self.original(x)

    def restore(self) -> None:  # the module's weight was never touched
        pass
