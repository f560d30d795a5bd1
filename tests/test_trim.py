"""Fewer experts a token than its router chose (HinaConfig.top_k; hi_na_moe.core.trim, the native
RoutingTrim in csrc/experts/trim.cpp).

What must hold: the native trim keeps the slots and gives the weights its oracle
(core.reference.trim_routing) gives, bit for bit, on ties, skipped slots and NaN; a trimmed block
computes what the untrimmed block computes on the trimmed routing, bit for bit, in every weights
format, on the decode and prefill paths and through a memory tier; a fixed top-k on a router that
does not renormalise gives the model with that k bit for bit, and on one that does, the same up
to float32 rounding; the reference backend, scope="all" and the per-block path agree; the counts
behind stats()'s experts_per_token are the slots the trim kept; top_k="model" changes nothing;
bad keys are refused naming them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny_models import build_tiny

import hi_na_moe
from hi_na_moe.core import trim as trim_mod
from hi_na_moe.core.config import ConfigError, HinaConfig, load_config
from hi_na_moe.core.native import native_kernels_available, native_module
from hi_na_moe.core.reference import trim_routing
from hi_na_moe.core.registry import patched_experts
from hi_na_moe.core.trim import Trim

native_only = pytest.mark.skipif(not native_kernels_available(), reason="the trim runs in the native op")

TRIMS = [
    Trim("fixed", keep=1), Trim("fixed", keep=2, renorm=True), Trim("fixed", keep=9),
    Trim("adaptive", threshold=0.3), Trim("adaptive", threshold=0.5, min_k=2, renorm=True),
    Trim("adaptive", threshold=0.0, renorm=True), Trim("adaptive", threshold=1.0, min_k=1, renorm=True),
]


def _routing(T: int, K: int, E: int, seed: int):
    """Routing with what a trim must get right: ties (bfloat16-valued weights, whole rows equal),
    skipped slots, a NaN, a row of negative weights and one with no valid slot."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g) * 2, dim=-1).to(torch.bfloat16).float()
    if T >= 6:
        w[1] = w[1, 0]  # every weight equal
        idx[2, K // 2] = -1
        w[3, -1] = float("nan")
        w[4] = -w[4]
        idx[5] = -1
    return idx, w


@native_only
@pytest.mark.parametrize("trim", TRIMS, ids=str)
@pytest.mark.parametrize("K", [1, 3, 8])
def test_the_native_trim_keeps_what_its_oracle_keeps_bit_for_bit(trim, K):
    native = native_module()[0]
    E = 16
    for seed in range(3):
        idx, w = _routing(40, K, E, seed)
        want_idx, want_w = trim_routing(idx, w, trim)
        got_idx, got_w = torch.empty_like(idx), torch.empty_like(w)
        kept = native.trim_routing(idx, w, got_idx, got_w, E, *trim.native_args())
        assert torch.equal(got_idx, want_idx)
        kept_mask = want_idx >= 0
        assert torch.equal(got_w[kept_mask].view(torch.int32), want_w[kept_mask].view(torch.int32))
        assert kept == int(kept_mask.sum())


def test_the_oracle_keeps_what_the_rules_say():
    """The oracle itself, on rows worked by hand."""
    idx = torch.tensor([[4, 7, 1, 9], [2, 3, -1, 5], [0, 1, 2, 3]])
    w = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.2, 0.2, 0.9, 0.05], [0.25, 0.25, 0.25, 0.25]])
    i, v = trim_routing(idx, w, Trim("adaptive", threshold=0.5))  # weight >= 0.5 x 1/4
    assert i.tolist() == [[-1, 7, 1, -1], [2, 3, -1, -1], [0, 1, 2, 3]]  # the -1 slot's 0.9 is no weight
    i, v = trim_routing(idx, w, Trim("adaptive", threshold=1.0, renorm=True))  # >= the mean of the valid weights
    assert i.tolist() == [[-1, 7, 1, -1], [2, 3, -1, -1], [0, 1, 2, 3]]
    assert v[1, 0].item() == pytest.approx(0.225)  # 0.2 x 0.45 / 0.4
    i, v = trim_routing(idx, w, Trim("fixed", keep=1, renorm=True))
    assert i.tolist() == [[-1, 7, -1, -1], [2, -1, -1, -1], [0, -1, -1, -1]]  # equal weights: the earlier slot
    assert v[0, 1].item() == pytest.approx(1.0) and v[1, 0].item() == pytest.approx(0.45)
    i, _ = trim_routing(idx, w, Trim("adaptive", threshold=1.0, min_k=2))
    assert i.tolist() == [[-1, 7, 1, -1], [2, 3, -1, -1], [0, 1, 2, 3]]


@native_only
def test_a_bad_trim_or_index_is_refused_naming_it():
    native = native_module()[0]
    idx, w = _routing(4, 2, 8, 0)
    out_i, out_w = torch.empty_like(idx), torch.empty_like(w)
    with pytest.raises(ValueError, match="'full', 'fixed' or 'adaptive'"):
        native.trim_routing(idx, w, out_i, out_w, 8, "greedy")
    with pytest.raises(ValueError, match="out of range: the experts have E = 4"):
        native.trim_routing(idx, w, out_i, out_w, 4, "fixed", keep=1)
    g = torch.randn(8, 32, 64, dtype=torch.bfloat16)
    pe = native.PackedExperts(g, g.clone(), torch.randn(8, 64, 32, dtype=torch.bfloat16), None, None, None,
                              "auto", 0, "lossless", 32)
    with pytest.raises(ValueError, match="keeps at least 1 expert"):
        pe.set_trim("fixed", keep=0)
    with pytest.raises(ValueError, match="a finite threshold >= 0"):
        pe.set_trim("adaptive", threshold=-0.5)
    with pytest.raises(ValueError, match="a finite threshold >= 0"):
        pe.set_trim("adaptive", threshold=float("inf"))
    assert pe.trim[0] == "full"


@native_only
@pytest.mark.parametrize("weights", ["lossless", "lossless12", "int8", "int4"])
@pytest.mark.parametrize("T", [1, 3, 40])
def test_a_trimmed_block_computes_the_untrimmed_block_on_the_trimmed_routing(weights, T):
    native = native_module()[0]
    E, H, I, K = 16, 128, 64, 6
    g = torch.Generator().manual_seed(1)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)  # noqa: E731
    gate, up, down = mk(E, I, H), mk(E, I, H), mk(E, H, I)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx, w = _routing(T, K, E, 3)
    w = torch.nan_to_num(w).abs().to(torch.bfloat16)  # (the kernels' NaN handling is not the trim's)
    for trim in (Trim("adaptive", threshold=0.4, renorm=True), Trim("fixed", keep=2)):
        trimmed = native.PackedExperts(gate, up, down, None, None, None, "auto", 0, weights, 32)
        plain = native.PackedExperts(gate, up, down, None, None, None, "auto", 0, weights, 32)
        trimmed.set_trim(*trim.native_args())
        got, want = torch.empty(T, H, dtype=torch.bfloat16), torch.empty(T, H, dtype=torch.bfloat16)
        trimmed.forward(x, idx, w, got)
        t_idx, t_w = trim_routing(idx, w, trim)
        plain.forward(x, t_idx, t_w, want)
        assert torch.equal(got, want), (weights, trim)
        tokens, slots = trimmed.routing_counts()
        assert (tokens, slots) == (T, int((t_idx >= 0).sum()))
        assert plain.routing_counts(reset=True) == (T, int((t_idx >= 0).sum()))
        assert plain.routing_counts() == (0, 0)


# ---- whole models -------------------------------------------------------------------------------

TINY = dict(num_experts=16, num_hidden_layers=2, hidden_size=64, intermediate_size=32)


def _olmoe(k: int, norm: bool, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    return build_tiny("olmoe", dtype=dtype, num_experts_per_tok=k, norm_topk_prob=norm, **TINY).model


@contextlib.contextmanager
def _enabled(m, **kw):
    report = hi_na_moe.enable_for_model(m, **kw)
    try:
        yield report
    finally:
        hi_na_moe.disable_for_model(m)


def _prompt(n: int = 12, rows: int = 1):
    return torch.randint(3, 100, (rows, n), generator=torch.Generator().manual_seed(5))


def _logits(m, x):
    with torch.no_grad():
        return m(x).logits


@native_only
@pytest.mark.parametrize("scope", ["experts", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fixed_top_k_on_a_router_that_does_not_renormalise_is_the_model_with_that_k(scope, dtype):
    """OLMoE's router (norm_topk_prob=False) weights its k experts by their softmax probability
    over all experts: keeping the 2 largest of 4 leaves exactly the weights of the model with k=2,
    and the kernels sum a token's experts in expert order, whatever their slots."""
    big, small = _olmoe(4, False, dtype), _olmoe(2, False, dtype)
    small.load_state_dict(big.state_dict())
    x = _prompt()
    with _enabled(small, scope=scope):
        want = _logits(small, x)
    with _enabled(big, scope=scope, top_k=2) as report:
        got = _logits(big, x)
        s = hi_na_moe.stats(big)
    assert "top_k=2: each token keeps its 2 largest-weight experts" in str(report)
    assert "norm_topk_prob=False" in str(report)
    assert torch.equal(got, want)
    assert s["top_k"] == 2 and s["experts_per_token"] == 2.0
    assert not torch.equal(_logits(big, x), want)  # disabled: the model's own 4 experts


@native_only
def test_a_fixed_top_k_on_a_router_that_renormalises_is_the_model_with_that_k_up_to_rounding():
    big, small = _olmoe(4, True), _olmoe(2, True)
    small.load_state_dict(big.state_dict())
    x = _prompt()
    with _enabled(small):
        want = _logits(small, x)
    with _enabled(big, top_k=2, top_k_renorm="auto") as report:
        got = _logits(big, x)
    assert "norm_topk_prob=True" in str(report) and "kept weights renormalised" in str(report)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with _enabled(big, top_k=2, top_k_renorm="off"):  # the weights as the router gave them: another model
        assert not torch.allclose(_logits(big, x), want, rtol=1e-3, atol=1e-3)


class _Capture:
    """The routing each experts module receives (forward pre-hooks: the per-block path)."""

    def __init__(self, m):
        self.calls = []
        self.handles = [layer.mlp.experts.register_forward_pre_hook(self.hook) for layer in m.model.layers]

    def hook(self, module, args):
        self.calls.append((args[1].clone(), args[2].clone()))

    def close(self):
        for h in self.handles:
            h.remove()


@native_only
def test_adaptive_counts_the_slots_its_oracle_keeps_and_the_paths_agree():
    m = _olmoe(4, False, seed=3)
    x = _prompt(rows=2)
    # (a random router's weights are nearly even: the threshold is set at one even share of them)
    cfg = dict(top_k="adaptive", top_k_threshold=1.0, top_k_renorm="on")
    trim = Trim("adaptive", threshold=1.0, min_k=1, renorm=True)
    with _enabled(m, backend="reference", **cfg) as report:
        want = _logits(m, x)
        assert hi_na_moe.stats(m)["experts_per_token"] is None  # the reference path is not counted
    assert "adaptive: an expert stays while its weight is >= 1 x an even share of the token's routing weight, " \
           "at least 1 a token; kept weights renormalised (top_k_renorm='on')" in str(report)
    with _enabled(m, **cfg):
        cap = _Capture(m)
        try:
            got = _logits(m, x)
        finally:
            cap.close()
        s = hi_na_moe.stats(m)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    kept = [int((trim_routing(i, w, trim)[0] >= 0).sum()) for i, w in cap.calls]
    assert [r["slots"] for r in s["routing"].values()] == kept
    assert all(r["tokens"] == x.numel() for r in s["routing"].values())
    assert 1.0 <= s["experts_per_token"] < 4.0  # something was dropped, and every token kept one
    with _enabled(m, scope="all", **cfg):
        torch.testing.assert_close(_logits(m, x), want, rtol=1e-5, atol=1e-5)
        assert hi_na_moe.stats(m)["experts_per_token"] == pytest.approx(s["experts_per_token"])
    # generate: the one-call decode step and batched rows trim as the per-block path does
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad(), _enabled(m, **cfg):
        seq_blocks = m.generate(x, attention_mask=torch.ones_like(x), **kw)
    with torch.no_grad(), _enabled(m, scope="all", **cfg):
        seq_all = m.generate(x, attention_mask=torch.ones_like(x), **kw)
    assert torch.equal(seq_blocks, seq_all)


@native_only
def test_top_k_model_changes_nothing_and_counts_the_models_k():
    m = _olmoe(4, False)
    x = _prompt()
    with _enabled(m):
        want = _logits(m, x)
        assert hi_na_moe.stats(m)["experts_per_token"] == 4.0
    with _enabled(m, top_k="model") as report:
        assert torch.equal(_logits(m, x), want)
        assert "top_k=" not in str(report)
    with _enabled(m, top_k=4):  # every slot kept
        assert torch.equal(_logits(m, x), want)


@native_only
def test_a_trimmed_model_through_the_memory_tier_gives_the_trimmed_model_in_memory(tmp_path):
    m = _olmoe(4, False, torch.bfloat16)
    x = _prompt(20)
    kw = dict(weights="int4", cache_dir=str(tmp_path), top_k="adaptive", top_k_threshold=1.0, top_k_renorm="on")
    with _enabled(m, **kw):
        want = _logits(m, x)
        block = patched_experts(m.model.layers[0].mlp.experts)
        info = native_module()[0].header_info(block.packed.header)
        slot = int(native_module()[0].tier_slot_bytes(info["gu_expert_bytes"], info["down_expert_bytes"]))
    with _enabled(m, memory_limit=5 * slot, **kw):
        got = _logits(m, x)
        s = hi_na_moe.stats(m)
    assert s["memory_tier"] is True and s["misses"] > 0
    assert torch.equal(got, want)


@native_only
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_set_top_k_switches_an_enabled_model_as_enabling_with_it_would(backend):
    m = _olmoe(4, False)
    x = _prompt()
    with _enabled(m, backend=backend, top_k=2):
        want2 = _logits(m, x)
    with _enabled(m, backend=backend):
        want = _logits(m, x)
    with _enabled(m, backend=backend) as report:
        text = hi_na_moe.set_top_k(m, 2)
        assert "each token keeps its 2 largest-weight experts" in text and report.top_k == text
        assert torch.equal(_logits(m, x), want2)
        s = hi_na_moe.stats(m)
        assert s["top_k"] == 2 and s["experts_per_token"] == (2.0 if backend == "auto" else None)
        hi_na_moe.set_top_k(m, "adaptive", threshold=1.0, renorm="on")
        assert hi_na_moe.stats(m)["top_k"] == "adaptive"
        with pytest.raises(ConfigError, match="top_k_threshold"):
            hi_na_moe.set_top_k(m, "adaptive", threshold=-1.0)
        assert hi_na_moe.stats(m)["top_k"] == "adaptive"  # (a refused value changes nothing)
        hi_na_moe.set_top_k(m)  # back to the router's own experts, bit for bit
        assert torch.equal(_logits(m, x), want) and report.top_k is None
    with pytest.raises(RuntimeError, match="not enabled"):
        hi_na_moe.set_top_k(m, 2)


@native_only
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_the_experts_interface_applies_the_configs_top_k(backend, monkeypatch):
    """experts_implementation="hi_na_moe" (no enable_for_model) reads top_k from the environment as
    enable does: OLMoE with top_k=2 is the model with k=2."""
    big, small = _olmoe(4, False), _olmoe(2, False)
    small.load_state_dict(big.state_dict())
    x = _prompt()
    want = _logits(small, x)
    monkeypatch.setenv("HINA_MOE_TOP_K", "2")
    monkeypatch.setenv("HINA_MOE_BACKEND", backend)
    big.set_experts_implementation("hi_na_moe")
    try:
        torch.testing.assert_close(_logits(big, x), want, rtol=1e-5, atol=1e-6)
    finally:
        big.set_experts_implementation("eager")


# ---- configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,what", [
    (dict(top_k=0), "'top_k'"), (dict(top_k="greedy"), "'top_k'"), (dict(top_k=True), "'top_k'"),
    (dict(top_k_threshold=-0.1), "'top_k_threshold'"), (dict(top_k_threshold="x"), "'top_k_threshold'"),
    (dict(top_k_threshold=float("nan")), "'top_k_threshold'"),
    (dict(top_k_min=0), "'top_k_min'"), (dict(top_k_renorm="yes"), "'top_k_renorm'"),
])
def test_bad_top_k_keys_are_refused_naming_them(kw, what):
    with pytest.raises(ConfigError, match=what):
        HinaConfig(**kw)


def test_top_k_keys_from_the_environment_and_the_nested_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("HINA_MOE_TOP_K", "3")
    monkeypatch.setenv("HINA_MOE_TOP_K_THRESHOLD", "0.25")
    cfg = load_config()
    assert cfg.top_k == 3 and cfg.top_k_threshold == 0.25
    monkeypatch.setenv("HINA_MOE_TOP_K", "adaptive")
    assert load_config().top_k == "adaptive"
    monkeypatch.delenv("HINA_MOE_TOP_K")
    monkeypatch.delenv("HINA_MOE_TOP_K_THRESHOLD")
    f = tmp_path / "c.yaml"
    f.write_text("top_k:\n  mode: adaptive\n  threshold: 0.4\n  min: 2\n  renorm: off\n")
    monkeypatch.setenv("HINA_MOE_CONFIG", str(f))
    cfg = load_config()
    assert (cfg.top_k, cfg.top_k_threshold, cfg.top_k_min, cfg.top_k_renorm) == ("adaptive", 0.4, 2, "off")
    f.write_text("top_k: 2\n")
    assert load_config().top_k == 2
    f.write_text("top_k:\n  threshold: nope\n")
    with pytest.raises(ConfigError, match="top_k_threshold"):
        load_config()


def test_renorm_auto_follows_the_models_config():
    class Cfg:
        pass

    class Model(torch.nn.Module):
        def __init__(self, **attrs):
            super().__init__()
            self.config = Cfg()
            self.config.__dict__.update(attrs)

    for attrs, want in (({"norm_topk_prob": True}, True), ({"norm_topk_prob": False}, False), ({}, True)):
        t = trim_mod.from_config(HinaConfig(top_k=2), Model(**attrs))
        assert t.renorm is want and t.keep == 2
    assert trim_mod.from_config(HinaConfig(top_k=2, top_k_renorm="off"), Model(norm_topk_prob=True)).renorm is False
    assert trim_mod.from_config(HinaConfig(), Model()) is None
