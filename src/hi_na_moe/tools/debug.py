"""Replay the same input natively and with hi_na_moe, and say where the outputs part.

Forward hooks record, in both runs, every decoder layer's output hidden states, every MoE
block's output and the top-k expert indices each experts module receives. The report gives per
layer the max abs / relative L2 error and cosine of the hidden states, per MoE block the same
for its output and the router's top-k set agreement, the first layer beyond tolerance, and the
final logits' KL divergence and top-1 agreement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.config import load_config
from ..integrate import adapters
from ..integrate.patching import disable_for_model, enable_for_model
from .quality import logits_agreement

DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@dataclass
class Diff:
    name: str
    max_abs: float
    rel_l2: float
    cosine: float
    topk_agreement: float | None = None  # MoE blocks: share of tokens whose top-k set is the same


@dataclass
class DebugReport:
    tolerance: float
    layers: list[Diff] = field(default_factory=list)
    moe_blocks: list[Diff] = field(default_factory=list)
    first_divergent_layer: str | None = None
    logits_kl: float = 0.0
    top1_agreement: float = 1.0
    kernels: list[str] = field(default_factory=list)
    # Lossless: the final logits must agree on the top-1 token (>= 99 % of positions).
    # Quantised experts change the logits by design, and on a short prompt one flipped argmax
    # is a large share, so there the criterion is the logits' KL divergence instead.
    max_kl: float | None = None

    @property
    def ok(self) -> bool:
        if self.first_divergent_layer is not None:
            return False
        if self.max_kl is not None:
            return self.logits_kl <= self.max_kl
        return self.top1_agreement >= 0.99

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def __str__(self) -> str:
        lines = [f"tolerance (relative L2): {self.tolerance:g}; kernels: {', '.join(sorted(set(self.kernels))) or '-'}",
                 "| where | max abs | rel L2 | cosine | top-k agreement |", "|---|---|---|---|---|"]
        for d in self.layers + self.moe_blocks:
            agree = "-" if d.topk_agreement is None else f"{100 * d.topk_agreement:.1f} %"
            flag = "  <-- beyond tolerance" if d.rel_l2 > self.tolerance else ""
            lines.append(f"| {d.name} | {d.max_abs:.3g} | {d.rel_l2:.3g} | {d.cosine:.6f} | {agree} |{flag}")
        crit = (f" (quantised experts: pass if KL <= {self.max_kl:g})" if self.max_kl is not None
                else " (pass if top-1 >= 99 %)")
        lines.append(f"final logits: KL(native || hi_na_moe) = {self.logits_kl:.3g}, "
                     f"top-1 agreement {100 * self.top1_agreement:.1f} %{crit}")
        lines.append("first layer beyond tolerance: " + (self.first_divergent_layer or "none") +
                     ("  -> OK" if self.ok else "  -> FAILED"))
        return "\n".join(lines)


def _diff(name: str, a: torch.Tensor, b: torch.Tensor) -> Diff:
    a, b = a.double().flatten(), b.double().flatten()
    err = (a - b).norm().item()
    base = a.norm().item() or 1.0
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item() if a.numel() else 1.0
    return Diff(name, (a - b).abs().max().item() if a.numel() else 0.0, err / base, cos)


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of the decoder: the longest ModuleList in the model."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and (best is None or len(m) > len(best[1])):
            best = (name, m)
    return [] if best is None else [(f"{best[0]}.{i}", layer) for i, layer in enumerate(best[1])]


def _record(model: nn.Module, blocks: list[adapters.BlockMatch], layers, inputs: dict) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    handles = []

    def save_out(name):
        def hook(_m, _args, out):
            rec[name] = (out[0] if isinstance(out, tuple) else out).detach().float().clone()
        return hook

    def save_topk(name):
        def hook(_m, args, kwargs):
            idx = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if isinstance(idx, torch.Tensor):
                rec[name + "#topk"] = idx.detach().clone()
        return hook

    for name, layer in layers:
        handles.append(layer.register_forward_hook(save_out(name)))
    for b in blocks:
        handles.append(b.module.register_forward_hook(save_out(b.name)))
        handles.append(b.module.register_forward_pre_hook(save_topk(b.name), with_kwargs=True))
    try:
        with torch.inference_mode():
            out = model(**inputs)
    finally:
        for h in handles:
            h.remove()
    rec["#logits"] = out.logits.detach().float()
    return rec


# Quantised experts differ from native by design; beyond these per-layer relative errors a layer
# is reported as divergent (int4 on random-weight models measured 0.1-0.2 per layer).
QUANT_TOLERANCE = {"int8": 5e-2, "int4": 2.5e-1}
# ... and beyond this KL(native || hi_na_moe) of the final logits (nats per token; measured on the
# shipped model's held-out text: int8 0.0001, int4-g64 0.0012).
QUANT_MAX_KL = {"int8": 0.01, "int4": 0.05}


def compare(model: nn.Module, inputs: dict, tolerance: float | None = None, baseline: dict | None = None,
            **config: Any) -> DebugReport:
    """Run `model(**inputs)` natively (or, with `baseline`, enabled with those config keys:
    e.g. {"weights": "int8"} to compare int4 against int8, or {"isa": "generic"} to compare
    tiers), then with hi_na_moe enabled (config keys as for enable_for_model), and localise any
    difference."""
    load_config(**config)  # a bad key or value is refused before the first (native) run, not after it
    if baseline is not None:
        load_config(**baseline)
    blocks = [b for b in adapters.discover(model) if b.spec is not None]
    layers = _decoder_layers(model)
    dtype = next(model.parameters()).dtype
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE.get(dtype, 1e-4)
    if tolerance is None and config.get("weights") in QUANT_TOLERANCE:
        tol = max(tol, QUANT_TOLERANCE[config["weights"]])
    if baseline is None:
        native = _record(model, blocks, layers, inputs)
    else:
        enable_for_model(model, **baseline)
        try:
            native = _record(model, blocks, layers, inputs)
        finally:
            disable_for_model(model)
    report_enable = enable_for_model(model, **config)
    try:
        ours = _record(model, blocks, layers, inputs)
    finally:
        disable_for_model(model)
    rep = DebugReport(tolerance=tol, kernels=[b.kernel for b in report_enable.blocks if b.kernel],
                      max_kl=QUANT_MAX_KL.get(config.get("weights")))
    for name, _ in layers:
        if name in native and name in ours:
            d = _diff(name, native[name], ours[name])
            rep.layers.append(d)
            if rep.first_divergent_layer is None and d.rel_l2 > tol:
                rep.first_divergent_layer = name
    for b in blocks:
        if b.name not in native or b.name not in ours:
            continue
        d = _diff(b.name, native[b.name], ours[b.name])
        ta, tb = native.get(b.name + "#topk"), ours.get(b.name + "#topk")
        if ta is not None and tb is not None and ta.shape == tb.shape:
            d.topk_agreement = (ta.sort(-1).values == tb.sort(-1).values).all(-1).float().mean().item()
        rep.moe_blocks.append(d)
    rep.logits_kl, rep.top1_agreement = logits_agreement(native["#logits"], ours["#logits"])
    return rep
