"""Where a whole-model decode step goes: the step, and inside it the time of hi_na_moe's experts
op (timed around every MoE block's runner call); the rest is attention, router, norms, lm_head
in PyTorch and Python. Loads with hi_na_moe.from_pretrained (warm: the store must hold the
format, e.g. after benchmarks/bench_full_model.py), 16-token prompt, then --steps decode steps.

    python benchmarks/bench_decode_breakdown.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4 [--torch-threads 2] [--steps 40]
Run it with and without OMP_WAIT_POLICY=PASSIVE in the environment to compare.
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
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache

    import hi_na_moe
    from hi_na_moe import ops, patching

    torch.set_num_threads(args.torch_threads)
    model = hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, dtype=torch.bfloat16, progress=False,
                                      config=hi_na_moe.load_config(cache_dir=args.cache_dir))
    if any(b.cache != "reused" for b in hi_na_moe.report_for(model).blocks):
        raise SystemExit(f"the store {args.cache_dir} did not hold every block: run the cold load first")
    spent = [0.0]

    class Timed(ops.NativeExperts):
        def __call__(self, *a):
            t = time.perf_counter()
            out = super().__call__(*a)
            spent[0] += time.perf_counter() - t
            return out

    for _, _, choice in patching._ROOTS[model][0]:
        if isinstance(choice.runner, ops.NativeExperts):
            choice.runner.__class__ = Timed
    ids = torch.randint(3, 50000, (1, 16), generator=torch.Generator().manual_seed(0))
    steps, experts = [], []
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(args.steps):
            spent[0] = 0.0
            t = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            steps.append(time.perf_counter() - t)
            experts.append(spent[0])
            nxt = out.logits[:, -1:].argmax(-1)
    step, exp = statistics.median(steps), statistics.median(experts)
    print(f"{args.weights}, torch threads {args.torch_threads}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}: "
          f"step {1e3 * step:.1f} ms = experts op {1e3 * exp:.1f} ms + rest {1e3 * (step - exp):.1f} ms "
          f"(medians of {args.steps} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
