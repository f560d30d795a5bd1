"""Exclusive time per part of a model's forward, from module hooks: a stack of open module calls,
each call's time less its children's, added to its part. Used by bench_decode_breakdown.py and
studies/study_prefill_parts.py."""
from __future__ import annotations

import time


class PartTimer:
    """`spent[part]`: seconds inside modules of that part, not inside a nested timed module."""

    def __init__(self, parts):
        self.spent = {p: 0.0 for p in parts}
        self._stack: list[list] = []  # [part, start, children's time]

    def attach(self, module, part: str) -> None:
        def pre(mod, inputs):
            self._stack.append([part, time.perf_counter(), 0.0])

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(self._post)

    def _post(self, mod, inputs, output):
        part, t0, child = self._stack.pop()
        total = time.perf_counter() - t0
        self.spent[part] += total - child
        if self._stack:
            self._stack[-1][2] += total
