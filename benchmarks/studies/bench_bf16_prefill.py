"""Prefill of bf16 weights on an AVX-512 CPU without AMX: the bf16 dot-product kernel
(vdpbf16ps, moe_prefill_bf16_avx512bf16) against the fp32 FMA kernel it replaced and against
PyTorch's own bf16 matmuls, round by round in one process.

    chrt -f 1 python benchmarks/studies/bench_bf16_prefill.py                  # dot vs torch
    pip install --no-deps --no-build-isolation -e . -Ccmake.define.HINA_PREFETCH_TUNING=ON \
        -Cbuild-dir=build/pftune                                       # + the fp32 arm
    chrt -f 1 python benchmarks/studies/bench_bf16_prefill.py
    pip install --no-deps --no-build-isolation -e .                    # back to the release build

The fp32 arm needs a tuning build, whose kernel selection reads HINA_BF16DOT=0; in a release
build it is left out (the script says so). Ops, at op level (PackedExperts.forward / .linear):
- moe: OLMoE-1B-7B-shaped experts (E64 H2048 I1024 top-8, SiLU-gated), T tokens, fresh
  tokens and routing every round, several packed copies cycled (>= 1 GB of weights);
  torch arm: what transformers' expert loop does in bf16 (per expert: index, F.linear gate/up,
  silu * up, F.linear down, scale, index_add_).
- linear: a 2048 x 2048 projection (an attention q/o of that model), T tokens; torch arm F.linear.
Every round runs each arm once, in alternating order, then a torch.mm bf16 probe (4096^3);
prints median ms, GFLOP/s, the paired share of the probe, and ratios against the dot kernel.

Question: Does bf16 prefill on AVX512-BF16 dot products beat the fp32 FMA kernel on a CPU without
  AMX?
Answered in benchmarks/log/whole-model.md, "bf16 prefill with AVX512-BF16 dot products on a CPU
  without AMX (2026-11-30)".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hi_na_moe import _native

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package
from lib.synth import weight_maker


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ops", default="moe,linear")
    args = ap.parse_args()
    if not _native.cpu_features()["cpu"]["avx512bf16"]:
        print("this CPU has no AVX512-BF16: the dot kernel does not run here")
        return 1
    torch.set_num_threads(args.threads)
    T, E, H, I, K = args.tokens, 64, 2048, 1024, 8
    g = torch.Generator().manual_seed(0)
    tensor = weight_maker(g)

    os.environ["HINA_BF16DOT"] = "0"
    probe = _native.PackedExperts.pack_linear(tensor((64, 64), 1))
    fp32_arm = probe.kernel_name("prefill").endswith("_avx512")
    os.environ.pop("HINA_BF16DOT")
    if not fp32_arm:
        print("# release build: the fp32 arm needs -Ccmake.define.HINA_PREFETCH_TUNING=ON (left out)")
    arms = ["dot", "fp32", "torch"] if fp32_arm else ["dot", "torch"]

    ops = args.ops.split(",")
    work = {}
    if "moe" in ops:
        packs, refs = [], []
        for i in range(3):
            gate, up, down = tensor((E, I, H), 7 * i), tensor((E, I, H), 11 * i + 1), tensor((E, H, I), 13 * i + 2)
            packs.append(_native.PackedExperts(gate, up, down))
            refs.append((gate, up, down))
        work["moe"] = (packs, refs, 2 * T * K * 3 * H * I)
    if "linear" in ops:
        ws = [tensor((H, H), 17 * i + 3) for i in range(8)]
        work["linear"] = ([_native.PackedExperts.pack_linear(w) for w in ws], ws, 2 * T * H * H)

    def torch_moe(x, idx, w, ref):
        gate, up, down = ref
        out = torch.zeros(T, H, dtype=torch.bfloat16)
        for e in range(E):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            h = F.silu(F.linear(xe, gate[e])) * F.linear(xe, up[e])
            out.index_add_(0, rows, F.linear(h, down[e]) * w[rows, slot, None].bfloat16())
        return out

    mm = torch.randn(4096, 4096, generator=g).bfloat16()
    torch.mm(mm, mm)
    times = {(op, a): [] for op in work for a in arms}
    probes = []
    names = {}
    for r in range(args.rounds + 1):
        x = torch.randn(T, H, generator=g).bfloat16()
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
        w = torch.rand(T, K, generator=g)
        out = torch.empty(T, H, dtype=torch.bfloat16)
        order = arms if r % 2 == 0 else arms[::-1]
        for op, (packs, refs, _) in work.items():
            i = r % len(packs)
            for a in order:
                if a == "fp32":
                    os.environ["HINA_BF16DOT"] = "0"
                t0 = time.perf_counter()
                if a == "torch":
                    if op == "moe":
                        torch_moe(x, idx, w, refs[i])
                    else:
                        F.linear(x, refs[i])
                elif op == "moe":
                    names[(op, a)] = packs[i].forward(x, idx, w, out, num_threads=args.threads, path="prefill")
                else:
                    names[(op, a)] = packs[i].linear(x, out, num_threads=args.threads, path="prefill")
                dt = time.perf_counter() - t0
                os.environ.pop("HINA_BF16DOT", None)
                if r > 0:
                    times[(op, a)].append(dt)
        if r > 0:
            t0 = time.perf_counter()
            torch.mm(mm, mm)
            probes.append(2 * 4096 ** 3 / (time.perf_counter() - t0) / 1e9)
    print(f"# T={T}, {args.threads} threads, {args.rounds} rounds; torch.mm bf16 probe after each round: "
          f"median {statistics.median(probes):.0f} GFLOP/s ({min(probes):.0f}-{max(probes):.0f})")
    print("| op | arm | kernel | median ms | GFLOP/s | paired share of the probe | dot kernel's speed-up |")
    print("|---|---|---|---|---|---|---|")
    for op, (_, _, flop) in work.items():
        dot = statistics.median(times[(op, "dot")])
        for a in arms:
            v = times[(op, a)]
            med = statistics.median(v)
            share = statistics.median(flop / t / 1e9 / p for t, p in zip(v, probes))
            print(f"| {op} | {a} | {names.get((op, a), 'torch bf16')} | {med * 1e3:.1f} | {flop / med / 1e9:.0f} | "
                  f"{share:.0%} | {med / dot:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
