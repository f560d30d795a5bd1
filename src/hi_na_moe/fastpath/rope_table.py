"""The rotary module's cos/sin for a decode step read from a table of its own outputs.

A decoder stack's rotary module (rotary_emb) computes, at every decode step, about ten small
elementwise ops for one position: with the weight stream evicting the caches between steps, its
call measured 0.15 ms of a 24 ms OLMoE int4 step (benchmarks/log/whole-model.md, 2026-11-30). Its output
for a position depends on nothing but the position, its inv_freq buffer, its attention_scaling
and the dtype, so hi_na_moe.fastpath.stack reads it from a table instead.

The table is the module's own output: one call of the module on positions [0, n), n doubling
when a step passes the end. Each element of that output is computed by the same elementwise
kernels as in a call on one position, so the rows are the same bits; that is checked, not
assumed: every time the table is built, its first, middle and last rows must equal, bit for bit,
calls of the module on those positions alone, else the table is dropped for good
(`RopeTable.broken` says why) and the module is called at every step.

A step's position_ids (generate passes them at every step; several rows differ when prompts were
left-padded) are read as their rows of the table: the module computes each row of its output from
that row's position alone (a product with inv_freq, then elementwise ops).

A step reads the table only when nothing could tell the difference: the module's class forward
(no forward set on the object), no hook on it (global hooks and modes send the whole step to
the stack's own forward), a rope type whose frequencies are fixed (not "dynamic" or "longrope":
those rewrite inv_freq as the sequence grows), and the same inv_freq tensor, unchanged since the
table was built (identity and version counter), the same attention_scaling and dtype.
"""

from __future__ import annotations

import torch
from torch import nn

# positions of the first table; it doubles when a step passes its end, up to MAX_ROWS (beyond,
# the module is called)
FIRST_ROWS = 1024
MAX_ROWS = 1 << 17


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype is b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


class RopeTable:
    """cos/sin of a rotary module for one position at a time, from a table of its outputs."""

    __slots__ = ("module", "forward", "cos", "sin", "key", "broken")

    def __init__(self, module: nn.Module):
        self.module = module
        self.forward = type(module).forward
        self.cos = self.sin = self.key = None
        self.broken: str | None = None

    def _key(self, dtype: torch.dtype):
        m = self.module
        buffers = m._buffers
        inv = buffers.get("inv_freq")
        return (inv, None if inv is None else inv._version, m.__dict__.get("attention_scaling"), dtype)

    def usable(self) -> bool:
        """Whether this step may read the table (module docstring), before any argument is seen."""
        return self.blocker() is None

    def blocker(self) -> str | None:
        """Why a step cannot read the table now (for the report), or None."""
        m = self.module
        if self.broken is not None:
            return self.broken
        if m._forward_hooks or m._forward_pre_hooks:
            return "a hook on the rotary module"
        if "forward" in m.__dict__ or type(m).forward is not self.forward:
            return "the rotary module's forward was replaced"
        rope_type = m.__dict__.get("rope_type")
        if type(rope_type) is not str or "dynamic" in rope_type or rope_type == "longrope":
            return f"its rope type {rope_type!r} may rewrite its frequencies as the sequence grows"
        return None

    def lookup(self, x: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(cos, sin) [1, 1, D] of `position` as module(x, [[position]]) returns them (in the
        dtype it returns: x's, or float32 as ERNIE 4.5's keeps them; a module returning one complex
        tensor, as DeepSeek-V2's: (that tensor's row, None)), or None when the table cannot give
        them (then call the module)."""
        if not self.usable():
            return None
        key = self._key(x.dtype)
        if key[0] is None or key[2] is None:
            return None
        same = self.key is not None and self.key[0] is key[0] and self.key[1:] == key[1:]
        if not same or position >= self.cos.shape[1]:
            rows = self.cos.shape[1] if same else FIRST_ROWS
            while rows <= position:
                rows *= 2
            if rows > MAX_ROWS or not self._build(x, rows, key, position):
                return None
        return self.cos.narrow(1, position, 1), None if self.sin is None else self.sin.narrow(1, position, 1)

    def lookup_ids(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """module(x, position_ids) for a step's position_ids [rows, 1] (generate passes them at every
        step): lookup's row for one row, else [rows, 1, D], row b the table's row of position_ids[b]
        (the module computes each row from its position alone: a product and elementwise ops). None
        when the table cannot give them (then call the module)."""
        if position_ids.dtype not in (torch.int64, torch.int32):
            return None
        if position_ids.numel() == 1:
            p = int(position_ids)
            return self.lookup(x, p) if p >= 0 else None
        lo, hi = torch.aminmax(position_ids)
        lo, hi = int(lo), int(hi)
        if lo < 0 or self.lookup(x, hi) is None:  # (the table then reaches hi)
            return None
        idx = position_ids.reshape(-1)
        cos = self.cos[0].index_select(0, idx).unsqueeze(1)
        return cos, None if self.sin is None else self.sin[0].index_select(0, idx).unsqueeze(1)

    def _build(self, x: torch.Tensor, rows: int, key, position: int) -> bool:
        m = self.module
        self.cos = self.sin = self.key = None
        with torch.no_grad():
            proto = x.new_empty((1, 1, 1))

            def pair(out):  # (cos, sin), or (the complex tensor, None)
                return (out, None) if type(out) is torch.Tensor and out.is_complex() else out

            cos, sin = pair(m(proto, torch.arange(rows).unsqueeze(0)))
            if (type(cos) is not torch.Tensor or cos.dim() != 3 or cos.shape[:2] != (1, rows)
                    or not cos.is_contiguous() or not (cos.is_complex() if sin is None else (
                        type(sin) is torch.Tensor and sin.shape == cos.shape and sin.dtype is cos.dtype
                        and cos.is_floating_point() and sin.is_contiguous()))):
                self.broken = ("the rotary module's output is not a pair of [1, positions, D] tensors, or one "
                               "complex tensor")
                return False
            for p in sorted({0, rows // 2, rows - 1, position}):
                c, s = pair(m(proto, torch.tensor([[p]])))
                if not (_same_bits(c, cos[:, p:p + 1]) and (s is None if sin is None else (
                        s is not None and _same_bits(s, sin[:, p:p + 1])))):
                    self.broken = f"its output for position {p} alone differs from its row of the table"
                    return False
        now = self._key(x.dtype)
        if now[0] is not key[0] or now[1:] != key[1:]:  # the module changed its buffers while building
            return False
        self.cos, self.sin, self.key = cos, sin, key
        return True
