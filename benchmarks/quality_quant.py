"""Quality of quantised experts on the shipped model's held-out text (hi_na_moe.tools.quality).

Perplexity of the shipped model (models/hina-tiny-moe, bf16) on data/heldout.txt for lossless,
int8 and int4 with group sizes 32 / 64 / 128; mean KL(lossless || quantised) per token, top-1
agreement with lossless, and each MoE block's output SQNR on the real activations the lossless
model feeds it. The issue's targets are printed beside the figures.

    python benchmarks/quality_quant.py [--chunks 16] [--seq 256] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hi_na_moe.tools import quality

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "hina-tiny-moe"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(MODEL)
    ids = tok((ROOT / "data" / "heldout.txt").read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    n = min(args.chunks, len(ids) // args.seq)
    chunks = torch.tensor(ids[: n * args.seq]).view(n, args.seq)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval()
    with tempfile.TemporaryDirectory() as cache:  # measure packing from scratch, leave nothing behind
        res = quality.measure(model, chunks, [("int8", 64), ("int4", 32), ("int4", 64), ("int4", 128)],
                              cache_dir=cache,
                              progress=lambda w, g: print(f"  {w} g{g} ...", file=sys.stderr))
    base = res[0].perplexity
    if args.json:
        print(json.dumps([dict(r.__dict__, min_sqnr_db=r.min_sqnr_db) for r in res], indent=1))
        return 0
    print(f"# shipped model (bf16), {n} x {args.seq} held-out tokens; targets: int8 SQNR >= 35 dB and "
          "top-1 >= 99 %; int4 SQNR >= 20 dB and perplexity <= +3 %")
    print("| weights | perplexity | vs lossless | KL nats/token | top-1 vs lossless | block SQNR dB (min) |")
    print("|---|---|---|---|---|---|")
    for r in res:
        sq = ", ".join(f"{v:.1f}" for v in r.block_sqnr_db.values()) or "-"
        print(f"| {r.weights} | {r.perplexity:.2f} | {100 * (r.perplexity / base - 1):+.2f} % | "
              f"{r.kl_vs_lossless:.4f} | {100 * r.top1_vs_lossless:.1f} % | {sq}"
              + (f" ({r.min_sqnr_db:.1f})" if r.min_sqnr_db is not None else "") + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
