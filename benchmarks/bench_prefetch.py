"""Software-prefetch settings of the kernels, compared round by round in one process (the
settings alternate call by call, so drift on a shared machine hits all alike).

Needs a tuning build, in which the kernels read their prefetch settings from the environment
at every job; a normal build ignores them and this script says so:

    pip install --no-deps --no-build-isolation -e . -Ccmake.define.HINA_PREFETCH_TUNING=ON
    chrt -f 1 python benchmarks/bench_prefetch.py --settings 1024:0,4096:1,8192:1 [--isa avx2]
    chrt -f 1 python benchmarks/bench_prefetch.py --prefill 512 --settings 0,1,2
    pip install --no-deps --no-build-isolation -e .        # back to the release build

Decode (the default, T=1): each setting is <bytes ahead>:<level> of the FMA / integer-dot
kernels' weight stream (HINA_PF, HINA_PFH; level 0: L1, 1: L2, 2: L3).
Prefill (--prefill T, the AMX tier): each setting is the AMX kernels' panel-ahead mode
(HINA_PFA): 0 = no software prefetch, 1 = the next panel of the same job into L2, 2 = also the
next job's first panel (the driver's hint), the release default.

OLMoE-1B-7B-shaped experts (E64 H2048 I1024 top-8, bf16; --weights int8/int4 quantises them,
--qdot picks the kernel family), enough packed copies cycled to exceed 3 GB of bf16 weights
(10x the L3), fresh tokens and routing every round, at op level (PackedExperts.forward).
Prints median ms and GB/s (decode) or GFLOP/s (prefill) per setting, and the machine's probes
of the same run: read bandwidth, and for prefill a torch.mm bf16 probe right after every round
(the paired share is the median of call GFLOP/s over that probe).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hi_na_moe import _native
from lib.synth import weight_maker


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=None,
                    help="comma list; decode: <bytes ahead>:<level> (default 1024:0,2048:0,4096:1,6144:1,"
                         "8192:1,4096:2); prefill: AMX modes (default 0,1,2)")
    ap.add_argument("--prefill", type=int, default=0, help="tokens per call for the prefill path (0: decode T=1)")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds (default 80 decode, 12 prefill)")
    ap.add_argument("--isa", default="auto")
    ap.add_argument("--weights", default="lossless", choices=("lossless", "int8", "int4"))
    ap.add_argument("--qdot", default="auto", choices=("auto", "int", "expand"), help="int8/int4 kernel family")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    T = args.prefill or 1
    rounds = args.rounds or (12 if args.prefill else 80)
    default = "0,1,2" if args.prefill else "1024:0,2048:0,4096:1,6144:1,8192:1,4096:2"
    settings = [tuple(int(v) for v in s.split(":")) for s in (args.settings or default).split(",")]
    E, H, I, K = 64, 2048, 1024, 8
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    tensor = weight_maker(g)

    n_packs = 4 if args.weights == "lossless" else 8
    packs = [_native.PackedExperts(tensor((E, I, H), 7 * i), tensor((E, I, H), 11 * i + 1),
                                   tensor((E, H, I), 13 * i + 2), isa=args.isa, weights=args.weights)
             for i in range(n_packs)]
    per_expert = packs[0].nbytes / E
    path = "prefill" if args.prefill else "decode"
    times: dict[tuple, list[float]] = {s: [] for s in settings}
    probes: list[float] = []
    mm = torch.randn(4096, 4096, generator=g).bfloat16()
    torch.mm(mm, mm)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    qdot = {} if args.weights == "lossless" else {"qdot": args.qdot}
    for r in range(rounds + 2):
        x = torch.randn(T, H, generator=g).bfloat16()
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
        w = torch.rand(T, K, generator=g)
        for i, s in enumerate(settings):
            if args.prefill:
                os.environ["HINA_PFA"] = str(s[0])
            else:
                os.environ["HINA_PF"], os.environ["HINA_PFH"] = str(s[0]), str(s[1])
            pe = packs[(r * len(settings) + i) % len(packs)]
            t0 = time.perf_counter()
            pe.forward(x, idx, w, out, num_threads=args.threads, path=path, **qdot)
            if r >= 2:
                times[s].append(time.perf_counter() - t0)
        if args.prefill and r >= 2:
            t0 = time.perf_counter()
            torch.mm(mm, mm)
            probes.append(2 * 4096 ** 3 / (time.perf_counter() - t0) / 1e9)
    bw = _native.measure_read_bandwidth(1 << 30, args.threads, 5)
    print(f"# {packs[0].kernel_name(path, **qdot)}, T={T}, {args.threads} threads, {n_packs} packed copies of "
          f"{packs[0].nbytes / 1e9:.2f} GB; read-bandwidth probe of this run: best {bw['best_gbs']:.1f}, "
          f"median {bw['median_gbs']:.1f} GB/s")
    meds = {}
    if args.prefill:
        flop = 2 * T * K * 3 * H * I
        print(f"# torch.mm bf16 probes after each round: median {statistics.median(probes):.0f} GFLOP/s, "
              f"range {min(probes):.0f}-{max(probes):.0f}")
        print("| AMX prefetch mode | median ms | GFLOP/s | paired share of the torch.mm probe | vs mode 0 |")
        print("|---|---|---|---|---|")
        for s, v in times.items():
            meds[s] = statistics.median(v)
        base = meds.get((0,))
        for s, v in times.items():
            share = statistics.median(flop / t / 1e9 / p for t, p in zip(v, probes))
            vs = f"{base / meds[s]:.2f}x" if base else ""
            print(f"| {s[0]} | {meds[s] * 1e3:.1f} | {flop / meds[s] / 1e9:.0f} | {share:.0%} | {vs} |")
    else:
        print("| bytes ahead | level | median ms | GB/s | share of best probe |")
        print("|---|---|---|---|---|")
        for s, v in times.items():
            meds[s] = statistics.median(v)
            gbs = K * per_expert / meds[s] / 1e9
            print(f"| {s[0]} | L{s[1] + 1} | {meds[s] * 1e3:.2f} | {gbs:.1f} | {gbs / bw['best_gbs']:.0%} |")
    if len(set(round(m, 4) for m in meds.values())) == 1 or max(meds.values()) / min(meds.values()) < 1.02:
        print("(all settings within 2 %: is this a HINA_PREFETCH_TUNING build?)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
