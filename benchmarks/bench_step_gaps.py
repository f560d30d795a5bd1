"""Where a scope="all" decode step spends its time between the native kernels.

Timestamps every native call a decode step makes on the decoder layers' short path
(hi_na_moe.layers: layer_decode_pre, layer_decode_post, the experts' kernel; or the stack's one
native call for all layers, "one", hi_na_moe.stack) and prints, per
step (median over --steps), the time inside each kind of call and the time between each pair of
consecutive events ("exp -> pre": from the end of one layer's experts call to the start of the
next layer's pre call, i.e. the Python in between). After every step, untimed, a 256 MB read of a
1 GiB buffer evicts the caches as the paired probe of bench_full_model.py does (--no-flush: not).

    chrt -f 1 python benchmarks/bench_step_gaps.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4

--tiny: instead of a checkpoint, a 16-layer OLMoE with hidden 512 and random weights (int4, a
store under --cache-dir), whose weights stay in cache: the step is then nearly all Python and
call overhead, with and without the eviction.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt")
    ap.add_argument("--tiny", action="store_true", help="a 16-layer tiny OLMoE instead of --ckpt")
    ap.add_argument("--weights", default="int4", choices=("lossless", "int8", "int4"))
    ap.add_argument("--cache-dir", required=True, help="the store of --weights")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--no-flush", action="store_true")
    ap.add_argument("--context", type=int, default=16, help="prompt tokens before the timed steps")
    args = ap.parse_args()
    if bool(args.ckpt) == args.tiny:
        raise SystemExit("give --ckpt or --tiny")
    import torch
    from transformers import DynamicCache

    import hi_na_moe
    from hi_na_moe import _native, torch_ops
    from hi_na_moe.patching import patched_runner

    torch.set_num_threads(2)
    cfg = hi_na_moe.load_config(cache_dir=args.cache_dir, scope="all", dense_lossless="")
    if args.tiny:
        from transformers import OlmoeConfig, OlmoeForCausalLM

        torch.manual_seed(0)
        model = OlmoeForCausalLM(OlmoeConfig(
            hidden_size=512, intermediate_size=128, num_hidden_layers=16, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=512, num_experts=8, num_experts_per_tok=2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)).eval().bfloat16()
        hi_na_moe.enable_for_model(model, weights=args.weights, config=cfg)
    else:
        model = hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, dtype=torch.bfloat16, progress=False,
                                          config=cfg).eval()
    stacks = [patched_runner(m) for m in model.modules() if type(patched_runner(m)).__name__ == "NativeStack"]
    layers = [patched_runner(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    # (latent attention's layers: NativeLayer.latent_step)
    if not layers or any(r is None or (r.step is None and r.latent_step is None) for r in layers):
        raise SystemExit("not every decoder layer takes the two native calls (hi_na_moe.layers)")

    events: list[tuple[str, float]] = []
    now = time.perf_counter

    class Timed:  # the runner's native module, with layer_decode_pre/post timestamped
        def __init__(self, native):
            self.native = native

        def __getattr__(self, name):
            fn = getattr(self.native, name)
            if name not in ("layer_decode_pre_raw", "layer_decode_post_raw"):
                return fn
            tag = name.split("_")[2]

            def timed(*a):
                events.append((tag, now()))
                out = fn(*a)
                events.append(("/" + tag, now()))
                return out

            return timed

    for r in layers:
        r.native = Timed(r.native)
    call_bound = torch_ops.call_bound

    def experts(*a):
        events.append(("exp", now()))
        out = call_bound(*a)
        events.append(("/exp", now()))
        return out

    torch_ops.call_bound = experts

    class TimedPlan:  # a stack's StepPlan (hi_na_moe.stack's one native call), its run timestamped
        def __init__(self, plan):
            self.plan = plan

        def __getattr__(self, name):
            return getattr(self.plan, name)

        def run(self, *a):
            events.append(("one", now()))
            out = self.plan.run(*a)
            events.append(("/one", now()))
            return out

    def time_plans():
        for st in stacks:
            if st._plan is not None and not isinstance(st._plan[0], TimedPlan):
                st._plan = (TimedPlan(st._plan[0]), st._plan[1])
    probe = _native.BandwidthProbe(1 << 30, 2)
    ids = torch.randint(3, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    spans: dict[str, list[float]] = collections.defaultdict(list)
    steps = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        nxt = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        for i in range(args.steps + 4):
            events.clear()
            events.append(("step", now()))
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            events.append(("/step", now()))
            nxt = out.logits[:, -1:].argmax(-1)
            time_plans()
            if not args.no_flush:
                probe.read(256 << 20)
            if i < 4:
                continue
            steps.append(events[-1][1] - events[0][1])
            per: dict[str, float] = collections.defaultdict(float)
            for (a, ta), (b, tb) in zip(events, events[1:]):
                key = f"in {a}" if b == "/" + a else f"{a.lstrip('/')} -> {b.lstrip('/')}"
                per[key] += tb - ta
            for k, v in per.items():
                spans[k].append(v)
    print(f"{'tiny' if args.tiny else args.ckpt}, {args.weights}, {len(layers)} layers, "
          f"{'no eviction' if args.no_flush else '256 MB read after each step'}, {args.context}-token prompt: "
          f"step {1e3 * statistics.median(steps):.2f} ms (median of {len(steps)})")
    print("| span | ms per step (median) |")
    print("|---|---|")
    for k, v in sorted(spans.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"| {k} | {1e3 * statistics.median(v):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
