"""What the activation epilogue costs the prefill kernels: one OLMoE-shaped MoE layer (E64 H2048
I1024 top-8, bf16, T=512, 2 threads) packed for each tier given, run with SiLU and with ReLU
(whose epilogue costs next to nothing) back to back, the order alternating round by round.
Prints per tier the median ms of each and the median of the per-round differences SiLU - ReLU
(paired: the machine's drift between rounds cancels).

    chrt -f 1 python benchmarks/studies/study_act_epilogue.py --tiers avx2,avx512 --rounds 15

Question: What does the activation epilogue cost the prefill kernels?
Answered in benchmarks/log/whole-model.md, "bf16 prefill with AVX512-BF16 dot products on a CPU
  without AMX (2026-11-30)".
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hi_na_moe import _native


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiers", default="avx2,avx512")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    E, H, I, K, T = 64, 2048, 1024, 8, 512
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    packs = {t: _native.PackedExperts(rnd(E, I, H), rnd(E, I, H), rnd(E, H, I), isa=t) for t in args.tiers.split(",")}
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, generator=g)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    times = {(t, a): [] for t in packs for a in ("silu", "relu")}
    names = {}
    for r in range(args.rounds + 1):
        for t, pe in packs.items():
            for a in (("silu", "relu") if r % 2 else ("relu", "silu")):
                t0 = time.perf_counter()
                names[t] = pe.forward(x, idx, w, out, num_threads=2, path="prefill", act=a)
                if r:
                    times[(t, a)].append(time.perf_counter() - t0)
    print(f"# T={T}, 2 threads, {args.rounds} rounds")
    print("| tier | kernel | SiLU ms | ReLU ms | median of SiLU - ReLU per round, ms |")
    print("|---|---|---|---|---|")
    for t in packs:
        s, rl = times[(t, "silu")], times[(t, "relu")]
        d = statistics.median(a - b for a, b in zip(s, rl))
        print(f"| {t} | {names[t]} | {statistics.median(s) * 1e3:.1f} | {statistics.median(rl) * 1e3:.1f} | {d * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
