"""Native kernel paths on one OLMoE-shaped experts layer (bf16, E64 H2048 I1024):

1. switch point: for T tokens (top-8 routing, so ~T*8/64 rows per active expert), time the
   decode (weight-streaming) path and the prefill (tiled GEMM) path forced, side by side, to find
   where prefill starts to win; the library's default threshold is printed next to it.
2. oversubscription: a decode step timed alone, and right after torch ran a matmul on its
   OpenMP pool (whose threads may still be spinning), on each thread-pool backend (`pool`:
   the library's own workers, and torch's OpenMP team), interleaved round by round; the ratio
   should stay near 1.

Working set: `--layers` copies cycled (805 MB each), fresh routing per call.

    chrt -f 1 python benchmarks/bench_native_paths.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hi_na_moe.tools.workload import build_layers, make_inputs


def pack_all(layers, isa):
    from hi_na_moe import _native

    packs = []
    for ex in layers:
        gu, down = ex.gate_up_proj, ex.down_proj
        I = gu.shape[1] // 2
        packs.append(_native.PackedExperts(gu[:, :I].contiguous(), gu[:, I:].contiguous(), down.contiguous(), isa=isa))
    return packs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--isa", default="auto", help="kernel tier to pack for (auto, avx2, avx512, amx, generic)")
    ap.add_argument("--skip-oversubscription", action="store_true")
    args = ap.parse_args()

    from hi_na_moe import _native

    torch.set_num_threads(args.threads)
    cfg, layers = build_layers("olmoe", args.layers, torch.bfloat16)
    packs = pack_all(layers, args.isa)
    del layers  # the packed copies are all the benchmark needs
    K, H = cfg.num_experts_per_tok, cfg.hidden_size
    print(f"# OLMoE experts layer bf16, {args.layers} packed copies ({packs[0].nbytes / 1e6:.0f} MB each), "
          f"{args.threads} threads, tier {packs[0].isa}, prefill path from T >= {_native.DEFAULT_PREFILL_MIN_TOKENS}")

    print("\n| T | rows per active expert | decode path ms | prefill path ms | prefill/decode | kernels |")
    print("|---|---|---|---|---|---|")
    call = 0
    for T in (int(t) for t in args.tokens.split(",")):
        times = {"decode": [], "prefill": []}
        names = {}
        rows = []
        for rep in range(args.reps + 1):
            x, idx, w = make_inputs(cfg, T, torch.bfloat16, 100 + rep)
            idx = idx.to(torch.int32)
            w = w.float()
            rows.append(T * K / torch.unique(idx).numel())
            for path in ("decode", "prefill"):  # same inputs, both paths, alternating
                p = packs[call % len(packs)]
                call += 1
                out = torch.empty(T, H, dtype=torch.bfloat16)
                t0 = time.perf_counter()
                names[path] = p.forward(x, idx, w, out, num_threads=args.threads, path=path)
                dt = time.perf_counter() - t0
                if rep:  # first round is warm-up
                    times[path].append(dt)
        d, pf = statistics.median(times["decode"]), statistics.median(times["prefill"])
        print(f"| {T} | {statistics.median(rows):.1f} | {d * 1e3:.2f} | {pf * 1e3:.2f} | {pf / d:.2f} | "
              f"{names['decode']}, {names['prefill']} |")

    if args.skip_oversubscription:
        return 0
    # oversubscription: decode alone vs right after torch's OpenMP pool worked, per pool backend
    a = torch.randn(1024, 1024)
    backends = ["own"] + (["openmp"] if _native.openmp_runtime() else [])
    times = {(b, c): [] for b in backends for c in ("alone", "after")}
    for i in range(40):
        x, idx, w = make_inputs(cfg, 1, torch.bfloat16, 500 + i)
        idx, w = idx.to(torch.int32), w.float()
        out = torch.empty(1, H, dtype=torch.bfloat16)
        for j, (b, case) in enumerate(times):
            _native.set_pool_backend(b)
            p = packs[(i * len(times) + j) % len(packs)]
            if case == "after":
                torch.mm(a, a)  # torch's pool just ran: its threads may still spin
            else:
                # past libgomp's spin window: after a torch op its workers spin 5-10 ms here
                time.sleep(0.02)
            t0 = time.perf_counter()
            p.forward(x, idx, w, out, num_threads=args.threads)
            times[(b, case)].append(time.perf_counter() - t0)
    _native.set_pool_backend("auto")
    active = 8 * 3 * H * cfg.intermediate_size * 2
    print(f"\n| pool backend | decode T=1 alone ms | right after a torch matmul ms | ratio after/alone | "
          f"GB/s alone / after ({active / 1e6:.0f} MB) |")
    print("|---|---|---|---|---|")
    for b in backends:
        ma, mb = statistics.median(times[(b, "alone")]), statistics.median(times[(b, "after")])
        print(f"| {b} | {ma * 1e3:.2f} | {mb * 1e3:.2f} | {mb / ma:.2f} | {active / ma / 1e9:.1f} / {active / mb / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
