"""Where the Python of a scope="all" decode step goes, around the stack's one native call.

Loads the model with hi_na_moe.from_pretrained (scope="all", the store must hold --weights),
decodes a few tokens, then times --steps decode steps, each after an untimed 256 MB read of a
1 GiB buffer (the paired probe of bench_full_model.py, which also evicts the caches: a real
step's Python runs on caches the weight stream has just flushed). Wall-clock timers wrap, for
the time of the study only, the pieces of a step: the whole forward; the causal LM's path
(hi_na_moe.fastpath.stack.NativeCausalLM: its `_args`, `_run` and the Watch checks) when it took the
model; the stack's checks (`_observed`, `_args`), its decode step (`_hidden`), the one call
(`_one_call`), the layers' `plan_args` inside it, the native `StepPlan.run`, and inside those
the embedding's lookup, the rotary table's lookup, the KV cache's slots and commits and the
output objects (stack.Outputs); and the lm_head (its runner's forward on the path, when it does
not run at the end of the one call). Means per
step; what no timer holds is the module call and the patched forward around the causal LM's
path (without the path: transformers' own code around the stack and lm_head). (A timer costs about a
microsecond per call: 16 layers' plan_args, about 20 us a step, is the largest such overhead.)

    chrt -f 1 python benchmarks/studies/study_step_python.py --ckpt /work/ckpt/olmoe-1b-7b \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4

Question: Where does the Python of a scope="all" decode step go, around the stack's one native call?
Answered in benchmarks/log/decode-step.md, "The shared expert and dense layers op by op, paired
  linear layers, and the step's Python (2026-12-05)".
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package
from lib import stored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stored.add_args(ap)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache

    from hi_na_moe import _native
    from hi_na_moe.fastpath import kv_cache
    from hi_na_moe.fastpath.layers import NativeLayer
    from hi_na_moe.core.registry import patched_runner
    from hi_na_moe.fastpath.stack import NativeCausalLM, NativeStack, Outputs

    torch.set_num_threads(args.threads)
    model = stored.load(args.ckpt, args.weights, args.cache_dir)
    stacks = [r for m in model.modules() if isinstance(r := patched_runner(m), NativeStack)]
    if len(stacks) != 1:
        raise SystemExit(f"expected one decoder stack on hi_na_moe.fastpath.stack, found {len(stacks)}")
    st = stacks[0]
    spent: dict[str, float] = collections.defaultdict(float)
    now = time.perf_counter

    def timed(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def g(*a, **k):
            t = now()
            try:
                return f(*a, **k)
            finally:
                spent[key] += now() - t

        setattr(obj, name, g)

    timed(NativeLayer, "plan_args", "layers' plan_args")
    for name in ("_observed", "_args", "_hidden", "_one_call"):
        timed(st, name, f"stack {name}")
    lm = patched_runner(model)  # the causal LM's path (NativeCausalLM), when it took the model
    if isinstance(lm, NativeCausalLM):
        for name in ("_args", "_run"):
            timed(lm, name, f"causal LM {name}")
        timed(type(lm.watch), "observed", "causal LM watch")  # (a class with __slots__; the layers use it too)
        # (its runner: a forward set on the module takes the path; nothing when the lm_head runs
        # in the one call, stack.HEAD_IN_CALL, whose time is then the native call's)
        timed(lm.head_runner, "forward", "lm_head")
    else:
        timed(model.lm_head, "forward", "lm_head")
    # finer: the pieces of _run and _one_call outside the native call (instance and module
    # attributes, for the study's lifetime)
    timed(st, "_embed", "embedding lookup")  # (not the module's forward: a forward set on it takes its call)
    timed(type(st.rope), "lookup", "rotary table lookup")  # (a class with __slots__)
    timed(Outputs, "build", "model output object")  # (the stack's or the causal LM's; a class with __slots__)
    # (the stack takes a DynamicCache's slots and commits for all layers at once, kv_cache.slots /
    # commit_all, whose standalone members' commit is inside; slot for latent attention's)
    timed(kv_cache, "slot", "KV slots")
    timed(kv_cache, "slots", "KV slots")
    timed(kv_cache, "commit_all", "KV commits")

    class TimedPlan:  # the stack's StepPlan, its run timed
        def __init__(self, plan):
            self.plan = plan

        def run(self, *a):
            t = now()
            try:
                return self.plan.run(*a)
            finally:
                spent["native StepPlan.run"] += now() - t

        def scratch_bytes(self, B):
            return self.plan.scratch_bytes(B)

    probe = _native.BandwidthProbe(1 << 30, args.threads)
    ids = torch.randint(300, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(4):
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
        if st._plan is None:
            raise SystemExit("the stack's decode steps did not take the one native call (report_for says why)")
        st._plan = (TimedPlan(st._plan[0]), *st._plan[1:])
        spent.clear()
        for _ in range(args.steps):
            probe.read(256 << 20)
            t = now()
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            spent["step"] += now() - t
            nxt = out.logits[:, -1:].argmax(-1)
    ms = {k: v / args.steps * 1e3 for k, v in spent.items()}
    native, lm = ms["native StepPlan.run"], ms.setdefault("lm_head", 0.0)  # (0: in the native call)
    print(f"{args.ckpt}, {args.weights}, scope all, {args.threads} threads, mean of {args.steps} steps, "
          f"256 MB read before each")
    print("| piece | ms per step |")
    print("|---|---|")
    for k in ("step", "causal LM _run", "stack _hidden", "stack _one_call", "native StepPlan.run", "lm_head",
              "layers' plan_args", "stack _observed", "stack _args", "causal LM _args", "causal LM watch"):
        print(f"| {k} | {ms.get(k, 0.0):.3f} |")
    print(f"| Python: the step less the native call and lm_head | {ms['step'] - native - lm:.3f} |")
    one_rest = ms["stack _one_call"] - native - ms["layers' plan_args"]
    print(f"| of it in _one_call, outside the native call and plan_args | {one_rest:.3f} |")
    for k in ("KV slots", "KV commits"):
        print(f"| - {k} | {ms.get(k, 0.0):.3f} |")
    print(f"| - the rest of _one_call (plan check, tables, scratch, final norm, kernel names) | "
          f"{one_rest - ms.get('KV slots', 0.0) - ms.get('KV commits', 0.0):.3f} |")
    run_rest = ms["stack _hidden"] - ms["stack _one_call"]
    print(f"| of it in _hidden, outside _one_call | {run_rest:.3f} |")
    for k in ("embedding lookup", "rotary table lookup"):
        print(f"| - {k} | {ms.get(k, 0.0):.3f} |")
    print(f"| - the rest of _hidden (the attention's argument checks, ...) | "
          f"{run_rest - sum(ms.get(k, 0.0) for k in ('embedding lookup', 'rotary table lookup')):.3f} |")
    if "causal LM _run" in ms:  # the path: its _run holds the stack's _hidden, lm_head and the output object
        print(f"| in the causal LM's _run, outside _hidden and lm_head | {ms['causal LM _run'] - ms['stack _hidden'] - lm:.3f} |")
        print(f"| - model output object | {ms.get('model output object', 0.0):.3f} |")
        print(f"| outside the causal LM's _run, _args and checks (module call, the patched forward) | "
              f"{ms['step'] - ms['causal LM _run'] - ms['causal LM _args'] - ms['causal LM watch'] - ms['stack _observed']:.3f} |")
    else:
        print(f"| - model output object | {ms.get('model output object', 0.0):.3f} |")
        print(f"| of it outside the stack's forward (transformers' model, the lm_head's Python included) | "
              f"{ms['step'] - ms['stack _hidden'] - ms.get('model output object', 0.0) - ms['stack _observed'] - ms['stack _args'] - lm:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
