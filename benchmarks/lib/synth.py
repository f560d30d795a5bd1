"""Synthetic bf16 weights for the op-level benchmarks (imported by the scripts in this folder):
many distinct large tensors without generating gigabytes of random numbers."""
from __future__ import annotations

import math

import torch


def weight_maker(gen: torch.Generator, scale: float = 0.02):
    """A function tensor(shape, shift) -> a contiguous bf16 tensor of `shape`: a 4 Mi-element
    random block, rotated by `shift` elements and repeated. Different shifts give different
    tensors (so packed copies do not share cache lines), at the cost of one copy each."""
    block = (torch.randn(1 << 22, generator=gen) * scale).bfloat16()

    def tensor(shape, shift: int) -> torch.Tensor:
        n = math.prod(shape)
        src = torch.cat([block[shift:], block[:shift]])
        return src.repeat(n // src.numel() + 1)[:n].view(shape).contiguous()

    return tensor
