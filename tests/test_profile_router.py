"""hi_na_moe.tools.profile_router and `hi-na-moe profile-router`: the recorded routing against counts made
independently here (the model's own router logits, hi_na_moe's enabled experts path), the
figures' definitions recomputed by hand, the files it writes, and its error paths."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch

from hi_na_moe.core import cache_policy as cp
from hi_na_moe.tools import profile_router as prm
from hi_na_moe.tools.cli import main

from tiny_models import build_tiny, olmoe

SEQ = 64


@pytest.fixture(scope="module")
def tiny():
    """A 3-layer float32 OLMoE (8 experts, top-2) and 150 tokens: windows of 64, 64 and 22. Its
    norms get random weights: with the initial ones an RMSNorm only scales a token's logits,
    which no top-k can see."""
    model = olmoe(layers=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) * 1.8 + 0.2)
    ids = torch.randint(3, 512, (150,), generator=torch.Generator().manual_seed(1))
    return model, ids


@pytest.fixture(scope="module")
def profile(tiny):
    model, ids = tiny
    return prm.profile_router(model, None, ids, seq_len=SEQ, batch_size=1, keep_hidden=True)


def _windows(ids):
    return [ids[i:i + SEQ] for i in range(0, ids.numel(), SEQ)]


def _own_routing(model, ids):
    """Per layer [tokens, k] experts from the model's own router logits (output_router_logits),
    the MoE blocks' inputs and the decoder layers' outputs, window by window."""
    k = model.config.num_experts_per_tok
    idx, inputs, outs = {}, {}, {}
    handles = [layer.mlp.register_forward_pre_hook(
        lambda m, a, l=l: inputs.setdefault(l, []).append(a[0].reshape(-1, a[0].shape[-1]).clone()))
        for l, layer in enumerate(model.model.layers)]
    try:
        for w in _windows(ids):
            with torch.inference_mode():
                o = model(input_ids=w[None], output_router_logits=True, output_hidden_states=True, use_cache=False)
            for l, logits in enumerate(o.router_logits):
                idx.setdefault(l, []).append(logits.softmax(-1).topk(k, dim=-1).indices)
            for l in range(len(model.model.layers) - 1):  # hidden_states[l + 1]: layer l's output (not the last)
                outs.setdefault(l, []).append(o.hidden_states[l + 1].reshape(-1, o.hidden_states[0].shape[-1]))
    finally:
        for h in handles:
            h.remove()
    cat = lambda d: {l: torch.cat(v) for l, v in d.items()}  # noqa: E731
    return cat(idx), cat(inputs), cat(outs)


def test_counts_match_the_models_own_router_logits(tiny, profile):
    model, ids = tiny
    want, inputs, _ = _own_routing(model, ids)
    assert profile.tokens == 150 and len(profile.blocks) == 3
    for l in range(3):
        got = profile.indices[l]
        assert got.shape == (150, 2)
        assert torch.equal(got.sort(-1).values, want[l].sort(-1).values)
        counts = torch.bincount(want[l].reshape(-1), minlength=8).tolist()
        fig = profile.figures["per_block"][l]
        assert fig["load"]["counts"] == counts
        assert fig["load"]["share"] == pytest.approx([c / 300 for c in counts])
        c = np.array(counts, dtype=float)
        assert fig["imbalance"]["max_over_mean"] == pytest.approx(c.max() / c.mean())
        assert fig["imbalance"]["cv"] == pytest.approx(c.std() / c.mean())
        # the hidden state entering the block, as a hook on the block itself sees it
        assert torch.equal(profile.hidden[l], inputs[l])
        b = profile.blocks[l]
        assert b["name"] == f"model.layers.{l}.mlp.experts" and b["layer"] == l
        assert b["router"] == f"model.layers.{l}.mlp.gate" and b["router_standalone"]
        assert b["router_agreement"] == 1.0
        assert b["pre_moe_norm"] == f"model.layers.{l}.post_attention_layernorm"


def test_co_activation_and_weight_shares_by_hand(profile):
    idx = profile.indices[1].numpy()
    pairs = {}
    for a, b in idx:
        key = (min(a, b), max(a, b))
        pairs[key] = pairs.get(key, 0) + 1
    top = profile.figures["per_block"][1]["co_activation_top_pairs"][0]
    assert top["tokens"] == max(pairs.values())
    assert pairs[tuple(top["experts"])] == top["tokens"]
    used = np.bincount(idx.reshape(-1), minlength=8)
    i, j = top["experts"]
    assert top["lift"] == pytest.approx(top["tokens"] / (used[i] * used[j] / 150))
    w = profile.weights[1].numpy()
    top1 = (w.max(1) / w.sum(1)).mean()
    assert profile.figures["per_block"][1]["weight_share_top"]["1"] == pytest.approx(top1)
    assert profile.figures["per_block"][1]["weight_share_top"]["2"] == pytest.approx(1.0)


def test_next_layer_prediction_matches_an_independent_computation(tiny, profile):
    model, ids = tiny
    want, inputs, outs = _own_routing(model, ids)
    for l in (1, 2):
        layer = model.model.layers[l]
        with torch.inference_mode():
            x = layer.post_attention_layernorm(outs[l - 1])
            order = torch.nn.functional.linear(x, layer.mlp.gate.weight).topk(4, dim=-1).indices
            order_prev = torch.nn.functional.linear(inputs[l - 1], layer.mlp.gate.weight).topk(2, dim=-1).indices
        row = profile.figures["prediction"]["per_block"][l]
        for m in (2, 4):
            hits = sum(len(set(order[t, :m].tolist()) & set(want[l][t].tolist())) for t in range(150))
            assert row["residual"][f"m={m}"]["recall"] == hits / 300
            assert row["residual"][f"m={m}"]["precision"] == hits / (150 * m)
        hits = sum(len(set(order_prev[t].tolist()) & set(want[l][t].tolist())) for t in range(150))
        assert row["previous_block_input"]["m=2"]["recall"] == hits / 300
        load = np.bincount(want[l].reshape(-1).numpy(), minlength=8)
        static = set(np.argsort(-load, kind="stable")[:2].tolist())
        hits = sum(len(static & set(want[l][t].tolist())) for t in range(150))
        assert row["static"]["m=2"]["recall"] == hits / 300
    assert "unavailable" in profile.figures["prediction"]["per_block"][0]


def test_hit_rates_are_the_cache_replay_of_the_recorded_trace(profile):
    hr = profile.figures["over_time"]["hit_rate"]
    trace = cp.make_trace([i.numpy() for i in profile.indices])
    assert profile.figures["over_time"]["accesses"] == 150 * 3 * 2 == trace.accesses
    for name, rates in hr["policies"].items():
        for size, rate in zip(hr["sizes"], rates):
            opts = {"half_life": prm.HALF_LIFE} if name == "freq-decay" else {}
            assert rate == cp.simulate(trace, size, name, **opts).hit_rate
    for s, b in zip(hr["sizes"], hr["policies"]["belady"]):
        assert all(b >= hr["policies"][n][hr["sizes"].index(s)] for n in cp.ONLINE)
    for line in profile.figures["advice"]["cache_size"]:
        if line["reached"]:
            assert cp.simulate(trace, line["slots"], line["policy"], **(
                {"half_life": prm.HALF_LIFE} if line["policy"] == "freq-decay" else {})).hit_rate >= line["target"]
            if line["slots"] > cp.min_capacity(trace):  # the smallest such size
                assert cp.simulate(trace, line["slots"] - 1, line["policy"], **(
                    {"half_life": prm.HALF_LIFE} if line["policy"] == "freq-decay" else {})).hit_rate < line["target"]
            assert line["bytes"]["own"] == line["slots"] * profile.blocks[0]["expert_bytes"]["own"]


def test_a_router_that_chooses_otherwise_is_not_applied_standalone(tiny):
    model, ids = tiny
    gate = model.model.layers[1].mlp.gate
    bias = torch.linspace(-3, 3, 8)

    def biased(self, h):  # a score-correction bias the logits alone do not show
        h = h.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(h, self.weight)
        probs = logits.softmax(-1)
        idx = (probs + bias).topk(self.top_k, dim=-1).indices
        return logits, probs.gather(1, idx), idx

    gate.forward = types.MethodType(biased, gate)
    try:
        p = prm.profile_router(model, None, ids[:64], seq_len=SEQ)
    finally:
        del gate.forward
    b = p.blocks[1]
    assert not b["router_standalone"] and b["router_agreement"] < prm.STANDALONE_AGREEMENT
    assert "cannot be applied standalone" in b["router_note"]
    assert "cannot be applied standalone" in p.figures["prediction"]["per_block"][1]["unavailable"]
    assert p.figures["per_block"][1]["router_entropy_bits"] is None
    assert p.blocks[2]["router_standalone"]
    assert "cannot be applied standalone" in p.summary()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "llama4_text", "jetmoe", "doge", "deepseek_v3", "gpt_oss"])
def test_every_family_records_the_routing_its_blocks_compute(family):
    """With hi_na_moe enabled, one forward both profiles and hands each accelerated block's
    top_k_index to the experts runner (the adapters' path): the two must be the same."""
    import hi_na_moe
    from hi_na_moe.tools.quality import _runners

    tiny = build_tiny(family)
    ids = torch.randint(3, tiny.vocab_size, (100,), generator=torch.Generator().manual_seed(2))
    want: dict[str, list] = {}
    hi_na_moe.enable_for_model(tiny.model, cache=False)
    try:
        for r in _runners(tiny.model):
            r.recorder = lambda name, h, idx, w, out: want.setdefault(name, []).append(idx.clone())
        p = prm.profile_router(tiny.model, None, ids, seq_len=SEQ, fractions=(0.5, 1.0))
    finally:
        hi_na_moe.disable_for_model(tiny.model)
    assert want
    compared = 0
    for b, idx in zip(p.blocks, p.indices):
        assert idx.shape[0] == 100 and bool((idx >= 0).all()) and bool((idx < b["num_experts"]).all())
        assert sum(p.figures["per_block"][b["index"]]["load"]["counts"]) == 100 * b["top_k"]
        if b["name"] in want:
            assert torch.equal(idx, torch.cat(want[b["name"]]).long()), b["name"]
            compared += 1
    assert compared == len(want)


def test_switch_transformers_records_capacity_dropped_tokens_as_minus_one():
    tiny = build_tiny("switch_transformers")
    ids = torch.randint(3, tiny.vocab_size, (64,), generator=torch.Generator().manual_seed(3))
    p = prm.profile_router(tiny.model, None, ids, seq_len=SEQ, fractions=(1.0,))
    assert len(p.blocks) == 2 and all(b["top_k"] == 1 for b in p.blocks)
    for b, idx in zip(p.blocks, p.indices):
        assert idx.shape == (64, 1) and bool((idx < b["num_experts"]).all())
        assert sum(p.figures["per_block"][b["index"]]["load"]["counts"]) == int((idx >= 0).sum())


def test_files_plots_and_prior(profile, tmp_path):
    from PIL import Image

    saved = profile.save(tmp_path)
    assert saved["plots_skipped"] is None
    d = json.loads((tmp_path / "profile.json").read_text())
    assert d["format"] == prm.FORMAT and d["tokens"] == 150
    assert set(d["plots"]) == {"load_heatmap.png", "hit_rate.png", "prediction_recall.png"}
    for name, what in d["plots"].items():
        with Image.open(tmp_path / name) as im:
            im.load()
            assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200
        assert what["what"] and what["json"].split(".")[0].split("[")[0] in d
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "hit_rate.png").ndim == 3
    prior = json.loads((tmp_path / "expert_prior.json").read_text())
    assert prior["format"] == prm.PRIOR_FORMAT and len(prior["blocks"]) == 3
    for b, fig in zip(prior["blocks"], d["per_block"]):
        assert b["counts"] == fig["load"]["counts"] and sum(b["frequency"]) == pytest.approx(1.0)
    from safetensors.torch import load_file

    raw = load_file(tmp_path / "routing.safetensors")
    for i in range(3):
        assert torch.equal(raw[f"block{i}.top_k_index"].long(), profile.indices[i])
        assert torch.equal(raw[f"block{i}.hidden"], profile.hidden[i])


def test_without_matplotlib_the_json_is_written_and_the_plots_named_skipped(profile, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    saved = profile.save(tmp_path)
    assert "pip install" in saved["plots_skipped"] and "matplotlib" in saved["plots_skipped"]
    assert json.loads((tmp_path / "profile.json").read_text())["plots"] == {}
    assert not list(tmp_path.glob("*.png"))


def test_api_errors_name_what_is_wrong(tiny):
    model, ids = tiny
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    with pytest.raises(prm.ProfileError, match="no MoE block found in LlamaForCausalLM"):
        prm.profile_router(dense, None, ids)
    with pytest.raises(prm.ProfileError, match="empty"):
        prm.profile_router(model, object(), ["", "  "])
    with pytest.raises(prm.ProfileError, match="tokens must be a positive integer"):
        prm.profile_router(model, None, ids, tokens=0)
    with pytest.raises(prm.ProfileError, match="need a tokenizer"):
        prm.profile_router(model, None, "some text")
    with pytest.raises(prm.ProfileError, match="token id 600 is past the model's 512 input embeddings"):
        prm.profile_router(model, None, torch.tensor([3, 600]))


def test_the_adaptive_top_k_advice_is_the_kl_an_enabled_model_measures(tiny):
    """advise() runs the model per threshold on the native kernels; the KL it reports is what the
    model enabled with that threshold gives against the model with its own top-k, and the model
    is left as it was."""
    pytest.importorskip("hi_na_moe._native")
    import hi_na_moe
    from hi_na_moe.tools import top_k_advice
    from hi_na_moe.tools.quality import logits_agreement

    model, ids = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    windows = _windows(ids)
    wide = top_k_advice.advise(model, windows, budget=10.0)
    assert [r["threshold"] for r in wide["rows"]] == sorted(top_k_advice.THRESHOLDS)  # nothing past the budget
    assert wide["choice"] == wide["rows"][-1] and wide["tokens"] == ids.numel()
    epts = [r["experts_per_token"] for r in wide["rows"]]
    assert epts == sorted(epts, reverse=True) and 1.0 <= epts[-1] < epts[0] <= 2.0
    assert not hi_na_moe.is_enabled(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    mid = wide["rows"][len(wide["rows"]) // 2]
    budget = mid["kl"] * 1.0001
    adv = top_k_advice.advise(model, windows, budget=budget)
    c = adv["choice"]
    assert c is not None and c["kl"] <= budget and adv["rows"][-1]["kl"] > budget
    assert f"top_k_threshold={c['threshold']:g} keeps KL at" in adv["text"]

    def logits(**kw):
        hi_na_moe.enable_for_model(model, cache=False, **kw)
        try:
            with torch.inference_mode():
                return torch.cat([model(input_ids=w[None], use_cache=False).logits.float()[0] for w in windows])
        finally:
            hi_na_moe.disable_for_model(model)

    kl, top1 = logits_agreement(logits(), logits(top_k="adaptive", top_k_threshold=c["threshold"]))
    assert kl == pytest.approx(c["kl"], rel=1e-3, abs=1e-7) and top1 == pytest.approx(c["top1"], abs=1 / ids.numel())
    none = top_k_advice.advise(model, windows, budget=1e-12)
    assert none["choice"] is None and "no threshold tried drops experts and keeps KL within" in none["text"]
    with pytest.raises(prm.ProfileError, match="kl_budget must be > 0"):
        prm.profile_router(model, None, ids, kl_budget=0)


def test_cli_writes_the_report_of_the_shipped_model(tmp_path, capsys):
    out = tmp_path / "prof"
    assert main(["profile-router", "--model", "builtin", "--tokens", "300", "--out", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tokens"] == 300 and d["model_type"] == "olmoe" and len(d["blocks"]) == 4
    assert {p.name for p in out.iterdir()} >= {"profile.json", "expert_prior.json", "routing.safetensors",
                                                "hit_rate.png", "load_heatmap.png", "prediction_recall.png"}
    assert all(b["router_standalone"] for b in d["blocks"])
    tk = d["advice"]["top_k"]  # (--kl-budget's default)
    assert tk["budget"] == 0.01 and tk["rows"] and (tk["choice"] is None or tk["choice"]["kl"] <= 0.01)
    assert main(["profile-router", "--model", "builtin", "--tokens", "300", "--out", str(out), "--json",
                 "--kl-budget", "0"]) == 0
    assert "top_k" not in json.loads(capsys.readouterr().out)["advice"]
    assert main(["profile-router", "--model", "builtin", "--kl-budget", "-1"]) == 2
    assert "--kl-budget must be >= 0" in capsys.readouterr().err


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("case", ["no-model-path", "empty-dir", "config-only", "no-data-file", "empty-data",
                                  "jsonl-no-text", "jsonl-not-json", "tokens-0", "dense-model"])
def test_cli_errors_are_one_line_naming_the_thing(case, tmp_path, capsys):
    text = _write(tmp_path / "t.txt", "def f(x):\n    return x\n")
    argv = ["profile-router", "--model", "builtin", "--data", text, "--out", str(tmp_path / "o")]
    if case == "no-model-path":
        argv[2], want = str(tmp_path / "nope"), "nope"
    elif case == "empty-dir":
        (tmp_path / "empty").mkdir()
        argv[2], want = str(tmp_path / "empty"), "config.json"
    elif case == "config-only":
        (tmp_path / "cfg").mkdir()
        _write(tmp_path / "cfg" / "config.json", json.dumps({"model_type": "olmoe"}))
        argv[2], want = str(tmp_path / "cfg"), "cfg"
    elif case == "no-data-file":
        argv[4], want = str(tmp_path / "missing.txt"), "missing.txt"
    elif case == "empty-data":
        argv[4], want = _write(tmp_path / "e.txt", "  \n"), "e.txt' is empty"
    elif case == "jsonl-no-text":
        argv[4], want = _write(tmp_path / "d.jsonl", '{"text": "a"}\n{"body": "b"}\n'), 'line 2: no string field "text"'
    elif case == "jsonl-not-json":
        argv[4], want = _write(tmp_path / "d.jsonl", '{"text": "a"}\n{oops\n'), "line 2: not JSON"
    elif case == "tokens-0":
        argv += ["--tokens", "0"]
        want = "--tokens must be >= 1"
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=64)).save_pretrained(tmp_path / "dense")
        argv[2], want = str(tmp_path / "dense"), "no MoE block found in"
    assert main(argv) == 2
    err = capsys.readouterr().err
    # (transformers' own progress bars while saving or loading a model aside)
    first, *rest = [ln for ln in err.strip().splitlines() if "%|" not in ln and ln.strip()]
    assert first.startswith("hi-na-moe: error:") and want in first, err
    assert all(line.startswith("hint:") for line in rest) and "Traceback" not in err
    assert not (tmp_path / "o").exists()
