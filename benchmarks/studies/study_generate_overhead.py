"""Where a generate() decode step's time goes beyond a plain loop of forwards, and whose it is.

Loads --ckpt with scope="all" (lib/stored.load: lm_head quantised too, the store in --cache-dir,
packed on a first run) and times, interleaved in one process, per round (order swapped every
round): (a) greedy `model.generate(prompt, max_new_tokens=N, do_sample=False, eos_token_id=None)`
with one extra stopping criterion that only records time.perf_counter() (a step: from one
timestamp to the next; a criterion rather than a logits processor, as (c) shows why),
and (b) a loop of `model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)` over the
same cache class (DynamicCache) with an argmax, timestamped after each argmax, and (c) (a) with a
no-op logits processor added. All must decode the same tokens. Then each arm runs --profile-calls
more times under cProfile (switched on at the first timestamp: decode steps only, no prefill),
interleaved; per decode step, every function's own (self) time is put in one group by where it lives: transformers, hi_na_moe, torch
ops (built-in torch functions and tensor methods), torch's Python, and the rest (the native step
is a nanobind function, which cProfile does not see: its time is the self time of the stack's
_one_call, a group of its own); the top functions of generate by self time and the
cumulative time of generate's own per-step stages are listed; last, each arm's greedy pick over a
vocabulary-sized logits row (bf16 argmax, float32 copy + argmax) timed alone. (cProfile adds about a microsecond
per Python call, so its figures over-weight Python against native work: read them as shares.)

    chrt -f 1 python benchmarks/studies/study_generate_overhead.py --ckpt models/hina-tiny-moe \\
        --cache-dir /tmp/hina-store-tiny

Question: How much slower is a generate() decode step than a plain forward loop, and how much of
  the difference is hi_na_moe's Python against transformers' generation machinery?
Answered in benchmarks/log/decode-step.md, "generate() against a loop of forwards: where the
  per-step difference goes (2026-12-07)".
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package
from lib import stored

STAGES = ("_sample", "prepare_inputs_for_generation", "_update_model_kwargs_for_generation",
          "_call_impl", "__call__")


def group(filename: str, name: str) -> str:
    """The owner of a profiled function, by its file (built-ins by their name)."""
    f = filename.replace("\\", "/")
    if "/transformers/" in f:
        return "transformers"
    if f.endswith("hi_na_moe/fastpath/stack.py") and name == "_one_call":
        # nanobind's functions are no builtins to cProfile: the native step is in its caller's self time
        return "hi_na_moe (_one_call: the native step)"
    if "/hi_na_moe/" in f:
        return "hi_na_moe (Python)"
    if "/torch/" in f:
        return "torch (Python)"
    if f == "~":
        if "torch" in name or "Tensor" in name:
            return "torch ops"
        return "builtins"
    return "other Python"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stored.add_args(ap, cache_help="the store of --weights (packed here on a first run)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10, help="rounds of both arms, their order swapped every round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile-calls", type=int, default=5, help="calls of each arm under cProfile")
    ap.add_argument("--top", type=int, default=20, help="functions listed by self time")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    torch.set_num_threads(args.threads)
    model = stored.load(args.ckpt, args.weights, args.cache_dir)
    prompt = torch.randint(10, min(model.config.vocab_size, 30000), (1, 16), generator=torch.Generator().manual_seed(0))
    n = args.new_tokens
    stamps: list[float] = []
    profiling: list = [None]  # the arm's cProfile.Profile while profiling: switched on at the first stamp

    def mark() -> None:
        stamps.append(time.perf_counter())
        if len(stamps) == 1 and profiling[0] is not None:
            profiling[0].enable()  # the prefill is done: profile the decode steps only

    class Stamp(StoppingCriteria):
        # a stopping criterion, not a logits processor: LogitsProcessorList calls inspect.signature
        # on every processor at every step, which would add its own cost to the arm it times
        def __call__(self, input_ids, scores, **kwargs):
            mark()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    class NoOp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores

    def generate(processors=()) -> list[int]:
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, stopping_criteria=StoppingCriteriaList([Stamp()]),
                                 logits_processor=LogitsProcessorList(processors))
        return out[0, prompt.shape[1]:].tolist()

    def loop() -> list[int]:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            mark()
            toks = [int(nxt)]
            for _ in range(n - 1):
                out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                nxt = out.logits[:, -1:].argmax(-1)
                mark()
                toks.append(int(nxt))
        return toks

    arms = {"generate": generate, "loop of forwards": loop,
            "generate + a no-op logits processor": lambda: generate([NoOp()])}
    tokens = {a: fn() for a, fn in arms.items()}  # warm-up, and the tokens
    steps = {a: [] for a in arms}
    wall = {a: [] for a in arms}
    for r in range(args.rounds):
        order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
        for arm in (order if r % 2 == 0 else order[::-1]):
            stamps.clear()
            t = time.perf_counter()
            if arms[arm]() != tokens[arm]:
                raise SystemExit(f"{arm}: other tokens than its first run's")
            wall[arm].append((time.perf_counter() - t) * 1e3)
            if len(stamps) != n:
                raise SystemExit(f"{arm}: {len(stamps)} timestamps, expected {n}")
            # the first stamp ends the prefill; steps 2.. are decode steps after a decode step
            steps[arm] += [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:])]
    same = len({tuple(t) for t in tokens.values()}) == 1
    med = {a: statistics.median(v) for a, v in steps.items()}
    print(f"{args.ckpt}, {args.weights} scope all, {args.threads} threads, {args.rounds} rounds of {n} new tokens "
          f"an arm, interleaved; the same tokens: {same}")
    print("| arm | decode step ms (median) | p10 | p90 | wall ms a call (median) |")
    print("|---|---|---|---|---|")
    for a, v in steps.items():
        s = sorted(v)
        print(f"| {a} | {med[a]:.3f} | {s[len(s) // 10]:.3f} | {s[9 * len(s) // 10]:.3f} | "
              f"{statistics.median(wall[a]):.1f} |")
    g, lp = med["generate"], med["loop of forwards"]
    print(f"generate - loop: {g - lp:+.3f} ms a step, ratio {g / lp:.3f}x; the no-op logits processor: "
          f"{med['generate + a no-op logits processor'] - g:+.3f} ms a step")

    # attribution: cProfile over a few calls of each arm, self time per decode step by owner
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ckpt": args.ckpt, "weights": args.weights,
           "threads": args.threads, "new_tokens": n, "rounds": args.rounds, "same_tokens": same,
           "median_step_ms": med, "median_wall_ms": {a: statistics.median(v) for a, v in wall.items()},
           "profile": {}}
    profs = {arm: cProfile.Profile() for arm in arms}
    for _ in range(args.profile_calls):  # interleaved too, so a busy moment of the host hits every arm
        for arm, fn in arms.items():
            stamps.clear()
            profiling[0] = profs[arm]
            fn()
            profs[arm].disable()
            profiling[0] = None
    k = args.profile_calls * (n - 1)  # the decode steps after the prefill's token
    per_step = {arm: (pstats.Stats(prof).stats, k) for arm, prof in profs.items()}
    groups: dict[str, dict[str, float]] = {}
    for arm, (st, k) in per_step.items():
        acc = collections.Counter()
        for (fname, _line, name), (_cc, _nc, tt, _ct, _callers) in st.items():
            acc[group(fname, name)] += tt * 1e6 / k
        groups[arm] = dict(acc)
    names = sorted(set(groups["generate"]) | set(groups["loop of forwards"]), key=lambda x: -groups["generate"].get(x, 0))
    third = groups["generate + a no-op logits processor"]
    print("\nSelf time per decode step under cProfile (us), by owner:")
    print("| owner | generate | loop | difference | generate + no-op processor |")
    print("|---|---|---|---|---|")
    for nm in names:
        a, b = groups["generate"].get(nm, 0.0), groups["loop of forwards"].get(nm, 0.0)
        print(f"| {nm} | {a:.1f} | {b:.1f} | {a - b:+.1f} | {third.get(nm, 0.0):.1f} |")
    ta, tb = sum(groups["generate"].values()), sum(groups["loop of forwards"].values())
    print(f"| all | {ta:.1f} | {tb:.1f} | {ta - tb:+.1f} | {sum(third.values()):.1f} |")
    res["profile"]["self_us_per_step_by_owner"] = groups

    st, k = per_step["generate"]
    st_l, k_l = per_step["loop of forwards"]
    loop_self = {key: v[2] * 1e6 / k_l for key, v in st_l.items()}
    print("\nThe loop's top 10 functions by self time per decode step (us):")
    for (fname, line, name), v in sorted(st_l.items(), key=lambda kv: -kv[1][2])[:10]:
        print(f"- {Path(fname).name}:{line} {name}: {v[1] / k_l:.2f} calls, {v[2] * 1e6 / k_l:.1f} us")
    print(f"\nThe functions generate spends most more self time in than the loop, per decode step (us), top {args.top}:")
    print("| function | owner | generate self us | loop self us | difference |")
    print("|---|---|---|---|---|")
    keys = set(st) | set(st_l)
    diff = {key: (st[key][2] * 1e6 / k if key in st else 0.0) - loop_self.get(key, 0.0) for key in keys}
    res["profile"]["top_difference"] = []
    for key in sorted(keys, key=lambda x: -diff[x])[:args.top]:
        fname, line, name = key
        where = f"{Path(fname).name}:{line} {name}" if fname != "~" else name
        g_us = st[key][2] * 1e6 / k if key in st else 0.0
        res["profile"]["top_difference"].append({"function": where, "owner": group(fname, name), "generate_self_us": g_us,
                                                 "loop_self_us": loop_self.get(key, 0.0), "difference_us": diff[key]})
        print(f"| {where} | {group(fname, name)} | {g_us:.1f} | {loop_self.get(key, 0.0):.1f} | {diff[key]:+.1f} |")
    print(f"\ngenerate's top {args.top} functions by self time per decode step (us), beside the loop's:")
    print("| function | owner | calls a step | self us | cumulative us | loop self us |")
    print("|---|---|---|---|---|---|")
    top = sorted(st.items(), key=lambda kv: -kv[1][2])[:args.top]
    res["profile"]["top_generate"] = []
    for (fname, line, name), (_cc, nc, tt, ct, _c) in top:
        where = f"{Path(fname).name}:{line} {name}" if fname != "~" else name
        row = {"function": where, "owner": group(fname, name), "calls": nc / k, "self_us": tt * 1e6 / k,
               "cum_us": ct * 1e6 / k, "loop_self_us": loop_self.get((fname, line, name), 0.0)}
        res["profile"]["top_generate"].append(row)
        print(f"| {where} | {row['owner']} | {row['calls']:.2f} | {row['self_us']:.1f} | {row['cum_us']:.1f} | "
              f"{row['loop_self_us']:.1f} |")
    print("\nWho calls generate's top functions the loop spends under half their time in, cumulative us a decode step:")
    for (fname, line, name), (_cc, nc, tt, ct, callers) in top:
        if loop_self.get((fname, line, name), 0.0) < 0.5 * tt * 1e6 / k and callers:
            by = sorted(callers.items(), key=lambda kv: -kv[1][3])[:3]
            who = "; ".join(f"{Path(c[0]).name}:{c[1]} {c[2]} ({v[3] * 1e6 / k:.1f})" for c, v in by)
            print(f"- {Path(fname).name}:{line} {name} <- {who}")
    print("\ngenerate's transformers functions by cumulative time per decode step (us), top 15:")
    print("| function | calls a step | self us | cumulative us |")
    print("|---|---|---|---|")
    tf = [(key, v) for key, v in st.items() if group(key[0], key[2]) == "transformers"]
    res["profile"]["transformers_cum"] = []
    for (fname, line, name), (_cc, nc, tt, ct, _c) in sorted(tf, key=lambda kv: -kv[1][3])[:15]:
        row = {"function": f"{Path(fname).name}:{line} {name}", "calls": nc / k, "self_us": tt * 1e6 / k,
               "cum_us": ct * 1e6 / k}
        res["profile"]["transformers_cum"].append(row)
        print(f"| {row['function']} | {row['calls']:.2f} | {row['self_us']:.1f} | {row['cum_us']:.1f} |")
    # the greedy pick each arm makes: the loop's argmax on the bf16 logits, generate's on a float32 copy
    row = torch.randn(1, 1, model.config.vocab_size, generator=torch.Generator().manual_seed(1)).bfloat16()

    def us(fn) -> float:
        for _ in range(20):
            fn()
        t = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(t)

    pick = {"bf16 argmax (the loop)": us(lambda: row[:, -1:].argmax(-1)),
            "float32 copy + argmax (generate)": us(lambda: torch.argmax(row[:, -1].to(copy=True, dtype=torch.float32),
                                                                        dim=-1))}
    res["greedy_pick_us"] = pick
    print(f"\nThe greedy pick over {model.config.vocab_size} logits (median of 200, us): "
          + "; ".join(f"{a}: {v:.1f}" for a, v in pick.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
