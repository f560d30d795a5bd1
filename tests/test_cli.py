"""The command line: demo end to end (reduced), check in both output modes, user errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from hi_na_moe.tools.cli import main, shipped_model_dir


def test_demo_runs_end_to_end_in_reduced_mode(capsys):
    # part 1 on the shipped model, part 2 on one real-size OLMoE layer; exit 0 = outputs agree
    assert main(["demo", "--quick", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "all outputs identical" in out
    assert "read limit: the native read probe" in out and "| hi_na_moe | decode T=1 |" in out
    row = next(line for line in out.splitlines() if line.startswith("| hi_na_moe | decode T=1 |"))
    probe, share = row.split("|")[5:7]
    assert float(probe) > 0 and 0 < float(share.strip().rstrip(" *").rstrip("%")) <= 100  # paired, measured


def test_shipped_model_is_found():
    assert shipped_model_dir() is not None


def test_check_text_and_json(capsys):
    assert main(["check", "--model", str(shipped_model_dir())]) == 0
    text = capsys.readouterr().out
    assert "best kernel tier" in text and "model.layers.0.mlp.experts" in text
    assert "read bandwidth (measured now" in text and "roofline" in text
    from hi_na_moe import _native
    from hi_na_moe.fastpath.attention import math_kernel

    assert f'attention of decode steps (scope="all"): {math_kernel(_native.resolve_isa())}' in text
    from hi_na_moe.fastpath import mla

    assert f'latent attention (MLA) of decode steps (scope="all"): {mla.math_kernel(_native.resolve_isa())}' in text
    assert main(["check", "--model", str(shipped_model_dir()), "--output", "json", "--no-bandwidth"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["blocks"]["summary"]["moe_blocks"] == 4
    assert data["model"]["active_bytes_per_token"] > 0 and data["model"]["top_k"] == 2
    assert "cpu" in data["capabilities"] and data["system"]["numa_nodes"]


@pytest.mark.parametrize("argv,message", [
    (["check", "--model", "/no/such/dir"], "does not exist"),
    (["demo", "--model", "/"], "has no config.json"),
    (["check", "--model", "/"], "has no config.json"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message):
    proc = subprocess.run([sys.executable, "-m", "hi_na_moe", *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_config_error_from_env_is_exit_2():
    import os

    env = dict(os.environ, HINA_MOE_BACKEND="fast")
    proc = subprocess.run([sys.executable, "-m", "hi_na_moe", "check"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "HINA_MOE_BACKEND" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_builtin_json(tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    rc = main(["bench", "--model", "builtin", "--gen-tokens", "4", "--num-iters", "1", "--warmup", "0",
               "--seq-len", "8", "--output", "json", "--json-file", str(out_file)])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["greedy_tokens_identical"] is True
    for arm in ("native", "hina"):
        r = data["arms"][arm]
        assert r["tg_tokens_per_s"] > 0 and r["pp_tokens_per_s"] > 0
        assert set(r["latency_ms"]) == {"avg", "p50", "p95", "p99"}
        assert len(r["samples"]["decode_step_s"]) == 3  # 4 tokens: 3 decode steps after the first
        assert r["achieved_gbs"] > 0 and r["peak_rss_bytes"] > 0
        assert r["bytes_per_step"] == r["bytes_per_token"]  # one row: a step reads one token's bytes
        assert r["paired_read_probe_gbs"] > 0 and 0 < r["memory_bandwidth_util_pct"] <= 100
    assert data["experts_read_per_step"] is None
    assert "moe_decode" in data["arms"]["hina"]["kernel"]
    assert json.loads(out_file.read_text())["arms"].keys() == data["arms"].keys()


def test_bench_top_k_counts_the_experts_a_token_used_and_the_bytes_it_did_not_read(capsys):
    rc = main(["bench", "--model", "builtin", "--gen-tokens", "4", "--num-iters", "1", "--warmup", "0",
               "--seq-len", "8", "--output", "json", "--top-k", "1"])
    assert rc == 0  # different greedy tokens are no failure with a trim
    data = json.loads(capsys.readouterr().out)
    native, hina = data["arms"]["native"], data["arms"]["hina"]
    assert hina["top_k"] == 1 and hina["experts_per_token"] == 1.0 and native["experts_per_token"] == 2
    assert hina["quality_vs_native"]["kl"] > 0
    # 4 MoE layers, each reading one of its 2 experts: one float32 SwiGLU expert (hidden 256,
    # intermediate 128) a layer not read
    assert native["bytes_per_token"] - hina["bytes_per_step"] == 4 * 3 * 256 * 128 * 4
    rc = main(["bench", "--model", "builtin", "--top-k", "adaptive", "--top-k-threshold", "-1"])
    assert rc == 2 and "top_k_threshold" in capsys.readouterr().err


def test_bench_counts_a_batch_step_as_the_union_of_its_rows_experts(capsys):
    """A decode step of 4 rows reads each expert any of its rows routes to once: more than one
    token's experts, at most 4 tokens' or all of them; GB/s is those bytes over the step."""
    import statistics

    from transformers import AutoConfig

    from hi_na_moe import inspect_model
    from hi_na_moe.tools.cli import shipped_model_dir

    rc = main(["bench", "--model", "builtin", "--gen-tokens", "5", "--num-iters", "1", "--warmup", "0",
               "--seq-len", "8", "--batch-size", "4", "--output", "json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    cfg = AutoConfig.from_pretrained(shipped_model_dir())
    k, e = cfg.num_experts_per_tok, cfg.num_local_experts if hasattr(cfg, "num_local_experts") else cfg.num_experts
    union = data["experts_read_per_step"]
    assert union and len(union) == cfg.num_hidden_layers
    assert all(k <= u <= min(e, 4 * k) for u in union.values())
    assert any(u > k for u in union.values())  # random prompts: the rows do not all pick the same experts
    for arm, r in data["arms"].items():
        assert r["bytes_per_step"] > r["bytes_per_token"]
        step = statistics.median(r["samples"]["decode_step_s"])
        assert abs(r["achieved_gbs"] - r["bytes_per_step"] / step / 1e9) < 1e-9
    # native: one token's bytes plus (union - k) bf16/fp32 experts a block
    from transformers import AutoModelForCausalLM

    with __import__("torch").device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    blocks = {b.name: b for b in inspect_model(meta).blocks}
    extra = sum((u - k) * blocks[n].expert_bytes / blocks[n].experts for n, u in union.items())
    native = data["arms"]["native"]
    assert abs(native["bytes_per_step"] - (native["bytes_per_token"] + extra)) < 1


def test_bench_scope_all(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path / "store"))
    rc = main(["bench", "--model", "builtin", "--gen-tokens", "3", "--num-iters", "1", "--warmup", "0",
               "--seq-len", "8", "--weights", "int8", "--scope", "all", "--output", "json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    hina, native = data["arms"]["hina"], data["arms"]["native"]
    assert hina["dense_layers"] > 0 and native["dense_layers"] == 0
    # the fp32 shipped model: int8 experts alone read ~80 % of native's bytes per token (9.2 of
    # 11.6 MB); with its attention projections in int8 too (lm_head stays fp32) ~53 %
    assert hina["bytes_per_token"] < 0.65 * native["bytes_per_token"]
    assert hina["attention_refused_at_runtime"] == [] and native["attention_decode_calls"] is None


def test_bench_names_attention_refused_at_every_decode_step(capsys, monkeypatch):
    """A module whose probe matched but whose decode calls all took its own forward (GLM-4.5's
    partial rotary before 2026-12-02) is named under the table."""
    from hi_na_moe.tools.commands import bench

    monkeypatch.setattr(bench, "decode_call_counts", lambda model: {"model.layers.0.self_attn": (0, 2),
                                                                       "model.layers.1.self_attn": (2, 0)})
    rc = main(["bench", "--model", "builtin", "--gen-tokens", "3", "--num-iters", "1", "--warmup", "0",
               "--seq-len", "8", "--scope", "all", "--compare", "hina"])
    out = capsys.readouterr().out
    assert rc == 0
    assert ("note: 1 attention module(s) matched their probe at enable but took their own forward at every decode "
            "step of this run (e.g. model.layers.0.self_attn)") in out


def test_bench_never_shows_a_share_above_its_read_limit(tmp_path, capsys, monkeypatch):
    """bench held every arm against one probe taken before the runs, so an arm that read faster
    than it showed a bandwidth share above 100 %. Now each timed generation is followed by a read
    on the native probe: here a fake one reads far slower than the tiny model's steps for the
    first arm (its own rate is its limit, marked and explained) and far faster for the second."""
    from types import SimpleNamespace

    from hi_na_moe.tools.commands import bench, common
    from hi_na_moe.tools.commands.demo import OWN_RATE_NOTE, PROBE_READ_BYTES

    reads = []

    class Probe:
        size = 0  # nothing resident to leave out of the peak RSS

        def __init__(self, nbytes, threads):
            assert nbytes >= 3 * PROBE_READ_BYTES and threads >= 1

        def read(self, nbytes):
            reads.append(nbytes)
            return 1e-3 if len(reads) <= 2 else 1e4  # GB/s: two iterations an arm, native first

    monkeypatch.setattr(bench, "native_module", lambda: (SimpleNamespace(BandwidthProbe=Probe), None), raising=False)
    monkeypatch.setattr(common, "_bandwidth", lambda threads: 1e-3)  # the unpaired probe, as slow
    out_file = tmp_path / "bench.json"
    rc = main(["bench", "--model", "builtin", "--gen-tokens", "3", "--num-iters", "2", "--warmup", "0",
               "--seq-len", "8", "--json-file", str(out_file)])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out_file.read_text())
    assert all(0 < r["memory_bandwidth_util_pct"] <= 100 for r in data["arms"].values())
    assert reads == [PROBE_READ_BYTES] * 4
    native, hina = data["arms"]["native"], data["arms"]["hina"]
    assert data["machine_read_bandwidth_gbs"] == 1e-3
    assert native["samples"]["paired_read_probe_gbs"] == [1e-3, 1e-3] and native["paired_read_probe_gbs"] == 1e-3
    assert native["read_limit_is_own_rate"] and native["read_limit_gbs"] == native["achieved_gbs"]
    assert native["memory_bandwidth_util_pct"] == 100
    assert hina["paired_read_probe_gbs"] == 1e4 and not hina["read_limit_is_own_rate"]
    assert hina["read_limit_gbs"] == 1e4 and 0 < hina["memory_bandwidth_util_pct"] < 100
    assert hina["peak_rss_bytes"] > 0
    # a cell's "|" (the kernels column's moe_decode_...|moe_prefill_...) is escaped: every row has
    # the header's columns
    cells = [re.split(r"(?<!\\)\|", line) for line in out.splitlines() if line.startswith("| ")]
    assert len({len(c) for c in cells}) == 1
    rows = {c[1].strip(): c for c in cells}
    assert rows["arm"][-5:-3] == [" paired probe GB/s ", " bw util % "]
    assert rows["native"][-5:-3] == [" 0.0 ", " 100 * "]
    assert rows["hina"][-5] == " 10000.0 " and float(rows["hina"][-4]) <= 100
    assert OWN_RATE_NOTE in out.splitlines()


def test_bench_with_a_static_kv_cache(capsys):
    rc = main(["bench", "--model", "builtin", "--gen-tokens", "4", "--num-iters", "1", "--warmup", "0",
               "--seq-len", "8", "--kv-cache", "static", "--output", "json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_cache"] == "static" and data["greedy_tokens_identical"] is True
    assert all(len(r["samples"]["decode_step_s"]) == 3 for r in data["arms"].values())


def test_bench_bad_compare_is_a_user_error():
    proc = subprocess.run([sys.executable, "-m", "hi_na_moe", "bench", "--model", "builtin", "--compare", "fast"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--compare has 'fast'" in proc.stderr and "Traceback" not in proc.stderr


def test_check_shows_every_expert_format(capsys):
    assert main(["check", "--model", str(shipped_model_dir()), "--output", "json", "--no-bandwidth"]) == 0
    formats = {f["weights"]: f for f in json.loads(capsys.readouterr().out)["model"]["formats"]}
    assert set(formats) == {"lossless", "int8", "int4-g32", "int8, scope all", "int4-g32, scope all"}
    # scope all: the dense layers in that format too read fewer bytes per token
    assert formats["int4-g32, scope all"]["active_bytes_per_token"] < formats["int4-g32"]["active_bytes_per_token"]
    # fp32 shipped model: int8 ~ 1/4 and int4 ~ 1/8 of the lossless expert bytes (plus scales)
    assert formats["int8"]["expert_bytes"] < 0.3 * formats["lossless"]["expert_bytes"]
    assert formats["int4-g32"]["expert_bytes"] < formats["int8"]["expert_bytes"] * 0.6
    assert formats["int4-g32"]["active_bytes_per_token"] < formats["lossless"]["active_bytes_per_token"]


def test_check_shows_lossless12_for_a_bfloat16_model(tmp_path, capsys):
    from tiny_models import olmoe

    olmoe(layers=2, hidden=512, heads=8).save_pretrained(tmp_path / "m")  # bfloat16
    assert main(["check", "--model", str(tmp_path / "m"), "--output", "json", "--no-bandwidth"]) == 0
    formats = {f["weights"]: f for f in json.loads(capsys.readouterr().out)["model"]["formats"]}
    assert {"lossless", "lossless12", "lossless12, scope all"} <= set(formats)
    # the same weights in 75-80 % of the bytes (the panels' tables and spill areas included)
    assert 0.75 < formats["lossless12"]["expert_bytes"] / formats["lossless"]["expert_bytes"] < 0.8
    assert formats["lossless12, scope all"]["active_bytes_per_token"] < formats["lossless12"]["active_bytes_per_token"]


def test_bench_and_debug_with_quantised_weights(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path / "store"))
    rc = main(["bench", "--model", "builtin", "--gen-tokens", "3", "--num-iters", "1", "--warmup", "0",
               "--seq-len", "8", "--weights", "int8", "--output", "json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    hina, native = data["arms"]["hina"], data["arms"]["native"]
    assert "int8" in hina["kernel"] and hina["weights"] == "int8"
    assert hina["bytes_per_token"] < native["bytes_per_token"]
    q = hina["quality_vs_native"]
    assert 0 <= q["kl"] < 0.05 and q["top1"] >= 0.75 and q["sqnr_min_db"] > 30
    rc = main(["debug", "--model", str(shipped_model_dir()), "--prompt", "def parse(text):", "--weights", "int4",
               "--output", "json"])
    assert rc == 0, "int4 within the int4 tolerance on the shipped model"
    rep = json.loads(capsys.readouterr().out)
    assert any("int4" in k for k in rep["prompts"][0]["kernels"])


def test_debug_against_another_format_and_bad_against(capsys):
    rc = main(["debug", "--model", str(shipped_model_dir()), "--prompt", "import os", "--weights", "int4",
               "--against", "weights=int8", "--output", "json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)["prompts"][0]
    assert rep["logits_kl"] > 0 and all("int4" in k for k in rep["kernels"])
    proc = subprocess.run([sys.executable, "-m", "hi_na_moe", "debug", "--model", str(shipped_model_dir()),
                           "--prompt", "x", "--against", "fast"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--against 'fast'" in proc.stderr and "Traceback" not in proc.stderr


def test_generation_of_exactly_n_tokens_turns_end_of_sequence_off(monkeypatch, capsys):
    """bench and demo generate exactly N tokens with the end-of-sequence token turned off, not
    masked at every step (min_new_tokens' processors); a transformers that stops anyway gets
    min_new_tokens, said once."""
    import torch
    from tiny_models import olmoe

    from hi_na_moe.tools.commands import bench, common

    model = olmoe(layers=1)
    ids = torch.tensor([[3, 9, 4, 7]])
    with torch.inference_mode():
        free = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    model.generation_config.eos_token_id = free[1]  # the model would stop after two tokens
    seen = []
    own = type(model).generate

    def spy(self, *a, **kw):
        seen.append({k: kw.get(k, "-") for k in ("eos_token_id", "min_new_tokens")})
        return own(self, *a, **kw)

    monkeypatch.setattr(type(model), "generate", spy)
    out, _ = common._generate(model, ids, 6)
    assert out[0, 4:].tolist() == free and seen == [{"eos_token_id": None, "min_new_tokens": "-"}]
    out, pre, lat = bench._timed_generate(model, ids, 6)
    assert out.shape[1] == 10 and len(lat) == 5 and pre > 0
    # a transformers reading eos_token_id=None as the model's own: min_new_tokens, said once
    monkeypatch.setattr(common, "_EOS_OFF_IGNORED", False)

    def stops(self, *a, **kw):
        if kw.get("eos_token_id", 0) is None:
            kw.pop("eos_token_id")
        return own(self, *a, **kw)

    monkeypatch.setattr(type(model), "generate", stops)
    out, pre, lat = bench._timed_generate(model, ids, 6)
    # (masked, the end-of-sequence token is never picked: other tokens than free's)
    assert out.shape[1] == 10 and free[1] not in out[0, 4:].tolist() and len(lat) == 5 and pre > 0
    out, _ = common._generate(model, ids, 6)
    assert out.shape[1] == 10
    err = capsys.readouterr().err
    assert err.count("using min_new_tokens instead") == 1


# ---------------------------------------------------------------------------------------------
# Bad arguments are refused before any model is loaded (or the machine measured), naming the
# option and the value


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a model or measuring the machine fails the test: a bad argument must be refused
    first."""
    from hi_na_moe.tools.commands import check, common

    def refuse(*a, **k):
        raise AssertionError("a model was loaded (or the machine measured) before the arguments were checked")

    monkeypatch.setattr(common, "_load", refuse)
    monkeypatch.setattr(common, "_bandwidth", refuse)
    monkeypatch.setattr(check, "system_info", refuse)
    for name in list(__import__("os").environ):
        if name.startswith("HINA_MOE_") and name != "HINA_MOE_CACHE_DIR":
            monkeypatch.delenv(name)


def _refused(capsys, argv) -> str:
    """stderr of a command line that must end with status 2 (argparse's exit or ours)."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


MODEL = str(shipped_model_dir())


@pytest.mark.parametrize("argv,message", [
    (["debug", "--model", MODEL, "--prompt", "x", "--isa", "avx9"], r"--isa: invalid choice: 'avx9'"),
    (["debug", "--model", MODEL, "--prompt", "x", "--against", "nonsense"], r"--against 'nonsense': expected native"),
    (["debug", "--model", MODEL, "--prompt", "x", "--against", "isa=avx9"],
     r"config key 'isa' \(--against\) has bad value 'avx9'.*did you mean 'avx2'"),
    (["debug", "--model", MODEL, "--prompt", "x", "--against", "weights=int3"],
     r"config key 'weights' \(--against\) has bad value 'int3'"),
    (["debug", "--model", MODEL, "--prompt", "x", "--tolerance", "-1"], r"--tolerance must be a number > 0, got -1"),
    (["debug", "--model", MODEL, "--prompt", "x", "--tolerance", "nan"], r"--tolerance must be a number > 0, got nan"),
    (["bench", "--model", MODEL, "--threads", "1000000000000"], r"--threads must be from 0 to 8192, got 1000000000000"),
    (["bench", "--model", MODEL, "--threads", "-2"], r"--threads must be from 0 to 8192, got -2"),
    (["bench", "--model", MODEL, "--warmup", "-1"], r"--warmup must be >= 0, got -1"),
    (["bench", "--model", MODEL, "--json-file", "/no/such/dir/out.json"],
     r"--json-file '/no/such/dir/out.json': the directory '/no/such/dir' does not exist"),
    (["demo", "--max-new-tokens", "0"], r"--max-new-tokens must be >= 1, got 0"),
    (["check", "--model", "/no/such/dir"], r"'/no/such/dir' does not exist"),
    (["check", "--model", MODEL + "/config.json"], r"config.json' is a file, not a checkpoint directory"),
])
def test_bad_arguments_are_refused_before_anything_is_loaded(argv, message, capsys, nothing_loads):
    import re

    err = _refused(capsys, argv)
    assert re.search(message, err), err


def test_a_tier_the_cpu_lacks_is_refused_before_loading(capsys, nothing_loads, monkeypatch):
    import types

    from hi_na_moe.core import config

    fake = types.SimpleNamespace(isa_supported=lambda t: t in ("generic", "avx2"), best_isa=lambda: "avx2")
    monkeypatch.setattr(config, "native_module", lambda: (fake, None))
    err = _refused(capsys, ["debug", "--model", MODEL, "--prompt", "x", "--isa", "avx512"])
    assert "config key 'isa' (--isa) asks for 'avx512', which this CPU/OS does not support" in err
    err = _refused(capsys, ["debug", "--model", MODEL, "--prompt", "x", "--against", "isa=amx"])
    assert "config key 'isa' (--against) asks for 'amx'" in err


@pytest.mark.parametrize("argv", [["bench", "--model", MODEL], ["demo"],
                                  ["debug", "--model", MODEL, "--prompt", "x"]])
def test_a_bad_config_variable_is_refused_before_loading(argv, capsys, nothing_loads, monkeypatch):
    monkeypatch.setenv("HINA_MOE_QDOT", "fast")
    err = _refused(capsys, argv)
    assert "config key 'qdot' (env HINA_MOE_QDOT) has bad value 'fast'" in err


def test_the_demo_never_shows_a_share_above_its_read_limit():
    """On an AVX2-only CPU the demo said hi_na_moe read at 106 % of the machine's bandwidth: its
    probe read slower than the kernels. The limit is never below the calls' own rate, and when
    the calls are what sets it, the table says so."""
    import math
    import random
    import re

    from hi_na_moe.tools.commands.demo import read_limit, workload_table

    assert read_limit(21.2, 20.0) == (21.2, True)  # the probe a lower bound: the calls' rate
    assert read_limit(18.0, 20.0) == (20.0, False)
    assert math.isnan(read_limit(18.0, float("nan"))[0])
    rows = [("transformers (grouped_mm)", "decode T=1", 30.0, 9.1, 0.0, 20.0),
            ("hi_na_moe", "decode T=1", 12.9, 21.2, 1e-3, 20.0),
            ("transformers (grouped_mm)", "prefill T=128", 300.0, 4.0, 0.0, 19.0),
            ("hi_na_moe", "prefill T=128", 100.0, 12.0, 1e-3, 19.5)]
    lines = workload_table(rows)
    assert lines[0].startswith("| provider | case | median ms | achieved GB/s | paired read probe GB/s | "
                               "share of read limit |")
    assert lines[3] == "| hi_na_moe | decode T=1 | 12.9 | 21.2 | 20.0 | 100% * | 2.33x | 1.0e-03 |"
    assert lines[2] == "| transformers (grouped_mm) | decode T=1 | 30.0 | 9.1 | 20.0 | 46% | 1.00x | 0.0e+00 |"
    assert lines[-1].startswith("* these calls read faster than the probe read right after them")
    assert not any(line.startswith("*") for line in workload_table(rows[:1]))  # no note when none is capped
    assert workload_table([(*rows[0][:5], float("nan"))])[2].split("|")[5:7] == [" - ", " - "]
    g = random.Random(0)
    for _ in range(1000):
        achieved, probe = g.uniform(0.1, 100), g.uniform(0.1, 100)
        limit, _ = read_limit(achieved, probe)
        assert limit >= achieved and limit >= probe
        share = re.search(r"\| (\d+)% ", workload_table([("a", "c", 1.0, achieved, 0.0, probe)])[2]).group(1)
        assert int(share) <= 100
