"""A gated MLP as two dense linears against the same weights as one gated expert, streamed from DRAM.

A shared expert (Qwen2-MoE, DeepSeek) or a dense MLP runs in the one native call as two dense
linears, [gate | up] then down (hi_na_moe.fastpath.mlp, csrc/moe/mlp.cpp: one matrix a panel, PyTorch's
roundings between them); a routed expert runs through the experts' kernel, gate and up
interleaved in one panel (two matrices a pass). bench_step_gaps.py --ops put Qwen1.5-MoE's shared
expert at 86-100 % of the read probe and its routed experts at 106-113 %. This study asks how much
of that is the kernels: --copies packed copies of one random MLP (hidden --hidden, intermediate
--inter, weights --weights), both forms, cycled so the working set is far larger than the
caches; rounds alternate the arms' order; each round is preceded by a 256 MB read (the probe).
Prints the median GB/s of packed bytes per arm and its share of the median probe.

    chrt -f 1 python benchmarks/studies/study_gated_vs_linear.py --inter 5632 --weights int4 --copies 24

Question: Does a gated MLP stream faster packed as one gated expert than as two dense linears?
Answered in benchmarks/log/decode-step.md, "The shared expert and dense layers op by op, paired
  linear layers, and the step's Python (2026-12-05)".
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--weights", default="int4", choices=("lossless", "lossless12", "int8", "int4"))
    ap.add_argument("--copies", type=int, default=24, help="packed copies cycled (working set)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    from hi_na_moe import _native

    PE = _native.PackedExperts
    H, I, nt = args.hidden, args.inter, args.threads
    gen = torch.Generator().manual_seed(0)
    dense, gated = [], []
    for _ in range(args.copies):
        g, u, d = (torch.randn(*s, generator=gen).mul_(0.02).bfloat16() for s in ((I, H), (I, H), (H, I)))
        dense.append((PE.pack_linear(torch.cat([g, u]).contiguous(), weights=args.weights),
                      PE.pack_linear(d.contiguous(), weights=args.weights)))
        gated.append(PE(g[None].contiguous(), u[None].contiguous(), d[None].contiguous(), weights=args.weights))
    nbytes = gated[0].data.nbytes
    ws = nbytes * args.copies
    if ws < 512e6:
        print(f"note: the working set is {ws / 1e6:.0f} MB; raise --copies for one far larger than the caches")
    x = torch.randn(1, H, generator=gen).bfloat16()
    m = torch.randn(1, I, generator=gen).bfloat16()
    gu = torch.empty(1, 2 * I, dtype=torch.bfloat16)
    out = torch.empty(1, H, dtype=torch.bfloat16)
    idx, wt = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    probe = _native.BandwidthProbe(1 << 30, nt)
    rates: dict[str, list[float]] = {"two linears": [], "one gated expert": []}
    probes = []
    for r in range(args.rounds):
        for arm in (list(rates) if r % 2 == 0 else list(rates)[::-1]):
            probes.append(probe.read(256 << 20))
            t = time.perf_counter()
            for c in range(args.copies):
                if arm == "two linears":
                    dense[c][0].linear(x, gu, num_threads=nt)
                    dense[c][1].linear(m, out, num_threads=nt)
                else:
                    gated[c].forward(x, idx, wt, out, num_threads=nt)
            rates[arm].append(ws / (time.perf_counter() - t) / 1e9)
    pm = statistics.median(probes)
    print(f"hidden {H}, intermediate {I}, {args.weights}, {nbytes / 1e6:.1f} MB a copy x {args.copies}, {nt} threads, "
          f"{args.rounds} rounds; read probe median {pm:.1f} GB/s")
    for arm, v in rates.items():
        print(f"  {arm:18s} {statistics.median(v):6.1f} GB/s ({100 * statistics.median(v) / pm:.0f} % of the probe)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
