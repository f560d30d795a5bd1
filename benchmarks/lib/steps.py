"""Decode steps of two (or more) arms in one process, alternating in blocks, each step after an
untimed read of the bandwidth probe: the method of bench_step_ab.py and the studies that A/B one
switch or one packing (studies/bench_paired_linears.py). The read also evicts the caches, as a
real step's weight stream does, and the step's time is read against that read's GB/s."""
from __future__ import annotations

import statistics
import time


def alternate(arms: dict, rounds: int, steps: int, block: int, threads: int, count=None):
    """Decode steps of each arm (name -> (model, a function that puts the arm in place)), `block`
    steps of one arm then the other's, each arm on its own DynamicCache after a 16-token prompt,
    restarted every `steps`, the arms' order swapped every round; each step after an untimed 256
    MB read of a 1 GiB buffer and a 30 ms pause. Returns per arm (step ms, the reads' GB/s, the
    first round's tokens, how much `count()` grew over its steps)."""
    import torch
    from transformers import DynamicCache

    from hi_na_moe import _native

    probe = _native.BandwidthProbe(1 << 30, threads)
    ms: dict[str, list[float]] = {a: [] for a in arms}
    gbs: dict[str, list[float]] = {a: [] for a in arms}
    tokens: dict[str, list[int]] = {a: [] for a in arms}
    calls = {a: 0 for a in arms}
    prompt = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for r in range(rounds):
            state = {}
            for arm, (model, put) in arms.items():
                put()
                cache = DynamicCache(config=model.config)
                out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                state[arm] = (cache, out.logits[:, -1:].argmax(-1))
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for b in range(0, steps, block):
                for arm in order:
                    model, put = arms[arm]
                    put()
                    cache, nxt = state[arm]
                    for _ in range(min(block, steps - b)):
                        gbs[arm].append(probe.read(256 << 20))
                        time.sleep(0.03)
                        before = count() if count else 0
                        t = time.perf_counter()
                        out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                        ms[arm].append((time.perf_counter() - t) * 1e3)
                        calls[arm] += (count() if count else 0) - before
                        nxt = out.logits[:, -1:].argmax(-1)
                        if r == 0:
                            tokens[arm].append(int(nxt))
                    state[arm] = (cache, nxt)
    return ms, gbs, tokens, calls


def arm_rows(ms: dict, gbs: dict) -> dict:
    """Per arm: median ms a step, the paired probe's median GB/s and the number of steps."""
    return {arm: {"median_ms": statistics.median(ms[arm]), "probe_gbs": statistics.median(gbs[arm]),
                  "steps": len(ms[arm])} for arm in ms}
