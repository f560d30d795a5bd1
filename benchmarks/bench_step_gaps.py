"""Where a scope="all" decode step spends its time between the native kernels.

Timestamps every native call a decode step makes on the decoder layers' short path
(hi_na_moe.fastpath.layers: a layer's partial StepPlan's layer_pre and layer_post, the experts' kernel; or the stack's one
native call for all layers, "one", hi_na_moe.fastpath.stack) and prints, per
step (median over --steps), the time inside each kind of call and the time between each pair of
consecutive events ("exp -> pre": from the end of one layer's experts call to the start of the
next layer's pre call, i.e. the Python in between). After every step, untimed, a 256 MB read of a
1 GiB buffer evicts the caches as the paired probe of bench_full_model.py does (--no-flush: not).

    chrt -f 1 python benchmarks/bench_step_gaps.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4

--tiny: instead of a checkpoint, a 16-layer OLMoE with hidden 512 and random weights (int4, a
store under --cache-dir), whose weights stay in cache: the step is then nearly all Python and
call overhead, with and without the eviction.

--ops (a tuning build, -Ccmake.define.HINA_PREFETCH_TUNING=ON: _native.take_step_trace): inside
the one call, per kind of op (summed over the layers), ms per step and, for the ops that stream
weights, the bytes they read (the report's packed bytes; the experts' as top_k / E of the block's,
two thirds of them in the gate/up region) and the rate, next to a paired read probe on OpenMP's
team (the median of three 256 MB reads after each step, which also evict the caches).
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
    ap.add_argument("--weights", default="int4", choices=("lossless", "lossless12", "int8", "int4"))
    ap.add_argument("--cache-dir", required=True, help="the store of --weights")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--no-flush", action="store_true")
    ap.add_argument("--context", type=int, default=16, help="prompt tokens before the timed steps")
    ap.add_argument("--ops", action="store_true", help="the one call's ops (a tuning build's step trace)")
    args = ap.parse_args()
    if bool(args.ckpt) == args.tiny:
        raise SystemExit("give --ckpt or --tiny")
    import torch
    from transformers import DynamicCache

    import hi_na_moe
    from hi_na_moe import _native
    from hi_na_moe.core import torch_ops
    from hi_na_moe.core.registry import patched_runner

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
        raise SystemExit("not every decoder layer takes the two native calls (hi_na_moe.fastpath.layers)")

    events: list[tuple[str, float]] = []
    now = time.perf_counter

    class TimedLayer:  # a layer's partial StepPlan, its two calls (layer_pre, layer_post) timestamped
        def __init__(self, plan):
            self.plan = plan

        def __getattr__(self, name):
            fn = getattr(self.plan, name)
            if name not in ("layer_pre", "layer_post"):
                return fn
            tag = name.split("_")[1]

            def timed(*a, **kw):
                events.append((tag, now()))
                out = fn(*a, **kw)
                events.append(("/" + tag, now()))
                return out

            return timed

    class Timed:  # the runner's native module, the partial StepPlans it makes timestamped
        def __init__(self, native):
            self.native = native

        def __getattr__(self, name):
            fn = getattr(self.native, name)
            if name != "StepPlan":
                return fn
            return lambda *a, **kw: TimedLayer(fn(*a, **kw))

    for r in layers:
        r.native = Timed(r.native)
        r._call_held = None  # (a plan the warm-up made would not be timed)
    call_bound = torch_ops.call_bound

    def experts(*a):
        events.append(("exp", now()))
        out = call_bound(*a)
        events.append(("/exp", now()))
        return out

    torch_ops.call_bound = experts

    class TimedPlan:  # a stack's StepPlan (hi_na_moe.fastpath.stack's one native call), its run timestamped
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
                st._plan = (TimedPlan(st._plan[0]), *st._plan[1:])
    probe = _native.BandwidthProbe(1 << 30, 2)
    if args.ops and not _native.step_trace_compiled():
        raise SystemExit("--ops needs a tuning build: pip install --no-deps --no-build-isolation -e . "
                         "-Ccmake.define.HINA_PREFETCH_TUNING=ON")
    op_ms: dict[str, list[float]] = collections.defaultdict(list)
    probe_gbs: list[float] = []
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
            trace = _native.take_step_trace()
            if args.ops and i >= 4:
                per_op: dict[str, float] = collections.defaultdict(float)
                for _, op, t0, t1 in trace:
                    per_op[op] += (t1 - t0) * 1e-9
                for k, v in per_op.items():
                    op_ms[k].append(v)
                probe_gbs.append(statistics.median(probe.read(256 << 20) for _ in range(3)))
            if not args.no_flush and not args.ops:  # (--ops: its paired reads evicted them)
                probe.read(256 << 20)
            if args.ops or not args.no_flush:  # the probe's OpenMP threads spin for ms: let them sleep
                time.sleep(0.03)  # (bench_full_model.py, PROBE_SETTLE_S)
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
    if args.ops:
        print_ops(model, op_ms, statistics.median(probe_gbs))
    return 0


def op_bytes(model) -> dict[str, float]:
    """Bytes a decode step's ops read from weights, by the step trace's op names: the packed
    dense layers by their module names (report_for), the experts top_k / E of each block's."""
    import hi_na_moe

    report = hi_na_moe.report_for(model)
    out: dict[str, float] = collections.defaultdict(float)
    kinds = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv", "o_proj": "o_proj",
             "gate": "router", "lm_head": "lm_head", "gate_proj": "mlp_gate_up", "up_proj": "mlp_gate_up",
             "down_proj": "mlp_down"}
    for d in report.dense:
        leaf = d.name.rsplit(".", 1)[-1]
        kind = kinds.get(leaf, leaf)
        if ".shared_expert_gate" in d.name:  # (Qwen2-MoE's sigmoid gate)
            kind = "shared_gate"
        elif ".shared_expert" in d.name:  # a shared expert's MLP: the trace's shared_gate_up / shared_down
            kind = kind.replace("mlp_", "shared_")
        out[kind] += d.packed_bytes
    k = model.config.num_experts_per_tok
    for b in report.blocks:  # (gated experts: gate and up are two thirds of an expert's bytes)
        if b.experts and b.packed_bytes:
            out["experts_gate_up"] += b.packed_bytes / b.experts * k * 2 / 3
            out["experts_down"] += b.packed_bytes / b.experts * k / 3
    return out


def print_ops(model, op_ms: dict[str, list[float]], probe: float) -> None:
    nbytes = op_bytes(model)
    total = sum(statistics.median(v) for v in op_ms.values())
    print(f"\nthe one call's ops, summed over the layers (median per step; paired probe {probe:.1f} GB/s):")
    print("| op | ms per step | share of the call | MB read | GB/s | share of the probe |")
    print("|---|---|---|---|---|---|")
    for k, v in sorted(op_ms.items(), key=lambda kv: -statistics.median(kv[1])):
        ms = statistics.median(v)
        b = nbytes.get(k, 0.0)
        rate = f"{b / ms / 1e9:.1f} | {100 * b / ms / 1e9 / probe:.0f} %" if b else "- | -"
        print(f"| {k} | {1e3 * ms:.3f} | {100 * ms / total:.1f} % | {b / 1e6:.1f} | {rate} |")
    b = sum(v for kk, v in nbytes.items() if kk in op_ms)
    print(f"| all | {1e3 * total:.3f} | 100 % | {b / 1e6:.1f} | {b / total / 1e9:.1f} | "
          f"{100 * b / total / 1e9 / probe:.0f} % |")


if __name__ == "__main__":
    raise SystemExit(main())
