"""Decode at long context: what the KV cache costs per step, with transformers' DynamicCache and StaticCache.

A decode step at N tokens of context reads the KV cache once for attention (2 x layers x
kv_heads x head_dim x N values); transformers' DynamicCache also grows its tensors with
torch.cat at every step, which copies the whole cache (read + write) once more. StaticCache
writes the new token in place (index_copy_) into tensors allocated for max_cache_len.

For each context length: a random prompt of N tokens in one prefill forward (untimed), then
--steps greedy decode steps (each one forward of one token), timed; the attention modules'
time inside each step is taken with forward hooks (their whole time: projections, RoPE, the
cache update and the attention math). The cache kinds alternate in order per context. The model
is loaded once (hi_na_moe.from_pretrained from a warm store, or plain transformers with
--weights native). StaticCache gets max_cache_len = N + --steps + 1.

--ab-kv: each point runs twice on fresh caches, once with the cache's new position written in
place (hi_na_moe.fastpath.kv_cache, the default) and once through the cache's own update (torch.cat for
a DynamicCache), in alternating order; both compute the same function.

--no-attention-time: no timing hooks on the attention modules. Their hooks make the decoder
layers step aside from their two-call path (hi_na_moe.fastpath.layers) to the per-module one; without
them the step is the one a user gets.

--ab-stacks (scope all, with --no-attention-time): the decoder stack alternates every two steps
between hi_na_moe.fastpath.stack's loop over the layers' short paths and its own forward, on the same
growing cache, as --ab-attention does below.

--ab-attention (scope all): on each cache, the attention modules alternate every two steps
between hi_na_moe's decode path (native RoPE and attention kernels) and their own forward, on
the same growing cache (both compute the same function), and each arm gets its own row; the
cache then holds N + 2 x --steps tokens at the end. Latent attention modules (DeepSeek-V2/V3:
hi_na_moe.fastpath.mla) alternate likewise; their cache holds a latent and a rope key a position, which the
last column counts (the modules' own forward reads it and then makes every head's keys and
values from it).

    python benchmarks/bench_long_context.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 --scope all \\
        --dense-lossless "" --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--weights", default="int4", choices=("native", "lossless", "int8", "int4"))
    ap.add_argument("--scope", default="all", choices=("experts", "all"))
    ap.add_argument("--dense-lossless", default="lm_head")
    ap.add_argument("--cache-dir", help="the store of --weights (hi_na_moe)")
    ap.add_argument("--contexts", default="512,2048,4096", help="comma list of context lengths (prompt tokens)")
    ap.add_argument("--caches", default="dynamic,static")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ab-attention", action="store_true",
                    help="alternate native / PyTorch attention decode on the same cache (scope all)")
    ap.add_argument("--ab-kv", action="store_true", help="in-place KV appends vs the cache's own update")
    ap.add_argument("--ab-stacks", action="store_true",
                    help="alternate the decoder stack's loop / its own forward (scope all, --no-attention-time)")
    ap.add_argument("--no-attention-time", action="store_true", help="no hooks on the attention modules")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

    import hi_na_moe

    torch.set_num_threads(args.threads)
    if args.weights == "native":
        model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16)
    else:
        if not args.cache_dir:
            raise SystemExit("--cache-dir is needed with hi_na_moe weights")
        cfg = hi_na_moe.load_config(cache_dir=args.cache_dir, scope=args.scope, dense_lossless=args.dense_lossless)
        model = hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, dtype=torch.bfloat16, progress=False,
                                          config=cfg)
    model.eval()
    conf = model.config
    attn_time = [0.0]
    starts: list[float] = []
    for m in model.modules():
        if type(m).__name__.endswith("Attention") and not args.no_attention_time:
            m.register_forward_pre_hook(lambda mod, a: starts.append(time.perf_counter()))
            m.register_forward_hook(lambda mod, a, o: attn_time.__setitem__(0, attn_time[0] + time.perf_counter() - starts.pop()))
    if args.ab_attention + args.ab_kv + args.ab_stacks > 1:
        raise SystemExit("--ab-attention, --ab-kv and --ab-stacks are separate runs")
    if args.ab_stacks and not args.no_attention_time:
        raise SystemExit("--ab-stacks needs --no-attention-time (hooks on the attention send every step to the "
                         "stack's own forward)")
    arms = ["native attention", "PyTorch attention"] if args.ab_attention else [""]
    use_native = None
    from hi_na_moe.fastpath import kv_cache

    if args.ab_kv:
        arms = ["in-place KV", "torch.cat KV"]
    if args.ab_attention or args.ab_stacks:
        from lib.ab_switch import small_module_switch

        kind = "attention" if args.ab_attention else "stacks"
        use_native = small_module_switch(model, kind)
        if args.ab_stacks:
            arms = ["native stacks", "own-forward stacks"]

    def use_arm(arm: str) -> None:
        kv_cache.IN_PLACE = arm != "torch.cat KV"
        if use_native:
            use_native(arm.startswith("native"))

    kv_heads = getattr(conf, "num_key_value_heads", conf.num_attention_heads)
    head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    kinds = args.caches.split(",")
    print(f"# {args.ckpt} | {args.weights} scope {args.scope} | {args.threads} threads | {args.steps} steps per point")
    print("| context | cache | ms/step (median) | attention ms/step | tok/s | KV bytes read per step (attention) |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for ci, n in enumerate(int(c) for c in args.contexts.split(",")):
            ids = torch.randint(300, conf.vocab_size, (1, n), generator=gen)
            for kind in kinds[ci % len(kinds):] + kinds[: ci % len(kinds)]:
                # --ab-kv: one fresh cache per arm, the arms' order alternating by context;
                # otherwise one cache the arms alternate on every two steps
                runs = ([[a] for a in (arms if ci % 2 == 0 else arms[::-1])] if args.ab_kv else [arms])
                steps = {a: [] for a in arms}
                attn = {a: [] for a in arms}
                for run in runs:
                    use_arm(run[0])
                    if kind == "dynamic":
                        cache = DynamicCache(config=conf)
                    elif kind == "static":
                        cache = StaticCache(config=conf, max_cache_len=n + len(run) * args.steps + 1)
                    else:
                        raise SystemExit(f"unknown cache kind {kind!r}")
                    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    nxt = out.logits[:, -1:].argmax(-1)
                    for i in range(args.steps * len(run)):
                        arm = run[(i // 2) % len(run)]
                        use_arm(arm)
                        attn_time[0] = 0.0
                        t = time.perf_counter()
                        out = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                        steps[arm].append(time.perf_counter() - t)
                        attn[arm].append(attn_time[0])
                        nxt = out.logits[:, -1:].argmax(-1)
                    del cache, out
                use_arm(arms[0])
                # positions each layer reads: a sliding layer (GPT-OSS) at most its window
                types = getattr(conf, "layer_types", None) or ["full_attention"] * conf.num_hidden_layers
                window = getattr(conf, "sliding_window", None) or n
                if getattr(conf, "kv_lora_rank", None):  # latent attention: a latent and a rope key a position
                    kv = (conf.kv_lora_rank + conf.qk_rope_head_dim) * n * 2 * conf.num_hidden_layers
                else:
                    kv = sum(2 * kv_heads * head_dim * (min(n, window) if t == "sliding_attention" else n) * 2
                             for t in types)
                for arm in arms:
                    med = statistics.median(steps[arm])
                    label = f"{kind}, {arm}" if arm else kind
                    at = "-" if args.no_attention_time else f"{1e3 * statistics.median(attn[arm]):.1f}"
                    print(f"| {n} | {label} | {1e3 * med:.1f} | {at} | "
                          f"{1 / med:.2f} | {kv / 1e6:.0f} MB |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
