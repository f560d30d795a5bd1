"""Decode speed of distilled checkpoints beside their original: `hi-na-moe bench` (the hina arm,
--weights, scope="all") on each model directory given, the models alternating round by round
(the order reversed every other round), each run its own process under the caller's priority.
Prints per model the median decode tokens/s over the rounds, the bytes a token reads (the
report's), the checkpoint's size on disk and the process's peak RSS, and the ratio to the first
model's speed.

    chrt -f 1 python benchmarks/studies/study_distill_speed.py --rounds 4 \\
        models/hina-tiny-moe /tmp/tiny-e4k2 /tmp/tiny-e4k1

Question: what does a distilled checkpoint buy at decode, with and without a lowered top-k
(issue 44: "memory of the result; decode speed with lowered k")?
Answered in benchmarks/log/distill.md, "Decode speed and memory of distilled checkpoints
(2026-12-07)".
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def run(model: str, weights: str, tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "hi_na_moe", "bench", "--model", model, "--compare", "hina",
                          "--weights", weights, "--scope", "all", "--gen-tokens", str(tokens), "--num-iters", "3",
                          "--output", "json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="model directories, the original first")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--weights", default="lossless")
    ap.add_argument("--gen-tokens", type=int, default=64)
    args = ap.parse_args()
    for m in args.models:
        if not (Path(m) / "config.json").is_file():
            raise SystemExit(f"{m}: not a model directory (no config.json)")
    speed: dict[str, list[float]] = {m: [] for m in args.models}
    last: dict[str, dict] = {}
    for r in range(args.rounds):
        for m in (args.models if r % 2 == 0 else args.models[::-1]):
            d = run(m, args.weights, args.gen_tokens)
            arm = d["arms"]["hina"]
            speed[m].append(arm["tg_tokens_per_s"])
            last[m] = arm
            print(f"round {r + 1}: {m} {arm['tg_tokens_per_s']:.1f} tok/s", flush=True)
    base = statistics.median(speed[args.models[0]])
    print("| model | decode tok/s (median) | vs the first | bytes a token | experts a token | checkpoint MB | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for m in args.models:
        a, med = last[m], statistics.median(speed[m])
        size = sum(f.stat().st_size for f in Path(m).glob("*.safetensors")) / 1e6
        print(f"| {m} | {med:.1f} | {med / base:.2f}x | {a['bytes_per_token'] / 1e6:.2f} MB | "
              f"{a['experts_per_token']:.1f} | {size:.1f} | {a['peak_rss_bytes'] / 2**20:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
