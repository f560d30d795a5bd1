"""What quantised experts cost in quality, measured on real text: perplexity, logits KL and
top-1 agreement against the lossless path, and each MoE block's output SQNR on the activations
the lossless model actually feeds it (same inputs for both, so errors do not compound)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ..core import ops
from ..integrate import patching


@dataclass
class FormatQuality:
    weights: str  # "lossless", "int8", "int4-g64", ...
    perplexity: float
    kl_vs_lossless: float  # mean over tokens of KL(p_lossless || p_this), nats
    top1_vs_lossless: float  # share of positions whose argmax equals the lossless argmax
    block_sqnr_db: dict[str, float] = field(default_factory=dict)  # per block, real activations

    @property
    def min_sqnr_db(self) -> float | None:
        return min(self.block_sqnr_db.values()) if self.block_sqnr_db else None


def logits_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(mean KL(p_ref || p) in nats per position, share of positions with the same argmax), in
    float64; the KL is clamped at 0 (it can round to a tiny negative)."""
    pa, pb = ref_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    kl = max(0.0, float((pa.exp() * (pa - pb)).sum(-1).mean()))
    return kl, float((pa.argmax(-1) == pb.argmax(-1)).float().mean())


def _runners(model) -> list[ops.NativeExperts]:
    return [r for _, r in patching.native_runners(model)]


def nll_and_logits(model, chunks: torch.Tensor, batch: int | None = None):
    """(mean next-token NLL over `chunks` [N, L], float32 logits [N, L - 1, V]), the chunks run
    `batch` at a time (None: all in one forward)."""
    batch = batch or len(chunks)
    nll, logits = 0.0, []
    for i in range(0, len(chunks), batch):
        part = chunks[i:i + batch]
        with torch.no_grad():
            lg = model(input_ids=part).logits.float()[:, :-1]
        nll += float(-torch.log_softmax(lg, dim=-1).gather(-1, part[:, 1:, None]).sum())
        logits.append(lg)
    return nll / (chunks.shape[0] * (chunks.shape[1] - 1)), torch.cat(logits)


def measure(model, chunks: torch.Tensor, formats: Iterable[tuple[str, int]], progress=None,
            **config: Any) -> list[FormatQuality]:
    """Runs `chunks` ([N, L] token ids) through `model` enabled as lossless, then as each
    (weights, group_size) in `formats`; the model must not be enabled already. Extra keyword
    arguments are config keys (isa, threads, cache, cache_dir, ...)."""
    if patching.is_enabled(model):
        raise RuntimeError("measure() enables the model itself; disable_for_model(model) first")
    calls: dict[str, list] = {}

    def record(name, hidden, idx, w, out):
        calls.setdefault(name, []).append((hidden.detach().clone(), idx.clone(), w.detach().clone(), out.clone()))

    patching.enable_for_model(model, weights="lossless", **config)
    try:
        for r in _runners(model):
            r.recorder = record
        base_nll, base_logits = nll_and_logits(model, chunks)
    finally:
        for r in _runners(model):
            r.recorder = None
        patching.disable_for_model(model)
    results = [FormatQuality("lossless", math.exp(base_nll), 0.0, 1.0)]
    for weights, group in formats:
        if progress:
            progress(weights, group)
        rep = patching.enable_for_model(model, weights=weights, group_size=group, **config)
        try:
            nll, logits = nll_and_logits(model, chunks)
            kl, top1 = logits_agreement(base_logits, logits)
            sq: dict[str, float] = {}
            with torch.no_grad():
                for r in _runners(model):
                    sig = err = 0.0
                    for hidden, idx, w, out in calls.get(r.name, []):
                        got = r(r.spec, hidden, idx, w).float()
                        sig += float(out.float().pow(2).sum())
                        err += float((got - out.float()).pow(2).sum())
                    if sig > 0:
                        sq[r.name] = float("inf") if err == 0 else 10 * math.log10(sig / err)
            label = rep.accelerated[0].weights if rep.accelerated else weights
            results.append(FormatQuality(label, math.exp(nll), kl, top1, sq))
        finally:
            patching.disable_for_model(model)
    return results
