"""What a whole-model decode step costs besides the experts' weight stream: the baselines of
the whole-model issue (dense layers, per-token overhead).

1. Framework overhead: OLMoE's module graph (16 layers, 64 experts top-8, attention with q/k
   norms) with tiny matrices (hidden 64), so a decode step reads almost no bytes and its time
   is Python, dispatch and small-op overhead: transformers alone, then with hi_na_moe enabled.
2. The dense layers: bf16 torch.nn.functional.linear at T=1 on OLMoE-1B-7B's attention
   projections (64 matrices of 2048x2048 = 16 layers x q/k/v/o, 537 MB) and its lm_head
   (50304x2048, 206 MB), and the same matrices on hi_na_moe's kernels (scope="all":
   PackedExperts.pack_linear, lossless / int8 / int4), in GB/s of what each arm reads, next to
   the read-bandwidth probe of the same round.
3. Attention math of a decode step (torch's SDPA, bf16 KV cache) at 512-4096 tokens of
   context: how much of a step it is, and whether it streams its KV cache at the bandwidth.

    chrt -f 1 python benchmarks/studies/bench_overhead.py [--steps 60] [--rounds 3]

Question: What does a whole-model decode step cost besides the experts' weight stream (framework
  overhead, PyTorch's dense GEMV)?
Answered in benchmarks/log/whole-model.md, "Baselines for the whole-model issue: framework overhead
  and PyTorch's dense GEMV (2026-11-30)".
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def decode_ms(model, cfg, steps: int) -> float:
    from transformers import DynamicCache

    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = DynamicCache(config=cfg)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[5:]) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-attention", action="store_true", help="skip part 3 (attention by context length)")
    args = ap.parse_args()
    from transformers import OlmoeConfig, OlmoeForCausalLM

    import hi_na_moe
    from hi_na_moe import _native

    torch.set_num_threads(args.threads)
    cfg = OlmoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=16, num_attention_heads=4,
                      num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, vocab_size=512,
                      max_position_embeddings=512, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = OlmoeForCausalLM(cfg).to(torch.bfloat16).eval()
    print("1. framework overhead per decode step (OLMoE graph, 16 layers, hidden 64), median ms:")
    print("| round | transformers | hi_na_moe enabled |")
    print("|---|---|---|")
    for r in range(args.rounds):
        native = decode_ms(model, cfg, args.steps)
        hi_na_moe.enable_for_model(model, threads=args.threads)
        ours = decode_ms(model, cfg, args.steps)
        hi_na_moe.disable_for_model(model)
        print(f"| {r + 1} | {native:.2f} | {ours:.2f} |", flush=True)

    print("\n2. dense layers at T=1, bf16: PyTorch's linear, and the same matrices packed for hi_na_moe's kernels "
          "(pack_linear, lossless, and int8/int4 from the same weights; scope='all'), each arm timed back to back "
          "in every round:")
    g = torch.Generator().manual_seed(0)
    attn = [torch.randn(2048, 2048, generator=g).bfloat16() for _ in range(64)]
    lm_head = torch.randn(50304, 2048, generator=g).bfloat16()
    x = torch.randn(1, 2048, generator=g).bfloat16()
    attn_bytes = sum(w.numel() * 2 for w in attn)

    arms = {"PyTorch F.linear": (None, None)}
    for fmt in ("lossless", "int8", "int4"):
        packs = [_native.PackedExperts.pack_linear(w, weights=fmt) for w in attn]
        head = _native.PackedExperts.pack_linear(lm_head, weights=fmt)
        arms[f"hi_na_moe {fmt}"] = (packs, head)
    outs = {2048: torch.empty(1, 2048, dtype=torch.bfloat16), 50304: torch.empty(1, 50304, dtype=torch.bfloat16)}
    print("| round | arm | attention projections ms (GB/s) | lm_head ms (GB/s) | read-bandwidth probe GB/s |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, (packs, head) in arms.items():
                t0 = time.perf_counter()
                if packs is None:
                    for w in attn:
                        torch.nn.functional.linear(x, w)
                else:
                    for pk in packs:
                        pk.linear(x, outs[2048], num_threads=args.threads)
                ta = time.perf_counter() - t0
                t0 = time.perf_counter()
                if head is None:
                    torch.nn.functional.linear(x, lm_head)
                else:
                    head.linear(x, outs[50304], num_threads=args.threads)
                tl = time.perf_counter() - t0
                ab = attn_bytes if packs is None else sum(pk.nbytes for pk in packs)
                hb = lm_head.numel() * 2 if head is None else head.nbytes
                bw = _native.measure_read_bandwidth(1 << 30, args.threads, 3)["median_gbs"]
                print(f"| {r + 1} | {name} | {ta * 1e3:.1f} ({ab / ta / 1e9:.1f}) | {tl * 1e3:.1f} "
                      f"({hb / tl / 1e9:.1f}) | {bw:.1f} |", flush=True)

    if args.skip_attention:
        return 0
    print("\n3. attention math of one decode step in PyTorch (OLMoE-1B-7B: 16 layers, 16 heads x 128, bf16 KV "
          "cache; torch's scaled_dot_product_attention, one query token), by context length; bytes = the K and V "
          "read:")
    print("| context | ms per step (16 layers) | KV bytes per step | GB/s |")
    print("|---|---|---|---|")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.inference_mode():
        for ctx in (512, 1024, 2048, 4096):
            kv = [(torch.randn(1, 16, ctx, 128, generator=g).bfloat16(), torch.randn(1, 16, ctx, 128, generator=g).bfloat16())
                  for _ in range(16)]
            q = torch.randn(1, 16, 1, 128, generator=g).bfloat16()
            for k, v in kv:
                sdpa(q, k, v)
            times = []
            for _ in range(args.rounds * 3):
                t0 = time.perf_counter()
                for k, v in kv:
                    sdpa(q, k, v)
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            nbytes = sum(k.numel() * 2 + v.numel() * 2 for k, v in kv)
            print(f"| {ctx} | {t * 1e3:.2f} | {nbytes / 1e6:.0f} MB | {nbytes / t / 1e9:.1f} |", flush=True)
            del kv
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
