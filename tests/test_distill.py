"""hi_na_moe.tools.distill and `hi-na-moe distill`: the written checkpoint's shapes and config, that
it loads in plain transformers and under enable_for_model, that pruning experts the router never
chooses leaves the outputs as they were (constructed cases), merge's arithmetic, and the error
paths (nothing half-written left behind)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hi_na_moe
from hi_na_moe.tools import distill as dm
from hi_na_moe.tools.cli import main

from tiny_models import build_tiny, olmoe

IDS = torch.randint(3, 512, (256,), generator=torch.Generator().manual_seed(1))


def _ids(vocab: int, n: int = 200, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny():
    return olmoe(layers=2, dtype=torch.float32)


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_written_checkpoint_has_the_new_counts_and_sliced_tensors(family, tmp_path):
    t = build_tiny(family)
    cfg = t.config
    E = next(getattr(cfg, k) for k in ("n_routed_experts", "num_local_experts", "num_experts") if hasattr(cfg, k))
    small = dm.distill(t.model, 2, top_k=1, data=_ids(t.vocab_size), seq_len=50)
    out = dm.save_distilled(small, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    key = next(k for k in ("n_routed_experts", "num_local_experts", "num_experts") if k in config)
    assert config[key] == 2 and config["num_experts_per_tok"] == 1
    rows = {}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for k in f.keys():
            rows[k] = tuple(f.get_slice(k).get_shape())
    # save_pretrained writes the family's checkpoint format: fused [experts, ...] tensors, or one
    # tensor an expert (OLMoE, Mixtral: experts.<e>.<proj>.weight) that loading fuses again
    fused = [k for k in rows if re.search(r"experts\.(gate_up|down|up)_proj", k) and "shared" not in k]
    numbered = {int(m.group(1)) for k in rows for m in [re.search(r"experts\.(\d+)\.", k)] if m}
    assert fused or numbered
    assert all(rows[k][0] == 2 for k in fused) and numbered in (set(), {0, 1})
    before = t.model.state_dict()
    loaded = type(t.model).from_pretrained(out, dtype=torch.float32).state_dict()
    for b in small.distill_report.layers:  # router rows, bias and correction bias: one per kept expert
        router = [k for k in loaded if k.startswith(b["router"] + ".")]
        assert router and all(loaded[k].shape[0] == 2 and before[k].shape[0] == E for k in router)
        assert loaded[f"{b['router']}.weight"].equal(before[f"{b['router']}.weight"][b["kept"]])
    shared = [k for k in loaded if "shared" in k]
    assert all(loaded[k].equal(before[k]) for k in shared)  # shared experts untouched
    assert (out / "README.md").read_text().startswith("# Distilled MoE")


def test_loads_in_plain_transformers_and_under_enable(tiny, tmp_path):
    small = dm.distill(tiny, 4, data=IDS, seq_len=64)
    out = dm.save_distilled(small, tmp_path / "d")
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}); "
            "assert 'hi_na_moe' not in sys.modules; "
            "print(m.config.num_experts, tuple(m.model.layers[0].mlp.experts.gate_up_proj.shape))")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[0] == "4"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(IDS[None, :64]).logits
        want_small = small(IDS[None, :64]).logits
        report = hi_na_moe.enable_for_model(model)
        try:
            got = model(IDS[None, :64]).logits
        finally:
            hi_na_moe.disable_for_model(model)
    assert len(report.blocks) == 2 and all(b.status in ("accelerated", "reference") for b in report.blocks)
    torch.testing.assert_close(want, want_small, rtol=0, atol=0)  # what was written is what distill returned
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _never_route(model, dropped: list[int], c: int = 0):
    """Make `dropped` experts unreachable in every block of an OLMoE: residual coordinate c holds
    the embedding's constant 0.1 at every layer (nothing writes to it), so after the norm it is
    positive for every token; the dropped experts' router rows are -1000 there and 0 elsewhere,
    their logits far below any other (softmax gives them exactly 0). The other rows are scaled up
    so that every kept expert is chosen by some token."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, c] = 0.1
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[c, :] = 0
            layer.mlp.experts.down_proj[:, c, :] = 0
            layer.post_attention_layernorm.weight[c] = 1.0
            gate = layer.mlp.gate.weight
            gate.mul_(20)
            gate[:, c] = 0
            gate[dropped] = 0
            gate[dropped, c] = -1000.0


def test_pruning_experts_never_routed_to_leaves_the_outputs_equal():
    model = olmoe(layers=2, dtype=torch.float32)
    dropped = [1, 4, 6]
    _never_route(model, dropped)
    small = dm.distill(model, 5, data=IDS, seq_len=64)
    for b in small.distill_report.layers:
        assert b["dropped"] == dropped and all(b["routings"][d] == 0 for d in dropped)
    with torch.no_grad():
        want = model(IDS[None]).logits
        got = small(IDS[None]).logits
    # equal up to rounding: the router's matmul over 5 rows may round differently from over 8
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the check can fail: pruning an expert the router does choose changes the outputs
    other = dm.distill(model, 5, score="random", seed=3, data=IDS, seq_len=64)
    assert any(b["dropped"] != dropped for b in other.distill_report.layers)
    with torch.no_grad():
        assert not torch.allclose(other(IDS[None]).logits, want, rtol=1e-5, atol=1e-6)


def test_pruning_with_a_router_bias_leaves_the_outputs_equal():
    """GPT-OSS's router has a bias (and its experts biases): a dropped expert's bias of -1e4 keeps
    it out of every token's top-k; the softmax over the top-k then sees the same values."""
    t = build_tiny("gpt_oss")
    model = t.model
    dropped = [0, 3]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.bias[dropped] = -1e4
    ids = _ids(t.vocab_size)
    small = dm.distill(model, 2, data=ids, seq_len=50)
    assert all(b["dropped"] == dropped for b in small.distill_report.layers)
    with torch.no_grad():
        want = model(ids[None, :50]).logits
        got = small(ids[None, :50]).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # up to the router matmul's rounding


def test_merge_averages_by_frequency_and_keeps_router_rows(tiny):
    small = dm.distill(tiny, 5, method="merge", data=IDS, seq_len=64)
    for j, info in enumerate(small.distill_report.layers):
        src, dst = tiny.model.layers[j].mlp, small.model.layers[j].mlp
        f = torch.tensor(info["routings"], dtype=torch.float64)
        for new_i, k in enumerate(info["kept"]):
            members = [k] + [int(d) for d, kk in info["merged_into"].items() if kk == k]
            wts = f[members] / f[members].sum()
            want = sum(w * src.experts.gate_up_proj[m].double() for w, m in zip(wts, members)).float()
            torch.testing.assert_close(dst.experts.gate_up_proj[new_i], want, rtol=1e-6, atol=1e-7)
            assert torch.equal(dst.gate.weight[new_i], src.gate.weight[k])
        assert sorted(int(d) for d in info["merged_into"]) == info["dropped"]


def test_scores_rank_differently_and_saliency_follows_its_definition(tiny):
    freq = dm.distill(tiny, 4, score="frequency", data=IDS, seq_len=64).distill_report
    sal = dm.distill(tiny, 4, score="saliency", data=IDS, seq_len=64).distill_report
    assert freq.layers[0]["routings"] == sal.layers[0]["routings"]
    assert freq.layers[0]["scores"] == [float(v) for v in freq.layers[0]["routings"]]
    # saliency by hand for block 0: router weight x |expert output|, averaged over its tokens
    mlp = tiny.model.layers[0].mlp
    captured = {}
    h = mlp.register_forward_pre_hook(lambda m, a: captured.update(x=a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        tiny(IDS[None, :64])
        h.remove()
        x = captured["x"]
        _, w, idx = mlp.gate(x)
        E = mlp.experts.num_experts
        sums, counts = torch.zeros(E, dtype=torch.float64), torch.zeros(E)
        for e in range(E):
            tok, pos = torch.where(idx == e)
            gu = x[tok] @ mlp.experts.gate_up_proj[e].T
            g, u = gu.chunk(2, -1)
            y = (torch.nn.functional.silu(g) * u) @ mlp.experts.down_proj[e].T
            sums[e] = float((w[tok, pos] * y.norm(dim=-1)).sum())
            counts[e] = len(tok)
    one = dm.distill(tiny, 4, score="saliency", data=IDS[:64], seq_len=64).distill_report
    want = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)
    torch.testing.assert_close(torch.tensor(one.layers[0]["scores"], dtype=torch.float64), want, rtol=1e-4, atol=1e-6)


def test_api_errors_name_what_is_wrong(tiny, tmp_path):
    with pytest.raises(dm.DistillError, match="fewer than the model's 8"):
        dm.distill(tiny, 8, data=IDS)
    with pytest.raises(dm.DistillError, match="experts must be a whole number >= 1"):
        dm.distill(tiny, 0, data=IDS)
    with pytest.raises(dm.DistillError, match="top_k 3 is more than the 2 experts"):
        dm.distill(tiny, 2, top_k=3, data=IDS)
    with pytest.raises(dm.DistillError, match="method must be one of"):
        dm.distill(tiny, 2, method="fold", data=IDS)
    with pytest.raises(dm.DistillError, match="data is needed"):
        dm.distill(tiny, 2)
    from transformers import LlamaConfig, LlamaForCausalLM
    dense = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    with pytest.raises(dm.DistillError, match="no MoE block found in LlamaForCausalLM"):
        dm.distill(dense, 2, data=IDS % 64)
    dead = olmoe(layers=1, dtype=torch.float32)
    with torch.no_grad():
        dead.model.layers[0].mlp.experts.down_proj.zero_()
    with pytest.raises(dm.DistillError, match="saliency cannot rank its experts"):
        dm.distill(dead, 2, score="saliency", data=IDS, seq_len=64)
    sw = build_tiny("jetmoe")
    with pytest.raises(dm.DistillError, match=r"JetMoeMo[AE].*attention experts"):
        dm.distill(sw.model, 2, data=_ids(sw.vocab_size))


def test_a_failed_write_leaves_nothing_and_an_existing_out_untouched(tiny, tmp_path, monkeypatch):
    small = dm.distill(tiny, 4, data=IDS, seq_len=64)
    out = tmp_path / "out"
    calls = []

    def broken(self, path, **kw):
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        calls.append(path)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(small), "save_pretrained", broken)
    with pytest.raises(dm.DistillError, match="writing failed .No space left on device.; nothing was left behind"):
        dm.save_distilled(small, out)
    assert calls and not out.exists() and _leftovers(tmp_path, "out") == []
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(dm.DistillError, match="is not empty"):
        dm.save_distilled(small, out)
    with pytest.raises(dm.DistillError, match="writing failed"):
        dm.save_distilled(small, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and _leftovers(tmp_path, "out") == []
    monkeypatch.undo()
    dm.save_distilled(small, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert _leftovers(tmp_path, "out") == []
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(dm.DistillError, match="is a file"):
        dm.save_distilled(small, f)
    with pytest.raises(dm.DistillError, match="parent directory .* does not exist"):
        dm.save_distilled(small, f / "sub")


def test_cli_json_and_errors(tmp_path, capsys):
    out = tmp_path / "small"
    rc = main(["distill", "--model", "builtin", "--experts", "6", "--tokens", "256", "--score", "saliency",
               "--out", str(out), "--output", "json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    d = json.loads(captured.out)
    assert (d["experts_before"], d["experts_after"], d["top_k_after"], d["score"]) == (8, 6, 2, "saliency")
    assert d["calibration_tokens"] == 256 and d["out"] == str(out.resolve())
    assert len(d["layers"]) == 4 and all(len(b["kept"]) == 6 for b in d["layers"])
    assert json.loads((out / "config.json").read_text())["num_experts"] == 6
    assert (out / "tokenizer.json").is_file()
    cases = [
        (["--experts", "0"], "--experts must be >= 1"),
        (["--experts", "4", "--top-k", "5"], "--top-k 5 is more than --experts 4"),
        (["--experts", "8"], "experts must be fewer than the model's 8"),
        (["--experts", "4", "--data", str(tmp_path / "nope.txt")], "nope.txt' does not exist"),
        (["--experts", "4", "--out", str(out)], "is not empty"),
        (["--experts", "4", "--out", str(tmp_path / "no" / "such")], "does not exist"),
        (["--experts", "4", "--repair-experts"], "--repair-experts needs --repair-steps"),
        (["--experts", "4", "--repair-steps", "-1"], "--repair-steps must be >= 0"),
    ]
    for extra, msg in cases:
        args = ["distill", "--model", "builtin", "--tokens", "64", "--out", str(tmp_path / "x")] + extra
        assert main(args) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
        assert not (tmp_path / "x").exists() and _leftovers(tmp_path, "x") == []


def test_repair_trains_only_the_routers_and_lowers_the_kl(tiny):
    small = dm.distill(tiny, 2, data=IDS, seq_len=64)
    before = {k: v.clone() for k, v in small.state_dict().items()}
    dm.repair(small, tiny, IDS, steps=15, lr=1e-3, seq_len=64, batch_size=2)
    rep = small.distill_report.repair
    assert rep["steps"] == 15 and rep["kl_after"] < rep["kl_before"]
    changed = {k for k, v in small.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {f"{b['router']}.weight" for b in small.distill_report.layers}
    assert all(p.requires_grad for p in small.parameters()) and all(p.grad is None for p in small.parameters())
    both = dm.distill(tiny, 2, data=IDS, seq_len=64)
    dm.repair(both, tiny, IDS, steps=2, seq_len=64, batch_size=2, train_experts=True)
    changed = {k for k, v in both.state_dict().items() if not torch.equal(v, before[k])}
    want = {f"{b['router']}.weight" for b in both.distill_report.layers}
    want |= {f"{b['experts']}.{n}" for b in both.distill_report.layers for n in ("gate_up_proj", "down_proj")}
    assert changed == want and both.distill_report.repair["trained"] == "routers and experts"
    with pytest.raises(dm.DistillError, match="repair steps must be a whole number >= 1"):
        dm.repair(small, tiny, IDS, steps=0)
    with pytest.raises(dm.DistillError, match="fewer than one window of 256"):
        dm.repair(small, tiny, IDS[:100], steps=1)


# ---------------------------------------------------------------------------------------------
# Per-expert layouts: one module an expert (Switch, NLLB-MoE), flat stacked rows (DBRX)
# ---------------------------------------------------------------------------------------------

PER_EXPERT = ["switch_transformers", "nllb-moe", "dbrx"]


def _per_expert_model(family: str):
    """The tiny model a user loads (with its LM head), 4 experts, no expert capacity limit on the
    tiny inputs; Switch and NLLB with a router bias (the constructed case sets it)."""
    over = {"switch_transformers": dict(router_bias=True, expert_capacity=1024),
            "nllb-moe": dict(router_bias=True, moe_eval_capacity_token_fraction=1.0)}.get(family, {})
    return build_tiny(family, user_class=True, **over)


def _expert_count(cfg: dict) -> tuple[int, int | None]:
    """(expert count, top-k) as a written config.json says them."""
    if "ffn_config" in cfg:
        return cfg["ffn_config"]["moe_num_experts"], cfg["ffn_config"]["moe_top_k"]
    return cfg["num_experts"], cfg.get("num_experts_per_tok")


def _run(model, ids):
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(input_ids=ids, decoder_input_ids=ids).logits
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", PER_EXPERT)
@pytest.mark.parametrize("method", ["prune", "merge"])
def test_per_expert_layouts_write_a_smaller_checkpoint(family, method, tmp_path):
    t = _per_expert_model(family)
    ids = _ids(t.vocab_size, 120)
    small = dm.distill(t.model, 2, method=method, data=ids, seq_len=40)
    out = dm.save_distilled(small, tmp_path / "out")
    E, K = _expert_count(t.model.config.to_dict())
    e, k = _expert_count(json.loads((out / "config.json").read_text()))
    assert E == 4 and e == 2 and k == (None if K is None else min(K, 2))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    before = t.model.state_dict()
    numbered = {int(m.group(1)) for key in shapes for m in [re.search(r"experts\.expert_(\d+)\.", key)] if m}
    assert numbered in (set(), {0, 1})  # per-expert modules renumbered 0..N-1
    loaded = type(t.model).from_pretrained(out, dtype=torch.float32).state_dict()
    for b in small.distill_report.layers:
        kept = b["kept"]
        router = [key for key in loaded if key.startswith(b["router"] + ".")]
        assert router and all(loaded[key].shape[0] == 2 and before[key].shape[0] == 4 for key in router)
        for key in router:  # the router's rows (and bias) of the kept experts, merged or not
            assert loaded[key].equal(before[key][kept])
        if family == "dbrx":  # flat [experts x intermediate, hidden] rows, sliced per expert
            for n in ("w1", "v1", "w2"):
                key = f"{b['experts']}.mlp.{n}"
                old, new = before[key].view(4, -1, before[key].shape[-1]), loaded[key].view(2, -1, before[key].shape[-1])
                assert loaded[key].shape[0] * 2 == before[key].shape[0]
                if method == "prune":
                    assert new.equal(old[kept])
        elif method == "prune":
            for i, k_old in enumerate(kept):
                for sfx in ("wi.weight", "wo.weight") if family == "switch_transformers" else ("fc1.weight", "fc1.bias"):
                    assert loaded[f"{b['experts']}.expert_{i}.{sfx}"].equal(before[f"{b['experts']}.expert_{k_old}.{sfx}"])
        else:  # merge: each kept expert the frequency-weighted average of its group
            f = torch.tensor(b["routings"], dtype=torch.float64)
            for i, k_old in enumerate(kept):
                members = [k_old] + [int(d) for d, kk in b["merged_into"].items() if kk == k_old]
                wts = f[members] / f[members].sum() if float(f[members].sum()) > 0 else torch.full((len(members),), 1 / len(members), dtype=torch.float64)
                sfx = ".mlp.w1" if family == "dbrx" else f".expert_{i}." + ("wi.weight" if family == "switch_transformers" else "fc1.weight")
                if family == "dbrx":
                    old = before[b["experts"] + sfx].view(4, -1, before[b["experts"] + sfx].shape[-1])
                    want = sum(w * old[m].double() for w, m in zip(wts, members)).float()
                    got = loaded[b["experts"] + sfx].view(2, -1, want.shape[-1])[i]
                else:
                    want = sum(w * before[f"{b['experts']}.expert_{m}." + sfx.split(".", 2)[2]].double()
                               for w, m in zip(wts, members)).float()
                    got = loaded[b["experts"] + sfx]
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # loads in plain transformers, without hi_na_moe, and runs
    code = ("import sys, torch; from transformers import AutoConfig; import transformers; "
            f"c = AutoConfig.from_pretrained({str(out)!r}); "
            "cls = getattr(transformers, c.architectures[0]); "
            f"m = cls.from_pretrained({str(out)!r}).eval(); "
            "assert 'hi_na_moe' not in sys.modules; ids = torch.arange(3, 11)[None]; "
            "kw = dict(decoder_input_ids=ids) if c.is_encoder_decoder else {}; "
            "print(tuple(m(input_ids=ids, **kw).logits.shape))")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    # and under enable_for_model: every block runs, the outputs as transformers' own
    model = type(t.model).from_pretrained(out, dtype=torch.float32).eval()
    x = ids[None, :24]
    want = _run(model, x)
    torch.testing.assert_close(want, _run(small, x), rtol=0, atol=0)  # what was written is what distill returned
    report = hi_na_moe.enable_for_model(model)
    try:
        got = _run(model, x)
    finally:
        hi_na_moe.disable_for_model(model)
    assert report.blocks and all(b.status in ("accelerated", "reference") for b in report.blocks), report
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _never_route_per_expert(family: str, model, dropped: list[int]):
    """Make `dropped` unreachable in every block: Switch and NLLB through the router's bias
    (-1e4: softmax gives them exactly 0, so the kept experts' probabilities and capacity counts are
    as before); DBRX (no router bias) through a residual coordinate c far larger than the others
    at every layer (nothing writes to it), so after the LayerNorm it is positive for every token,
    and the dropped experts' router rows are -1000 there and 0 elsewhere."""
    with torch.no_grad():
        if family != "dbrx":
            for name, mod in model.named_modules():
                if type(mod).__name__.endswith(("Top1Router", "Top2Router")):
                    mod.classifier.weight[dropped] = 0
                    mod.classifier.bias[dropped] = -1e4
            return
        c = 0
        model.transformer.wte.weight[:, c] = 5.0
        for blk in model.transformer.blocks:
            blk.norm_attn_norm.attn.out_proj.weight[c, :] = 0
            blk.norm_attn_norm.norm_2.weight[c] = 1.0
            blk.ffn.experts.mlp.w2[:, c] = 0
            gate = blk.ffn.router.layer.weight
            gate[:, c] = 0
            gate.mul_(20)
            gate[dropped] = 0
            gate[dropped, c] = -1000.0


@pytest.mark.parametrize("family,dropped", [("switch_transformers", [1, 3]), ("nllb-moe", [2, 3]), ("dbrx", [0, 2])])
def test_per_expert_pruning_experts_never_routed_to_leaves_the_outputs_equal(family, dropped):
    """NLLB drops 2 and 3: transformers 5.23's NllbMoeExperts runs its expert_0 and expert_1 only
    (hi_na_moe's adapter found its routing by top-1 mask value), so those are what its tokens reach."""
    t = _per_expert_model(family)
    model = t.model
    _never_route_per_expert(family, model, dropped)
    ids = _ids(t.vocab_size, 120)
    small = dm.distill(model, 2, data=ids, seq_len=40)
    for b in small.distill_report.layers:
        assert b["dropped"] == dropped and all(b["routings"][d] == 0 for d in dropped), b
    x = ids[None, :40]
    want = _run(model, x)
    torch.testing.assert_close(_run(small, x), want, rtol=1e-5, atol=1e-6)  # up to the router matmul's rounding
    # the check can fail: pruning experts the tokens do reach changes the outputs
    other = dm.distill(model, 2, score="random", seed=5, data=ids, seq_len=40)
    assert any(b["dropped"] != dropped for b in other.distill_report.layers)
    assert not torch.allclose(_run(other, x), want, rtol=1e-5, atol=1e-6)


def test_per_expert_layout_errors_name_the_block_and_why():
    t = _per_expert_model("switch_transformers")
    with pytest.raises(dm.DistillError, match="top_k cannot change: SwitchTransformersConfig has no top-k key"):
        dm.distill(t.model, 2, top_k=1, data=_ids(t.vocab_size, 60), seq_len=30)
    n = _per_expert_model("nllb-moe")
    with pytest.raises(dm.DistillError, match="at least the router's fixed top-k 2"):
        dm.distill(n.model, 1, data=_ids(n.vocab_size, 60), seq_len=30)
    for family, why in [("doge", r"DogeCDMoE.*product-key experts"), ("longcat_flash", r"LongcatFlashExperts.*identity"),
                        ("llama4", r"Llama4TextMoe.*scale their input")]:
        m = build_tiny(family)
        with pytest.raises(dm.DistillError, match=why):
            dm.distill(m.model, 2, data=_ids(m.vocab_size, 60), seq_len=30)


# ---------------------------------------------------------------------------------------------
# Resumable repair
# ---------------------------------------------------------------------------------------------

class _Killed(BaseException):
    """What a kill does to the run: it stops between two lines, nothing catches it."""


def _kill_at_step(monkeypatch, k: int):
    """Adam's k-th step (counted from now) raises _Killed before it changes anything."""
    calls = {"n": 0}
    real = torch.optim.Adam.step

    def step(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == k:
            raise _Killed()
        return real(self, *a, **kw)

    monkeypatch.setattr(torch.optim.Adam, "step", step)


def _trainable(model, report) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()
            if any(k.startswith(L["router"] + ".") or k.startswith(L["experts"] + ".") for L in report.layers)}


def test_a_killed_repair_resumes_from_its_last_saved_step_and_ends_as_the_straight_run(tiny, tmp_path, monkeypatch,
                                                                                        capsys):
    opts = dict(steps=6, lr=1e-3, seq_len=64, batch_size=2, seed=4, train_experts=True)
    straight = dm.repair(dm.distill(tiny, 4, data=IDS, seq_len=64), tiny, IDS, **opts)
    want = _trainable(straight, straight.distill_report)
    state = tmp_path / "state"
    _kill_at_step(monkeypatch, 4)  # steps 1-3 run, saved at 2; killed inside step 4
    killed = dm.distill(tiny, 4, data=IDS, seq_len=64)
    with pytest.raises(_Killed):
        dm.repair(killed, tiny, IDS, state=state, save_every=2, **opts)
    monkeypatch.undo()
    assert sorted(p.name for p in state.iterdir()) == [dm.STATE_FILE]  # nothing half-written beside it
    assert torch.load(state / dm.STATE_FILE, weights_only=True)["step"] == 2
    # a state of another run is refused, naming what differs; so is one past the steps asked
    with pytest.raises(dm.DistillError, match="belongs to another run .lr differ"):
        dm.repair(dm.distill(tiny, 4, data=IDS, seq_len=64), tiny, IDS, state=state, **dict(opts, lr=2e-3))
    with pytest.raises(dm.DistillError, match="is at step 2, past steps=1"):
        dm.repair(dm.distill(tiny, 4, data=IDS, seq_len=64), tiny, IDS, state=state, **dict(opts, steps=1))
    capsys.readouterr()
    # the same call again, on a fresh distill (as a new process would): steps 3-6, then the same result
    resumed = dm.repair(dm.distill(tiny, 4, data=IDS, seq_len=64), tiny, IDS, state=state, save_every=2,
                        progress=True, **opts)
    bars = capsys.readouterr().err
    assert re.search(r"repair:\s+33%.*\| 2/6 ", bars) and " 0/6 " not in bars, bars  # the bar starts at step 2
    got = _trainable(resumed, resumed.distill_report)
    assert got.keys() == want.keys() and len(got) == 6  # 2 routers, 2 x (gate_up, down)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
    rs, rw = resumed.distill_report.repair, straight.distill_report.repair
    assert rs["steps"] == 6 and rs["kl_before"] == rw["kl_before"]
    assert rs["kl_after"] == pytest.approx(rw["kl_after"], rel=1e-5)
    st = torch.load(state / dm.STATE_FILE, weights_only=True)
    assert st["step"] == 6 and sorted(p.name for p in state.iterdir()) == [dm.STATE_FILE]
    # the comparison can fail: two steps fewer end measurably elsewhere
    fresh = dm.repair(dm.distill(tiny, 4, data=IDS, seq_len=64), tiny, IDS, **dict(opts, steps=4))
    assert any(not torch.allclose(v, want[k], rtol=1e-6, atol=1e-7) for k, v in _trainable(fresh, fresh.distill_report).items())


def test_cli_repair_killed_and_run_again_continues(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dm, "SAVE_EVERY", 1)
    args = ["distill", "--model", "builtin", "--experts", "6", "--tokens", "512", "--repair-steps", "3",
            "--output", "json"]
    assert main(args + ["--out", str(tmp_path / "straight")]) == 0
    _kill_at_step(monkeypatch, 3)
    with pytest.raises(_Killed):
        main(args + ["--out", str(tmp_path / "out")])
    monkeypatch.undo()
    monkeypatch.setattr(dm, "SAVE_EVERY", 1)
    state = tmp_path / ".out.repair-state"
    assert torch.load(state / dm.STATE_FILE, weights_only=True)["step"] == 2 and not (tmp_path / "out").exists()
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert f"continuing from the state saved in {state}" in captured.err
    assert json.loads(captured.out)["repair"]["steps"] == 3
    assert not state.exists() and _leftovers(tmp_path, "out") == []  # the state goes once the checkpoint is written
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "straight" / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            torch.testing.assert_close(a.get_tensor(k), b.get_tensor(k), rtol=1e-6, atol=1e-7)
