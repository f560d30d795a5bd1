"""weights="lossless12": bfloat16 expert (and, under scope="all", dense) weights packed bit for
bit in about 75 % of their bytes. Against weights="lossless" on the same model: the same logits
and greedy tokens bit for bit, at every tier; the packed bytes; exact restore; the fallbacks to
lossless (another dtype, weights the packing cannot hold) named in the report; and the store
through from_pretrained."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny, greedy_decode, olmoe

import hi_na_moe
from hi_na_moe.fastpath import linear
from hi_na_moe.core.native import native_kernels_available, native_module

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="native library not built")


def _tiers() -> list[str]:
    native = native_module()[0]
    return [t for t in ("generic", "avx2", "avx512", "amx") if native.isa_supported(t)]


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


def _run(model, ids, steps=4, **config):
    """(prompt logits, greedy decode logits, report) with hi_na_moe enabled under config."""
    rep = hi_na_moe.enable_for_model(model, **config)
    try:
        return _logits(model, ids), greedy_decode(model, ids, steps)[0], rep
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("isa", _tiers())
@pytest.mark.parametrize("scope", ["experts", "all"])
def test_same_bits_as_lossless_at_every_tier(isa, scope, monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[3, 9, 4, 7, 11, 2, 8, 5]])
    want_p, want_d, plain = _run(model, ids, isa=isa, scope=scope, weights="lossless")
    got_p, got_d, rep = _run(model, ids, isa=isa, scope=scope, weights="lossless12")
    assert torch.equal(got_p, want_p)  # prefill
    assert all(torch.equal(g, w) for g, w in zip(got_d, want_d))  # decode
    for b, p in zip(rep.blocks, plain.blocks):
        assert b.status == "accelerated" and b.weights == "bfloat16-lossless12" and not b.reason
        assert "_l12_" in b.kernel
        assert b.packed_bytes < 0.8 * p.packed_bytes
    if scope == "all":
        fmts = {d.name: d.weights for d in rep.dense}
        assert fmts and all(f == "lossless12" for n, f in fmts.items() if ".gate" not in n)
        assert rep.stacks == plain.stacks == ["model"]  # the one call (or loop) as with lossless
        assert rep.stacks_loop_only == plain.stacks_loop_only
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # restored exactly


def test_another_dtype_is_stored_lossless_and_the_report_says_why(monkeypatch):
    model = olmoe(layers=1, dtype=torch.float32)
    ids = torch.tensor([[3, 9, 4, 7]])
    want = _run(model, ids, weights="lossless")[0]
    got, _, rep = _run(model, ids, weights="lossless12")
    assert torch.equal(got, want)
    b = rep.blocks[0]
    assert b.weights == "float32" and "lossless12 packs bfloat16 weights" in b.reason
    assert "_f32_" in b.kernel


def test_weights_the_packing_cannot_hold_fall_back_to_lossless(monkeypatch):
    model = olmoe(layers=1)
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # magnitudes over ~60 binades: far more than 16 high bytes per panel
        for p in (experts.gate_up_proj, experts.down_proj):
            sign = torch.randint(0, 2, p.shape, generator=gen) * 2 - 1
            p.copy_((sign * torch.exp2(torch.randint(-40, 20, p.shape, generator=gen).float())).to(p.dtype))
    ids = torch.tensor([[3, 9, 4, 7]])
    want = _run(model, ids, weights="lossless")[0]
    got, _, rep = _run(model, ids, weights="lossless12")
    assert torch.equal(got, want)
    b = rep.blocks[0]
    assert b.weights == "bfloat16" and "stored as lossless" in b.reason and "lossless" in b.reason
    assert "_bf16_" in b.kernel


def test_from_pretrained_packs_into_the_store_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path / "store"))
    tiny = build_tiny("olmoe", torch.bfloat16)
    path = tmp_path / "ckpt"
    tiny.model.save_pretrained(path)
    ids = torch.tensor([[3, 9, 4, 7, 5]])
    ref = hi_na_moe.from_pretrained(path, weights="lossless", dtype=torch.bfloat16, progress=False)
    want = _logits(ref, ids)
    del ref
    cold = hi_na_moe.from_pretrained(path, weights="lossless12", dtype=torch.bfloat16, progress=False)
    rep = hi_na_moe.report_for(cold)
    assert all(b.weights == "bfloat16-lossless12" and b.cache == "built" for b in rep.blocks)
    assert torch.equal(_logits(cold, ids), want)
    del cold
    warm = hi_na_moe.from_pretrained(path, weights="lossless12", dtype=torch.bfloat16, progress=False)
    assert all(b.cache == "reused" for b in hi_na_moe.report_for(warm).blocks)
    assert torch.equal(_logits(warm, ids), want)
