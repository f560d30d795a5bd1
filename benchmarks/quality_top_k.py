"""What fewer experts a token cost in quality (HinaConfig.top_k, hi_na_moe.core.trim), measured on
trained models and real text.

For each model (default: the shipped models/hina-tiny-moe, and models/hina-moe-e64 when it has
been built; see benchmarks/log/memory-tier.md), on data/heldout.txt: the model with its own top-k
(top_k="model"), then every fixed lower k, then top_k="adaptive" at each threshold. Per arm:
perplexity, its change, mean KL(full || arm) nats per token, top-1 agreement with the full model,
the experts a token used (hi_na_moe.stats(model)["experts_per_token"], counted by the kernels)
and the expert bytes per token saved. Each adaptive arm is set beside the fixed-k curve at the
same experts a token (linear between the two neighbouring k): adaptive must be better there to
be worth having. Every arm runs the native kernels on the same weights (--weights); the full
arm is the reference for KL and top-1.

    python benchmarks/quality_top_k.py [--model DIR ...] [--thresholds 0.05,0.1,...] [--renorm auto,on]
        [--chunks 64] [--seq 256] [--weights lossless] [--json OUT] [--plot OUT.png]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import hi_na_moe
from hi_na_moe.tools import quality
from lib import record

ROOT = Path(__file__).resolve().parent.parent
MODELS = [ROOT / "models" / "hina-tiny-moe", ROOT / "models" / "hina-moe-e64"]
THRESHOLDS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


def _arm(model, chunks, label: str, base_logits, **kw) -> dict:
    hi_na_moe.enable_for_model(model, **kw)
    try:
        t0 = time.perf_counter()
        nll, logits = quality.nll_and_logits(model, chunks, batch=8)
        seconds = time.perf_counter() - t0
        ept = hi_na_moe.stats(model)["experts_per_token"]
    finally:
        hi_na_moe.disable_for_model(model)
    kl, top1 = quality.logits_agreement(base_logits, logits) if base_logits is not None else (0.0, 1.0)
    return dict(arm=label, top_k=kw.get("top_k", "model"), threshold=kw.get("top_k_threshold"),
                renorm=kw.get("top_k_renorm", "auto"), perplexity=math.exp(nll), kl=kl, top1=top1,
                experts_per_token=ept, seconds=seconds), logits


def _interpolate(fixed: list[dict], ept: float, key: str) -> float | None:
    """The fixed-k curve's `key` at `ept` experts a token, linear between the neighbouring k."""
    pts = sorted((r["experts_per_token"], r[key]) for r in fixed)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= ept <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (ept - x0) / (x1 - x0)
    return None


def measure(model_dir: Path, chunks_n: int, seq: int, thresholds, renorms, weights: str, cache: str) -> dict:
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok((ROOT / "data" / "heldout.txt").read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    n = min(chunks_n, len(ids) // seq)
    chunks = torch.tensor(ids[: n * seq]).view(n, seq)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    K = int(model.config.num_experts_per_tok)
    common = dict(weights=weights, cache_dir=cache)
    arms = [("full", {})] + [(f"k={k}", dict(top_k=k)) for k in range(K - 1, 0, -1)]
    arms += [(f"adaptive {t:g} renorm={r}", dict(top_k="adaptive", top_k_threshold=t, top_k_renorm=r))
             for r in renorms for t in thresholds]
    rows, base = [], None
    for label, kw in tqdm(arms, desc=model_dir.name, unit="arm", leave=False):
        row, logits = _arm(model, chunks, label, base, **common, **kw)
        if base is None:
            base = logits
        rows.append(row)
    full = rows[0]
    for r in rows:
        r["perplexity_change"] = r["perplexity"] / full["perplexity"] - 1
        r["bytes_saved"] = 1 - r["experts_per_token"] / full["experts_per_token"]
    fixed = [r for r in rows if r["arm"] == "full" or r["arm"].startswith("k=")]
    for r in rows:
        if r["top_k"] == "adaptive":
            r["fixed_k_at_same_bytes"] = {key: _interpolate(fixed, r["experts_per_token"], key)
                                          for key in ("perplexity", "kl", "top1")}
    return dict(model=model_dir.name, experts=int(model.config.num_experts), k=K,
                norm_topk_prob=getattr(model.config, "norm_topk_prob", None), tokens=int(chunks.numel()),
                chunks=n, seq=seq, weights=weights, rows=rows)


def table(res: dict) -> str:
    out = [f"## {res['model']} (E={res['experts']}, top-{res['k']}, norm_topk_prob={res['norm_topk_prob']}; "
           f"{res['weights']}, {res['chunks']} x {res['seq']} held-out tokens)", "",
           "| arm | experts/token | bytes saved | perplexity | change | KL nats/token | top-1 | fixed k at the same bytes: change, KL, top-1 |",
           "|---|---|---|---|---|---|---|---|"]
    base = res["rows"][0]["perplexity"]
    for r in res["rows"]:
        same = r.get("fixed_k_at_same_bytes")
        cmp = "-" if not same or same["perplexity"] is None else (
            f"{same['perplexity'] / base - 1:+.2%}, {same['kl']:.4f}, {same['top1']:.1%}")
        out.append(f"| {r['arm']} | {r['experts_per_token']:.3f} | {r['bytes_saved']:.1%} | {r['perplexity']:.3f} | "
                   f"{r['perplexity_change']:+.2%} | {r['kl']:.4f} | {r['top1']:.1%} | {cmp} |")
    return "\n".join(out)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    for row, res in zip(axes, results):
        fixed = [r for r in res["rows"] if r["arm"] == "full" or r["arm"].startswith("k=")]
        series = [("fixed k", fixed, "o-")]
        for renorm in sorted({r["renorm"] for r in res["rows"] if r["top_k"] == "adaptive"}):
            series.append((f"adaptive (renorm {renorm})",
                           [r for r in res["rows"] if r["top_k"] == "adaptive" and r["renorm"] == renorm], "s-"))
        for ax, key, label in ((row[0], "perplexity_change", "perplexity change"), (row[1], "kl", "KL(full || arm), nats/token")):
            for name, rs, style in series:
                # (KL on a log scale: the full arm's 0 is left out)
                rs = sorted((r for r in rs if key != "kl" or r[key] > 0), key=lambda r: r["experts_per_token"])
                ax.plot([r["experts_per_token"] for r in rs], [r[key] for r in rs], style, label=name)
            if key == "perplexity_change":
                ax.axhline(0.01, color="grey", lw=0.8, ls="--", label="+1 %")
                ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
                # the adaptive arms' range: the fixed k of one or two experts would flatten the rest
                top = max(r[key] for _, rs, _ in series[1:] for r in rs) if len(series) > 1 else None
                if top:
                    ax.set_ylim(-0.05 * top, 1.15 * top)
            else:
                ax.set_yscale("log")
            ax.set_xlabel("experts a token (mean)")
            ax.set_ylabel(label)
            ax.set_title(f"{res['model']}: E={res['experts']}, top-{res['k']}")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, action="append", help="model dir (repeat); default the shipped "
                    "models/hina-tiny-moe and models/hina-moe-e64 when present")
    ap.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)))
    ap.add_argument("--renorm", default="auto", help="top_k_renorm values for the adaptive arms, comma-separated")
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--weights", default="lossless")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--plot", type=Path, help="write the curves here (PNG)")
    args = ap.parse_args()
    models = args.model or [m for m in MODELS if (m / "config.json").is_file()]
    for m in models:
        if not (m / "config.json").is_file():
            ap.error(f"--model {m}: no config.json there (a transformers model directory is expected)")
    thresholds = [float(t) for t in args.thresholds.split(",")]
    renorms = args.renorm.split(",")
    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for m in models:
            res = measure(m, args.chunks, args.seq, thresholds, renorms, args.weights, cache)
            results.append(res)
            print(table(res) + "\n", flush=True)
    meta = dict(record.host(), threads=torch.get_num_threads(), command=" ".join(sys.argv))
    print(f"{meta['date']}, {meta['commit']}, {meta['cpu_model']}, {meta['threads']} threads")
    if args.json:
        args.json.write_text(json.dumps(dict(meta, results=results), indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
