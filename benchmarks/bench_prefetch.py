"""Software-prefetch settings of the lossless decode kernels, compared round by round in one
process (the settings alternate call by call, so drift on a shared machine hits all alike).

Needs a tuning build, in which the kernels read HINA_PF (bytes ahead) and HINA_PFH (0: L1,
1: L2, 2: L3) at every job; a normal build ignores them and this script says so:

    pip install --no-deps --no-build-isolation -e . -Ccmake.define.HINA_PREFETCH_TUNING=ON
    chrt -f 1 python benchmarks/bench_prefetch.py --settings 1024:0,4096:1,8192:1 [--isa avx2]
    pip install --no-deps --no-build-isolation -e .        # back to the release build

OLMoE-1B-7B-shaped experts (E64 H2048 I1024 top-8, bf16; --weights int8/int4 quantises them,
--qdot picks the kernel family), 4 packed copies (3.2 GB) cycled (int8/int4: 8),
decode T=1 at op level (PackedExperts.forward). Prints median ms and GB/s per setting and the
read-bandwidth probe of the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hi_na_moe import _native


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="1024:0,2048:0,4096:1,6144:1,8192:1,4096:2",
                    help="comma list of <bytes ahead>:<level>")
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--isa", default="auto")
    ap.add_argument("--weights", default="lossless", choices=("lossless", "int8", "int4"))
    ap.add_argument("--qdot", default="auto", choices=("auto", "int", "expand"), help="int8/int4 kernel family")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    settings = [tuple(int(v) for v in s.split(":")) for s in args.settings.split(",")]
    E, H, I, K = 64, 2048, 1024, 8
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    block = (torch.randn(1 << 22, generator=g) * 0.02).bfloat16()

    def tensor(shape, shift):
        n = shape[0] * shape[1] * shape[2]
        src = torch.cat([block[shift:], block[:shift]])
        return src.repeat(n // src.numel() + 1)[:n].view(shape)

    packs = [_native.PackedExperts(tensor((E, I, H), 7 * i), tensor((E, I, H), 11 * i + 1),
                                   tensor((E, H, I), 13 * i + 2), isa=args.isa, weights=args.weights)
             for i in range(4 if args.weights == "lossless" else 8)]
    per_expert = packs[0].nbytes / E
    times: dict[tuple, list[float]] = {s: [] for s in settings}
    out = torch.empty(1, H, dtype=torch.bfloat16)
    qdot = {} if args.weights == "lossless" else {"qdot": args.qdot}
    for r in range(args.rounds + 2):
        x = torch.randn(1, H, generator=g).bfloat16()
        idx = torch.randperm(E, generator=g)[:K].int().view(1, K)
        w = torch.rand(1, K, generator=g)
        for i, s in enumerate(settings):
            os.environ["HINA_PF"], os.environ["HINA_PFH"] = str(s[0]), str(s[1])
            pe = packs[(r * len(settings) + i) % len(packs)]
            t0 = time.perf_counter()
            pe.forward(x, idx, w, out, num_threads=args.threads, **qdot)
            if r >= 2:
                times[s].append(time.perf_counter() - t0)
    bw = _native.measure_read_bandwidth(1 << 30, args.threads, 5)
    print(f"# {packs[0].kernel_name('decode', **qdot)}, {args.threads} threads; read-bandwidth probe of this run: "
          f"best {bw['best_gbs']:.1f}, median {bw['median_gbs']:.1f} GB/s")
    print("| bytes ahead | level | median ms | GB/s | share of best probe |")
    print("|---|---|---|---|---|")
    meds = {}
    for s, v in times.items():
        meds[s] = statistics.median(v)
        gbs = K * per_expert / meds[s] / 1e9
        print(f"| {s[0]} | L{s[1] + 1} | {meds[s] * 1e3:.2f} | {gbs:.1f} | {gbs / bw['best_gbs']:.0%} |")
    if len(set(round(m, 4) for m in meds.values())) == 1 or max(meds.values()) / min(meds.values()) < 1.02:
        print("(all settings within 2 %: is this a HINA_PREFETCH_TUNING build?)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
