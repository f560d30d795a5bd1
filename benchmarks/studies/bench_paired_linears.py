"""Whole decode steps with the dense layers packed paired against one matrix, in one process.

hi_na_moe.fastpath.linear packs an int8 / int4 layer with an even number of outputs paired (linear.PAIRED:
the rows' two halves as one gated expert's gate and up matrices, the same outputs bit for bit).
This loads the checkpoint twice with scope="all" (--weights, the store --cache-dir; each packing
has its own store entries, built on first use), once with linear.PAIRED False and once True, and
times decode steps of both, alternating every --block steps (each on its own KV cache, after a
16-token prompt, restarted every --steps), each step after an untimed 256 MB read of a 1 GiB
buffer (the paired probe of bench_full_model.py, which also evicts the caches) and a 30 ms
pause. Prints per arm the median ms a step, the paired probe's median and their ratio, and
checks that both arms decode the same tokens.

    chrt -f 1 python benchmarks/studies/bench_paired_linears.py --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen1.5-moe-a2.7b-4l/int4

--op-level (no checkpoint): the layers alone, timed from Python: --copies copies of five random
bfloat16 layers of Qwen1.5-MoE's and OLMoE's shapes (11264x2048, 6144x2048, 2048x2048,
2048x5632, 32768x2048) packed both ways, one row of input, the two packings' sweeps alternating
over 16 rounds, each after a 256 MB read; GB/s of packed bytes and the share of the probe.

Question: Does packing an int8 / int4 dense layer paired (two halves as gate and up) make decode
  faster?
Answered in benchmarks/log/decode-step.md, "The shared expert and dense layers op by op, paired
  linear layers, and the step's Python (2026-12-05)".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="the checkpoint (not with --op-level)")
    ap.add_argument("--op-level", action="store_true", help="the layers alone, no checkpoint")
    ap.add_argument("--copies", type=int, default=8, help="--op-level: copies of the five layers (working set)")
    ap.add_argument("--weights", default="int4", choices=("int8", "int4"))
    ap.add_argument("--cache-dir", help="the store of --weights (not with --op-level)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per round and arm")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=8, help="steps of one arm before the other's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.op_level:
        return op_level(args)
    if not (args.ckpt and args.cache_dir):
        raise SystemExit("give --ckpt and --cache-dir, or --op-level")
    import torch
    from lib.steps import alternate, arm_rows

    import hi_na_moe
    from hi_na_moe.fastpath import linear
    from hi_na_moe.fastpath.linear import patched_member

    torch.set_num_threads(args.threads)
    cfg = hi_na_moe.load_config(cache_dir=args.cache_dir, scope="all", dense_lossless="")
    models = {}
    linear.REUSE_UNPAIRED = False  # the paired arm builds its own entries beside the one-matrix ones
    for arm, pair in (("one matrix", False), ("paired", True)):
        linear.PAIRED = pair
        models[arm] = hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, dtype=torch.bfloat16,
                                                progress=False, config=cfg).eval()
        runners = {id(r): r for m in models[arm].modules() if (r := (patched_member(m) or (None,))[0]) is not None
                   and getattr(r, "packed", None) is not None and r.weights == args.weights}.values()
        n = sum(r.packed.paired for r in runners)
        if (n > 0) != pair:
            raise SystemExit(f"the {arm} arm has {n} paired layers of {len(runners)}")
        print(f"{arm}: {n} of {len(runners)} {args.weights} dense layers (or groups) paired")
    linear.PAIRED, linear.REUSE_UNPAIRED = True, True
    ms, gbs, tokens, _ = alternate({arm: (model, lambda: None) for arm, model in models.items()}, args.rounds,
                                   args.steps, args.block, args.threads)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ckpt": args.ckpt, "weights": args.weights,
           "same_tokens": tokens["paired"] == tokens["one matrix"], "arms": {}}
    print(f"{args.ckpt}, {args.weights}, scope all, {args.threads} threads, {args.rounds} rounds of {args.steps} "
          f"steps an arm, alternating every {args.block}")
    print("| dense layers | median ms a step | paired probe GB/s | step x probe |")
    print("|---|---|---|---|")
    res["arms"] = arm_rows(ms, gbs)
    for arm, row in res["arms"].items():
        print(f"| {arm} | {row['median_ms']:.2f} | {row['probe_gbs']:.1f} | {row['median_ms'] * row['probe_gbs']:.0f} |")
    ratio = res["arms"]["one matrix"]["median_ms"] / res["arms"]["paired"]["median_ms"]
    res["speedup"] = ratio
    print(f"paired: {ratio:.3f}x the one-matrix arm's speed; the same tokens: {res['same_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["same_tokens"] else 1


def op_level(args) -> int:
    import torch

    from hi_na_moe import _native

    PE = _native.PackedExperts
    shapes = [(11264, 2048), (6144, 2048), (2048, 2048), (2048, 5632), (32768, 2048)]
    gen = torch.Generator().manual_seed(0)
    blocks: dict[str, list] = {"one matrix": [], "paired": []}
    for _ in range(args.copies):
        for o, i in shapes:
            w = torch.randn(o, i, generator=gen).mul_(0.02).bfloat16()
            for arm in blocks:
                blocks[arm].append((PE.pack_linear(w, weights=args.weights, paired=arm == "paired"), o, i))
    xs = {i: torch.randn(1, i, generator=gen).bfloat16() for _, i in shapes}
    outs = {arm: {o: torch.empty(1, o, dtype=torch.bfloat16) for o, _ in shapes} for arm in blocks}
    nbytes = sum(b.data.nbytes for b, _, _ in blocks["one matrix"])
    probe = _native.BandwidthProbe(1 << 30, args.threads)
    rates: dict[str, list[float]] = {arm: [] for arm in blocks}
    probes = []
    for r in range(16):
        for arm in (list(blocks) if r % 2 == 0 else list(blocks)[::-1]):
            probes.append(probe.read(256 << 20))
            t = time.perf_counter()
            for b, o, i in blocks[arm]:
                b.linear(xs[i], outs[arm][o], num_threads=args.threads)
            rates[arm].append(nbytes / (time.perf_counter() - t) / 1e9)
    same = all(torch.equal(outs["paired"][o], outs["one matrix"][o]) for o, _ in shapes)
    pm = statistics.median(probes)
    med = {arm: statistics.median(v) for arm, v in rates.items()}
    print(f"{args.weights}, {nbytes / 1e6:.0f} MB a sweep, {args.threads} threads, read probe median {pm:.1f} GB/s: "
          + ", ".join(f"{arm} {v:.1f} GB/s ({100 * v / pm:.0f} %)" for arm, v in med.items())
          + f"; paired {med['paired'] / med['one matrix']:.3f}x; the same outputs: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
