"""Fewer experts a token than its router chose: HinaConfig.top_k (docs/adaptive-top-k.md).

At the memory roofline a decode step's time is the bytes it reads, and most of those are the
experts'. An expert the router gives a small weight adds little to a token's output;
`top_k="adaptive"` drops it: a slot stays while its weight is at least `top_k_threshold` times an
even share of the token's routing weight (1/k of the k weights' sum when the router renormalises
them, 1/k of the router's total of 1 when its weights are probabilities over every expert), and
the `top_k_min` largest stay whatever their weight. `top_k=<n>` keeps every token's n largest.
The kept weights are renormalised as the model's router normalises its k (`top_k_renorm="auto"`),
so a normalising router's weights still sum to what they summed to.

Why a share and not a fraction of the token's largest weight: on the trained 64-expert top-8
model the fraction-of-the-largest rule was worse than a fixed lower k at the same experts a token
(benchmarks/log/top-k.md, 2026-12-07); the share rule better, at every budget measured.

The trim runs on the experts' inputs, inside the native op (RoutingTrim, csrc/experts/trim.cpp):
every path that runs a block (per block, batched, prefill, the one-call decode step, the memory
tier) sees the same selection. Its oracle is hi_na_moe.core.reference.trim_routing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

MODES = ("fixed", "adaptive")


@dataclass(frozen=True)
class Trim:
    """What the native RoutingTrim does (hina_moe/experts.h)."""

    mode: str  # "fixed" or "adaptive"
    keep: int = 0  # fixed: the experts a token keeps
    threshold: float = 0.0  # adaptive: weight >= threshold x the token's largest stays,
    min_k: int = 1  # and the min_k largest
    renorm: bool = False  # the kept weights scaled to the sum of the token's weights
    why_renorm: str = ""  # where renorm came from, for the report

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Trim.mode is one of {MODES}, not {self.mode!r}")

    def native_args(self) -> tuple:
        """PackedExperts.set_trim's arguments."""
        return (self.mode, self.keep, self.threshold, self.min_k, self.renorm)

    def describe(self) -> str:
        what = (f"each token keeps its {self.keep} largest-weight experts" if self.mode == "fixed" else
                f"adaptive: an expert stays while its weight is >= {self.threshold:g} x an even share of the "
                f"token's routing weight, at least {self.min_k} a token")
        norm = "kept weights renormalised" if self.renorm else "kept weights as the router gave them"
        return f"{what}; {norm} ({self.why_renorm})" if self.why_renorm else f"{what}; {norm}"


def model_renormalises(model: nn.Module) -> tuple[bool | None, str]:
    """Whether the model's router normalises its k weights to a fixed sum, from its config's
    norm_topk_prob (the transformers name; on the text config of a multimodal model), and where
    that came from. (None, why) when the config does not say."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None), getattr(config, "get_text_config", lambda: None)()):
        value = getattr(cfg, "norm_topk_prob", None) if cfg is not None else None
        if isinstance(value, bool):
            return value, f"the model's config has norm_topk_prob={value}"
    return None, "the model's config has no norm_topk_prob"


def from_config(cfg, model: nn.Module) -> Trim | None:
    """The Trim `cfg` (a HinaConfig) asks for on `model`, or None (top_k="model": the router's own)."""
    if cfg.top_k == "model":
        return None
    renorm: bool | None
    if cfg.top_k_renorm == "auto":
        renorm, why = model_renormalises(model)
        if renorm is None:
            # a router that does not say: its weights summed to something; keep that sum
            renorm, why = True, f"{why}: renormalised (top_k_renorm='off' keeps the weights as they are)"
        why = f"top_k_renorm='auto': {why}"
    else:
        renorm, why = cfg.top_k_renorm == "on", f"top_k_renorm={cfg.top_k_renorm!r}"
    if cfg.top_k == "adaptive":
        return Trim("adaptive", threshold=float(cfg.top_k_threshold), min_k=cfg.top_k_min, renorm=renorm,
                    why_renorm=why)
    return Trim("fixed", keep=int(cfg.top_k), renorm=renorm, why_renorm=why)
