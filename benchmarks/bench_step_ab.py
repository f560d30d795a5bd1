"""Whole decode steps with one of hi_na_moe's step paths on and off, in one process.

Loads the checkpoint once with scope="all" (--weights, the store --cache-dir) and times decode
steps with the path --switch names on and off, alternating every --block steps (each arm on its
own KV cache, after a 16-token prompt, restarted every --steps; the arms' order swaps every
round), each step after an untimed 256 MB read of a 1 GiB buffer (the paired probe of
bench_full_model.py, which also evicts the caches, as a real step's weight stream does) and a
30 ms pause. Prints per arm the median ms a step and the probe's median; checks that both arms
decode the same tokens and that the path was taken by every step of its arm and by none of the other's.

Switches:
  causal_lm  the causal LM's decode step as its stack's step and lm_head called straight
             (hi_na_moe.fastpath.stack.NativeCausalLM) against its own forward around them
  outputs    the output objects built without their constructors (hi_na_moe.fastpath.stack.Outputs)
             against by them (steps on the path: those with the fast build)
  head_in_call  the lm_head at the end of the stack's one native call (stack.HEAD_IN_CALL)
             against its runner's forward after the call
  held_plan_args  the layers' one-call arguments held while what they hold is unchanged
             (layers.HOLD_PLAN_ARGS) against built at every step
  kv_group   the layers' KV buffers as one tensor whose step views are two torch ops
             (kv_cache.GROUP) against a buffer and two views a layer

    chrt -f 1 python benchmarks/bench_step_ab.py --switch causal_lm --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen1.5-moe-a2.7b-4l/int4
"""
from __future__ import annotations

import argparse
import time

from lib import record, stored
from lib.steps import alternate, arm_rows


def causal_lm_switch(model):
    """(use(on), calls()): the NativeCausalLM of `model` on or off, and how many steps took it."""
    from hi_na_moe.core.registry import patched_runner
    from hi_na_moe.fastpath.stack import NativeCausalLM

    runner = patched_runner(model)
    if not isinstance(runner, NativeCausalLM):
        raise SystemExit("the model's decode steps do not take hi_na_moe.fastpath.stack.NativeCausalLM (report_for says why)")
    taken = [0]
    run = runner._run

    def counted(fast):
        taken[0] += 1
        return run(fast)

    runner._run = counted

    def use(on: bool) -> None:
        runner.ready = on

    return use, lambda: taken[0]


def outputs_switch(model):
    """(use(on), calls()): the output objects of the causal LM's path and of the stack built
    without their constructors (hi_na_moe.fastpath.stack.Outputs) or by them."""
    from hi_na_moe.core.registry import patched_runner
    from hi_na_moe.fastpath.stack import NativeCausalLM, NativeStack

    builders = [r.outputs for m in model.modules() if isinstance(r := patched_runner(m), (NativeCausalLM, NativeStack))]
    if not builders or not all(b.fast for b in builders):
        raise SystemExit("the model's output objects are not built by hi_na_moe.fastpath.stack.Outputs' fast path")

    def use(on: bool) -> None:
        for b in builders:
            b.fast = on

    _, lm_calls = causal_lm_switch(model)  # (counts the causal LM's steps: each builds one output object)
    return use, lambda: lm_calls() if builders[0].fast else 0


def _one_calls(model, counts):
    """A count of the model's stack's one native calls for which counts(their return) holds (its
    _one_call wrapped)."""
    from hi_na_moe.core.registry import patched_runner
    from hi_na_moe.fastpath.stack import NativeStack

    stacks = [r for m in model.modules() if isinstance(r := patched_runner(m), NativeStack)]
    if len(stacks) != 1:
        raise SystemExit("the model has no decoder stack on hi_na_moe.fastpath.stack")
    taken = [0]
    one_call = stacks[0]._one_call

    def counted(*args):
        out = one_call(*args)
        taken[0] += out is not None and bool(counts(out))
        return out

    stacks[0]._one_call = counted
    return lambda: taken[0]


def head_in_call_switch(model):
    """(use(on), calls()): the causal LM's lm_head at the end of the stack's one call
    (hi_na_moe.fastpath.stack.HEAD_IN_CALL) or its runner's forward after it."""
    from hi_na_moe.fastpath import stack

    causal_lm_switch(model)  # (checks that the path took the model)

    def use(on: bool) -> None:
        stack.HEAD_IN_CALL = on

    return use, _one_calls(model, lambda out: out[2] is not None)


def held_plan_args_switch(model):
    """(use(on), calls()): the layers' plan_args returning the last step's arguments while the key
    of what they hold is unchanged (hi_na_moe.fastpath.layers.HOLD_PLAN_ARGS), or building them every step."""
    from hi_na_moe.fastpath import layers

    def use(on: bool) -> None:
        layers.HOLD_PLAN_ARGS = on

    return use, _one_calls(model, lambda out: layers.HOLD_PLAN_ARGS)


def kv_group_switch(model):
    """(use(on), calls()): the stack's KV slots of a DynamicCache taken as one group
    (hi_na_moe.fastpath.kv_cache.GROUP: one buffer, a step's views in two torch ops) or per layer. The
    group is made when the buffers are (each arm's cache is new every round)."""
    from hi_na_moe.fastpath import kv_cache

    taken = [0]
    commit_all = kv_cache.commit_all

    def counted(slots):
        taken[0] += any(s.group is not None for s in slots)
        return commit_all(slots)

    kv_cache.commit_all = counted

    def use(on: bool) -> None:
        kv_cache.GROUP = on

    return use, lambda: taken[0]


SWITCHES = {"kv_group": kv_group_switch, "causal_lm": causal_lm_switch, "outputs": outputs_switch, "head_in_call": head_in_call_switch,
            "held_plan_args": held_plan_args_switch}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", required=True, choices=sorted(SWITCHES))
    stored.add_args(ap)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per round and arm")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=8, help="steps of one arm before the other's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch

    import hi_na_moe

    torch.set_num_threads(args.threads)
    model = stored.load(args.ckpt, args.weights, args.cache_dir)
    use, taken = SWITCHES[args.switch](model)
    arms = {"off": (model, lambda: use(False)), "on": (model, lambda: use(True))}
    ms, gbs, tokens, calls = alternate(arms, args.rounds, args.steps, args.block, args.threads, taken)
    use(True)
    ok = tokens["on"] == tokens["off"] and calls["off"] == 0 and calls["on"] == len(ms["on"])
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "switch": args.switch, "ckpt": args.ckpt,
           "weights": args.weights, "same_tokens": tokens["on"] == tokens["off"], "path_calls": calls, "arms": {}}
    print(f"{args.ckpt}, {args.weights}, scope all, {args.threads} threads, --switch {args.switch}, {args.rounds} "
          f"rounds of {args.steps} steps an arm, alternating every {args.block}")
    print("| arm | median ms a step | paired probe GB/s | steps on the path |")
    print("|---|---|---|---|")
    res["arms"] = arm_rows(ms, gbs)
    for arm, row in res["arms"].items():
        print(f"| {arm} | {row['median_ms']:.3f} | {row['probe_gbs']:.1f} | {calls[arm]} of {row['steps']} |")
    res["speedup"] = res["arms"]["off"]["median_ms"] / res["arms"]["on"]["median_ms"]
    res["saved_ms"] = res["arms"]["off"]["median_ms"] - res["arms"]["on"]["median_ms"]
    print(f"on: {res['speedup']:.3f}x the off arm's speed ({res['saved_ms']:.3f} ms a step less); "
          f"the same tokens: {res['same_tokens']}")
    if args.json:
        at = record.host()
        record.write(args.json, res, [record.make(arm, ms[arm], threads=args.threads, probe_gbs=gbs[arm],
                                                  tool="bench_step_ab.py", at=at, switch=args.switch,
                                                  model=args.ckpt, weights=args.weights) for arm in arms])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
