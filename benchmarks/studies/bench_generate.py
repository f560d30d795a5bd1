"""What a decode step costs under transformers' generate(), against a plain loop of forwards.

Loads the checkpoint with scope="all" (--weights from the store --cache-dir) and, alternating, per
round: generate(prompt, max_new_tokens=--new-tokens, do_sample=False) on a 16-token prompt, and
the same greedy decode as a loop of `model(token, past_key_values=cache, use_cache=True,
logits_to_keep=1)` with an argmax (bench_full_model.py's loop). Both must give the same tokens.
The causal LM's path (hi_na_moe.fastpath.stack.NativeCausalLM._run: the stack's step and its lm_head, the
native call inside) is timed in both; per decode step after the first: `run` its span, `between`
the time from one span's end to the next one's start (generate: its logits processing, stopping
checks, input preparation and the module call with our checks before _run; the loop: the argmax
and the module call with those checks), `step` their sum. No cache eviction between steps: the
steps follow each other as they do for a user (the weight stream evicts what a step's Python
touched, as it does there).

--ab-position-table: the two arms are generate() with the rotary table read for the
position_ids generate passes (RopeTable.lookup_ids, 2026-12-05, aa45a1d) and generate() with those
steps calling the rotary module (lookup_ids returning None), instead of generate and the loop.
--ab-hosting: the step's regions hosted on OpenMP's team (ThreadPool::host, 2026-12-05, aa45a1d) and on
the own workers (native set_pool_hosting(False)), both under --driver (generate, or the loop).
--ab-min-new-tokens: generate() with min_new_tokens=N (transformers' way to force N tokens: its
logits processors mask the end-of-sequence token at every step) against eos_token_id=None (no
processor; what `hi-na-moe bench` and `demo` use since 2026-12-05 (aa45a1d)).
--compete N: N competing processes (a busy Python loop each, normal scheduling policy) run
throughout, as on a shared machine (then run this without chrt: a real-time benchmark always
wins its cores).

    chrt -f 1 python benchmarks/studies/bench_generate.py --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen1.5-moe-a2.7b-4l/int4

Question: Does a decode step under generate() cost more than in a loop of forwards, and does hosting
  the one call on OpenMP's team fix it?
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
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=12, help="rounds of both arms, their order swapped every round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool", default="auto", choices=("auto", "own", "openmp"), help="the config's pool")
    ap.add_argument("--ab-position-table", action="store_true")
    ap.add_argument("--ab-hosting", action="store_true")
    ap.add_argument("--ab-min-new-tokens", action="store_true")
    ap.add_argument("--driver", default="generate", choices=("generate", "loop"), help="--ab-hosting's arms' decode")
    ap.add_argument("--compete", type=int, default=0, help="busy processes running meanwhile")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache

    from hi_na_moe.fastpath import rope_table
    from hi_na_moe.fastpath import stack

    torch.set_num_threads(args.threads)
    model = stored.load(args.ckpt, args.weights, args.cache_dir, pool=args.pool)
    prompt = torch.randint(300, min(model.config.vocab_size, 30000), (1, 16), generator=torch.Generator().manual_seed(0))
    spans: list[tuple[float, float]] = []
    run = stack.NativeCausalLM._run

    def timed(self, *a, **k):
        t = time.perf_counter()
        out = run(self, *a, **k)
        spans.append((t, time.perf_counter()))
        return out

    stack.NativeCausalLM._run = timed
    lookup_ids = rope_table.RopeTable.lookup_ids
    n = args.new_tokens

    def generate(**kw) -> list[int]:
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                                 **kw)
        return out[0, prompt.shape[1]:].tolist()

    def loop() -> list[int]:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            toks = [int(nxt)]
            for _ in range(n - 1):
                out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                nxt = out.logits[:, -1:].argmax(-1)
                toks.append(int(nxt))
        return toks

    def no_table(self, x, position_ids):
        return None

    from hi_na_moe import _native

    def setting(hosting: bool = True, lookup=lookup_ids):
        def put():
            _native.set_pool_hosting(hosting)
            rope_table.RopeTable.lookup_ids = lookup
        return put

    if args.ab_position_table:
        arms = {"generate, table for position_ids": (generate, setting()),
                "generate, rotary module called": (generate, setting(lookup=no_table))}
    elif args.ab_min_new_tokens:
        arms = {"generate, eos_token_id=None": (lambda: generate(eos_token_id=None), setting()),
                "generate, min_new_tokens": (lambda: generate(min_new_tokens=n), setting())}
    elif args.ab_hosting:
        drive = generate if args.driver == "generate" else loop
        arms = {f"{args.driver}, hosted on OpenMP's team": (drive, setting()),
                f"{args.driver}, own workers": (drive, setting(hosting=False))}
    else:
        arms = {"generate": (generate, setting()), "loop of forwards": (loop, setting())}
    from lib.rivals import competing

    figures = {a: {"run": [], "between": [], "step": [], "wall_ms": []} for a in arms}
    tokens = {}
    with competing(args.compete):
        for arm, (fn, put) in arms.items():  # warm-up, and the tokens
            put()
            tokens[arm] = fn()
        for r in range(args.rounds):
            for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                fn, put = arms[arm]
                put()
                spans.clear()
                t = time.perf_counter()
                if fn() != tokens[arm]:
                    raise SystemExit(f"{arm}: other tokens than its first run's")
                f = figures[arm]
                f["wall_ms"].append((time.perf_counter() - t) * 1e3)
                if len(spans) != n - 1:
                    raise SystemExit(f"{arm}: {len(spans)} decode steps on the causal LM's path, expected {n - 1}")
                for (_, a1), (b0, b1) in zip(spans[1:], spans[2:]):
                    f["run"].append((b1 - b0) * 1e3)
                    f["between"].append((b0 - a1) * 1e3)
                    f["step"].append((b1 - a1) * 1e3)
    setting()()
    stack.NativeCausalLM._run = run
    same = len({tuple(t) for t in tokens.values()}) == 1
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ckpt": args.ckpt, "weights": args.weights,
           "threads": args.threads, "pool": _native.pool_backend(), "compete": args.compete,
           "pool_stats": _native.pool_stats(), "new_tokens": n, "rounds": args.rounds, "same_tokens": same, "arms": {}}
    print(f"{args.ckpt}, {args.weights} scope all, {args.threads} threads, pool {res['pool']}, {args.compete} "
          f"competing processes, {args.rounds} rounds of {n} new tokens an "
          f"arm, alternating")
    print("| arm | step ms (median) | the path's _run ms | between ms | p90 between ms | wall ms a call |")
    print("|---|---|---|---|---|---|")
    for arm, f in figures.items():
        m = {k: statistics.median(v) for k, v in f.items()}
        p90 = sorted(f["between"])[int(0.9 * len(f["between"]))]
        res["arms"][arm] = dict(m, p90_between=p90, steps=len(f["step"]))
        print(f"| {arm} | {m['step']:.3f} | {m['run']:.3f} | {m['between']:.3f} | {p90:.3f} | {m['wall_ms']:.1f} |")
    a, b = list(figures)
    d = statistics.median(figures[b]["step"]) - statistics.median(figures[a]["step"])
    print(f"'{a}' against '{b}': {d:+.3f} ms a step; the same tokens: {same}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
