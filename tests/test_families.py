"""Every MoE family of the installed transformers, found from transformers itself: a tiny random
model of the class a user loads (its causal LM, or the whole multimodal model: tiny_models.
user_model_class) saved and loaded back as a user would, in fp32 and in bf16, then enabled vs
native: logits, greedy tokens, and disable giving back the model bit for bit (logits, and each
parameter's and buffer's layout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import hi_na_moe
from hi_na_moe.integrate.families import moe_families
from tiny_models import UNBUILDABLE, build_tiny, forward_inputs, layout, layout_diff, load_tiny, misalign, save_tiny

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


# Models without a forward of their own (they generate text and speech through their parts): the
# parts whose forwards are compared (the first on the token ids, the others on random embeddings of
# their width), and the part that generates text.
PARTS = {"qwen3_omni_moe": (("thinker", "talker.model"), "thinker")}


def _outputs(tiny, inputs) -> list[torch.Tensor]:
    """The logits (or last hidden states) of the model's forward, or of each of its PARTS."""
    torch.manual_seed(0)  # DiffusionGemma draws its canvas noise in the forward
    if tiny.model_type not in PARTS:
        return [_logits(tiny.model(**inputs))]
    first, *others = (tiny.model.get_submodule(name) for name in PARTS[tiny.model_type][0])
    outs = [_logits(first(**inputs))]
    ids = inputs["input_ids"]
    for part in others:
        g = torch.Generator().manual_seed(len(outs))
        embeds = torch.randn(*ids.shape, part.config.hidden_size, generator=g).to(part.dtype)
        outs.append(_logits(part(inputs_embeds=embeds)))
    return outs


def _generate(tiny, ids) -> torch.Tensor:
    kw = {}
    if getattr(tiny.config, "is_encoder_decoder", False) and getattr(tiny.config, "decoder_start_token_id", None) is None:
        kw["decoder_start_token_id"] = tiny.config.pad_token_id
    model = tiny.model.get_submodule(PARTS[tiny.model_type][1]) if tiny.model_type in PARTS else tiny.model
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, **kw)
    return getattr(out, "sequences", out)  # DiffusionGemma returns an output object


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_enumeration_finds_the_known_families():
    # A floor, not the list: the enumeration comes from transformers and grows with it.
    for must in ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "dbrx", "jetmoe",
                 "llama4", "phimoe", "granitemoe", "jamba", "qwen3_next", "longcat_flash", "doge",
                 "diffusion_gemma", "inkling_mm_model"):
        assert must in FAMILIES
    assert len(FAMILIES) >= 72


def test_enumeration_covers_every_modeling_file_with_experts():
    """Read off the installed transformers' files, not through families.py's rule: every modeling
    package with an experts class (@use_experts_implementation) is a family's. A type's package
    need not bear its name: Inkling's checkpoints are `inkling_mm_model`, in package `inkling`
    (the enumeration once looked for `transformers.models.<type>` and missed it)."""
    root = Path(transformers.__file__).parent / "models"
    packages = {f.modeling_module.split(".")[2] for f in moe_families()}
    with_experts = [path.parent.name for path in sorted(root.glob("*/modeling_*.py"))
                    if path.name == f"modeling_{path.parent.name}.py"
                    and "@use_experts_implementation" in path.read_text(encoding="utf-8")]
    assert with_experts
    missing = sorted(set(with_experts) - packages)
    assert not missing, f"modeling packages with experts but no family: {missing}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """model_type -> (path, class, vocab size) of its tiny model of the user's class, saved once
    (in fp32) for every test of this module."""
    root, saved = tmp_path_factory.mktemp("tiny_checkpoints"), {}

    def get(model_type: str):
        if model_type in UNBUILDABLE:
            pytest.skip(f"no tiny model for {model_type}: {UNBUILDABLE[model_type]}")
        if model_type not in saved:
            tiny = build_tiny(model_type, user_class=True)
            save_tiny(tiny, root / model_type)
            saved[model_type] = (root / model_type, type(tiny.model), tiny.vocab_size)
        return saved[model_type]

    return get


def _load(checkpoint, model_type, dtype):
    """The saved tiny model loaded in `dtype`, every tensor off the 64-byte boundaries (as a real
    checkpoint's are, at the file's offsets: tiny_models.misalign)."""
    path, cls, vocab = checkpoint(model_type)
    tiny = load_tiny(model_type, cls, path, dtype, vocab)
    misalign(tiny.model)
    return tiny


@pytest.mark.parametrize("backend", ["auto", "reference"])  # auto: native kernels where they fit
@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_fp32(model_type, backend, checkpoint):
    tiny = _load(checkpoint, model_type, torch.float32)
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
        before, before_layout = _outputs(tiny, inputs), layout(model)
        gen_off = _generate(tiny, ids) if tiny.generates else None
        report = hi_na_moe.enable_for_model(model, backend=backend)
        assert [b.name for b in report.blocks] == [b.name for b in dry.blocks]
        if backend == "reference":
            assert not report.accelerated
        assert ("hi_na_moe=" in repr(model)) == (len(report.native) < len(report.blocks))
        enabled = _outputs(tiny, inputs)
        gen_on = _generate(tiny, ids) if tiny.generates else None
        hi_na_moe.disable_for_model(model)
        assert "hi_na_moe=" not in repr(model)
        after = _outputs(tiny, inputs)

    for part, (want, got, back) in enumerate(zip(before, enabled, after)):
        rel = _rel(got, want)
        assert rel < 1e-5, f"{model_type}: fp32 logits differ (output {part}), rel L2 {rel:.2e}\n{report}"
        assert torch.equal(want, back), f"{model_type}: disable did not restore bit-identical logits (output {part})"
    diff = layout_diff(before_layout, layout(model))
    assert not diff, f"{model_type}: disable did not restore the tensors' layout:\n{diff}"
    if tiny.generates:
        assert torch.equal(gen_on, gen_off), f"{model_type}: greedy tokens differ"


def _first_tensor(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else next(t for t in out if isinstance(t, torch.Tensor))


def _record_first_calls(modules: dict) -> tuple[dict, list]:
    """name -> (args, kwargs, output) of each module's first call from now on (copies), and the
    hooks' handles."""
    calls: dict = {}

    def hook(name):
        def record(mod, args, kwargs, out):
            if name not in calls:
                copy = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
                calls[name] = (tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()},
                               _first_tensor(out).detach().clone())
        return record

    return calls, [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in modules.items()]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_bf16(model_type, checkpoint):
    """bf16, block by block: each MoE block hi_na_moe runs, called on the inputs it had in the
    native forward, against its native output (bf16 rounding apart: the kernels accumulate in
    fp32). Whole logits are not compared: in a tiny random model a rounding difference moves a
    near-tied router to another expert and the logits with it (Qwen3.5-MoE's second layer does)."""
    tiny = _load(checkpoint, model_type, torch.bfloat16)
    model = tiny.model
    ids = torch.randint(0, min(tiny.vocab_size, 200), (2, 9), generator=torch.Generator().manual_seed(2))
    inputs = forward_inputs(tiny, ids)
    modules = {b.name: model.get_submodule(b.name) for b in hi_na_moe.inspect_model(model).blocks if b.status != "native"}
    calls, hooks = _record_first_calls(modules)
    try:
        with torch.no_grad():
            native, before_layout = _outputs(tiny, inputs), layout(model)
    finally:
        for h in hooks:
            h.remove()
    assert calls, f"{model_type}: the forward reached none of its MoE blocks"
    with torch.no_grad():
        report = hi_na_moe.enable_for_model(model)
        try:
            for name, (args, kwargs, want) in calls.items():
                torch.manual_seed(0)
                got = _first_tensor(modules[name](*args, **kwargs))
                rel = _rel(got, want)
                assert rel < 2e-2, f"{model_type}: {name} in bf16: rel L2 {rel:.2e} beyond bf16 rounding\n{report}"
            ours = _outputs(tiny, inputs)
        finally:
            hi_na_moe.disable_for_model(model)
        after = _outputs(tiny, inputs)
    for part, (want, got, back) in enumerate(zip(native, ours, after)):
        assert got.shape == want.shape and torch.isfinite(got.float()).all(), f"{model_type}: bf16 output {part}"
        assert torch.equal(want, back), f"{model_type}: disable did not restore bit-identical bf16 logits (output {part})"
    diff = layout_diff(before_layout, layout(model))
    assert not diff, f"{model_type}: disable did not restore the tensors' layout:\n{diff}"


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
