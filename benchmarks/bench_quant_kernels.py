"""Decode and prefill speed of the native op per weight format (bf16 / int8 / int4), at the op level.

What it measures: `PackedExperts.forward` on an OLMoE-1B-7B-shaped experts layer (E=64, H=2048,
I=1024, top-8 by default), one copy per layer, `--layers` copies cycled so the weights read per
step (>= 1.5 GB for every format by default) are far larger than the 300 MB L3. Arms are
interleaved: round r times every format on the same routing, then round r+1, so drift on this
shared machine hits every arm alike. Decode (T=1) bytes = the packed bytes of the experts the
step routes to (scales included); GB/s is compared with the read bandwidth measured in the same
run (`measure_read_bandwidth`, best of two probes of 3 passes). Prefill: T tokens (default 512), GFLOP/s.
int8 / int4 run once per kernel family in `--qdot` (arms `int8/int`, `int8/expand`, ...: the
integer-dot kernels with activations quantised per token, and the weight-expansion kernels;
`auto` = what the library picks), on the same packed copies.

Before timing, every arm is checked against the dequantised reference (PyTorch on
`unpack()`), so a wrong kernel is never timed (integer-dot arms within their activation
quantisation: rel L2 < 5e-2 instead of 2e-2).

    chrt -f 1 python benchmarks/bench_quant_kernels.py [--formats native,int8,int4] [--group 64]
        [--qdot int,expand] [--layers N] [--rounds 30] [--prefill 512] [--threads 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hi_na_moe import _native
from hi_na_moe.tools.workload import SHAPES


def reference(pe, x, idx, w):
    g, u, d = (torch.from_dlpack(a).float() if a is not None else None for a in pe.unpack()[:3])
    xf = x.float()
    out = torch.zeros_like(xf)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            h = torch.nn.functional.silu(g[e] @ xf[t]) * (u[e] @ xf[t])
            out[t] += float(w[t, k]) * (d[e] @ h)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="olmoe", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="lossless,int8,int4")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--qdot", default="int,expand", help="kernel families for int8/int4 (auto, int, expand)")
    ap.add_argument("--layers", type=int, default=0, help="copies cycled (0: enough for >= 1.5 GB per format)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: skip)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    kw = SHAPES[args.shape][1]
    E = kw.get("num_experts", kw.get("num_local_experts"))
    H, K = kw["hidden_size"], kw["num_experts_per_tok"]
    I = kw.get("moe_intermediate_size", kw.get("intermediate_size"))
    fmts = args.formats.split(",")
    qdots = args.qdot.split(",")
    # arms: (label, format, qdot); lossless ignores qdot
    arms = [(f, f, "auto") if f == "lossless" else (f"{f}/{q}", f, q) for f in fmts
            for q in (["auto"] if f == "lossless" else qdots)]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    std = 0.02
    bf16_layer = 3 * E * H * I * 2
    n_layers = args.layers or max(2, -(-int(1.5e9 * 4) // bf16_layer))  # int4 needs 4x the copies
    packs: dict[str, list] = {f: [] for f in fmts}
    for _ in range(n_layers):
        g = (torch.randn(E, I, H, generator=gen) * std).bfloat16()
        u = (torch.randn(E, I, H, generator=gen) * std).bfloat16()
        d = (torch.randn(E, H, I, generator=gen) * std).bfloat16()
        for f in fmts:
            # only keep as many copies of a format as it needs to exceed 1.5 GB
            need = max(2, -(-int(1.5e9) // (bf16_layer // {"lossless": 1, "int8": 2, "int4": 4}[f])))
            if len(packs[f]) < need or args.layers:
                packs[f].append(_native.PackedExperts(g, u, d, weights=f, group_size=args.group,
                                                      num_threads=args.threads))
        del g, u, d
    bw = max(_native.measure_read_bandwidth(1 << 30, args.threads, 3)["best_gbs"] for _ in range(2))

    # correctness gate
    x = torch.randn(3, H, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(3)]).int()
    w = torch.rand(3, K, generator=gen)
    for a, f, q in arms:
        pe = packs[f][0]
        out = torch.empty(3, H, dtype=torch.bfloat16)
        pe.forward(x, idx, w, out, num_threads=args.threads, qdot=q)
        ref = reference(pe, x, idx, w)
        err = float((out.float() - ref).norm() / ref.norm())
        if err > (2e-2 if q == "expand" or f == "lossless" else 5e-2):
            raise SystemExit(f"{a}: output differs from the dequantised reference (rel L2 {err:.2e})")

    per_expert = {f: packs[f][0].nbytes / E for f in fmts}
    results = []
    probes = [bw]
    cases = [("decode T=1", 1)] + ([(f"prefill T={args.prefill}", args.prefill)] if args.prefill else [])
    for label, T in cases:
        times: dict[str, list[float]] = {a: [] for a, _, _ in arms}
        active: dict[str, list[int]] = {a: [] for a, _, _ in arms}
        rounds = args.rounds if T == 1 else max(3, args.rounds // 6)
        for r in range(rounds + 2):
            x = torch.randn(T, H, generator=gen).bfloat16()
            idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int()
            w = torch.rand(T, K, generator=gen)
            out = torch.empty(T, H, dtype=torch.bfloat16)
            if T == 1 and r % 5 == 0:  # the probe interleaved with the rounds: the same conditions
                probes.append(_native.measure_read_bandwidth(1 << 30, args.threads, 1)["best_gbs"])
            for a, f, q in arms:
                pe = packs[f][r % len(packs[f])]
                t0 = time.perf_counter()
                pe.forward(x, idx, w, out, num_threads=args.threads, qdot=q)
                dt = time.perf_counter() - t0
                if r >= 2:  # warm-up rounds
                    times[a].append(dt)
                    active[a].append(len(set(idx.flatten().tolist())))
        if T == 1:
            # the machine drifts: shares are against the median of the probes taken during the rounds
            bw = statistics.median(probes)
        for a, f, q in arms:
            med = statistics.median(times[a])
            nbytes = statistics.median(active[a]) * per_expert[f]
            flops = 2 * 3 * H * I * T * K
            results.append(dict(format=a, case=label, median_ms=med * 1e3,
                                p90_ms=sorted(times[a])[int(0.9 * (len(times[a]) - 1))] * 1e3,
                                gb_s=nbytes / med / 1e9, roofline=nbytes / med / 1e9 / bw,
                                gflop_s=flops / med / 1e9, kernel=packs[f][0].kernel_name("decode" if T == 1 else "prefill", q),
                                copies=len(packs[f]), set_gb=len(packs[f]) * packs[f][0].nbytes / 1e9))
    if args.json:
        print(json.dumps(dict(shape=args.shape, group=args.group, bandwidth_gb_s=bw, probes_gb_s=probes,
                              results=results), indent=1))
        return 0
    print(f"# {args.shape} experts layer (E={E} H={H} I={I} top-{K}), int4 group {args.group}, "
          f"threads {args.threads or _native.default_num_threads()}, read bandwidth {bw:.1f} GB/s (median of {len(probes)} probes taken between the decode rounds, range {min(probes):.1f}-{max(probes):.1f})")
    print("| format | case | kernel | median ms | p90 ms | GB/s | share of bandwidth | GFLOP/s | cycled GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['format']} | {r['case']} | {r['kernel']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | "
              f"{r['gb_s']:.1f} | {100 * r['roofline']:.0f} % | {r['gflop_s']:.0f} | {r['set_gb']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
