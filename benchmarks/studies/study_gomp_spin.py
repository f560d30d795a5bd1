"""How long PyTorch's OpenMP worker keeps spinning after one parallel torch op, and what that does
to the next decode step on the own workers.

1. After one parallel `fill_` of 151936 floats (a logits row of Qwen's vocabulary, as generate's
   float32 copy), samples every thread's /proc state every ~0.5 ms for --sample-ms: the libgomp
   worker shows R (spinning) until its spin count runs out, then S.
2. With --ckpt / --cache-dir (scope="all", int4): a loop of decode forwards with the step's
   regions on the own workers (native set_pool_hosting(False)), alternating every 8 steps between
   nothing between steps and such a parallel fill between steps; prints the median of the step
   (the causal LM path's `_run`, which holds the native call) in each arm.

    python benchmarks/studies/study_gomp_spin.py [--ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen1.5-moe-a2.7b-4l/int4]

Question: How long does PyTorch's OpenMP worker spin after a parallel op, and what does that do to
  the next step on the own workers?
Answered in benchmarks/log/decode-step.md, "Decode steps under generate(): the rotary table for
  position_ids, steps hosted on OpenMP's team (2026-12-05)".
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package
from lib import stored


def states(pid: int) -> dict[int, str]:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                s = f.read()
            out[int(t)] = s[s.rindex(")") + 2]
        except OSError:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sample-ms", type=float, default=20.0)
    ap.add_argument("--ckpt")
    ap.add_argument("--cache-dir")
    ap.add_argument("--steps", type=int, default=256)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    x = torch.empty(151936)
    x.fill_(1)  # the team exists
    time.sleep(0.1)  # ... and sleeps
    me = os.getpid()
    x.fill_(2)
    t0 = time.perf_counter()
    spinning_until = 0.0
    while (now := time.perf_counter() - t0) * 1e3 < args.sample_ms:
        if any(st == "R" for tid, st in states(me).items() if tid != me):
            spinning_until = now
        time.sleep(0.0005)
    print(f"after one parallel fill_ of 151936 floats: another thread of this process in state R until "
          f"{spinning_until * 1e3:.1f} ms (sampled every ~0.5 ms for {args.sample_ms:.0f} ms)")
    if not args.ckpt:
        return 0
    from transformers import DynamicCache

    from hi_na_moe import _native
    from hi_na_moe.fastpath import stack

    model = stored.load(args.ckpt, "int4", args.cache_dir)
    _native.set_pool_hosting(False)
    spans: list[float] = []
    run = stack.NativeCausalLM._run

    def timed(self, *a, **k):
        t = time.perf_counter()
        out = run(self, *a, **k)
        spans.append((time.perf_counter() - t) * 1e3)
        return out

    stack.NativeCausalLM._run = timed
    ms = {"nothing between steps": [], "a parallel fill_ between steps": []}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        nxt = model(torch.tensor([[5, 6, 7, 8]]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        for i in range(args.steps):
            fill = (i // 8) % 2 == 1
            if fill:
                x.fill_(float(i))
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            ms[list(ms)[fill]].append(spans[-1])
    stack.NativeCausalLM._run = run
    _native.set_pool_hosting(True)
    for k, v in ms.items():
        print(f"{args.ckpt}, int4 scope all, own workers: {k}: the step's _run median {statistics.median(v):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
