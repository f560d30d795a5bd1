"""Where a prefill forward's time goes, by part of the model, against each part's compute floor.

Loads a stored model (benchmarks/lib/stored.py: scope="all", lm_head quantised), then times
--rounds prefill forwards of --prefill tokens on a fresh DynamicCache (logits of the last position
only, as bench_full_model.py's prefill-N), with forward hooks that take each module's exclusive
time (a part's children are subtracted from it), as bench_decode_breakdown.py does for decode
steps. Parts: experts (the experts module: hi_na_moe's native call, which quantises the rows,
runs gate/up, quantises h, runs down and scatter-adds), attention projections (q/k/v/o linears),
router (the MoE block's gate module: its logits and, in transformers 5's routers, softmax and
top-k), lm_head, attention (the attention modules minus their linears: q/k norms, RoPE, the
KV-cache update, SDPA), moe glue (the MoE block minus experts and router: reshapes and the
routing weights' handling), norms (the layers' RMSNorms), rest (embedding, residual adds, the
model's Python, the hooks). Per part the median over rounds and its share of the forward.

The floor column: the part's multiply-adds at --macs-per-cycle (per core; default 52, the rate
of independent vpmaddubsw + vpaddw chains that study_avx2_prefill.cpp measured on the Zen 4 of
2026-12-08) x --ghz (default 3.6, its clock by a chain of adds) x --threads; it ignores memory
and every other instruction, so it is a bound, not a target. Attention's floor counts QK^T and
PV of the causal prompt (half the square) as fp32 FMAs (16 a cycle a core: two 256-bit FMA pipes).

    HINA_MOE_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 chrt -f 1 python benchmarks/studies/study_prefill_parts.py \\
        --ckpt /work/ckpt/qwen3-30b-a3b-4l --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen3-30b-a3b-4l/int4

Question: Which parts of an int4 prefill-512 forward take its time on the avx2 tier, and how far is
  each from its compute floor?
Answered in benchmarks/log/whole-model.md, "The avx2 tier's prefill-512 by part, and its int4 tiles
  (2026-12-08)".
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package

from lib import stored  # noqa: E402
from lib.parts import PartTimer  # noqa: E402

PARTS = ("experts", "attn proj", "router", "lm_head", "attention", "moe glue", "norms", "rest")


def classify(name: str, module) -> str | None:
    from torch import nn

    kind = type(module).__name__
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith(".experts"):
        return "experts"
    if leaf == "lm_head":
        return "lm_head"
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return "attn proj"
    if leaf == "gate" and ".mlp" in name:
        return "router"
    if isinstance(module, nn.Linear):
        return "attn proj" if ".self_attn." in name else "router"
    if kind.endswith("Attention"):
        return "attention"
    if hasattr(module, "experts"):
        return "moe glue"
    if "Norm" in kind:
        return "norms" if ".self_attn." not in name else "attention"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stored.add_args(ap)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ghz", type=float, default=3.6, help="the core clock the floor assumes")
    ap.add_argument("--macs-per-cycle", type=float, default=52.0, help="int8 multiply-adds a cycle a core")
    ap.add_argument("--no-hooks", action="store_true", help="whole forwards only (e.g. under perf record)")
    args = ap.parse_args()
    if args.prefill < 1 or args.rounds < 1 or args.threads < 1:
        raise SystemExit(f"--prefill ({args.prefill}), --rounds ({args.rounds}) and --threads ({args.threads}) "
                         "must be >= 1")
    if not (args.ghz > 0 and args.macs_per_cycle > 0):
        raise SystemExit(f"--ghz ({args.ghz}) and --macs-per-cycle ({args.macs_per_cycle}) must be > 0")
    import torch
    from transformers import DynamicCache

    import hi_na_moe

    torch.set_num_threads(args.threads)
    model = stored.load(args.ckpt, args.weights, args.cache_dir)
    if any(b.cache != "reused" for b in hi_na_moe.report_for(model).blocks):
        print(f"note: the store {args.cache_dir} did not hold every block (packed during this load)")
    cfg = model.config

    timer = PartTimer(PARTS)
    spent = timer.spent

    if not args.no_hooks:
        for name, m in model.named_modules():
            part = classify(name, m)
            if part:
                timer.attach(m, part)

    gen = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size

    def forward() -> float:
        ids = torch.randint(0, vocab, (1, args.prefill), generator=gen)
        cache = DynamicCache(config=cfg)
        t = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t

    rows: dict[str, list[float]] = {p: [] for p in PARTS}
    totals = []
    with torch.inference_mode():
        forward()  # warm-up
        for _ in range(args.rounds):
            for p in PARTS:
                spent[p] = 0.0
            s = forward()
            totals.append(s)
            for p in PARTS[:-1]:
                rows[p].append(spent[p])
            rows["rest"].append(s - sum(spent[p] for p in PARTS[:-1]))

    # multiply-adds per part (per forward)
    T, L = args.prefill, cfg.num_hidden_layers
    H = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    k = getattr(cfg, "num_experts_per_tok", 0)
    inter = getattr(cfg, "moe_intermediate_size", 0)
    E = getattr(cfg, "num_experts", 0)
    macs = {
        "experts": T * L * k * 3 * H * inter,
        "attn proj": T * L * (H * nq * hd + 2 * H * nkv * hd + nq * hd * H),
        "router": T * L * H * E,
        "lm_head": H * vocab,  # the last position's logits only
    }
    attn_fma = L * nq * hd * T * (T + 1) // 2 * 2  # QK^T and PV over the causal half
    peak = args.macs_per_cycle * args.ghz * 1e9 * args.threads
    med_total = statistics.median(totals)
    print(f"prefill-{T}: {len(totals)} rounds, median {med_total * 1e3:.1f} ms "
          f"(min {min(totals) * 1e3:.1f}, max {max(totals) * 1e3:.1f}), {args.threads} threads"
          + ("" if not args.no_hooks else ", no hooks"))
    if args.no_hooks:
        return 0
    print("| part | median ms | share | GMAC | floor ms | median / floor |")
    print("|---|---|---|---|---|---|")
    for p in PARTS:
        m = statistics.median(rows[p])
        if macs.get(p):  # (a part with no module of a known size, e.g. a model without dense layers: no floor)
            fl = macs[p] / peak
            extra = f"{macs[p] / 1e9:.2f} | {fl * 1e3:.1f} | {m / fl:.1f}x"
        elif p == "attention":
            fl = attn_fma / (16 * args.ghz * 1e9 * args.threads)
            extra = f"{attn_fma / 1e9:.2f} (fp32) | {fl * 1e3:.1f} | {m / fl:.1f}x"
        else:
            extra = "- | - | -"
        print(f"| {p} | {m * 1e3:.1f} | {100 * m / med_total:.0f} % | {extra} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
