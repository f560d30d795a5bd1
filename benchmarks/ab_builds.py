"""Two builds of hi_na_moe side by side: bench_full_model.py run by turns in each.

A packed layout or kernel change cannot be compared inside one process (one extension module
a process, one layout a build). This driver runs each build's own benchmarks/bench_full_model.py
(from its source tree, with its interpreter, so the arms' child processes load that build) by
turns, A B B A A B ... (the order swapped every pair, so neither build always follows the
other), one run of the given arguments a turn, each build with its own store directory (a
layout's entries are not the other's). It reads the JSON each run writes and prints per arm and
turn: decode tok/s, the paired probe's GB/s (pass --paired-probe), tok/s per probe GB/s (decode
speed with the host's phase divided out), bytes a token, prefill ms; then B against A: the ratio
of the medians and the range of the adjacent pairs' ratios.

    chrt -f 1 python benchmarks/ab_builds.py --turns 6 \\
        --a old=/tmp/old-tree:/tmp/old-venv/bin/python:/work/ckpt/hina-cache/old-qwen4l \\
        --b new=/work/main:/work/main/.venv/bin/python:/work/ckpt/hina-cache/new-qwen4l \\
        --json benchmarks/results/ab_builds-<name>.json -- \\
        --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l --arms hina-int4-all --phases warm --paired-probe \\
        --dense-lossless "" --prefill-reps 1

Each store must hold its build's entries already (run bench_full_model.py's cold phase with that
build first); the arguments after `--` go to every run unchanged (no --cache-dir or --json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_spec(text: str) -> dict:
    """NAME=TREE:PYTHON:STORE -> its parts, checked."""
    name, _, rest = text.partition("=")
    parts = rest.split(":")
    if not name or len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=TREE:PYTHON:STORE")
    tree, python, store = (Path(p) for p in parts)
    script = tree / "benchmarks" / "bench_full_model.py"
    if not script.is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no {script}")
    if not python.is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no interpreter {python}")
    if not store.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: no store directory {store} (run the cold phase first)")
    return {"name": name, "tree": tree, "python": python, "store": store, "script": script}


def commit_of(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "?") + ("+uncommitted" if dirty else "")


def figures(r: dict) -> dict:
    """One arm's result -> the figures compared."""
    dec, pp = r.get("decode", {}), r.get("paired_probe") or {}
    tps, probe = dec.get("tokens_per_s"), pp.get("median_gbs")
    return {"tok_s": tps, "probe_gbs": probe, "tok_s_per_probe": tps / probe if tps and probe else None,
            "gb_token": (r.get("bytes_per_token") or {}).get("total", 0) / 1e9,
            "prefill_ms": (r.get("prefill") or {}).get("ms"), "share": pp.get("share")}


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=build_spec, required=True, help="NAME=TREE:PYTHON:STORE of build A (the baseline)")
    ap.add_argument("--b", type=build_spec, required=True, help="NAME=TREE:PYTHON:STORE of build B")
    ap.add_argument("--turns", type=int, default=4, help="runs of each build (default 4)")
    ap.add_argument("--json", help="write every run's results here")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_full_model.py's arguments")
    args = ap.parse_args()
    rest = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if not rest:
        ap.error("give bench_full_model.py's arguments after --")
    if any(a in ("--cache-dir", "--json") or a.startswith(("--cache-dir=", "--json=")) for a in rest):
        ap.error("--cache-dir and --json are this driver's to set (each build's store; its own JSON)")
    if args.turns < 1:
        ap.error(f"--turns {args.turns}: give 1 or more")
    builds = [args.a, args.b]
    for b in builds:
        b["commit"] = commit_of(b["tree"])
    order = []
    for t in range(args.turns):
        order += [0, 1] if t % 2 == 0 else [1, 0]
    runs = []  # (build index, turn, results)
    print(f"# A = {args.a['name']} ({args.a['commit']}), B = {args.b['name']} ({args.b['commit']}); "
          f"{args.turns} turns each, order {''.join('AB'[i] for i in order)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for n, i in enumerate(order):
            b = builds[i]
            out = Path(tmp) / f"run{n}.json"
            cmd = [str(b["python"]), str(b["script"]), *rest, "--cache-dir", str(b["store"]), "--json", str(out)]
            t0 = time.time()
            print(f"# run {n + 1}/{len(order)}: {b['name']} ...", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=b["tree"])
            if proc.returncode != 0 or not out.is_file():
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                raise SystemExit(f"run {n + 1} ({b['name']}) failed (exit {proc.returncode}): {' '.join(cmd)}")
            runs.append({"build": b["name"], "index": i, "started": t0, "results": json.loads(out.read_text())["results"]})
    arms = [r["arm"] for r in runs[0]["results"]]
    summary = {}
    for arm in arms:
        print(f"\n## {arm}\n| run | build | tok/s | probe GB/s | tok/s per probe GB/s | GB/token | share | prefill ms |")
        print("|---|---|---|---|---|---|---|---|")
        per = {0: [], 1: []}
        for n, run in enumerate(runs):
            r = next((x for x in run["results"] if x["arm"] == arm), None)
            if r is None:
                continue
            f = figures(r)
            per[run["index"]].append(f)
            print(f"| {n + 1} | {run['build']} | {fmt(f['tok_s'])} | {fmt(f['probe_gbs'], '.1f')} | "
                  f"{fmt(f['tok_s_per_probe'], '.3f')} | {fmt(f['gb_token'], '.4f')} | {fmt(f['share'], '.3f')} | "
                  f"{fmt(f['prefill_ms'], '.0f')} |")
        s = {}
        for key, better in (("tok_s", 1), ("tok_s_per_probe", 1), ("prefill_ms", -1)):
            a = [f[key] for f in per[0] if f[key] is not None]
            bb = [f[key] for f in per[1] if f[key] is not None]
            if not a or not bb:
                continue
            # B's speed over A's: tok/s ratios as they are, prefill times inverted
            ratio = (statistics.median(bb) / statistics.median(a)) ** better
            pairs = [(y / x) ** better for x, y in zip(a, bb)]
            s[key] = {"a_median": statistics.median(a), "b_median": statistics.median(bb), "b_speed_vs_a": ratio,
                      "pairs": pairs}
            print(f"B vs A, {key}: {ratio:.3f}x (medians {statistics.median(bb):.3f} / {statistics.median(a):.3f}; "
                  f"turn pairs {min(pairs):.3f}-{max(pairs):.3f}x)")
        summary[arm] = s
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "a": {k: str(v) for k, v in args.a.items()}, "b": {k: str(v) for k, v in args.b.items()},
            "bench_args": rest, "order": order, "runs": runs, "summary": summary}, indent=1))
        print(f"# written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
