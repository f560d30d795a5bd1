"""Kernel tiers side by side at op level, in one process: the same OLMoE-shaped experts packed for
each tier (--tiers, e.g. avx2,avx512), decode calls (T=1) alternating tier by tier, so the
machine's drift hits every tier alike. What a CPU of the lower tier would run, on this machine's
cores and memory (a proxy: an AVX2-only CPU has its own core and memory system).

    chrt -f 1 python benchmarks/bench_tiers.py --tiers avx2,avx512 --weights lossless,int8,int4

E64 H2048 I1024 top-8 (bf16; --weights quantises; qdot auto), enough packed copies cycled to
exceed 1.5 GB per tier and format (5x the largest L3 we run on), fresh tokens and routing every
round. Prints median ms and GB/s of the weights each call reads, and the share of a read
bandwidth probe run right after each round (paired share: median over rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hi_na_moe import _native
from lib.synth import weight_maker


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiers", default="avx2,avx512")
    ap.add_argument("--weights", default="lossless,int8,int4")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tiers = args.tiers.split(",")
    for t in tiers:
        if not _native.isa_supported(t):
            raise SystemExit(f"--tiers: this CPU has no '{t}' tier")
    E, H, I, K = 64, 2048, 1024, 8
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    tensor = weight_maker(g)

    probe = _native.BandwidthProbe(1 << 30, args.threads)
    out = torch.empty(1, H, dtype=torch.bfloat16)
    print(f"# E{E} H{H} I{I} top-{K}, T=1, {args.threads} threads, {args.rounds} rounds")
    print("| weights | tier | kernel | median ms | GB/s | paired share of the read probe | vs the first tier |")
    print("|---|---|---|---|---|---|---|")
    for wf in args.weights.split(","):
        packed_bytes = _native.header_info(_native.PackedExperts.plan(
            "bfloat16", E, H, I, True, False, False, False, tiers[0], wf, 64, False))["nbytes"]
        n_packs = max(2, -(-int(1.5e9) // packed_bytes))
        srcs = [(tensor((E, I, H), 7 * i), tensor((E, I, H), 11 * i + 1), tensor((E, H, I), 13 * i + 2))
                for i in range(n_packs)]
        packs = {t: [_native.PackedExperts(*s, isa=t, weights=wf) for s in srcs] for t in tiers}
        per_expert = packs[tiers[0]][0].nbytes / E
        times = {t: [] for t in tiers}
        shares = {t: [] for t in tiers}
        names = {}
        for r in range(args.rounds + 3):
            x = torch.randn(1, H, generator=g).bfloat16()
            idx = torch.randperm(E, generator=g)[:K].view(1, K).int()
            w = torch.rand(1, K, generator=g)
            order = tiers if r % 2 == 0 else tiers[::-1]
            dts = {}
            for t in order:
                pe = packs[t][r % n_packs]
                t0 = time.perf_counter()
                names[t] = pe.forward(x, idx, w, out, num_threads=args.threads, path="decode")
                dts[t] = time.perf_counter() - t0
            bw = probe.read(256 << 20)
            if r >= 3:
                for t in tiers:
                    times[t].append(dts[t])
                    shares[t].append(K * per_expert / dts[t] / 1e9 / bw)
        base = statistics.median(times[tiers[0]])
        for t in tiers:
            med = statistics.median(times[t])
            print(f"| {wf} | {t} | {names[t]} | {med * 1e3:.2f} | {K * per_expert / med / 1e9:.1f} | "
                  f"{statistics.median(shares[t]):.0%} | {base / med:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
