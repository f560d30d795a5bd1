"""The latent attention (MLA) decode kernel alone (hina::mla_decode, hi_na_moe.fastpath.mla): one layer's
attention of one new token over S cached positions, DeepSeek-V2-Lite's sizes by default (16
heads, 128 nope + 64 rope dims, latent rank 512, values of 128), bfloat16, at each tier this CPU
runs, tiers alternating call by call. Reported: median time, GFLOP/s (2 H ((Dn + Dv) L + S (2 L +
Dr)) flops: the absorbed query and output, the scores and the weighted sums), and GB/s of the
bytes a call reads at least once (kv_b_proj's weight and the cached latent and rope keys).

    chrt -f 1 python benchmarks/bench_mla_kernel.py --contexts 512,2048,4096
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--nope", type=int, default=128)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--v", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tiers", default="", help="comma list (default: every tier this CPU runs)")
    args = ap.parse_args()
    from hi_na_moe import _native as n

    H, Dn, Dr, L, Dv = args.heads, args.nope, args.rope, args.rank, args.v
    tiers = args.tiers.split(",") if args.tiers else [t for t in ("generic", "avx2", "avx512") if n.isa_supported(t)]
    gen = torch.Generator().manual_seed(0)
    print(f"# H={H} Dn={Dn} Dr={Dr} L={L} Dv={Dv} bf16 | {args.threads} threads | median of {args.reps}")
    print("| positions | tier | ms | GFLOP/s | GB/s (weight + cache) |")
    print("|---|---|---|---|---|")
    for S in (int(c) for c in args.contexts.split(",")):
        q = torch.randn(1, H, Dn + Dr, generator=gen).bfloat16()
        w = (torch.randn(H * (Dn + Dv), L, generator=gen) * 0.05).bfloat16()
        lat = torch.randn(1, S, L, generator=gen).bfloat16()
        kr = torch.randn(1, S, Dr, generator=gen).bfloat16()
        out = torch.empty(1, H, Dv).bfloat16()
        times: dict[str, list[float]] = {t: [] for t in tiers}

        def call(tier: str) -> None:
            n.mla_decode_raw(1, q.data_ptr(), q.stride(0), q.stride(1), q.data_ptr() + Dn * 2, q.stride(0),
                             q.stride(1), w.data_ptr(), lat.data_ptr(), lat.stride(0), lat.stride(1), kr.data_ptr(),
                             kr.stride(0), kr.stride(1), out.data_ptr(), 1, H, S, Dn, Dr, L, Dv, 0.07, 0, 0,
                             args.threads, tier)

        for tier in tiers:
            call(tier)
        for _ in range(args.reps):
            for tier in tiers:
                t = time.perf_counter()
                call(tier)
                times[tier].append(time.perf_counter() - t)
        flop = 2 * H * ((Dn + Dv) * L + S * (2 * L + Dr))
        nbytes = 2 * (w.numel() + lat.numel() + kr.numel())
        for tier in tiers:
            med = statistics.median(times[tier])
            print(f"| {S} | {tier} | {1e3 * med:.3f} | {flop / med / 1e9:.1f} | {nbytes / med / 1e9:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
