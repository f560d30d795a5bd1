"""scope="all" with dense_fuse on and off, in one process: two models, decode steps alternating.

Both models are loaded with hi_na_moe.from_pretrained from the same warm store (the experts'
entries are the same files, mapped twice: no second copy in memory); one with dense_fuse=True
(q/k/v and gate/up as one kernel call), one with dense_fuse=False. Each keeps its own KV cache
and decodes the same token ids; the arms alternate every --block steps, so the machine's drift
hits both alike. Prints the median step of each arm and their ratio, and checks that both
produce the same logits (the fused groups compute the same bits).

    python benchmarks/studies/bench_dense_fuse.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 --dense-lossless "" \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4

Question: Do sibling projections fused into one call (dense_fuse) make a decode step faster?
Answered in benchmarks/log/decode-step.md, "Whole-model decode: paired probe, where the step goes,
  and the overhead cuts (2026-11-30)".
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--weights", default="int4", choices=("lossless", "int8", "int4"))
    ap.add_argument("--dense-lossless", default="lm_head")
    ap.add_argument("--cache-dir", required=True, help="the store of --weights")
    ap.add_argument("--steps", type=int, default=96, help="timed steps per arm")
    ap.add_argument("--block", type=int, default=4, help="steps in a row per arm")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache

    import hi_na_moe

    torch.set_num_threads(args.threads)
    arms = {}
    for fuse in (True, False):
        cfg = hi_na_moe.load_config(cache_dir=args.cache_dir, scope="all", dense_lossless=args.dense_lossless,
                                    dense_fuse=fuse)
        model = hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, dtype=torch.bfloat16, progress=False,
                                          config=cfg)
        arms["fused" if fuse else "one call per layer"] = model.eval()
    ids = torch.randint(300, 50000, (1, 16), generator=torch.Generator().manual_seed(0))
    state, times, same = {}, {a: [] for a in arms}, True
    with torch.inference_mode():
        for arm, model in arms.items():
            cache = DynamicCache(config=model.config)
            out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            state[arm] = [cache, out.logits[:, -1:].argmax(-1)]
        # both decode the first arm's tokens, so the work (context length) stays the same
        names = list(arms)
        total = args.steps * len(arms) + 2 * args.block
        for i in range(total):
            arm = names[(i // args.block) % len(names)]
            cache, nxt = state[arm]
            t = time.perf_counter()
            out = arms[arm](nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            dt = time.perf_counter() - t
            state[arm][1] = out.logits[:, -1:].argmax(-1)
            if i >= 2 * args.block:  # warm-up blocks
                times[arm].append(dt)
        # the same input once more through both: the same logits
        probe = torch.tensor([[1234]])
        outs = []
        for arm, model in arms.items():
            c = DynamicCache(config=model.config)
            outs.append(model(torch.cat([ids, probe], 1), past_key_values=c, use_cache=True, logits_to_keep=1).logits)
        same = torch.equal(outs[0], outs[1])
    med = {a: statistics.median(t) for a, t in times.items()}
    a, b = names
    print(f"{args.weights}, scope all: {a} {1e3 * med[a]:.2f} ms/step, {b} {1e3 * med[b]:.2f} ms/step "
          f"(medians of {args.steps} steps each, alternating every {args.block}); {a} / {b} = {med[a] / med[b]:.3f}; "
          f"same logits: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
