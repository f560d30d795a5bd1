"""Where a whole-model decode step goes, by part of the model.

Loads with hi_na_moe.from_pretrained (warm: the store must hold the format, e.g. after
benchmarks/bench_full_model.py), or with plain transformers (--weights native), then times
--steps decode steps after a --prompt-len token prompt. Inside each step, forward hooks time
every module of these kinds (exclusive time: a part's children are subtracted from it):

- experts: the MoE block's experts module (hi_na_moe's kernel call when enabled);
- linear: every nn.Linear (attention projections, shared experts, router, lm_head; hi_na_moe's
  kernels under --scope all);
- attention: the attention modules minus their linears (RoPE, the KV-cache update, SDPA);
- moe glue: the MoE block minus experts and its linears (router softmax/top-k, the weighted
  sum, shared-expert gating);
- norms: the RMSNorm modules;
- rest: the step minus all of the above (decoder-layer residual adds, embedding, the model's
  Python between modules, the hooks' own cost).

--ab-wrapper: a measurement of the causal-LM wrapper's own cost, not a setting: one arm calls
the model as usual, the other its decoder stack and lm_head straight
(`model.lm_head(model.model(...).last_hidden_state[:, -1:])`, the same logits), whole-step times
only likewise.

--ab-pool: the native parallel regions alternate, four steps at a time, between the library's own
workers (spin 80 us, then sleep) and torch's GNU OpenMP team (`_native.set_pool_backend`; the
config key `pool`), whole-step times only; run it with a competing process to see which
degrades less on a shared machine.

--static-cache: the steps decode into a StaticCache (as generate(cache_implementation="static")
does) instead of a DynamicCache.

--ab-norms (with --scope all): the RMSNorm modules alternate, four steps at a time, between
hi_na_moe's native RMSNorm and their own forward, and the table is printed for each arm (an
in-process A/B: the machine's drift hits both alike). --ab-routers: the same for the routers
(their logits on the native kernel, or their own forward with F.linear); --ab-attention: the
attention modules (decode steps on the native rotary and attention kernels, or their own forward);
--ab-layers: the decoder layers (hi_na_moe.fastpath.layers' short path, or their own forward on the
patched modules), whole-step times only (hooks on the parts would send every call to the
layers' own forward); --ab-stacks: the decoder stack (hi_na_moe.fastpath.stack's loop over the layers'
short paths, or its own forward calling each layer), whole-step times only likewise;
--ab-select: the routers' softmax and top-k on router_select or in PyTorch's ops
(hi_na_moe.fastpath.routers.NATIVE_SELECT; the experts then also leave layer_decode_post), whole-step
times only likewise; --ab-one-call: the stack's decode step in one native call or its loop over
the layers' short paths (hi_na_moe.fastpath.stack.ONE_CALL), whole-step times only likewise;
--ab-shared: a shared expert (Qwen2-MoE) inside the layers' native call, so the stack's one call,
or as modules after the call in the layers' loop (hi_na_moe.fastpath.layers.FUSE_SHARED), likewise;
--ab-rope-norm: the stack's rotary output from its table and its final norm inside the one call,
or both modules called (hi_na_moe.fastpath.stack.ROPE_TABLE and FINAL_NORM), likewise;
--ab-layer-calls: the layers' two native calls with the stack's loop or one call, or each layer's
per-module short path (hi_na_moe.fastpath.layers' NativeLayer.step and latent_step unset) under the stack's own forward
(what GPT-OSS's steps ran before the native calls took its sinks and sliding windows), likewise;
--ab-moe-block: the layers' short paths with their MoE blocks' router, experts and shared
experts called directly (hi_na_moe.fastpath.layers' NativeLayer.moe) and the routers on the native path,
or each MoE block called as its module with the routers on their own forwards (what ERNIE 4.5's
steps ran before its router had a native form), likewise;
--ab-mla-weight: latent attention's kernels reading a quantised kv_b_proj as its codes and scales
or through a dense copy in the model's dtype (hi_na_moe.fastpath.mla.QUANT_WEIGHT; both forms made before the
first timed step, so neither arm pays for making one), likewise;
--ab-mla-dots: latent attention's kernel reading a bfloat16 latent cache with AVX512-BF16 dot
products (its default where the CPU has them) or with float32 FMAs (_native.set_mla_bf16_dots),
likewise;
--ab-prefetch A,B: the kernels' software prefetch A or B bytes ahead into L2 (needs the
HINA_PREFETCH_TUNING build of bench_prefetch.py, whose kernels read HINA_PF at every job), likewise.
--ab-env VAR=A,B: any variable such a build's kernels read at every job (HINA_PF, HINA_PFH:
moe/prefetch.h), likewise.

The hooks add a few microseconds per module call, counted in "rest" (compare the step median
with bench_full_model.py's). Bytes a step reads (as bench_full_model.py defines them) over the
paired probe's bandwidth give the streaming floor, printed beside the parts.

    python benchmarks/bench_decode_breakdown.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 --scope all \\
        --dense-lossless "" --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4
Run it with and without OMP_WAIT_POLICY=PASSIVE in the environment to compare.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from lib.parts import PartTimer

PARTS = ("experts", "linear", "attention", "moe glue", "norms")


def classify(name: str, module) -> str | None:
    from torch import nn

    kind = type(module).__name__
    if isinstance(module, nn.Linear):
        return "linear"
    if name.endswith(".experts"):
        return "experts"
    if kind.endswith("Attention"):
        return "attention"
    if "SparseMoe" in kind or "MoeBlock" in kind or kind.endswith("MoE") or name.endswith(".mlp") and hasattr(module, "experts"):
        return "moe glue"
    if "Norm" in kind:
        return "norms"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--weights", default="int4", choices=("native", "lossless", "lossless12", "int8", "int4"))
    ap.add_argument("--scope", default="experts", choices=("experts", "all"))
    ap.add_argument("--dense-lossless", default="lm_head")
    ap.add_argument("--no-dense-fuse", action="store_true", help="config dense_fuse=False (one call per layer)")
    ap.add_argument("--cache-dir", help="the store of --weights (hi_na_moe arms)")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--ab-norms", action="store_true", help="alternate native / PyTorch RMSNorm (scope all)")
    ap.add_argument("--ab-routers", action="store_true", help="alternate native / PyTorch router logits (scope all)")
    ap.add_argument("--ab-attention", action="store_true", help="alternate native / PyTorch attention decode (scope all)")
    ap.add_argument("--ab-layers", action="store_true",
                    help="alternate the decoder layers' short path / their own forward (scope all; step times only)")
    ap.add_argument("--ab-stacks", action="store_true",
                    help="alternate the decoder stack's loop / its own forward (scope all; step times only)")
    ap.add_argument("--ab-select", action="store_true",
                    help="alternate the routers' selection on router_select / in PyTorch (scope all; step times only)")
    ap.add_argument("--ab-one-call", action="store_true",
                    help="alternate the stack's one native call / its loop over the layers (scope all; step times only)")
    ap.add_argument("--ab-shared", action="store_true",
                    help="alternate a shared expert inside the native call / as modules after it (scope all; step "
                         "times only)")
    ap.add_argument("--ab-rope-norm", action="store_true",
                    help="alternate the stack's rotary table and final norm in the call / both modules called "
                         "(scope all; step times only)")
    ap.add_argument("--ab-layer-calls", action="store_true",
                    help="alternate the layers' native calls with the stack / their per-module short path under the "
                         "stack's own forward (scope all; step times only)")
    ap.add_argument("--ab-mla-weight", action="store_true",
                    help="alternate latent attention's quantised kv_b_proj read as codes and scales / as a dense "
                         "copy (scope all, int8/int4; step times only)")
    ap.add_argument("--ab-mla-dots", action="store_true",
                    help="alternate latent attention's bf16 cache read on bf16 dot products / on float32 FMAs "
                         "(step times only)")
    ap.add_argument("--ab-moe-block", action="store_true",
                    help="alternate the MoE blocks called directly with native routers / as modules with the "
                         "routers' own forwards (scope all; step times only)")
    ap.add_argument("--ab-prefetch", default=None, metavar="A,B",
                    help="alternate the kernels' prefetch distance, bytes ahead into L2 (tuning build; step times only)")
    ap.add_argument("--ab-env", default=None, metavar="VAR=A,B",
                    help="alternate an environment variable the kernels read at every job (a tuning build's "
                         "HINA_PF, HINA_PFH; step times only)")
    ap.add_argument("--ab-pool", action="store_true",
                    help="alternate the parallel regions' pool backends: own workers / torch's OpenMP team")
    ap.add_argument("--ab-wrapper", action="store_true",
                    help="alternate the model's forward / its stack and lm_head called straight (step times only)")
    ap.add_argument("--static-cache", action="store_true",
                    help="decode into a StaticCache (as generate(cache_implementation='static')) instead of a "
                         "DynamicCache")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    import hi_na_moe
    from hi_na_moe import _native

    torch.set_num_threads(args.torch_threads)
    if args.weights == "native":
        model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16)
    else:
        if not args.cache_dir:
            raise SystemExit("--cache-dir is needed with hi_na_moe weights")
        cfg = hi_na_moe.load_config(cache_dir=args.cache_dir, scope=args.scope, dense_lossless=args.dense_lossless,
                                    dense_fuse=not args.no_dense_fuse)
        model = hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, dtype=torch.bfloat16, progress=False,
                                          config=cfg)
        if any(b.cache != "reused" for b in hi_na_moe.report_for(model).blocks):
            raise SystemExit(f"the store {args.cache_dir} did not hold every block: run the cold load first")
    model.eval()

    # exclusive time per part (lib.parts: a child's time is taken off its parent)
    timer = PartTimer(PARTS)
    spent = timer.spent

    kinds = [k for k, on in (("norms", args.ab_norms), ("routers", args.ab_routers),
                             ("attention", args.ab_attention), ("layers", args.ab_layers),
                             ("stacks", args.ab_stacks), ("select", args.ab_select),
                             ("one-call", args.ab_one_call), ("shared", args.ab_shared),
                             ("rope-norm", args.ab_rope_norm), ("layer-calls", args.ab_layer_calls),
                             ("moe-block", args.ab_moe_block), ("mla-weight", args.ab_mla_weight),
                             ("mla-dots", args.ab_mla_dots),
                             ("prefetch", bool(args.ab_prefetch)), ("env", bool(args.ab_env)),
                             ("wrapper", args.ab_wrapper), ("pool", args.ab_pool)) if on]
    if len(kinds) > 1:
        raise SystemExit("--ab-norms, --ab-routers, --ab-attention, --ab-layers, --ab-stacks, --ab-select, "
                         "--ab-one-call, --ab-shared, --ab-rope-norm, --ab-layer-calls, --ab-moe-block, --ab-mla-weight, "
                         "--ab-mla-dots, --ab-prefetch, --ab-env, --ab-wrapper, --ab-pool: one A/B at a time")
    whole_steps = ("layers", "stacks", "select", "one-call", "shared", "rope-norm", "layer-calls", "moe-block",
                   "mla-weight", "mla-dots", "prefetch", "env", "wrapper", "pool")
    kind = kinds[0] if kinds else None

    counted = {p: 0 for p in PARTS}
    # the layers' short path skips the modules' calls, and takes their own forward while any of
    # them has a hook: --ab-layers (and --ab-stacks, --ab-select) time whole steps only
    for name, m in model.named_modules() if kind not in whole_steps else ():
        part = classify(name, m)
        if part:
            timer.attach(m, part)
            counted[part] += 1

    arms = [f"native {kind}", ("own-forward " if kind in ("layers", "stacks") else
                               "per-module " if kind == "layer-calls" else "module " if kind == "moe-block" else
                               "layer-loop " if kind == "one-call" else "dense-copy " if kind == "mla-weight"
                               else "float32-FMA " if kind == "mla-dots"
                               else "modules " if kind in ("shared", "rope-norm")
                               else "PyTorch ") + kind] if kind else [""]
    use_native = None
    if kind == "wrapper":
        arms = ["causal-LM wrapper", "bare stack + lm_head"]
    elif kind == "pool":
        if _native.openmp_runtime() is None:
            raise SystemExit("--ab-pool: no GNU OpenMP runtime is loaded, only the own pool can run")
        arms = ["pool own", "pool openmp"]

        def use_arm(arm: str) -> None:
            _native.set_pool_backend(arm.split()[1])
    elif kind == "prefetch":
        print("--ab-prefetch: a release build ignores HINA_PF (arms then differ by noise only); "
              "see benchmarks/bench_prefetch.py for the tuning build")
        dists = args.ab_prefetch.split(",")
        arms = [f"prefetch {d} B" for d in dists]

        def use_arm(arm: str) -> None:
            os.environ["HINA_PF"], os.environ["HINA_PFH"] = arm.split()[1], "1"
    elif kind == "env":
        var, _, values = args.ab_env.partition("=")
        if not var or "," not in values:
            raise SystemExit(f"--ab-env takes VAR=A,B, not {args.ab_env!r}")
        if not _native.step_trace_compiled():
            print(f"--ab-env: a release build reads none of the tuning variables ({var} then changes nothing)")
        arms = [f"{var}={v}" for v in values.split(",")]

        def use_arm(arm: str) -> None:
            k, _, v = arm.partition("=")
            os.environ[k] = v
    elif kind:
        if args.scope != "all":
            raise SystemExit(f"--ab-{kind} needs --scope all")
        if kind == "select":
            from hi_na_moe.fastpath import routers

            def use_native(on: bool) -> None:
                routers.NATIVE_SELECT = on
        elif kind == "one-call":
            from hi_na_moe.fastpath import stack

            def use_native(on: bool) -> None:
                stack.ONE_CALL = on
        elif kind == "shared":
            from hi_na_moe.fastpath import layers

            def use_native(on: bool) -> None:
                layers.FUSE_SHARED = on
        elif kind == "rope-norm":
            from hi_na_moe.fastpath import stack

            def use_native(on: bool) -> None:
                stack.ROPE_TABLE = stack.FINAL_NORM = on
        elif kind == "moe-block":
            from lib.ab_switch import small_module_switch

            from hi_na_moe.fastpath.layers import NativeLayer
            from hi_na_moe.core.registry import patched_runner

            layer_runners = [r for m in model.modules() if isinstance(r := patched_runner(m), NativeLayer)]
            blocks = {id(r): r.moe for r in layer_runners}
            if not any(blocks.values()):
                raise SystemExit("--ab-moe-block: no decoder layer calls its MoE block directly")
            use_routers = small_module_switch(model, "routers")

            def use_native(on: bool) -> None:
                use_routers(on)
                for r in layer_runners:
                    r.moe = blocks[id(r)] if on else None
        elif kind == "mla-weight":
            from hi_na_moe.fastpath import mla
            from hi_na_moe.core.registry import patched_runner

            latents = [r for m in model.modules() if isinstance(r := patched_runner(m), mla.NativeMLA)]
            if not any(r.reads_codes() for r in latents):
                raise SystemExit("--ab-mla-weight: no latent attention module reads kv_b_proj as codes and scales")
            mla.QUANT_WEIGHT = False
            for r in latents:  # make the dense copies now, outside the timed steps (each arm keeps its form)
                r._weight()

            def use_native(on: bool) -> None:
                mla.QUANT_WEIGHT = on
        elif kind == "mla-dots":
            def use_native(on: bool) -> None:
                _native.set_mla_bf16_dots(on)
        elif kind == "layer-calls":
            from hi_na_moe.fastpath.layers import NativeLayer
            from hi_na_moe.core.registry import patched_runner
            from hi_na_moe.fastpath.stack import NativeStack

            runners = [r for m in model.modules() if isinstance(r := patched_runner(m), (NativeLayer, NativeStack))]
            # (latent attention's layers: NativeLayer.latent_step)
            calls = {id(r): (r.step, r.latent_step) for r in runners if isinstance(r, NativeLayer)}
            if not any(a or b for a, b in calls.values()):
                raise SystemExit("--ab-layer-calls: no decoder layer takes the native calls")

            def use_native(on: bool) -> None:
                for r in runners:
                    if isinstance(r, NativeLayer):
                        r.step, r.latent_step = calls[id(r)] if on else (None, None)
                    else:
                        r.ready = on
        else:
            from lib.ab_switch import small_module_switch

            use_native = small_module_switch(model, kind)

    if kind not in ("prefetch", "pool", "env"):  # (those three set use_arm above)
        def use_arm(arm: str) -> None:
            if use_native:
                use_native(arm.startswith("native"))

    probe = _native.BandwidthProbe(1 << 30, args.torch_threads)
    ids = torch.randint(300, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    steps = {a: [] for a in arms}
    parts = {a: {p: [] for p in PARTS} for a in arms}
    bws = {a: [] for a in arms}
    with torch.inference_mode():
        if args.static_cache:
            from transformers import StaticCache

            cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + args.steps * len(arms) + 8)
        else:
            cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        for i in range(args.steps * len(arms) + 4):
            arm = arms[(i // 4) % len(arms)]
            use_arm(arm)
            for p in PARTS:
                spent[p] = 0.0
            t = time.perf_counter()
            if arm.startswith("bare"):
                logits = model.lm_head(model.model(nxt, past_key_values=cache, use_cache=True).last_hidden_state[:, -1:])
            else:
                logits = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            dt = time.perf_counter() - t
            nxt = logits[:, -1:].argmax(-1)
            bw = probe.read(256 << 20)
            if i >= 4:  # warm-up steps
                steps[arm].append(dt)
                bws[arm].append(bw)
                for p in PARTS:
                    parts[arm][p].append(spent[p])
    use_arm(arms[0])
    for arm in arms:
        st = steps[arm]
        step = statistics.median(st)
        med = {p: statistics.median(parts[arm][p]) for p in PARTS}
        rest = statistics.median(s - sum(parts[arm][p][i] for p in PARTS) for i, s in enumerate(st))
        fuse = "" if args.scope != "all" else (", dense_fuse off" if args.no_dense_fuse else ", dense_fuse on")
        print(f"{args.weights}, scope {args.scope}{fuse}{', ' + arm if arm else ''}, torch threads {args.torch_threads}, "
              f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}: step {1e3 * step:.2f} ms (median of {len(st)}); "
              f"paired probe median {statistics.median(bws[arm]):.1f} GB/s")
        if kind in whole_steps:
            continue
        print("| part | modules | ms per step (median) | share of the step |")
        print("|---|---|---|---|")
        for p in PARTS:
            print(f"| {p} | {counted[p]} | {1e3 * med[p]:.1f} | {100 * med[p] / step:.0f} % |")
        print(f"| rest | - | {1e3 * rest:.1f} | {100 * rest / step:.0f} % |\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
