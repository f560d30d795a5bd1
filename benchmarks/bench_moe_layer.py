"""One MoE experts layer, side by side: transformers eager / grouped_mm vs hi_na_moe (reference
path and native kernels per tier). Real transformers experts classes, random bf16 weights.

The working set is far larger than the 300 MB L3: `--layers` separate copies of the layer are
cycled (OLMoE-1B-7B shape: 805 MB of experts per layer), and each call gets fresh tokens and
fresh random routing. Every arm's output is checked against the reference before it is timed.

    python benchmarks/bench_moe_layer.py                     # OLMoE shape, decode T=1 and prefill T=512
    python benchmarks/bench_moe_layer.py --shape mixtral --layers 2 --prefill 128
    chrt -f 1 python benchmarks/bench_moe_layer.py ...       # stable figures on a shared machine

Prints a markdown table (median ms, achieved GB/s over the bytes of the experts actually read,
speedup vs eager) and, with --json FILE, writes raw samples.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from hi_na_moe.workload import SHAPES, build_layers, make_inputs, set_impl, time_arm

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    ap.add_argument("--layers", type=int, default=4, help="separate layer copies cycled (working set ≫ L3)")
    ap.add_argument("--decode-iters", type=int, default=40)
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: skip)")
    ap.add_argument("--prefill-iters", type=int, default=5)
    ap.add_argument("--arms", default="eager,grouped_mm,reference,native",
                    help="comma list of: eager, grouped_mm, reference, native, native-<isa>")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write raw samples here")
    ap.add_argument("--compete", action="store_true",
                    help="run a busy-looping process (one core) during the timings: a shared machine")
    args = ap.parse_args()

    import hi_na_moe

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16
    cfg, layers = build_layers(args.shape, args.layers, dtype)
    layer_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    print(f"# {args.shape} experts layer, bf16, {args.layers} copies x {layer_bytes / 1e6:.0f} MB = "
          f"{args.layers * layer_bytes / 1e9:.2f} GB cycled, {args.threads} threads, torch {torch.__version__}")

    arms = args.arms.split(",")
    ref_out = {}
    # correctness first: every arm on the same input vs the reference path
    x, idx, w = make_inputs(cfg, 33, dtype, 999)
    hi_na_moe.enable_for_model(layers, backend="reference")
    with torch.inference_mode():
        ref_out = layers[0](x, idx, w).float()
    hi_na_moe.disable_for_model(layers)

    competitor = None
    if args.compete:
        competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        print("# a competing busy process runs during the timings")
    results = []
    for arm in arms:
        enabled = False
        if arm in ("eager", "grouped_mm"):
            set_impl(layers, arm)
        elif arm == "reference":
            hi_na_moe.enable_for_model(layers, backend="reference")
            enabled = True
        elif arm.startswith("native"):
            isa = arm.split("-", 1)[1] if "-" in arm else "auto"
            rep = hi_na_moe.enable_for_model(layers, backend="native", isa=isa, threads=args.threads)
            enabled = True
            arm = f"hi_na_moe:{rep.blocks[0].kernel}"
        else:
            raise SystemExit(f"unknown arm {arm!r}")
        with torch.inference_mode():
            got = layers[0](x, idx, w).float()
        err = ((got - ref_out).norm() / ref_out.norm()).item()
        if err > 2e-2:
            raise SystemExit(f"{arm}: output differs from the reference (rel L2 {err:.2e}); not timing it")
        for label, T, iters in (("decode T=1", 1, args.decode_iters), (f"prefill T={args.prefill}", args.prefill, args.prefill_iters)):
            if T == 0:
                continue
            s, b = time_arm(layers, cfg, T, dtype, iters, warmup=max(2, len(layers)), seed0=1000)
            med = statistics.median(s)
            gbs = statistics.median([bb / ss for bb, ss in zip(b, s)]) / 1e9
            results.append(dict(arm=arm, case=label, median_ms=med * 1e3, p90_ms=sorted(s)[max(0, -(-9 * len(s) // 10) - 1)] * 1e3,
                                gb_s=gbs, rel_err=err, samples_ms=[v * 1e3 for v in s]))
        if enabled:
            hi_na_moe.disable_for_model(layers)
        set_impl(layers, "grouped_mm")

    if competitor is not None:
        competitor.kill()
    base_arm = "eager" if "eager" in arms else results[0]["arm"]
    base = {r["case"]: r["median_ms"] for r in results if r["arm"] == base_arm}
    print(f"\n| provider | case | median ms | p90 ms | achieved GB/s | vs {base_arm} | rel err vs ref |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        sp = base.get(r["case"], float("nan")) / r["median_ms"]
        print(f"| {r['arm']} | {r['case']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['gb_s']:.1f} | {sp:.2f}x | {r['rel_err']:.1e} |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(machine=platform.processor() or platform.machine(), commit=commit,
                                                   args=vars(args), results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
