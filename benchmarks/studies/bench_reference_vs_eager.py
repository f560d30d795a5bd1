"""The pure-PyTorch reference path against transformers' own eager and grouped_mm experts,
interleaved call by call on the same inputs (so machine drift hits every arm alike).

The reference must never be slower than transformers' eager experts: it is the fallback for
blocks the native kernels cannot run. OLMoE-shaped layers (bf16), working set >> L3.

    chrt -f 1 python benchmarks/studies/bench_reference_vs_eager.py --layers 4

Question: Is the pure-PyTorch reference path never slower than transformers' own eager experts?
Answered in benchmarks/log/experts-op.md, "Reference path vs transformers' experts".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hi_na_moe.core import reference
from hi_na_moe.integrate.adapters import spec_from_interface
from hi_na_moe.tools.workload import build_layers, make_inputs, set_impl


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--tokens", default="1,16,128")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg, layers = build_layers("olmoe", args.layers, torch.bfloat16)
    specs = [spec_from_interface(ex)[0] for ex in layers]
    print(f"# OLMoE experts layer bf16, {args.layers} copies cycled, 2 threads, {args.iters} interleaved rounds")
    print("\n| T | eager ms | grouped_mm ms | reference ms | reference / eager (median of per-round ratios) |")
    print("|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        t = {"eager": [], "grouped_mm": [], "reference": []}
        ratios = []
        with torch.inference_mode():
            for i in range(args.iters + 2):
                x, idx, w = make_inputs(cfg, T, torch.bfloat16, i)
                k = i % len(layers)
                row = {}
                for arm in ("eager", "grouped_mm", "reference"):
                    layer = layers[(k + len(row)) % len(layers)]  # a different copy per arm: no warm cache
                    t0 = time.perf_counter()
                    if arm == "reference":
                        reference.experts_forward(specs[(k + len(row)) % len(layers)], x, idx, w)
                    else:
                        set_impl(layers, arm)
                        layer(x, idx, w)
                    row[arm] = time.perf_counter() - t0
                if i >= 2:
                    for arm, v in row.items():
                        t[arm].append(v)
                    ratios.append(row["reference"] / row["eager"])
        med = {a: statistics.median(v) * 1e3 for a, v in t.items()}
        print(f"| {T} | {med['eager']:.2f} | {med['grouped_mm']:.2f} | {med['reference']:.2f} | {statistics.median(ratios):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
