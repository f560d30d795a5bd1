"""The dry-run plan behind `hi-na-moe check --model`: built on the meta device, bytes per token."""

from __future__ import annotations

import pytest
import torch
from transformers import OlmoeConfig

from hi_na_moe.tools.plan import model_plan
from hi_na_moe.core.system import system_info


def test_olmoe_1b_7b_bytes_per_token(tmp_path):
    # OLMoE-1B-7B: 16 layers, 64 experts top-8, H 2048, I 1024, untied lm_head, bf16. Bytes per
    # decode token (shared/MEASURED.md, counted independently): 2.36 GB = attention 0.54 +
    # routed experts 1.61 + lm_head 0.21; the input embedding is a row lookup, not a stream.
    cfg = OlmoeConfig(intermediate_size=1024)
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(tmp_path)
    plan = model_plan(tmp_path, bandwidth_gbs=25.0)
    assert plan["top_k"] == 8 and plan["dtype"] == "bfloat16"
    assert plan["expert_bytes"] == 16 * 64 * 3 * 2048 * 1024 * 2
    assert abs(plan["active_bytes_per_token"] / 1e9 - 2.36) < 0.01
    assert abs(plan["roofline_decode_tokens_per_s"] - 25e9 / plan["active_bytes_per_token"]) < 1e-9
    report = plan["report"]
    assert len(report.blocks) == 16 and report.dry_run
    # planned on the meta device: nothing was read, yet the kernels that would run are named
    assert all(b.status == "accelerated" for b in report.blocks), [b.reason for b in report.blocks]


def test_format_table_has_scope_all_rows(tmp_path):
    from hi_na_moe.core.native import native_kernels_available
    from hi_na_moe.tools.plan import format_table

    if not native_kernels_available():
        pytest.skip("the packed sizes come from the native planner")
    cfg = OlmoeConfig(intermediate_size=1024)
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(tmp_path)
    rows = {r["weights"]: r for r in format_table(model_plan(tmp_path, bandwidth_gbs=25.0), 25.0)}
    assert set(rows) == {"lossless", "lossless12", "lossless12, scope all", "int8", "int8, scope all", "int4-g32",
                         "int4-g32, scope all"}
    # lossless12: the same bf16 weights in ~75 % of the bytes, experts and (scope all) dense layers
    assert 0.74 < rows["lossless12"]["expert_bytes"] / rows["lossless"]["expert_bytes"] < 0.78
    assert rows["lossless12, scope all"]["active_bytes_per_token"] < 0.8 * rows["lossless"]["active_bytes_per_token"]
    # OLMoE-1B-7B, int4 with scope all: 64 attention projections in int4 (0.54 GB of bf16 ->
    # ~0.14 GB), lm_head kept bf16 (0.21 GB), routed experts ~0.43 GB: ~0.78 GB per token
    # (bench_full_model.py measured 0.798 GB/token for this arm with dense_lossless=lm_head at
    # layout v3; v4's paired scales took 0.25 bits a weight off the 537 M weights of the down and
    # attention panels read a token, 16.8 MB: 0.781 GB at group 64; v5's default group 32 has as
    # many scale bytes (one-byte codes) plus a 4-byte factor a row: 0.784 GB)
    all4, exp4 = rows["int4-g32, scope all"], rows["int4-g32"]
    assert all4["scope"] == "all" and exp4["scope"] == "experts"
    assert abs(all4["active_bytes_per_token"] / 1e9 - 0.784) < 0.003
    assert exp4["active_bytes_per_token"] - all4["active_bytes_per_token"] > 0.35e9
    assert all4["roofline_decode_tokens_per_s"] > exp4["roofline_decode_tokens_per_s"]


def test_system_info_without_bandwidth():
    info = system_info(measure_bandwidth=False)
    assert info["cores"]["logical_cpus"] >= 1
    assert info["memory"]["total_bytes"] > 0
    assert info["read_bandwidth_gbs"] is None
