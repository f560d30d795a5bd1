"""The adaptive top-k threshold a KL budget allows, measured (profile-router's advice).

The model runs on the profile's token windows on the native kernels, once with every expert its
router chose and once per threshold of top_k="adaptive" (hi_na_moe.core.trim), the trim switched
on the packed blocks between runs; each run's logits are compared with the full run's (mean
KL(full || trimmed) per token, top-1 agreement) and the kernels count the experts a token used.
The advice is the largest threshold whose KL stays within the budget. A model that is not
enabled is enabled for the runs (lossless weights, nothing cached) and disabled after, which
gives its weights back bit for bit; an enabled one keeps its blocks, whose trim is put back.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core import trim as trim_mod
from ..core.config import HinaConfig
from ..core.native import native_module
from ..integrate import patching
from .quality import logits_agreement

THRESHOLDS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.8)
DEFAULT_KL_BUDGET = 0.01  # nats a token: +0.9 % perplexity on the trained 64-expert model (benchmarks/log/top-k.md)
MAX_TOKENS = 8192  # the runs' tokens: enough for the advice, bounded for a large model
BATCH = 8  # windows a forward


def _run(model, windows: list[torch.Tensor], runners, args: tuple) -> tuple[torch.Tensor, float]:
    for r in runners:
        r.packed.set_trim(*args)
        r.packed.routing_counts(reset=True)
    logits = []
    with torch.inference_mode():
        i = 0
        while i < len(windows):  # windows of one length in batches of BATCH (no padding)
            j = i + 1
            while j < len(windows) and j - i < BATCH and windows[j].numel() == windows[i].numel():
                j += 1
            out = model(input_ids=torch.stack(windows[i:j]), use_cache=False).logits.float()
            logits.append(out.reshape(-1, out.shape[-1]))
            i = j
    tokens = sum(r.packed.routing_counts()[0] for r in runners)
    slots = sum(r.packed.routing_counts()[1] for r in runners)
    return torch.cat(logits), (slots / tokens if tokens else float("nan"))


def advise(model: nn.Module, windows: Sequence[torch.Tensor], budget: float = DEFAULT_KL_BUDGET,
           thresholds: Sequence[float] = THRESHOLDS, max_tokens: int = MAX_TOKENS, progress: bool = False) -> dict[str, Any]:
    """{"budget", "tokens", "rows": [{threshold, experts_per_token, expert_bytes_saved, kl, top1}],
    "choice": the row of the largest threshold within the budget that drops any expert, or None,
    "text"}; rows stop at the first threshold past the budget. `windows`: 1-D token-id tensors (profile-router's)."""
    if budget <= 0:
        raise ValueError(f"the KL budget must be > 0 nats a token, got {budget}")
    native, why = native_module()
    if native is None:
        return {"budget": budget, "rows": [], "choice": None,
                "text": f"adaptive top-k: not measured: the native library is not loaded ({why})"}
    runs, n = [], 0
    for w in windows:
        if n >= max_tokens:
            break
        runs.append(w[: max_tokens - n])
        n += runs[-1].numel()
    enabled_here = not patching.is_enabled(model)
    if enabled_here:
        patching.enable_for_model(model, weights="lossless", cache=False, scope="experts", top_k="model")
    runners = [r for _, r in patching.native_runners(model)]
    before = [r.packed.trim for r in runners]
    bar = tqdm(total=len(thresholds) + 1, desc="profile-router: adaptive top-k", unit="run", leave=False,
               disable=not progress)
    rows: list[dict] = []
    try:
        if not runners:
            return {"budget": budget, "rows": [], "choice": None,
                    "text": "adaptive top-k: not measured: no MoE block runs on the native kernels"}
        full, k = _run(model, runs, runners, ("full",))
        bar.update()
        for t in sorted(thresholds):
            trim = trim_mod.from_config(HinaConfig(top_k="adaptive", top_k_threshold=t), model)
            logits, ept = _run(model, runs, runners, trim.native_args())
            kl, top1 = logits_agreement(full, logits)
            rows.append({"threshold": t, "experts_per_token": ept, "expert_bytes_saved": 1 - ept / k, "kl": kl,
                         "top1": top1, "renorm": trim.renorm})
            bar.update()
            if kl > budget:
                break
    finally:
        bar.close()
        for r, (mode, keep, threshold, min_k, renorm) in zip(runners, before):
            r.packed.set_trim(mode, keep, threshold, min_k, renorm)
            r.packed.routing_counts(reset=True)
        if enabled_here:
            patching.disable_for_model(model)
    # (a threshold that dropped nothing is no advice)
    within = [r for r in rows if r["kl"] <= budget and r["expert_bytes_saved"] > 0]
    choice = within[-1] if within else None
    if choice is None:
        saving = next((r for r in rows if r["expert_bytes_saved"] > 0), None)
        text = (f"adaptive top-k: no threshold tried drops experts and keeps KL within {budget:g} nats a token"
                + (f" (the first that drops any, {saving['threshold']:g}, measured {saving['kl']:.4f})" if saving else "")
                + ": keep top_k='model'")
    else:
        text = (f"adaptive top-k: top_k_threshold={choice['threshold']:g} keeps KL at {choice['kl']:.4f} <= {budget:g} "
                f"nats a token (top-1 {100 * choice['top1']:.1f} %): {choice['experts_per_token']:.2f} experts a token "
                f"of {k:g}, {100 * choice['expert_bytes_saved']:.1f} % fewer expert bytes (measured on {n} tokens)")
    return {"budget": budget, "tokens": n, "experts_per_token_full": k, "rows": rows, "choice": choice, "text": text}
