"""Transparent huge pages for packed weights, compared in one process: the same MoE shape packed
twice, once with the huge-page hint and once without, decode calls alternating between the two
sets, each call paired with a read of the bandwidth probe (itself in two variants, with and
without the hint, also alternating).

Needs a tuning build, in which the hint can be turned off per allocation (HINA_THP=0 at the
time a block or probe buffer is allocated); a normal build always asks for huge pages and this
script says so:

    pip install --no-deps --no-build-isolation -e . -Ccmake.define.HINA_PREFETCH_TUNING=ON -Cinstall.strip=false
    chrt -f 1 python benchmarks/studies/bench_huge_pages.py --shape qwen3,olmoe
    pip install --no-deps --no-build-isolation -e .        # back to the release build

Shapes as in bench_moe_layer.py (transformers' own experts classes, random weights), enough
layer copies per arm to cycle ~2.4 GB (8x the L3), decode T=1 through the patched module as a
user calls it. Prints per arm: median ms, GB/s, and the paired share (median over calls of
call GB/s / the 4 KiB-page probe read right after it), and the probes' medians.

Question: Do transparent huge pages for packed weights speed up decode?
Answered in benchmarks/log/experts-op.md, "Decode call overhead, huge pages, and the six shapes
  again (2026-11-30)".
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

import torch

import hi_na_moe
from hi_na_moe import _native
from hi_na_moe.tools import workload as W


def anon_huge_kb() -> int:
    m = re.search(r"AnonHugePages:\s+(\d+) kB", open(f"/proc/{os.getpid()}/smaps_rollup").read())
    return int(m.group(1)) if m else 0


def run_shape(shape: str, args) -> None:
    E, H, I, K = W.shape_dims(shape)
    n = max(2, -(-int(args.gb * 1e9) // (3 * E * H * I * 2)))
    arms = {}
    huge0 = anon_huge_kb()
    for hint in ("0", "1"):
        os.environ["HINA_THP"] = hint
        cfg, layers = W.build_layers(shape, n, torch.bfloat16)
        hi_na_moe.enable_for_model(layers, backend="native", threads=args.threads)
        arms["huge pages" if hint == "1" else "4 KiB pages"] = layers
    huge_weights = anon_huge_kb() - huge0
    probes = {}
    for hint in ("0", "1"):
        os.environ["HINA_THP"] = hint
        probes[hint] = _native.BandwidthProbe(1 << 30, args.threads)
    os.environ.pop("HINA_THP")
    res = {a: [] for a in arms}
    reads = {"0": [], "1": []}
    names = list(arms)
    with torch.inference_mode():
        for i in range(2 * n * len(names) + args.iters * len(names)):
            arm = names[i % len(names)]
            layer = arms[arm][(i // len(names)) % n]
            x, idx, w = W.make_inputs(cfg, 1, torch.bfloat16, 1000 + i)
            t0 = time.perf_counter()
            layer(x, idx, w)
            dt = time.perf_counter() - t0
            gbs = W.active_bytes(layer, idx) / dt / 1e9
            p4k = probes["0"].read(256 << 20)
            p2m = probes["1"].read(256 << 20)
            if i >= 2 * n * len(names):
                res[arm].append((dt, gbs, gbs / p4k))
                reads["0"].append(p4k)
                reads["1"].append(p2m)
    print(f"# {shape}: E{E} H{H} I{I} top-{K}, {n} layer copies per arm; huge pages granted to the "
          f"hinted arm: {huge_weights / 1e6:.2f} GB of {n * 3 * E * H * I * 2 / 1e9:.2f} GB (about twice that: not a "
          "tuning build, both arms were hinted)")
    print(f"# probe reads (256 MB, after every call): 4 KiB pages median {statistics.median(reads['0']):.1f} GB/s, "
          f"huge pages {statistics.median(reads['1']):.1f} GB/s, ratio "
          f"{statistics.median(b / a for a, b in zip(reads['0'], reads['1'])):.3f}")
    print("| shape | pages | median ms | GB/s | paired share of the 4 KiB-page probe |")
    print("|---|---|---|---|---|")
    for arm, v in res.items():
        print(f"| {shape} | {arm} | {statistics.median(d for d, _, _ in v) * 1e3:.3f} | "
              f"{statistics.median(g for _, g, _ in v):.1f} | {statistics.median(s for _, _, s in v):.1%} |")
    for layers in arms.values():
        hi_na_moe.disable_for_model(layers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3,olmoe", help=f"comma list of {', '.join(W.SHAPES)}")
    ap.add_argument("--iters", type=int, default=80, help="timed calls per arm")
    ap.add_argument("--gb", type=float, default=2.4, help="GB of bf16 weights cycled per arm")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for shape in args.shape.split(","):
        run_shape(shape, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
