"""Prefill under scope="all" on the own workers, OpenMP's team, and "mixed", in one process.

Loads the checkpoint with scope="all" (--weights from the store --cache-dir; pool "auto", which
is the own workers under scope="all") and times one forward of --tokens prompt tokens on a
fresh DynamicCache (logits of the last position), the process-wide backend switched between
"own", "openmp" and "mixed" (the own workers, prefill-sized calls on OpenMP's team: pool="auto"
under scope="all" since 2026-12-05 (aa45a1d); native set_pool_backend) every call, the order reversed
every round. A
prefill interleaves torch's ops (embedding, rotary, masks, residual adds) with the kernels'
regions; after each of torch's parallel ops its OpenMP thread spins for milliseconds on the
core the own workers need. --compete N: N busy processes beside it (benchmarks/lib/rivals.py; run
without chrt then).

    chrt -f 1 python benchmarks/studies/bench_prefill_pool.py --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen1.5-moe-a2.7b-4l/int4

Question: Should prefill under scope="all" run on the own workers, OpenMP's team, or both ("mixed")?
Answered in benchmarks/log/decode-step.md, "Decode steps under generate(): the rotary table for
  position_ids, steps hosted on OpenMP's team (2026-12-05)".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package
from lib import stored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stored.add_args(ap)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compete", type=int, default=0, help="busy processes running meanwhile")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache

    from hi_na_moe import _native

    torch.set_num_threads(args.threads)
    model = stored.load(args.ckpt, args.weights, args.cache_dir)
    ids = torch.randint(300, min(model.config.vocab_size, 30000), (1, args.tokens),
                        generator=torch.Generator().manual_seed(0))

    def prefill() -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
            return (time.perf_counter() - t) * 1e3

    from lib.rivals import competing

    ms: dict[str, list[float]] = {"own": [], "openmp": [], "mixed": []}
    with competing(args.compete):
        for b in ms:  # warm-up
            _native.set_pool_backend(b)
            prefill()
        for r in range(args.rounds):
            for b in (list(ms) if r % 2 == 0 else list(ms)[::-1]):
                _native.set_pool_backend(b)
                ms[b].append(prefill())
        _native.set_pool_backend("mixed")
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ckpt": args.ckpt, "weights": args.weights,
           "tokens": args.tokens, "threads": args.threads, "compete": args.compete,
           "median_ms": {b: statistics.median(v) for b, v in ms.items()}, "ms": ms}
    print(f"{args.ckpt}, {args.weights} scope all, prefill {args.tokens} tokens, {args.threads} threads, "
          f"{args.compete} competing processes, {args.rounds} rounds")
    for b, v in ms.items():
        print(f"  {b}: median {statistics.median(v):.1f} ms ({', '.join(f'{x:.0f}' for x in v)})")
    for b in ("openmp", "mixed"):
        print(f"  {b} against own: {statistics.median(ms['own']) / statistics.median(ms[b]):.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
