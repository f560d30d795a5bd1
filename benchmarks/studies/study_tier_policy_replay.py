"""The native memory tier's eviction policies replayed on recorded routing, beside the simulator.

Replays the trained models' routing traces (benchmarks/results/expert-cache/trace-*.npz, recorded
by study_expert_cache.py) through the tier's slot pool (cache_policy.replay_on_tier: tiny experts,
prediction off) and through core/cache_policy.py's simulator, at the tier's clock (acquires) and
at the study's (tokens), and prints the hit rates and how many accesses differ.

--warmup replays what the tier saw in bench_memory_tier.py's policy runs instead: from a cold
pool, an 8-token prompt (one step a layer: the union of its tokens' experts) then 20 decode tokens,
from the start of every 256-token window of the trace, and the same on near-uniform random routing
(every token top-k of E uniformly, at the benchmark's shape: 16 layers, E64 top-8).

--enable runs the tier itself, in a model: a small random-weight OLMoE of the benchmark's routing
shape (16 layers, E64 top-8, hidden 256; tests/tiny_models.py), enabled with scope="all", int4,
prediction off and a memory_limit of 512 slots (half its experts), then an 8-token prompt and 20
greedy tokens, per policy; it prints the tier's counters at enable (its probes acquire experts
too) and over the prompt and decode.

--native-so loads another build of the extension (e.g. one of an older commit) in its place.

    .venv/bin/python benchmarks/studies/study_tier_policy_replay.py --json out.json
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hi_na_moe.core import cache_policy as cp

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "benchmarks" / "results" / "expert-cache"
MODELS = ("hina-moe-e64", "hina-tiny-moe")


def load_native(so: str | None):
    if so is None:
        from hi_na_moe import _native
        return _native
    loader = importlib.machinery.ExtensionFileLoader("hi_na_moe._native", so)
    spec = importlib.util.spec_from_file_location("hi_na_moe._native", so, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def compare(native, trace: cp.Trace, cap: int, policy: str, hl: float, workdir: str, E: int) -> dict:
    tier = np.concatenate(cp.replay_on_tier(native, trace, cap, policy, hl, workdir, E))
    times, hl_acq = cp.tier_clock(trace, hl)
    opt = (lambda h: {"half_life": h}) if policy == "freq-decay" else (lambda h: {})
    at_tier = np.concatenate(cp.replay_hits(trace, cp.make_policy(policy, cap, **opt(hl_acq)), times))
    at_tokens = np.concatenate(cp.replay_hits(trace, cp.make_policy(policy, cap, **opt(hl))))
    return {"tier": float(tier.mean()), "sim_tier_clock": float(at_tier.mean()),
            "sim_token_clock": float(at_tokens.mean()), "differ_tier_clock": int((tier != at_tier).sum()),
            "differ_token_clock": int((tier != at_tokens).sum()), "accesses": int(tier.size)}


def warm_trace(idx: np.ndarray, start: int, prompt: int, decode: int) -> cp.Trace:
    """A cold run as the tier sees it: the prompt's experts a layer in one step, then a step a
    layer a decode token (idx [layers, tokens, k])."""
    L = idx.shape[0]
    steps, times, layers = [], [], []
    for l in range(L):
        union = list(dict.fromkeys(int(e) for e in idx[l, start:start + prompt].ravel() if e >= 0))
        steps.append(tuple((l, e) for e in union))
        times.append(prompt - 1)
        layers.append(l)
    for t in range(start + prompt, start + prompt + decode):
        for l in range(L):
            steps.append(tuple((l, int(e)) for e in dict.fromkeys(idx[l, t].tolist()) if e >= 0))
            times.append(t - start)
            layers.append(l)
    return cp.Trace(steps, times, layers, L)


def warmup(native, name: str, idx: np.ndarray, E: int, windows: list[int], args, workdir: str) -> dict:
    L = idx.shape[0]
    cap = round(args.warm_fraction * L * E)
    out = {}
    for policy, hl in [("lru", args.half_life)] + [("freq-decay", h) for h in args.half_lives]:
        tot = dec = n = nd = 0
        differ = 0
        for w in windows:
            tr = warm_trace(idx, w, args.prompt, args.decode)
            if tr.max_step > cap:
                continue
            hits = cp.replay_on_tier(native, tr, cap, policy, hl, workdir, E)
            times, hl_acq = cp.tier_clock(tr, hl)
            sim = cp.replay_hits(tr, cp.make_policy(policy, cap, **({"half_life": hl_acq} if policy == "freq-decay"
                                                                    else {})), times)
            flat, fs = np.concatenate(hits), np.concatenate(sim)
            differ += int((flat != fs).sum())
            tot += int(flat.sum())
            n += flat.size
            d = np.concatenate(hits[L:])
            dec += int(d.sum())
            nd += d.size
        key = policy if policy == "lru" else f"freq-decay/{hl:g}"
        out[key] = {"hit_rate": tot / n, "decode_hit_rate": dec / nd, "accesses": n, "differ_from_sim": differ}
        print(f"warm-up {name} {cap} slots {key}: {100 * tot / n:.2f} % of all accesses, "
              f"{100 * dec / nd:.2f} % of the decode's ({len(windows)} runs; {differ} differ from the simulator)",
              flush=True)
    return {"slots": cap, "layers": L, "experts": E, "policies": out}


def enable_run(native, args) -> dict:
    """The tier in a model (see --enable): per policy, its counters at enable and over the run."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import hi_na_moe
    from hi_na_moe.core import tier as tier_mod
    from hi_na_moe.core.registry import patched_experts
    from tiny_models import greedy_decode, olmoe

    torch.set_num_threads(1)
    m = olmoe(layers=16, experts=64, top_k=8)
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        hi_na_moe.enable_for_model(m, weights="int4", cache_dir=cache, scope="all")
        info = native.header_info(patched_experts(m.model.layers[0].mlp.experts).packed.header)
        slot = int(native.tier_slot_bytes(info["gu_expert_bytes"], info["down_expert_bytes"]))
        hi_na_moe.disable_for_model(m)
        ids = torch.randint(3, 512, (1, args.prompt), generator=torch.Generator().manual_seed(0))
        keys = ("acquires", "demanded", "hits", "misses")
        for policy, hl in [("lru", args.half_life)] + [("freq-decay", h) for h in args.half_lives]:
            tier_mod.DEFAULT_POLICY, tier_mod.HALF_LIFE_TOKENS = policy, hl
            hi_na_moe.enable_for_model(m, weights="int4", cache_dir=cache, scope="all", memory_limit=512 * slot,
                                       prefetch=False)
            try:
                s0 = {k: hi_na_moe.stats(m)[k] for k in keys}
                greedy_decode(m, ids, args.decode)
                run = {k: hi_na_moe.stats(m)[k] - s0[k] for k in keys}
            finally:
                hi_na_moe.disable_for_model(m)
            key = policy if policy == "lru" else f"freq-decay/{hl:g}"
            out[key] = {"at_enable": s0, "run": run, "hit_rate": run["hits"] / run["demanded"]}
            print(f"enable {key}: at enable {s0}; prompt and decode {run}: {100 * out[key]['hit_rate']:.1f} % hits",
                  flush=True)
    return {"slots": 512, "model": "tests/tiny_models.olmoe(layers=16, experts=64, top_k=8)", "policies": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--fractions", default="0.1,0.3,0.5", help="pool sizes as fractions of the experts")
    ap.add_argument("--half-life", type=float, default=32.0, help="freq-decay's, in tokens")
    ap.add_argument("--half-lives", type=lambda s: [float(x) for x in s.split(",")], default=[32.0, 8.0, 2.0],
                    help="freq-decay half-lives (tokens) for --warmup")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--warmup", action="store_true")
    ap.add_argument("--enable", action="store_true")
    ap.add_argument("--warm-fraction", type=float, default=0.5)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--decode", type=int, default=20)
    ap.add_argument("--native-so", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    native = load_native(args.native_so)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    res = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "cpu": platform.processor() or platform.machine(),
           "native": args.native_so or "installed", "args": vars(args), "results": {}}
    fractions = [float(f) for f in args.fractions.split(",")]
    if args.enable:
        if args.native_so:
            sys.modules["hi_na_moe._native"] = native  # (before hi_na_moe loads its own)
        res["results"]["enable"] = enable_run(native, args)
        args.models = ""
    with tempfile.TemporaryDirectory() as workdir:
        for name in filter(None, args.models.split(",")):
            path = TRACES / f"trace-{name}-8192.npz"
            if not path.is_file():
                print(f"{path}: no trace (benchmarks/studies/study_expert_cache.py --sections trace records it)",
                      file=sys.stderr)
                return 2
            z = np.load(path)
            idx, E, seq = z["top_k_index"].astype(np.int64), int(z["num_experts"]), int(z["seq_len"])
            if args.warmup:
                res["results"][name] = warmup(native, name, idx, E, list(range(0, idx.shape[1], seq)), args, workdir)
                continue
            trace = cp.make_trace(idx[:, :args.tokens])
            rows = []
            for f in fractions:
                cap = max(trace.max_step, round(f * trace.num_layers * E))
                for policy in cp.ONLINE:
                    t0 = time.perf_counter()
                    r = compare(native, trace, cap, policy, args.half_life, workdir, E)
                    r.update(fraction=f, slots=cap, policy=policy, seconds=round(time.perf_counter() - t0, 1))
                    rows.append(r)
                    print(f"{name} {100 * f:.0f} % ({cap} slots) {policy}: tier {100 * r['tier']:.2f} %, simulator "
                          f"{100 * r['sim_tier_clock']:.2f} % at the tier's clock ({r['differ_tier_clock']} accesses "
                          f"differ), {100 * r['sim_token_clock']:.2f} % at the token clock "
                          f"({r['differ_token_clock']} differ) of {r['accesses']}", flush=True)
            res["results"][name] = rows
        if args.warmup:
            rng = np.random.default_rng(0)
            L, T, E, k = 16, 256 * 8, 64, 8
            uni = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(T)]) for _ in range(L)])
            res["results"]["uniform-16x64-top8"] = warmup(native, "uniform", uni, E, list(range(0, T, 256)), args,
                                                          workdir)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
