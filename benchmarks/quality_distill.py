"""What fewer experts a layer cost in quality (hi_na_moe.tools.distill), measured on the shipped
model and real text.

For the shipped model (models/hina-tiny-moe: 8 experts, top-2), every arm method x score x N
(prune / merge; frequency / saliency / random; N experts kept a layer) is distilled on
calibration tokens from the model's *training* split (scripts/build_corpus.py rebuilds it from
the standard library; seeded windows of it) and evaluated on data/heldout.txt, the held-out
split, in chunks of --seq tokens as benchmarks/quality_top_k.py chunks it. Per arm: perplexity,
its change, mean KL(original || arm) nats per token and top-1 agreement with the original
(hi_na_moe.tools.quality.logits_agreement), the bytes of the written checkpoint
(model.safetensors) and the distill time; with --repair-steps also each arm after
hi_na_moe.tools.distill.repair (its time in the seconds column). Everything runs in transformers (no hi_na_moe kernels),
float32.

    python benchmarks/quality_distill.py [--experts 6,4] [--methods prune,merge]
        [--scores frequency,saliency,random] [--top-k model,1] [--repair-steps 200 [--train-experts]]
        [--calib-tokens 8192] [--chunks 112] [--seq 256] [--json OUT]
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from hi_na_moe.tools import quality
from hi_na_moe.tools.distill import distill, repair, save_distilled
from lib import record

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "hina-tiny-moe"


def _calibration(tok, tokens: int, seq: int, seed: int) -> torch.Tensor:
    """`tokens` tokens of the training split: seeded non-overlapping windows of `seq` tokens."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_corpus import build

    corpus = build(write=False)
    want = json.loads((ROOT / "data" / "corpus_manifest.json").read_text())["train_sha256"]
    if corpus["manifest"]["train_sha256"] != want:  # another Python's stdlib: still no held-out file in it
        print("note: the rebuilt training split differs from the one the model was trained on "
              "(corpus_manifest.json's train_sha256)", file=sys.stderr)
    ids = torch.tensor(tok(corpus["train_text"], add_special_tokens=False).input_ids)
    n = ids.numel() // seq
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: max(1, tokens // seq)]
    return ids[: n * seq].view(n, seq)[pick.sort().values].reshape(-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--experts", default="6,4")
    ap.add_argument("--methods", default="prune,merge")
    ap.add_argument("--scores", default="frequency,saliency,random")
    ap.add_argument("--top-k", default="model", help="top-k values of the distilled arms, comma-separated "
                    "('model': the original's); each lower k also gets an arm of the original at that k")
    ap.add_argument("--repair-steps", type=int, default=0, help="also each arm after this many steps of router "
                    "repair (the original as teacher, on the calibration tokens); 0: none")
    ap.add_argument("--train-experts", action="store_true", help="the repair trains the routed experts too")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--chunks", type=int, default=112)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there (a transformers model directory is expected)")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok((ROOT / "data" / "heldout.txt").read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    n = min(args.chunks, len(ids) // args.seq)
    chunks = torch.tensor(ids[: n * args.seq]).view(n, args.seq)
    calib = _calibration(tok, args.calib_tokens, args.seq, args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    E, K = int(model.config.num_experts), int(model.config.num_experts_per_tok)
    base_nll, base = quality.nll_and_logits(model, chunks, batch=8)
    rows = [dict(arm="original", experts=E, top_k=K, method="-", score="-", perplexity=math.exp(base_nll),
                 kl=0.0, top1=1.0, bytes=(args.model / "model.safetensors").stat().st_size, seconds=0.0)]
    ks = [K if k == "model" else int(k) for k in args.top_k.split(",")]
    for k in ks:
        if k != K:  # the original at a lower k: what lowering k alone costs
            cfg = copy.deepcopy(model.config)
            cfg.num_experts_per_tok = k
            low = type(model)._from_config(cfg, dtype=torch.float32).eval()
            low.load_state_dict(model.state_dict())
            nll, logits = quality.nll_and_logits(low, chunks, batch=8)
            kl, top1 = quality.logits_agreement(base, logits)
            rows.append(dict(arm=f"original k={k}", experts=E, top_k=k, method="-", score="-",
                             perplexity=math.exp(nll), kl=kl, top1=top1, bytes=rows[0]["bytes"], seconds=0.0))
            del low, logits
    arms = [(N, k, m, s) for k in ks for N in map(int, args.experts.split(",")) for m in args.methods.split(",")
            for s in args.scores.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for N, k, method, score in tqdm(arms, desc="arms", unit="arm"):
            t0 = time.perf_counter()
            small = distill(model, N, top_k=k, method=method, score=score, data=calib, seq_len=args.seq,
                            seed=args.seed)
            seconds = time.perf_counter() - t0
            out = save_distilled(small, Path(tmp) / f"{N}-{k}-{method}-{score}")
            nll, logits = quality.nll_and_logits(small, chunks, batch=8)
            kl, top1 = quality.logits_agreement(base, logits)
            rows.append(dict(arm=f"{method} {score} N={N}" + (f" k={k}" if k != K else ""), experts=N, top_k=small.config.num_experts_per_tok,
                             method=method, score=score, perplexity=math.exp(nll), kl=kl, top1=top1,
                             bytes=(out / "model.safetensors").stat().st_size, seconds=seconds,
                             kept=[b["kept"] for b in small.distill_report.layers],
                             merged_into=[b.get("merged_into") for b in small.distill_report.layers]))
            if args.repair_steps:
                t0 = time.perf_counter()
                repair(small, model, calib, steps=args.repair_steps, seq_len=args.seq, seed=args.seed,
                       train_experts=args.train_experts)
                seconds = time.perf_counter() - t0
                nll, logits = quality.nll_and_logits(small, chunks, batch=8)
                kl, top1 = quality.logits_agreement(base, logits)
                rows.append(dict(rows[-1], arm=rows[-1]["arm"] + f" +repair {args.repair_steps}",
                                 perplexity=math.exp(nll), kl=kl, top1=top1, seconds=seconds,
                                 repair=small.distill_report.repair))
            del small, logits
    for r in rows:
        r["perplexity_change"] = r["perplexity"] / rows[0]["perplexity"] - 1
    head = (f"{args.model.name} (E={E}, top-{K}), float32; calibration {calib.numel()} tokens of the training split "
            f"(seed {args.seed}); evaluation {n} x {args.seq} held-out tokens (data/heldout.txt)")
    lines = [head, "", "| arm | experts | top-k | perplexity | change | KL nats/token | top-1 | checkpoint bytes | "
             "seconds |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['experts']} | {r['top_k']} | {r['perplexity']:.3f} | "
                     f"{r['perplexity_change']:+.2%} | {r['kl']:.4f} | {r['top1']:.1%} | {r['bytes']:,} | "
                     f"{r['seconds']:.1f} |")
    print("\n".join(lines), flush=True)
    meta = dict(record.host(), threads=torch.get_num_threads(), command=" ".join(sys.argv))
    print(f"{meta['date']}, {meta['commit']}, {meta['cpu_model']}, {meta['threads']} threads")
    if args.json:
        args.json.write_text(json.dumps(dict(meta, model=args.model.name, experts=E, top_k=K,
                                             calibration_tokens=int(calib.numel()), chunks=n, seq=args.seq,
                                             rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
