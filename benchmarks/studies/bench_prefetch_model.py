"""Whole-model decode with the weight-stream prefetch hint alternating, in one process (tuning builds).

Needs a build with -Ccmake.define.HINA_PREFETCH_TUNING=ON (see csrc/moe/prefetch.h): the
kernels then read HINA_PFH (0: L1, 1: L2, the release default; 2: L3; 3: non-temporal) at the
start of every job, so this script can switch it between decode steps. The model is loaded
once (hi_na_moe.from_pretrained from a warm store, scope all); each round decodes 64 steps
after a fresh 16-token prompt, the hint changing every 4 steps (the order shifts per round);
the first 4 steps of a round are not counted.

    python benchmarks/studies/bench_prefetch_model.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4 --hints 1,3

Question: Which prefetch hint (L1, L2, L3, non-temporal) suits the weight stream of a whole decode
  step?
Answered in benchmarks/log/decode-step.md, "Whole-model decode: paired probe, where the step goes,
  and the overhead cuts (2026-11-30)".
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--weights", default="int4", choices=("lossless", "int8", "int4"))
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--dense-lossless", default="")
    ap.add_argument("--hints", default="1,3")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache

    import hi_na_moe

    torch.set_num_threads(2)
    hints = args.hints.split(",")
    model = hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, dtype=torch.bfloat16, progress=False,
                                      config=hi_na_moe.load_config(cache_dir=args.cache_dir, scope="all",
                                                                   dense_lossless=args.dense_lossless))
    model.eval()
    res: dict[str, list[float]] = {h: [] for h in hints}
    with torch.inference_mode():
        for rnd in range(args.rounds):
            cache = DynamicCache(config=model.config)
            out = model(input_ids=torch.tensor([list(range(300, 316))]), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
            tok = int(out.logits[0, -1].argmax())
            for step in range(64):
                h = hints[(step // 4 + rnd) % len(hints)]
                os.environ["HINA_PFH"] = h
                t = time.perf_counter()
                out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
                dt = time.perf_counter() - t
                tok = int(out.logits[0, -1].argmax())
                if step >= 4:
                    res[h].append(dt * 1e3)
    for h in hints:
        print(f"HINA_PFH={h}: median {statistics.median(res[h]):.1f} ms per step ({len(res[h])} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
