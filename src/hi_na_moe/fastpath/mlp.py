"""scope="all": a gated MLP's decode step in one native call (a shared expert, a dense MLP).

transformers writes the MLP of Llama-family layers, Qwen2-MoE's shared expert among them, as
down_proj(act_fn(gate_proj(x)) * up_proj(x)). Under scope="all" the three projections already run
on the dense kernels (gate_proj and up_proj as one group, hi_na_moe.fastpath.linear); what is left is two
elementwise ops in PyTorch and four module calls, each costing several times its hot time with
the caches a decode step's weight stream leaves behind. Here the whole forward is one native call
(gated_mlp_decode in moe.h): the group's kernel, silu and the product, then down_proj's kernel.

Which modules: children exactly gate_proj, up_proj, down_proj and act_fn; gate_proj and up_proj
patched as one dense group (in that order), down_proj alone, in one dtype. What it computes is
checked before it is patched:
- act_fn must be SiLU: on 8192 values (a sweep of [-24, 24] and random ones) act_fn(g) and the
  kernel's silu agree within one rounding of the dtype;
- the module's own forward and the native call, on rows at scales from 1e-2 to 1e2, agree
  within a few roundings of each row's largest value.
The kernel's silu is not PyTorch's to the bit: PyTorch's vectorised exp differs from ours (and
from its own scalar loop) in the last float32 bits, so a value can round to the neighbouring
bfloat16. Once patched, both the module's forward and the decoder layer's fused step
(hi_na_moe.fastpath.layers) run this kernel, so those two agree bit for bit.

Decode-sized inputs only (at most DECODE_MAX_ROWS rows); anything else, training, or anything that
would observe the skipped child calls (a hook on them, a replaced forward or child, a global
hook, a mode, compile tracing; watch.Watch) runs the module's own forward.
"""

from __future__ import annotations

import functools
import platform

import torch
from torch import nn

from ..core.native import native_module
from .common import _DTYPE_CODES, DECODE_MAX_ROWS, _matches
from .linear import patched_member
from .watch import Watch, observing

_CHILDREN = frozenset(("gate_proj", "up_proj", "down_proj", "act_fn"))
# the act_fn probe: the kernel's silu within this much (relative) of the module's activation
_ACT_RTOL = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}
# the forward probe: within this much of each row's largest absolute value
_ROW_TOL = {torch.float32: 2.0**-17, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}
# bytes of one vector of PyTorch's CPU build (torch.backends.cpu.get_cpu_capability()); a build
# not named here counts as 16 bytes, the narrowest any has, so its limit below is never too high
_TORCH_VECTOR_BYTES = {"AVX512": 64, "AVX2": 32}


@functools.cache
def torch_scalar_values(dtype: torch.dtype) -> int | None:
    """The most values of `dtype` on which PyTorch's elementwise CPU kernels (torch.sigmoid,
    F.silu) still run their scalar loop, 1 / (1 + std::exp(-x)) per value, or None when they do
    for any number. Its loop takes two vectors of the running build at a time (Vectorized<dtype>)
    and leaves the rest to the scalar loop; the vector exp differs from std::exp in the last
    float32 bits. So: fewer than 32 float32 values on AVX-512, 16 on AVX2 (the same two vectors:
    64 and 32 bfloat16 or float16 ones). x86's baseline build ("DEFAULT", ATEN_CPU_CAPABILITY=default) maps std::exp
    over each vector's lanes: any number."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "DEFAULT" and platform.machine().lower() in ("x86_64", "amd64"):
        return None
    return 2 * _TORCH_VECTOR_BYTES.get(cap, 16) // torch.empty((), dtype=dtype).element_size() - 1


@functools.cache
def sigmoid_rows(dtype: torch.dtype) -> int | None:
    """The most rows of a decode step for which the native calls' sigmoid gate of a shared expert
    (shared_combine: std::exp, as PyTorch's scalar loop) is torch.sigmoid's of the step's logits
    bit for bit, or None for any number (hi_na_moe.fastpath.layers runs the gate natively up to it).
    float32: torch_scalar_values (PyTorch's vector exp shows in about 4 % of the results). A
    16-bit dtype has few enough values to try them all, each through PyTorch's scalar loop and
    its vector loop against the native gate: where both agree (the rounding to 16 bits hides the
    vector exp's float32 ulps), any number of rows; where the scalar loop alone does, as many as
    it takes; where not even it does, none."""
    most = torch_scalar_values(dtype)
    if most is None or dtype not in (torch.bfloat16, torch.float16):
        return most
    native = native_module()[0]
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x)]
    n = x.numel()
    # two vectors' worth of padding behind them takes PyTorch's scalar tail
    want = torch.sigmoid(torch.cat([x, torch.zeros(most + 1, dtype=dtype)]))[:n]
    got = torch.empty_like(x)
    routed, ones = torch.zeros_like(x), torch.ones_like(x)
    # routed + round(sigmoid(logit)) * shared, with a row of one value: the gate alone
    native.shared_combine_raw(_DTYPE_CODES[dtype], routed.data_ptr(), ones.data_ptr(), x.data_ptr(), n, 1,
                              got.data_ptr())
    if not torch.equal(got, torch.cat([torch.sigmoid(p) for p in x.split(most)])):
        return 0
    return None if torch.equal(got, want) else most


def find_mlps(model: nn.Module, exclude: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of the gated-MLP candidates (the module docstring's children, three of them
    nn.Linear); whether their projections run on the dense kernels is checked when patched."""
    found = []
    for name, m in model.named_modules():
        if (set(m._modules) == _CHILDREN and not _matches(name, exclude)
                and all(type(m._modules[p]) is nn.Linear for p in ("gate_proj", "up_proj", "down_proj"))):
            found.append((name, m))
    return found


class NativeMLP:
    """One gated MLP module whose decode calls run in one native call (module docstring)."""

    weights = "lossless"  # what it adds: its projections are the dense layers' (their format)

    def __init__(self, name: str, module: nn.Module, original_forward):
        self.name, self.module = name, module
        self.original = original_forward
        self.native = native_module()[0]
        self.ready = False

    def _resolve(self) -> bool:
        m = self.module
        gu, up, dn = patched_member(m.gate_proj), patched_member(m.up_proj), patched_member(m.down_proj)
        if gu is None or up is None or dn is None:
            return False
        group, down = gu[0], dn[0]
        if (gu[1] != 0 or up != (group, 1) or len(group.modules) != 2 or dn[1] != 0 or len(down.modules) != 1
                or group.dtype is not down.dtype or group.dtype not in _DTYPE_CODES
                or group.out_features != 2 * down.in_features or down.out_features != group.in_features):
            return False
        self.gate_up, self.down = group, down
        self.dtype, self.hidden, self.inter = group.dtype, group.in_features, down.in_features
        self.watch = Watch([m.gate_proj, m.up_proj, m.down_proj, m.act_fn], [(m, n) for n in _CHILDREN])
        return True

    def matches(self) -> bool:
        if not self._resolve():
            return False
        dt, H = self.dtype, self.hidden
        gen = torch.Generator().manual_seed(5)
        g = torch.cat([torch.linspace(-24, 24, 4096), torch.randn(4096, generator=gen) * 3]).to(dt)
        ones = torch.ones_like(g)
        with torch.no_grad():
            try:
                want = self.module.act_fn(g)
                if not isinstance(want, torch.Tensor) or want.shape != g.shape or want.dtype != dt:
                    return False
                got = torch.empty_like(g)
                self.native.silu_mul_raw(_DTYPE_CODES[dt], self.gate_up.isa, g.data_ptr(), ones.data_ptr(), g.numel(),
                                         got.data_ptr())
                w = want.float()
                if not bool(((got.float() - w).abs() <= _ACT_RTOL[dt] * w.abs() + 1e-30).all()):
                    return False
                scale = torch.logspace(-2, 2, 5).unsqueeze(1)
                x = (torch.randn(5, H, generator=gen) * scale).to(dt)
                want = self.original(x)
                if not isinstance(want, torch.Tensor) or want.shape != x.shape or want.dtype != dt:
                    return False
                got = self._run(x)
            except Exception:
                return False
        w = want.float()
        tol = _ROW_TOL[dt] * w.abs().amax(dim=-1, keepdim=True)
        self.ready = bool(torch.isfinite(w).all() and ((got.float() - w).abs() <= tol).all())
        return self.ready

    def bounds(self):
        """(gate/up group's BoundForward, down_proj's, I) for a native call that runs this MLP."""
        return self.gate_up.bound, self.down.bound, self.inter

    def threads(self) -> int:
        return self.gate_up.threads or torch.get_num_threads()

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        dt, I = self.dtype, self.inter
        B = x.numel() // self.hidden
        out = torch.empty(x.shape, dtype=dt)
        scratch = torch.empty(B * 3 * I, dtype=dt)  # (gate/up's outputs and their product: the call carves it)
        self.native.gated_mlp_raw(_DTYPE_CODES[dt], B, I, x.data_ptr(), self.gate_up.bound, self.down.bound,
                                  scratch.data_ptr(), scratch.nbytes, out.data_ptr(), self.threads())
        return out

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if (self.ready and type(x) is torch.Tensor and x.dtype is self.dtype and x.is_contiguous() and x.is_cpu
                and not x.requires_grad and not x.is_neg() and x.dim() >= 1 and x.shape[-1] == self.hidden
                and 0 < x.numel() <= DECODE_MAX_ROWS * self.hidden
                and not (module.training and torch.is_grad_enabled()) and not self.watch.observed()
                and not observing()):
            return self._run(x)
        return self.original(x)

    def restore(self) -> None:  # nothing of the module was touched but its forward
        pass
