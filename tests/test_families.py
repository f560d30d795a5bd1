"""Every MoE family of the installed transformers, found from transformers itself: a tiny random
model saved and reloaded as a user would, then enabled vs native."""

from __future__ import annotations

import pytest
import torch

import hi_na_moe
from hi_na_moe.families import moe_families
from tiny_models import UNBUILDABLE, build_tiny, forward_inputs, reload

FAMILIES = [f.model_type for f in moe_families()]

# Blocks that are MoE but stay native, asserted explicitly (family -> block class -> reason text).
EXPECTED_NATIVE = {
    "jetmoe": {"JetMoeMoA": "attention experts"},
}
# Families that are not text decoders; the "no unsupported families" rule is for text decoders.
# (Switch Transformers and NLLB-MoE, encoder-decoders, are accelerated: tests/test_modulelist_experts.py.)
NOT_TEXT_DECODERS: set[str] = set()


def _logits(out) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def test_enumeration_finds_the_known_families():
    # A floor, not the list: the enumeration comes from transformers and grows with it.
    for must in ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "dbrx", "jetmoe",
                 "llama4", "phimoe", "granitemoe", "jamba", "qwen3_next", "longcat_flash", "doge"):
        assert must in FAMILIES
    assert len(FAMILIES) >= 60


@pytest.fixture(scope="module")
def tmp_models(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.mark.parametrize("backend", ["auto", "reference"])  # auto: native kernels where they fit
@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_fp32(model_type, backend, tmp_models):
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny model for {model_type}: {UNBUILDABLE[model_type]}")
    tiny = reload(build_tiny(model_type), tmp_models / f"{model_type}-{backend}")
    model = tiny.model
    ids = torch.randint(0, min(tiny.vocab_size, 200), (2, 7), generator=torch.Generator().manual_seed(1))
    inputs = forward_inputs(tiny, ids)

    dry = hi_na_moe.inspect_model(model)
    assert dry.blocks, f"{model_type}: no MoE block discovered"
    expected_native = EXPECTED_NATIVE.get(model_type, {})
    for b in dry.native:
        assert b.module_class in expected_native, f"{model_type}: {b.name} left native: {b.reason}"
        assert expected_native[b.module_class] in b.reason
    if model_type not in NOT_TEXT_DECODERS:
        assert len(dry.native) < len(dry.blocks)

    with torch.no_grad():
        before = _logits(model(**inputs))
        report = hi_na_moe.enable_for_model(model, backend=backend)
        assert [b.name for b in report.blocks] == [b.name for b in dry.blocks]
        if backend == "reference":
            assert not report.accelerated
        assert ("hi_na_moe=" in repr(model)) == (len(report.native) < len(report.blocks))
        enabled = _logits(model(**inputs))
        gen_on = model.generate(ids, max_new_tokens=8, do_sample=False) if tiny.causal_lm else None
        hi_na_moe.disable_for_model(model)
        assert "hi_na_moe=" not in repr(model)
        after = _logits(model(**inputs))
        gen_off = model.generate(ids, max_new_tokens=8, do_sample=False) if tiny.causal_lm else None

    rel = ((enabled - before).norm() / before.norm()).item()
    assert rel < 1e-5, f"{model_type}: fp32 logits differ, rel L2 {rel:.2e}"
    assert torch.equal(before, after), f"{model_type}: disable did not restore bit-identical logits"
    if tiny.causal_lm:
        assert torch.equal(gen_on, gen_off), f"{model_type}: greedy tokens differ"


# bf16 on a representative set of layouts (concatenated, interleaved+transposed+bias, no gate,
# shared experts, block adapters); fp32 covers every family above.
BF16_FAMILIES = ["olmoe", "mixtral", "gpt_oss", "nemotron_h", "qwen2_moe", "deepseek_v3", "dbrx", "jetmoe",
                 "llama4", "longcat_flash", "doge", "step3p7"]


@pytest.mark.parametrize("model_type", [f for f in BF16_FAMILIES if f in FAMILIES])
def test_family_bf16(model_type):
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny model for {model_type}: {UNBUILDABLE[model_type]}")
    tiny = build_tiny(model_type, dtype=torch.bfloat16)
    ids = torch.randint(0, min(tiny.vocab_size, 200), (2, 9), generator=torch.Generator().manual_seed(2))
    inputs = forward_inputs(tiny, ids)
    with torch.no_grad():
        native = _logits(tiny.model(**inputs)).float()
        hi_na_moe.enable_for_model(tiny.model)
        ours = _logits(tiny.model(**inputs)).float()
        hi_na_moe.disable_for_model(tiny.model)
    rel = ((ours - native).norm() / native.norm()).item()
    assert rel < 2e-2, f"{model_type}: bf16 logits rel L2 {rel:.2e} beyond bf16 rounding"
    agree = (ours.argmax(-1) == native.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"{model_type}: bf16 greedy top-1 agreement {agree:.2f}"


def _tiers():
    native = pytest.importorskip("hi_na_moe._native")
    return [t for t in ("generic", "avx2", "avx512", "amx") if native.isa_supported(t)]


# Every kernel tier this machine has, forced, on layouts that reach different kernel features
# (biases + interleaved + clamped gate, no gate, weight on input, identity experts).
@pytest.mark.parametrize("model_type", ["olmoe", "gpt_oss", "nemotron_h", "llama4", "longcat_flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_family_every_tier(model_type, dtype):
    tiny = build_tiny(model_type, dtype=dtype)
    ids = torch.randint(0, min(tiny.vocab_size, 200), (2, 9), generator=torch.Generator().manual_seed(3))
    inputs = forward_inputs(tiny, ids)
    with torch.no_grad():
        native = _logits(tiny.model(**inputs)).float()
        for isa in _tiers():
            report = hi_na_moe.enable_for_model(tiny.model, backend="native", isa=isa)
            decode_tier = "avx512" if isa == "amx" else isa  # the AMX tier decodes with AVX-512 FMA
            assert {b.kernel.split("|")[0].rsplit("_", 1)[1] for b in report.blocks} == {decode_tier}
            ours = _logits(tiny.model(**inputs)).float()
            hi_na_moe.disable_for_model(tiny.model)
            rel = ((ours - native).norm() / native.norm()).item()
            assert rel < (1e-5 if dtype == torch.float32 else 2e-2), f"{model_type} {isa} {dtype}: rel L2 {rel:.2e}"
