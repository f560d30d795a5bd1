"""debug: identical runs pass; a deliberately broken kernel is caught and its layer named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hi_na_moe.core import ops
from hi_na_moe.tools.cli import shipped_model_dir
from hi_na_moe.tools.debug import compare
from hi_na_moe.core.native import native_kernels_available


@pytest.fixture(scope="module")
def shipped():
    path = shipped_model_dir()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_lossless_run_is_ok(shipped):
    model, tok = shipped
    rep = compare(model, dict(tok("Return the number of items", return_tensors="pt")))
    assert rep.ok and rep.first_divergent_layer is None and rep.top1_agreement == 1.0
    assert len(rep.layers) == 4 and len(rep.moe_blocks) == 4
    assert all(d.topk_agreement == 1.0 for d in rep.moe_blocks)


@pytest.mark.skipif(not native_kernels_available(), reason="breaks a native kernel call")
def test_broken_expert_is_located(shipped, monkeypatch):
    model, tok = shipped
    target = model.model.layers[2].mlp.experts.gate_up_proj
    original = ops.NativeExperts.__call__

    def wrong_expert(self, spec, hidden, idx, w):  # layer 2 sends every token to the next expert
        if spec.gate_up is not None and spec.gate_up.data_ptr() == target.data_ptr():
            idx = (idx + 1) % spec.num_experts
        return original(self, spec, hidden, idx, w)

    monkeypatch.setattr(ops.NativeExperts, "__call__", wrong_expert)
    rep = compare(model, dict(tok("Return the number of items", return_tensors="pt")), keep_weights=True)
    assert not rep.ok
    assert rep.first_divergent_layer == "model.layers.2"
    assert [d.rel_l2 < rep.tolerance for d in rep.layers] == [True, True, False, False]
    # the router of layer 2 saw the same input: its choice agrees; layer 3's input differs
    assert rep.moe_blocks[2].topk_agreement == 1.0 and rep.moe_blocks[2].rel_l2 > rep.tolerance


def test_cli_json_and_exit_code():
    proc = subprocess.run([sys.executable, "-m", "hi_na_moe", "debug", "--model", str(shipped_model_dir()),
                           "--prompt", "The module", "--output", "json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] and data["prompts"][0]["first_divergent_layer"] is None


def test_cli_needs_a_prompt():
    proc = subprocess.run([sys.executable, "-m", "hi_na_moe", "debug", "--model", str(shipped_model_dir())],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--prompt TEXT or --prompts FILE" in proc.stderr


def test_compare_refuses_a_bad_config_before_running_the_model(shipped, monkeypatch):
    from hi_na_moe.core.config import ConfigError

    model, tok = shipped
    inputs = dict(tok("import os", return_tensors="pt"))
    runs = []
    handle = model.register_forward_pre_hook(lambda *a: runs.append(1))
    try:
        with pytest.raises(ConfigError, match=r"'isa' \(keyword argument\) has bad value 'avx9'"):
            compare(model, inputs, isa="avx9")
        with pytest.raises(ConfigError, match=r"'weights' \(keyword argument\) has bad value 'int3'"):
            compare(model, inputs, baseline={"weights": "int3"})
    finally:
        handle.remove()
    assert runs == [], "the model ran before the config was checked"
