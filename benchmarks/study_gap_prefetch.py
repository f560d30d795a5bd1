"""Experiment: prefetch the next native call's weights in the background while Python runs
between two calls (hi_na_moe._native.gap_prefetch), in-process A/B.

Loads the model with hi_na_moe.from_pretrained (scope="all", warm: the store must hold --weights),
then decodes in blocks of --block steps, alternating: A, no gap prefetch; B, after the stack's one
native call returns, lm_head's packed block is prefetched while Python gets to lm_head, and after
lm_head returns, layer 0's dense blocks (q/k/v, o_proj, router, shared expert) while Python gets to
the next step's call. Each region stops the prefetcher when it starts. Steps run back to back (no
read between them: the caches hold what a real decode leaves). Prints per-mode median step times
and their ratio, per round and overall.

    chrt -f 1 python benchmarks/study_gap_prefetch.py --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen1.5-moe-a2.7b-4l/int4
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--weights", default="int4", choices=("lossless", "lossless12", "int8", "int4"))
    ap.add_argument("--cache-dir", required=True, help="the store of --weights")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=16, help="steps per mode per round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache

    import hi_na_moe
    from hi_na_moe import _native
    from hi_na_moe.dense import NativeLinear
    from hi_na_moe.patching import patched_runner
    from hi_na_moe.stack import NativeStack

    torch.set_num_threads(args.threads)
    cfg = hi_na_moe.load_config(cache_dir=args.cache_dir, scope="all", dense_lossless="")
    model = hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, dtype=torch.bfloat16, progress=False,
                                      config=cfg).eval()
    st = next(r for m in model.modules() if isinstance(r := patched_runner(m), NativeStack))
    linears = {o.name: o for o in gc.get_objects() if isinstance(o, NativeLinear) and o.packed is not None}
    head = [o for n, o in linears.items() if n.startswith("lm_head")]
    first = [o for n, o in linears.items() if n.startswith("model.layers.0.")]
    if len(head) != 1 or not first:
        raise SystemExit(f"expected lm_head and layer 0's linears on the native kernels: {sorted(linears)[:8]}")
    head_ranges = [(head[0].packed.address, head[0].packed.nbytes)]
    first_ranges = [(o.packed.address, o.packed.nbytes) for o in first]
    mode = {"on": False}

    class Plan:  # the stack's StepPlan: after run, lm_head's block
        def __init__(self, plan):
            self.plan = plan

        def run(self, *a):
            out = self.plan.run(*a)
            if mode["on"]:
                _native.gap_prefetch(head_ranges)
            return out

        def scratch_bytes(self, B):
            return self.plan.scratch_bytes(B)

    fwd = model.lm_head.forward

    def head_forward(*a, **k):
        out = fwd(*a, **k)
        if mode["on"]:
            _native.gap_prefetch(first_ranges)
        return out

    model.lm_head.forward = head_forward
    ids = torch.randint(300, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    times = {False: [], True: []}
    per_round = []
    now = time.perf_counter
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(4):
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
        if st._plan is None:
            raise SystemExit("the stack's decode steps did not take the one native call")
        st._plan = (Plan(st._plan[0]), st._plan[1])
        lines0 = _native.gap_prefetch_lines()
        for r in range(args.rounds):
            meds = {}
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                mode["on"] = on
                ts = []
                for _ in range(args.block + 1):
                    t = now()
                    out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    ts.append(now() - t)
                    nxt = out.logits[:, -1:].argmax(-1)
                ts = ts[1:]  # the first step of a block follows the other mode's last
                times[on] += ts
                meds[on] = statistics.median(ts)
            per_round.append(meds)
            print(f"round {r}: off {meds[False] * 1e3:.2f} ms, on {meds[True] * 1e3:.2f} ms, "
                  f"on/off {meds[True] / meds[False]:.3f}", flush=True)
    lines = _native.gap_prefetch_lines() - lines0
    steps_on = len(times[True]) + args.rounds
    mb = sum(b for _, b in head_ranges + first_ranges) / 1e6
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.ckpt}, {args.weights}, scope all: median step off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms, "
          f"on/off {on / off:.3f} (median of rounds {statistics.median(m[True] / m[False] for m in per_round):.3f}); "
          f"prefetched {lines * 64 / steps_on / 1e6:.1f} MB a step of {mb:.1f} MB offered")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
