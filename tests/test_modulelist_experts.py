"""Switch Transformers and NLLB-MoE, whose experts are separate modules (a ModuleDict of
dense-act-dense experts): the full encoder-decoder models enabled against native, at every kernel
tier, with tokens dropped by expert capacity; their routers' outputs; exact restore; and the
blocks that must stay native."""

from __future__ import annotations

import pytest
import torch
from transformers import NllbMoeForConditionalGeneration, SwitchTransformersForConditionalGeneration
from transformers.models.nllb_moe import modeling_nllb_moe
from transformers.models.switch_transformers import modeling_switch_transformers
from transformers.utils import logging as hf_logging

import hi_na_moe
from hi_na_moe.core.native import native_kernels_available
from tiny_models import build_tiny

FULL = {"switch_transformers": SwitchTransformersForConditionalGeneration, "nllb-moe": NllbMoeForConditionalGeneration}
BLOCKS = {"switch_transformers": "SwitchTransformersSparseMLP", "nllb-moe": "NllbMoeSparseMLP"}
MODEL_TYPES = list(FULL)
# A token's expert capacity, small enough that the tiny models' inputs overflow it: Switch counts
# it per sequence (expert_capacity), NLLB in eval as a fraction of the call's tokens.
SMALL_CAPACITY = {"switch_transformers": {"expert_capacity": 1}, "nllb-moe": {"moe_eval_capacity_token_fraction": 0.2}}

needs_native = pytest.mark.skipif(not native_kernels_available(), reason="native kernels not built")


def _tiers():
    native = pytest.importorskip("hi_na_moe._native")
    return [t for t in ("generic", "avx2", "avx512", "amx") if native.isa_supported(t)]


def _full_model(model_type: str, path, dtype=torch.float32, **overrides):
    """The tiny random model of tiny_models.build_tiny (the family's base model), saved and loaded
    back as its *ForConditionalGeneration (its lm_head is tied to the shared embedding)."""
    tiny = build_tiny(model_type, **overrides)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tiny.model.save_pretrained(path)
        return FULL[model_type].from_pretrained(path, dtype=dtype).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _inputs(model, seed=1, rows=2, length=7):
    ids = torch.randint(3, 200, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0  # padding in one row: NLLB's routers take the padding mask
    ids[0, -2:] = model.config.pad_token_id
    dec = torch.randint(3, 200, (rows, 5), generator=torch.Generator().manual_seed(seed + 1))
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)


def _generate(model, inputs):
    start = getattr(model.config, "decoder_start_token_id", None)
    return model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=8,
                          do_sample=False, decoder_start_token_id=model.config.pad_token_id if start is None else start)


def _router_outputs(out) -> dict[str, torch.Tensor]:
    """The router logits transformers records per sparse layer and the losses it computes from
    them (z-loss, aux loss, and the loss they are added to)."""
    got = {}
    for key in ("encoder_router_logits", "decoder_router_logits"):
        for i, t in enumerate(getattr(out, key) or ()):
            got[f"{key}.{i}"] = t
    for key in ("encoder_z_loss", "encoder_aux_loss", "decoder_z_loss", "decoder_aux_loss", "loss"):
        v = getattr(out, key, None)
        if isinstance(v, torch.Tensor):
            got[key] = v
    return got


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _record_routing(model):
    """Hooks recording each router call's outputs: (handles, list of (capacity-masked choice,
    combine weights))."""
    calls = []
    for m in model.modules():
        if type(m).__name__ in ("SwitchTransformersTop1Router", "NllbMoeTop2Router"):
            m.register_forward_hook(lambda _m, _a, out: calls.append((out[0].detach().clone(), out[1].detach().clone())))
    return calls


@needs_native
@pytest.mark.parametrize("small_capacity", [False, True], ids=["capacity-ample", "capacity-drops"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_full_model_matches_native_at_every_tier(model_type, small_capacity, tmp_path):
    overrides = SMALL_CAPACITY[model_type] if small_capacity else {}
    model = _full_model(model_type, tmp_path / "m", **overrides)
    inputs = _inputs(model)
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = _record_routing(model)
    with torch.no_grad():
        native = model(**inputs, labels=inputs["decoder_input_ids"], output_router_logits=True)
        native_tokens = _generate(model, inputs)
    routed = calls[:2]  # the forward's encoder and decoder routers
    if small_capacity:
        # the capacity rule dropped tokens: zero one-hot rows (Switch), a dropped top-1 and a
        # dropped top-2 (NLLB)
        if model_type == "switch_transformers":
            assert sum(int((choice.sum(-1) == 0).sum()) for choice, _ in routed) > 0
        else:
            assert sum(int((choice.sum(-1) == 0).sum()) for choice, _ in routed) > 0
            assert sum(int(((w != 0).sum(-1) == 1).sum()) for _, w in routed) > 0
    for isa in _tiers():
        report = hi_na_moe.enable_for_model(model, backend="native", isa=isa)
        try:
            assert len(report.blocks) == 2 and not report.native, str(report)
            decode_tier = "avx512" if isa == "amx" else isa  # the AMX tier decodes with AVX-512 FMA
            assert {b.kernel.split("|")[0].rsplit("_", 1)[1] for b in report.blocks} == {decode_tier}
            assert {b.module_class for b in report.blocks} == {BLOCKS[model_type]}
            # the model's own expert weights are released (zero-byte placeholders) ...
            assert all(b.released_bytes == b.expert_bytes > 0 for b in report.blocks)
            expert_params = [p for n, (p, _) in params.items() if ".experts." in n]
            assert expert_params and all(p.untyped_storage().nbytes() <= 4 for p in expert_params)
            # ... but state_dict (save_pretrained) still returns them
            sd = model.state_dict()
            assert all(torch.equal(sd[k], v) for k, v in state.items())
            with torch.no_grad():
                ours = model(**inputs, labels=inputs["decoder_input_ids"], output_router_logits=True)
                tokens = _generate(model, inputs)
        finally:
            hi_na_moe.disable_for_model(model)
        rel = _rel(ours.logits, native.logits)
        assert rel < 1e-5, f"{model_type} {isa}: fp32 logits rel L2 {rel:.2e}"
        assert torch.equal(tokens, native_tokens), f"{model_type} {isa}: greedy tokens differ"
        want, got = _router_outputs(native), _router_outputs(ours)
        assert {"encoder_aux_loss", "decoder_aux_loss", "loss"} <= want.keys() == got.keys()
        for key in want:
            assert _rel(got[key], want[key]) < 1e-5, f"{model_type} {isa}: {key} differs"
        # restored: the same parameter objects, bit for bit, each with storage of its own again
        for n, p in model.named_parameters():
            assert p is params[n][0] and torch.equal(p, params[n][1]), n
        assert len({p.untyped_storage().data_ptr() for p in expert_params}) == len(expert_params)
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, native.logits)


@needs_native
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_bf16_at_every_tier(model_type, tmp_path):
    model = _full_model(model_type, tmp_path / "m", dtype=torch.bfloat16)
    inputs = _inputs(model, seed=5)
    with torch.no_grad():
        native = model(**inputs).logits.float()
    for isa in _tiers():
        report = hi_na_moe.enable_for_model(model, backend="native", isa=isa)
        try:
            assert not report.native and {b.weights for b in report.blocks} == {"bfloat16"}
            with torch.no_grad():
                ours = model(**inputs).logits.float()
        finally:
            hi_na_moe.disable_for_model(model)
        rel = _rel(ours, native)
        assert rel < 2e-2, f"{model_type} {isa}: bf16 logits rel L2 {rel:.2e} beyond bf16 rounding"
        agree = (ours.argmax(-1) == native.argmax(-1)).float().mean().item()
        assert agree >= 0.9, f"{model_type} {isa}: bf16 greedy top-1 agreement {agree:.2f}"


def _block_and_input(model, model_type, tokens=24, seed=3):
    block = next(m for m in model.modules() if type(m).__name__ == BLOCKS[model_type])
    h = torch.randn(2, tokens // 2, model.config.d_model, generator=torch.Generator().manual_seed(seed))
    return block, h


@needs_native
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_capacity_dropped_tokens_block_level(model_type, tmp_path):
    """One block on enough tokens that many overflow their experts' capacity: its output against
    its own forward's, at every tier; a token dropped from all its experts gets a zero row."""
    # NLLB: 24 tokens at a capacity of ceil(0.25 * 24) = 6 places an expert
    overrides = SMALL_CAPACITY[model_type] if model_type == "switch_transformers" else {
        "moe_eval_capacity_token_fraction": 0.25}
    model = _full_model(model_type, tmp_path / "m", **overrides)
    block, h = _block_and_input(model, model_type, seed=4)
    calls = _record_routing(model)
    with torch.no_grad():
        want = block(h)
    choice, weights = calls[0]
    if model_type == "switch_transformers":
        gone = choice.reshape(-1, choice.shape[-1]).sum(-1) == 0
    else:
        gone = (weights != 0).sum(-1) == 0  # top-1 and top-2 both dropped
        top1_kept, one_kept = choice.sum(-1) == 1, (weights != 0).sum(-1) == 1
        assert int((top1_kept & one_kept).sum()) > 0  # the top-2 dropped alone
        assert int((~top1_kept & one_kept).sum()) > 0  # the top-1 dropped alone
    assert 0 < int(gone.sum()) < gone.numel()
    assert torch.count_nonzero(want.reshape(-1, want.shape[-1])[gone]) == 0
    for isa in _tiers():
        hi_na_moe.enable_for_model(model, backend="native", isa=isa)
        try:
            with torch.no_grad():
                got = block(h)
        finally:
            hi_na_moe.disable_for_model(model)
        assert _rel(got, want) < 1e-5, isa
        assert torch.count_nonzero(got.reshape(-1, got.shape[-1])[gone]) == 0


@pytest.mark.parametrize("policy", ["all", "sampling", "random"])
def test_nllb_second_expert_policies(policy, tmp_path):
    """NLLB's router draws random numbers in eval for the "sampling" (Gumbel noise on the
    logits) and "random" (keep the second expert with probability 2 p) policies: it runs
    untouched, so the same seed gives the same routing as natively."""
    model = _full_model("nllb-moe", tmp_path / "m", second_expert_policy=policy)
    inputs = _inputs(model, seed=7)
    with torch.no_grad():
        torch.manual_seed(11)
        native = model(**inputs).logits
        torch.manual_seed(12)
        other_draw = model(**inputs).logits
        report = hi_na_moe.enable_for_model(model)
        try:
            assert not report.native
            torch.manual_seed(11)
            ours = model(**inputs).logits
        finally:
            hi_na_moe.disable_for_model(model)
    assert _rel(ours, native) < 1e-5
    if policy != "all":  # the draw matters: a test that the seed is what makes them agree
        assert _rel(other_draw, native) > 1e-4


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_training_mode_runs_the_experts_own_code(model_type, tmp_path):
    """Training mode: router jitter (Switch) and the experts' dropout draw random numbers; with
    keep_weights=True the block runs its experts' own code, bit for bit the native forward and
    its gradients. With the weights released it is a clear error, never zeros."""
    model = _full_model(model_type, tmp_path / "m")
    inputs = _inputs(model, seed=9)
    labels = inputs["decoder_input_ids"]
    model.train()
    torch.manual_seed(21)
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    hi_na_moe.enable_for_model(model, keep_weights=True)
    try:
        torch.manual_seed(21)
        ours = model(**inputs, labels=labels).loss
        ours.backward()
    finally:
        hi_na_moe.disable_for_model(model)
    assert torch.equal(ours, loss)
    assert any(".experts." in n for n in grads)
    for n, g in grads.items():
        assert torch.equal(dict(model.named_parameters())[n].grad, g), n
    if native_kernels_available():
        hi_na_moe.enable_for_model(model)
        try:
            with pytest.raises(RuntimeError, match="training mode.*keep_weights=True"):
                model(**inputs, labels=labels)
        finally:
            hi_na_moe.disable_for_model(model)


def _assert_enabled_logits_unchanged(model, inputs):
    """Logits with hi_na_moe enabled equal the native ones bit for bit (blocks left native)."""
    with torch.no_grad():
        want = model(**inputs).logits
        hi_na_moe.enable_for_model(model)
        try:
            got = model(**inputs).logits
        finally:
            hi_na_moe.disable_for_model(model)
    assert torch.equal(got, want)


def _fairseq_nllb_experts_forward(self, hidden_states, router_mask, router_probs):
    """NLLB-MoE as fairseq (and transformers 4.x) compute it: every expert with a nonzero combine
    weight, weighted by it (transformers 5.23 runs experts 0 and 1 only, by top-1 mask value)."""
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        rows = router_probs[:, e] != 0
        if rows.any():
            y = self[f"expert_{e}"](hidden_states[rows]) * router_probs[rows, e, None]
            if self.moe_token_dropout > 0 and not self.training:
                y = y * (1 - self.moe_token_dropout)
            out[rows] += y.to(out.dtype)
    return out


def test_nllb_experts_routing_found_from_their_own_forward(tmp_path, monkeypatch):
    """The routing handed to the experts op is the one the experts module's own forward is found
    to compute on probe experts: transformers 5.23's (experts 0 and 1, by top-1 mask value) as
    shipped, fairseq's (by expert index) when the forward computes that."""
    model = _full_model("nllb-moe", tmp_path / "m")
    inputs = _inputs(model, seed=13)
    results = {}
    for name in ("5.23", "fairseq"):
        if name == "fairseq":
            monkeypatch.setattr(modeling_nllb_moe.NllbMoeExperts, "forward", _fairseq_nllb_experts_forward)
        with torch.no_grad():
            native = model(**inputs).logits
            report = hi_na_moe.enable_for_model(model)
            try:
                assert not report.native
                ours = model(**inputs).logits
            finally:
                hi_na_moe.disable_for_model(model)
        assert _rel(ours, native) < 1e-5, name
        results[name] = native
    # the two routings differ on this model: the probe told them apart
    assert _rel(results["fairseq"], results["5.23"]) > 1e-3


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_unrecognised_experts_forward_stays_native(model_type, tmp_path, monkeypatch):
    """An experts forward that computes something else than the routings the adapter knows (here:
    each expert's output not weighted by the router) keeps the block native, with the reason."""
    model = _full_model(model_type, tmp_path / "m")
    inputs = _inputs(model, seed=15)
    experts_cls = (modeling_switch_transformers.SwitchTransformersExperts if model_type == "switch_transformers"
                   else modeling_nllb_moe.NllbMoeExperts)
    original = experts_cls.forward

    def unweighted(self, hidden_states, choice, weights):
        return original(self, hidden_states, choice, (weights != 0).to(weights.dtype))

    monkeypatch.setattr(experts_cls, "forward", unweighted)
    report = hi_na_moe.inspect_model(model)
    assert len(report.native) == 2 and not report.accelerated
    assert all(f"{experts_cls.__name__}.forward" in b.reason for b in report.native)
    _assert_enabled_logits_unchanged(model, inputs)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_mixed_dtype_experts_stay_native(model_type, tmp_path):
    """A bfloat16 model whose experts' output Linears are kept in float32 (as T5 keeps its `wo`):
    the expert casts its activations between the two, which one packed block cannot; the block
    stays native and says why."""
    model = _full_model(model_type, tmp_path / "m", dtype=torch.bfloat16)
    out_name = "wo" if model_type == "switch_transformers" else "fc2"
    for name, m in model.named_modules():
        if ".experts.expert_" in name and name.endswith("." + out_name):
            m.float()
    inputs = _inputs(model, seed=17)
    report = hi_na_moe.inspect_model(model)
    assert len(report.native) == 2
    assert all("mix dtypes (bfloat16, float32)" in b.reason for b in report.native)
    _assert_enabled_logits_unchanged(model, inputs)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_reference_backend(model_type, tmp_path):
    """The pure-PyTorch reference path reads each expert's own parameters (ExpertsSpec.members)."""
    model = _full_model(model_type, tmp_path / "m", **SMALL_CAPACITY[model_type])
    inputs = _inputs(model, seed=19)
    with torch.no_grad():
        native = model(**inputs).logits
        report = hi_na_moe.enable_for_model(model, backend="reference")
        try:
            assert {b.status for b in report.blocks} == {"reference"}
            ours = model(**inputs).logits
        finally:
            hi_na_moe.disable_for_model(model)
    assert _rel(ours, native) < 1e-5


@needs_native
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_quantised_and_streamed_from_the_checkpoint(model_type, tmp_path):
    """int8 experts (their exact backup in the store, restored through each expert's own
    parameters), and hi_na_moe.from_pretrained streaming each expert's Linears from the files."""
    from transformers import AutoModelForSeq2SeqLM

    model = _full_model(model_type, tmp_path / "m")
    inputs = _inputs(model, seed=23)
    with torch.no_grad():
        native = model(**inputs).logits
        report = hi_na_moe.enable_for_model(model, weights="int8")
        try:
            assert all(b.released_bytes == b.expert_bytes > 0 for b in report.blocks)
            int8 = model(**inputs).logits
        finally:
            hi_na_moe.disable_for_model(model)
        assert torch.equal(model(**inputs).logits, native)
    assert 0 < _rel(int8, native) < 1e-2
    streamed = hi_na_moe.from_pretrained(tmp_path / "m", weights="lossless", model_class=AutoModelForSeq2SeqLM,
                                         progress=False)
    try:
        report = hi_na_moe.report_for(streamed)
        assert len(report.blocks) == 2 and all("streamed from the checkpoint" in b.reason for b in report.blocks)
        with torch.no_grad():
            ours = streamed(**inputs).logits
    finally:
        hi_na_moe.disable_for_model(streamed)
    assert _rel(ours, native) < 1e-5
    with torch.no_grad():
        assert torch.equal(streamed(**inputs).logits, native)
