"""How fast each weight format's decode kernel runs when its weights are already in the caches.

A decode step streams its weights from DRAM, so its rate is bounded by the memory; this study
removes the memory from the picture: one dense linear (one row of input, --k inputs) per format
and size, packed with hi_na_moe's native core, called --calls times in a row so its weights stay
resident in L2/L3, median over --rounds rounds. Its bytes over its time is the kernel's
arithmetic ceiling: a format whose whole-model step reads far below this ceiling is held back by
something other than its arithmetic.

    chrt -f 1 python benchmarks/studies/study_resident_rates.py

Question: How fast does each format's decode kernel run with its weights already in the caches?
Answered in benchmarks/log/whole-model.md, "A fresh machine's int4 share, the rotary table and final
  norm, and a lossless packing study (2026-11-30)".
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="int4,int8,lossless", help="comma-separated formats")
    ap.add_argument("--rows", default="2048,16384", help="comma-separated output sizes")
    ap.add_argument("--k", type=int, default=2048, help="input size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import torch

    from hi_na_moe.core.native import native_module

    native, why = native_module()
    if native is None:
        raise SystemExit(f"the native library is not available: {why}")
    torch.manual_seed(0)
    x = torch.randn(1, args.k).bfloat16()
    print(f"one dense linear, {args.k} inputs, one row, {args.threads} threads, {args.calls} calls per round, "
          f"median of {args.rounds} rounds")
    for weights in args.weights.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            w = (torch.randn(rows, args.k) * 0.02).bfloat16()
            packed = native.PackedExperts.pack_linear(w, None, isa="auto", weights=weights, num_threads=args.threads)
            bound = packed.bind(qdot="auto")
            out = torch.empty(1, rows, dtype=torch.bfloat16)
            for _ in range(20):
                bound.linear(x.data_ptr(), 1, out.data_ptr(), args.threads)
            times = []
            for _ in range(args.rounds):
                t = time.perf_counter()
                for _ in range(args.calls):
                    bound.linear(x.data_ptr(), 1, out.data_ptr(), args.threads)
                times.append((time.perf_counter() - t) / args.calls)
            m = statistics.median(times)
            print(f"  {weights:10s} {packed.nbytes / 1e6:7.1f} MB: {m * 1e6:8.1f} us per call, "
                  f"{packed.nbytes / m / 1e9:6.1f} GB/s ({packed.kernel_name('decode', 'auto')})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
