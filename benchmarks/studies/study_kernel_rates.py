"""How fast each kind of native kernel streams its weights on its own, against the read probe.

Loads the model with hi_na_moe.from_pretrained (scope="all", warm: the store must hold
--weights), decodes two tokens so every kernel is bound, then sweeps the decoder layers, one kind
of call at a time (the q/k/v group's linear, o_proj's, the experts' forward with 8 random
experts of the layer, weight 1/8 each), each call timed alone from Python with one row of input;
before each sweep a 340 MB read of a 1 GiB buffer evicts the caches. Per kind: the bytes the
sweep's calls read over their summed time (the median over --rounds sweeps), beside the read
probe's median 256 MB read in the same rounds. It tells how much of a decode step's gap to the
probe is the kernels' own streaming rather than the code around them (bench_step_gaps.py).
With --experts-k 1,2,4,8 the experts are swept with each number of routed experts, and a line
fitted through (bytes, time) per call gives the call's fixed cost and its marginal rate.

    chrt -f 1 python benchmarks/studies/study_kernel_rates.py --ckpt /work/ckpt/olmoe-1b-7b \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4

Question: How fast does each kind of native kernel stream its weights on its own, against the read
  probe?
Answered in benchmarks/log/decode-step.md, "The router's selection native, and every layer of a
  decode step in one call (2026-11-30)".
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package
from lib import stored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stored.add_args(ap)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--experts-k", default="8", help="comma-separated numbers of routed experts per call")
    args = ap.parse_args()
    ks = [int(k) for k in args.experts_k.split(",")]
    import torch

    from hi_na_moe import _native
    from hi_na_moe.core.registry import patched_runner

    torch.set_num_threads(2)
    model = stored.load(args.ckpt, args.weights, args.cache_dir)
    layers = [patched_runner(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers or any(r is None or r.step is None or r.moe is None for r in layers):
        raise SystemExit("every decoder layer must take the native calls with the MoE block's short path")
    with torch.inference_mode():
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    dt = layers[0].attn.dtype
    H = layers[0].hidden
    x = torch.randn(1, H).to(dt)
    out = torch.empty(1, 4 * max(r.step[0].packed.I for r in layers) + H, dtype=dt)
    gen = torch.Generator().manual_seed(0)

    def linear(kind: int) -> tuple[float, int]:
        spent, nbytes = 0.0, 0
        for r in layers:
            group = r.step[kind]  # 0: the q/k/v group, 1: o_proj
            t = time.perf_counter()
            group.bound.linear(x.data_ptr(), 1, out.data_ptr(), 2)
            spent += time.perf_counter() - t
            nbytes += group.packed.nbytes
        return spent, nbytes

    def experts(k: int) -> tuple[float, int]:
        spent, nbytes = 0.0, 0
        for r in layers:
            e = r.moe.experts
            idx = torch.randperm(e.spec.num_experts, generator=gen)[:k].view(1, k)
            w = torch.full((1, k), 1.0 / k)
            bound, threads = e.bound_for(dt, H, k)
            t = time.perf_counter()
            bound(x.data_ptr(), 1, idx.data_ptr(), 64, k, w.data_ptr(), 0, out.data_ptr(), threads)
            spent += time.perf_counter() - t
            nbytes += k * e.expert_bytes
        return spent, nbytes

    probe = _native.BandwidthProbe(1 << 30, 2)
    kinds = {"q/k/v linear": lambda: linear(0), "o_proj linear": lambda: linear(1)}
    for k in ks:
        kinds[f"experts ({k} of each layer)"] = lambda k=k: experts(k)
    per_call: dict[str, list[tuple[float, int]]] = {k: [] for k in kinds}
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    reads = []
    for _ in range(args.rounds):
        for name, sweep in kinds.items():
            probe.read(340 << 20)
            spent, nbytes = sweep()
            rates[name].append(nbytes / spent / 1e9)
            per_call[name].append((spent / len(layers), nbytes // len(layers)))
        reads.append(probe.read(256 << 20))
    read = statistics.median(reads)
    print(f"{args.ckpt}, {args.weights}, {len(layers)} layers, {args.rounds} rounds: read probe median {read:.1f} GB/s")
    print("| kernel | GB/s (median) | share of the probe |")
    print("|---|---|---|")
    for name, v in rates.items():
        print(f"| {name} | {statistics.median(v):.1f} | {100 * statistics.median(v) / read:.0f} % |")
    if len(ks) > 1:  # least squares through (bytes, median time) of the experts' calls
        pts = [(per_call[f"experts ({k} of each layer)"][0][1],
                statistics.median(t for t, _ in per_call[f"experts ({k} of each layer)"])) for k in ks]
        mb = statistics.mean(b for b, _ in pts)
        mt = statistics.mean(t for _, t in pts)
        slope = sum((b - mb) * (t - mt) for b, t in pts) / sum((b - mb) ** 2 for b, _ in pts)
        print(f"experts' call, fitted over k = {args.experts_k}: {1e6 * (mt - slope * mb):.0f} us fixed, "
              f"{1e-9 / slope:.1f} GB/s marginal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
