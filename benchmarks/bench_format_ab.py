"""Two weight formats of one checkpoint, decode steps alternating in one process.

bench_full_model.py runs each arm in its own process, minutes apart, and this machine's
bandwidth moves by ±30 % between them; this loads the checkpoint once per format with
hi_na_moe.from_pretrained (warm: each format's store must hold every block, as
bench_full_model.py's cold phase writes it under <cache-dir>/<format>), gives each model the same
prompt and its own DynamicCache, and alternates greedy decode steps between them four at a time,
each step followed (untimed) by a 256 MB read of a 1 GiB probe buffer, as bench_full_model.py's
paired probe. Per format: median ms per step, bytes one token reads (as bench_full_model.py
counts them), its rate and share of the paired probe; and the step-time ratio. Both models must
fit in RAM at once.

    chrt -f 1 python benchmarks/bench_format_ab.py --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --formats lossless,lossless12 --scope all --dense-lossless "" \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen1.5-moe-a2.7b-4l
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--formats", default="lossless,lossless12", help="two formats, comma-separated")
    ap.add_argument("--scope", default="all", choices=("experts", "all"))
    ap.add_argument("--dense-lossless", default="lm_head")
    ap.add_argument("--cache-dir", required=True, help="holds one store per format: <cache-dir>/<format>")
    ap.add_argument("--steps", type=int, default=96, help="timed steps per format")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch and kernel threads (the probe uses as many)")
    ap.add_argument("--json", help="write the samples here")
    args = ap.parse_args()
    formats = args.formats.split(",")
    if len(formats) != 2:
        raise SystemExit("--formats: give exactly two")
    import torch
    from bench_full_model import dense_and_expert_bytes
    from transformers import DynamicCache

    import hi_na_moe
    from hi_na_moe import _native

    torch.set_num_threads(args.threads)
    shape = dense_and_expert_bytes(Path(args.ckpt))
    models, per_token = {}, {}
    for fmt in formats:
        cfg = hi_na_moe.load_config(cache_dir=str(Path(args.cache_dir) / fmt), scope=args.scope,
                                    dense_lossless=args.dense_lossless, threads=args.threads)
        model = hi_na_moe.from_pretrained(args.ckpt, weights=fmt, dtype=torch.bfloat16, progress=False,
                                          config=cfg).eval()
        rep = hi_na_moe.report_for(model)
        if any(b.cache != "reused" for b in rep.blocks):
            raise SystemExit(f"the store {Path(args.cache_dir) / fmt} did not hold every block: run "
                             "bench_full_model.py's cold phase for this format first")
        got = {b.name: b for b in rep.blocks}
        experts = sum((got[n].packed_bytes or b["expert_bytes"]) / b["experts"] * shape["top_k"]
                      for n, b in shape["blocks"].items())
        dense = shape["dense_bytes"] + sum(d.packed_bytes - 2 * d.out_features * d.in_features for d in rep.dense)
        models[fmt], per_token[fmt] = model, dense + experts
        print(f"{fmt}: {per_token[fmt] / 1e9:.3f} GB per token; weights {sorted({b.weights for b in rep.blocks})}, "
              f"dense {sorted({d.weights for d in rep.dense}) or '-'}; kernels {sorted({b.kernel for b in rep.blocks})}",
              flush=True)
    probe = _native.BandwidthProbe(1 << 30, args.threads)
    ids = torch.randint(300, shape["vocab"], (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    state = {}
    with torch.inference_mode():
        for fmt, model in models.items():
            cache = DynamicCache(config=model.config)
            out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            state[fmt] = [cache, out.logits[:, -1:].argmax(-1)]
        steps = {f: [] for f in formats}
        gbs = {f: [] for f in formats}
        for i in range(2 * args.steps + 8):
            fmt = formats[(i // 4) % 2]
            cache, nxt = state[fmt]
            t = time.perf_counter()
            out = models[fmt](nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            dt = time.perf_counter() - t
            state[fmt][1] = out.logits[:, -1:].argmax(-1)
            bw = probe.read(256 << 20)
            if i >= 8:  # warm-up: four steps each
                steps[fmt].append(dt)
                gbs[fmt].append(bw)
    res = {}
    for fmt in formats:
        med = statistics.median(steps[fmt])
        shares = [per_token[fmt] / s / 1e9 / b for s, b in zip(steps[fmt], gbs[fmt])]
        res[fmt] = {"median_ms": 1e3 * med, "bytes_per_token": per_token[fmt], "gbs": per_token[fmt] / med / 1e9,
                    "paired_share": statistics.median(shares), "probe_gbs": statistics.median(gbs[fmt]),
                    "steps_ms": [1e3 * s for s in steps[fmt]]}
        r = res[fmt]
        print(f"{fmt}: {r['median_ms']:.2f} ms per step (median of {len(steps[fmt])}), {r['gbs']:.1f} GB/s, "
              f"{100 * r['paired_share']:.0f} % of the paired probe ({r['probe_gbs']:.1f} GB/s)")
    a, b = formats
    print(f"{b} against {a}: {res[a]['median_ms'] / res[b]['median_ms']:.3f}x the decode speed")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
