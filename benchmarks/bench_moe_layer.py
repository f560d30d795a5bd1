"""One MoE experts layer per model shape, side by side: transformers eager / grouped_mm vs
hi_na_moe (reference path and native kernels per tier). Real transformers experts classes,
random bf16 weights.

Shapes (from the public configs; `--shape all` runs the six in one process):
  olmoe             OLMoE-1B-7B        H2048 I1024  E64  top-8
  qwen3             Qwen3-30B-A3B      H2048 I768   E128 top-8
  mixtral           Mixtral-8x7B       H4096 I14336 E8   top-2
  qwen15            Qwen1.5-MoE-A2.7B  H2048 I1408  E60  top-4, shared expert I5632
  deepseek-v2-lite  DeepSeek-V2-Lite   H2048 I1408  E64  top-6, 2 shared experts
  gpt-oss-20b       GPT-OSS-20B        H2880 I2880  E32  top-4, biases, clamped SwiGLU

The working set is far larger than the 300 MB L3: enough separate copies of the layer are
cycled that they hold >= 3 GB of experts (or `--layers N`), and each call gets fresh tokens and
fresh random routing. Every arm's output is checked against the reference path before it is
timed. The machine's read bandwidth (our streaming probe) and bf16 matmul peak (torch.mm,
4096^3, oneDNN/AMX here) are measured in the same run, so shares are against this run's
figures; every call is also paired with a probe right after it (decode: a 256 MB read of a 1 GB
buffer allocated once, round robin; prefill: one torch.mm): the paired share is the median of
call / probe, since this machine's bandwidth and AMX throughput swing within minutes. Shared experts are dense MLPs that PyTorch runs in every arm (hi_na_moe accelerates
the routed experts); their decode time is reported in its own row.

    python benchmarks/bench_moe_layer.py                       # OLMoE, decode T=1 and prefill T=512
    python benchmarks/bench_moe_layer.py --prefill 128,512     # two prefill sizes
    python benchmarks/bench_moe_layer.py --shape all --arms grouped_mm,native,native-avx2
    chrt -f 1 python benchmarks/bench_moe_layer.py ...         # stable figures on a shared machine

Prints one markdown table (median ms, active bytes, GB/s and share of the measured bandwidth
for decode, GFLOP/s and share of the measured matmul peak for prefill, speedup vs the first
arm) and, with --json FILE, writes raw samples.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hi_na_moe.tools.workload import SHAPES, build_layers, build_shared, make_inputs, set_impl, shape_dims, time_arm


class MatmulProbe:
    """One bf16 torch.mm (n^3) per call, in GFLOP/s: the matmul peak as PyTorch reaches it right
    now. This machine's AMX throughput swings by 2-3x within minutes (other tenants), so each
    prefill call is paired with the probe taken right after it."""

    def __init__(self, threads: int, n: int = 4096):
        torch.set_num_threads(threads)
        self.n = n
        self.a = torch.randn(n, n).bfloat16()
        self.b = torch.randn(n, n).bfloat16()
        torch.mm(self.a, self.b)

    def __call__(self) -> float:
        t0 = time.perf_counter()
        torch.mm(self.a, self.b)
        return 2 * self.n ** 3 / (time.perf_counter() - t0) / 1e9


def matmul_peak_gflops(threads: int, n: int = 4096, reps: int = 5) -> float:
    """Best bf16 torch.mm GFLOP/s over `reps` n^3 products (the machine's matmul peak as
    PyTorch reaches it)."""
    probe = MatmulProbe(threads, n)
    return max(probe() for _ in range(reps))


def p90(s: list[float]) -> float:
    return sorted(s)[max(0, -(-9 * len(s) // 10) - 1)]


def read_bandwidth(threads: int) -> float:
    from hi_na_moe import _native

    return max(_native.measure_read_bandwidth(1 << 30, threads, 3)["best_gbs"] for _ in range(2))


def run_shape(shape: str, args, bw_gbs: float, peak_gflops: float) -> list[dict]:
    import hi_na_moe

    dtype = torch.bfloat16
    E, H, I, K = shape_dims(shape)
    bf16_layer = 3 * E * H * I * 2
    n_layers = args.layers or max(2, -(-int(3e9) // bf16_layer))
    cfg, layers = build_layers(shape, n_layers, dtype)
    shared = build_shared(shape, n_layers, dtype)
    print(f"# {shape}: E{E} H{H} I{I} top-{K}, {n_layers} copies x {bf16_layer / 1e6:.0f} MB = "
          f"{n_layers * bf16_layer / 1e9:.2f} GB cycled" + (", with a shared expert" if shared is not None else ""),
          flush=True)
    # the machine drifts: shares of bandwidth use the higher of the run's first probe and this one
    # The machine drifts: the decode shares use the median of read-bandwidth probes taken at the
    # shape's start and after every arm's decode timing; prefill shares the higher matmul peak of
    # the run's start and the shape's start.
    probes = [bw_gbs, read_bandwidth(args.threads)]
    peak_here = matmul_peak_gflops(args.threads)
    print(f"#   read bandwidth now {probes[-1]:.1f} GB/s (run start {bw_gbs:.1f}), matmul peak now "
          f"{peak_here:.0f} GFLOP/s (run start {peak_gflops:.0f})", flush=True)
    peak_gflops = max(peak_gflops, peak_here)
    mm_probe = MatmulProbe(args.threads)
    from hi_na_moe import _native

    bw_probe = _native.BandwidthProbe(1 << 30, args.threads)  # 256 MB per decode call, round robin
    rows = []
    # correctness first: every arm on the same input vs the reference path
    x, idx, w = make_inputs(cfg, 33, dtype, 999)
    hi_na_moe.enable_for_model(layers, backend="reference")
    with torch.inference_mode():
        ref_out = layers[0](x, idx, w).float()
    hi_na_moe.disable_for_model(layers)

    cases = [("decode T=1", 1, args.decode_iters)]
    for T in (int(v) for v in str(args.prefill).split(",") if int(v) > 0):
        cases.append((f"prefill T={T}", T, args.prefill_iters))
    for arm in args.arms.split(","):
        enabled = False
        if arm in ("eager", "grouped_mm"):
            set_impl(layers, arm)
            label = f"transformers {arm}"
        elif arm == "reference":
            hi_na_moe.enable_for_model(layers, backend="reference")
            enabled, label = True, "hi_na_moe reference"
        elif arm.startswith("native"):
            isa = arm.split("-", 1)[1] if "-" in arm else "auto"
            rep = hi_na_moe.enable_for_model(layers, backend="native", isa=isa, threads=args.threads)
            enabled = True
            label = f"hi_na_moe {rep.blocks[0].kernel}"  # "hi_na_moe <decode kernel>|<prefill kernel>"
        else:
            raise SystemExit(f"unknown arm {arm!r}: use eager, grouped_mm, reference, native or native-<tier>")
        with torch.inference_mode():
            got = layers[0](x, idx, w).float()
        err = ((got - ref_out).norm() / ref_out.norm()).item()
        if err > 2e-2:
            raise SystemExit(f"{shape} {label}: output differs from the reference (rel L2 {err:.2e}); not timing it")
        for case, T, iters in cases:
            paired = []
            s, b = time_arm(layers, cfg, T, dtype, iters, warmup=max(2, len(layers)), seed0=1000,
                            after=lambda: paired.append(mm_probe() if T > 1 else bw_probe.read(256 << 20)))
            med = statistics.median(s)
            name = label
            if "|" in label:
                decode_k, prefill_k = label.split(" ", 1)[1].split("|")
                name = f"hi_na_moe {decode_k if T == 1 else prefill_k}"
            row = dict(shape=shape, arm=name, case=case, T=T, peak_gflops=peak_gflops, median_ms=med * 1e3, p90_ms=p90(s) * 1e3,
                       active_mb=statistics.median(b) / 1e6, rel_err=err, samples_ms=[v * 1e3 for v in s])
            if T == 1:
                row["gb_s"] = statistics.median([bb / ss for bb, ss in zip(b, s)]) / 1e9
                row["paired_peaks"] = paired
                row["paired_peak"] = statistics.median(paired)
                row["paired_share"] = statistics.median(bb / ss / 1e9 / pk for bb, ss, pk in zip(b, s, paired))
                probes.append(read_bandwidth(args.threads))
            else:
                flop = 2 * T * K * 3 * H * I
                row["gflop_s"] = flop / med / 1e9
                row["paired_peaks"] = paired
                row["paired_peak"] = statistics.median(paired)
                row["paired_share"] = statistics.median(flop / t / 1e9 / pk for t, pk in zip(s, paired))
            rows.append(row)
            print(f"  {name:55s} {case:15s} {row['median_ms']:8.2f} ms", flush=True)
        if enabled:
            hi_na_moe.disable_for_model(layers)
        set_impl(layers, "grouped_mm")

    if shared is not None:
        samples = []
        nbytes = sum(p.numel() * p.element_size() for p in shared[0].parameters())
        with torch.inference_mode():
            for i in range(len(shared) + args.decode_iters):
                xs = torch.randn(1, H).to(dtype)
                t0 = time.perf_counter()
                shared[i % len(shared)](xs)
                if i >= len(shared):
                    samples.append(time.perf_counter() - t0)
        med = statistics.median(samples)
        rows.append(dict(shape=shape, arm="shared expert MLP (PyTorch, every arm)", case="decode T=1", T=1,
                         median_ms=med * 1e3, p90_ms=p90(samples) * 1e3, active_mb=nbytes / 1e6,
                         gb_s=nbytes / med / 1e9, rel_err=float("nan"), samples_ms=[v * 1e3 for v in samples]))
    bw_shape = statistics.median(probes)
    for r in rows:
        if r["T"] == 1:
            r["bw_gbs"], r["share"] = bw_shape, r["gb_s"] / bw_shape
        else:
            r["share"] = r["gflop_s"] / peak_gflops
    print(f"#   read bandwidth probes for this shape: median {bw_shape:.1f}, range {min(probes):.1f}-{max(probes):.1f} GB/s",
          flush=True)
    del layers, shared
    gc.collect()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="olmoe", help=f"one of {', '.join(SHAPES)}, a comma list, or all")
    ap.add_argument("--layers", type=int, default=0, help="layer copies cycled (0: enough for >= 3 GB, 10x the L3)")
    ap.add_argument("--decode-iters", type=int, default=40)
    ap.add_argument("--prefill", default="512", help="prefill tokens per call, a comma list (0: skip prefill)")
    ap.add_argument("--prefill-iters", type=int, default=5)
    ap.add_argument("--arms", default="eager,grouped_mm,reference,native",
                    help="comma list of: eager, grouped_mm, reference, native, native-<tier>")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write raw samples here")
    ap.add_argument("--compete", action="store_true",
                    help="run a busy-looping process (one core) during the timings: a shared machine")
    args = ap.parse_args()
    shapes = list(SHAPES) if args.shape == "all" else args.shape.split(",")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shape {s!r}: unknown shape; choose from {', '.join(SHAPES)} or all")

    torch.set_num_threads(args.threads)
    bw = read_bandwidth(args.threads)
    peak = matmul_peak_gflops(args.threads)
    print(f"# measured in this run: read bandwidth {bw:.1f} GB/s, bf16 matmul peak {peak:.0f} GFLOP/s "
          f"(torch.mm 4096^3), {args.threads} threads, torch {torch.__version__}", flush=True)

    competitor = None
    if args.compete:
        competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        print("# a competing busy process runs during the timings")
    try:
        results = [r for s in shapes for r in run_shape(s, args, bw, peak)]
    finally:
        if competitor is not None:
            competitor.kill()

    print(f"\nat the start: read bandwidth {bw:.1f} GB/s, bf16 matmul peak {peak:.0f} GFLOP/s; decode roofline per "
          f"shape: the median of the probes taken through that shape; prefill: the higher of the run's and the "
          f"shape's matmul peak; paired: the median over calls of each call's GB/s (GFLOP/s) over the "
          f"bandwidth (torch.mm) probe taken right after it\n")
    print("| shape | provider | case | median ms | p90 ms | active MB | GB/s | GFLOP/s | share of roofline | roofline | "
          "paired share (median probe) | vs first arm | rel err vs ref |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    first = {}
    for r in results:
        key = (r["shape"], r["case"])
        if not r["arm"].startswith("shared"):
            first.setdefault(key, r["median_ms"])
        gbs = f"{r['gb_s']:.1f}" if "gb_s" in r else ""
        gfl = f"{r['gflop_s']:.0f}" if "gflop_s" in r else ""
        active = f"{r['active_mb']:.0f}" if r["T"] == 1 else ""
        roof = f"{r['bw_gbs']:.1f} GB/s" if r["T"] == 1 else f"{r['peak_gflops']:.0f} GFLOP/s"
        vs = "" if r["arm"].startswith("shared") else f"{first[key] / r['median_ms']:.2f}x"
        paired = (f"{r['paired_share']:.0%} ({r['paired_peak']:.{1 if r['T'] == 1 else 0}f})"
                  if "paired_share" in r else "")
        err = "" if r["rel_err"] != r["rel_err"] else f"{r['rel_err']:.1e}"
        print(f"| {r['shape']} | {r['arm']} | {r['case']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {active} | {gbs} | "
              f"{gfl} | {r['share']:.0%} | {roof} | {paired} | {vs} | {err} |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(machine=platform.processor() or platform.machine(), commit=commit,
                                                   bandwidth_gbs=bw, matmul_peak_gflops=peak,
                                                   args=vars(args), results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
