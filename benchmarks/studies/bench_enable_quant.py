"""enable_for_model(weights=...) on a model already loaded by transformers: time and memory of the
first enable (hash the experts, quantise, write the quantised blocks and the exact lossless
backups to the store), of disable (restore from the backups), and of a second enable (the
store has everything: hash and map only).

    python benchmarks/studies/bench_enable_quant.py --ckpt /work/ckpt/olmoe-1b-7b [--weights int4] [--cache-dir DIR]

Question: What do a first enable (quantise, write the store), a disable and a second enable cost on
  a loaded model?
Answered in benchmarks/log/memory-and-loading.md, "enable_for_model(weights="int4") on a model
  transformers already loaded (commit 0071f36)".
"""
from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path


def rss() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(val.split()[0]) / 2**20
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--weights", default="int4", choices=("int8", "int4"))
    ap.add_argument("--cache-dir", default="/work/ckpt/hina-cache/bench_enable_quant")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    import hi_na_moe
    from hi_na_moe.core.store import PackedStore

    cache = Path(args.cache_dir)
    if cache.exists():
        shutil.rmtree(cache)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16).eval()
    print(f"transformers load {time.perf_counter() - t:.1f} s; RSS {rss()}")
    ids = torch.randint(10, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids).logits
    for round_ in ("first enable", "second enable"):
        t = time.perf_counter()
        rep = hi_na_moe.enable_for_model(model, weights=args.weights, cache_dir=str(cache))
        te = time.perf_counter() - t
        store = PackedStore(cache).size_bytes()
        print(f"{round_}: {te:.1f} s; cache events {sorted({b.cache for b in rep.blocks})}; "
              f"store {store / 1e9:.2f} GB; RSS {rss()}")
        t = time.perf_counter()
        hi_na_moe.disable_for_model(model)
        td = time.perf_counter() - t
        with torch.no_grad():
            same = torch.equal(model(ids).logits, base)
        print(f"  disable {td:.1f} s; logits bit-identical to before: {same}; RSS {rss()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
