"""What every scope="all" part shares: the row limit of the native decode paths, the dtype codes
the kernels take, and the fnmatch test of dense_exclude / dense_lossless patterns."""

from __future__ import annotations

import fnmatch

import torch


def _matches(name: str, patterns: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p.strip()) for p in patterns.split(",") if p.strip())


_MISSING = object()


# Rows a call may have and still take the native decode paths: a decode step of up to this many
# sequences (the layers' short paths, the stack's one call, the decode attention), and calls of
# the norms, routers and gated MLPs of up to this many rows, so that a layer's own forward gives
# the bits of its short path (more rows, a prefill: the modules' own forwards). 16 until session
# 32, which measured the native step faster at every batch from 17 to 256 rows (Qwen1.5-MoE 4L
# int4: 17 rows 56 ms against 92 on the modules' forwards, 24 rows 76 against 116, 64 rows 178
# against 200, 256 rows 697 against 773; OLMoE-1B-7B 1.24-1.96x) and prompts of 17-256 tokens
# 0.985-1.13x (`bench_batch_decode.py --ab-decode-rows=16,-`, benchmarks/RESULTS.md).
DECODE_MAX_ROWS = 256


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
