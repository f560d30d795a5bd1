"""What a model needs on this machine, read from its config alone: the model is built on the
meta device (no weight is read), its MoE blocks are discovered, and the bytes one decode token
must stream give the roofline tokens/s for a given memory bandwidth."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..core.config import DEFAULT_GROUP_SIZE
from ..core.formats import LOSSLESS_FORMATS, Format, decide_format
from ..core.native import native_module
from ..integrate.patching import inspect_model


def _top_k(config) -> int | None:
    for c in (config, getattr(config, "text_config", None)):
        for key in ("num_experts_per_tok", "moe_top_k", "top_k", "moe_topk"):
            v = getattr(c, key, None) if c is not None else None
            if isinstance(v, int) and v > 0:
                return v
    return None


def packed_expert_bytes(block, weights: str, group_size: int = DEFAULT_GROUP_SIZE) -> int | None:
    """Bytes of one block's experts packed as `weights` (the native core's own layout plan, scales
    included; biases not counted), or None without the native library."""
    native, _ = native_module()
    if native is None or not block.experts or not block.hidden or not block.intermediate:
        return None
    gated = "(no gate)" not in (block.gate or "")
    dtype = (block.weights or "bfloat16") if weights in LOSSLESS_FORMATS else "bfloat16"
    if dtype not in ("float32", "bfloat16", "float16"):
        dtype = "bfloat16"
    weights = decide_format(weights, dtype).format  # what enable stores such a block as
    header = native.PackedExperts.plan(dtype, block.experts, block.hidden, block.intermediate, gated,
                                       isa="generic", weights=weights, group_size=group_size)
    return int(native.header_info(header)["nbytes"])


def format_table(plan: dict[str, Any], bandwidth_gbs: float | None, group_size: int = DEFAULT_GROUP_SIZE) -> list[dict[str, Any]]:
    """Per expert format: expert bytes, bytes read per decode token, roofline tokens/s; for
    lossless12/int8/int4 also a row with scope="all" (the dense layers in that format too, as
    planned by plan_for_model's `dense_scope_all`; with int8/int4 lm_head stays lossless by
    default)."""
    report, k = plan["report"], plan["top_k"]
    dense_active = (plan["active_bytes_per_token"] or 0) - sum(
        (b.expert_bytes or 0) * k / b.experts for b in report.blocks if b.experts) if k else None
    rows = []
    for weights in ("lossless", "lossless12", "int8", "int4"):
        if decide_format(weights, plan["dtype"]).format != weights:
            continue  # lossless12 packs bfloat16 weights; other models would store it as lossless
        sizes = [(b, packed_expert_bytes(b, weights, group_size)) for b in report.blocks if b.experts]
        if not sizes or any(n is None for _, n in sizes):
            continue
        experts = sum(n for _, n in sizes)
        active = None if dense_active is None else dense_active + sum(n * k / b.experts for b, n in sizes)
        label = weights if weights != Format.INT4 else f"int4-g{group_size}"
        variants = [("experts", label, 0)]
        dense = (plan.get("dense_scope_all") or {}).get(weights)
        if weights != Format.LOSSLESS and dense and dense["layers"]:
            # the packed dense layers are read instead of the model's own (their originals are
            # released, backed up in the store)
            variants.append(("all", f"{label}, scope all", dense["packed_bytes"] - dense["own_bytes"]))
        for scope, name, delta in variants:
            act = None if active is None else active + delta
            rows.append({"weights": name, "scope": scope, "expert_bytes": experts,
                         "ram_estimate_bytes": plan["dense_bytes"] + experts + delta,
                         "active_bytes_per_token": act,
                         "roofline_decode_tokens_per_s": bandwidth_gbs * 1e9 / act if bandwidth_gbs and act else None})
    return rows


def plan_for_model(model: torch.nn.Module, bandwidth_gbs: float | None = None, group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, Any]:
    """Blocks, bytes and roofline of an (already built, possibly meta) causal LM; with the
    native library also what scope="all" would pack per format (`dense_scope_all`)."""
    config = model.config
    report = inspect_model(model)
    dtype = next(model.parameters()).dtype
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = out is not None and inp is not None and out.weight is inp.weight
    # the input embedding is a row lookup per token, not a stream, unless lm_head reads it too
    lookup = 0 if tied or inp is None else inp.weight.numel() * inp.weight.element_size()
    experts = sum(b.expert_bytes or 0 for b in report.blocks)
    k = _top_k(config)
    routed_per_token = sum((b.expert_bytes or 0) * k / b.experts for b in report.blocks if b.experts) if k else None
    active = None if routed_per_token is None else (total - experts - lookup) + routed_per_token
    plan: dict[str, Any] = {
        "model_type": config.model_type, "dtype": str(dtype).replace("torch.", ""), "top_k": k,
        "total_bytes": total, "expert_bytes": experts, "dense_bytes": total - experts,
        "active_bytes_per_token": active,
        "ram_estimate_bytes": total,  # enabled: the packed experts replace the model's own
        "report": report,
    }
    if bandwidth_gbs and active:
        plan["roofline_decode_tokens_per_s"] = bandwidth_gbs * 1e9 / active
    if native_module()[0] is not None:
        # per format: the dense layers scope="all" would take, their own and their packed bytes
        plan["dense_scope_all"] = {}
        for weights in ("lossless12", "int8", "int4"):
            dense = inspect_model(model, scope="all", weights=weights, group_size=group_size).dense
            plan["dense_scope_all"][weights] = {
                "layers": len(dense), "own_bytes": sum(d.out_features * d.in_features for d in dense) * dtype.itemsize,
                "packed_bytes": sum(d.packed_bytes for d in dense)}
    return plan


def model_plan(path: str | Path, bandwidth_gbs: float | None = None, group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, Any]:
    """plan_for_model for the model in `path`, built on the meta device from its config alone,
    in its own dtype (lossless): no weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM  # import cost: 0.26 s (measured 2026-12-07)

    config = AutoConfig.from_pretrained(path)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return plan_for_model(model, bandwidth_gbs, group_size)
