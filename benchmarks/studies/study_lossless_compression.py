"""Would bf16 weights stored losslessly in fewer bytes make lossless decode faster? A study.

Lossless decode reads every weight's 16 bits and already streams at 91-97 % of the paired read
probe (RESULTS, 2026-11-30, db2870d..6301535), so only fewer bytes can make it faster. A bf16 weight's low byte
(the exponent's last bit and 7 mantissa bits) is close to random, but its high byte (sign and the
exponent's top 7 bits) takes few values in a trained or normal-initialised matrix. The format
studied (benchmarks/studies/study_lossless_compression.cpp has the details): per panel of 16 output rows,
a table of its 16 most frequent high bytes; per block of 64 weights, 64 low bytes and 64 4-bit
codes (96 bytes, 75 %), or the 128 plain bytes when one of its high bytes is not in the table.

Part 1, what it saves on real tensors: the format's bytes over the plain bytes, the share of
blocks left plain, and the high byte's entropy (8 + that entropy is what any lossless coder of
the high byte alone could reach), for every 2-D weight of a checkpoint read per token (not the
input embedding; routed experts' matrices sampled: --max-gb), converted to bf16 as a bf16 load
converts it. Part 2, what it buys at decode: the C++ kernel, built here with g++ -O3
-march=native, runs a GEMV of one token over a --gib GiB matrix (normal weights, far above the
L3) in the plain panel layout (the package's bf16 decode loop: shift/and, fp32 FMAs) and in the
compressed one (decode to the same words, same FMAs), arms alternating, with and without the
4 KiB software prefetch; it checks that both outputs are the same bits.

    chrt -f 1 python benchmarks/studies/study_lossless_compression.py --ckpt /work/ckpt/olmoe-1b-7b \\
        --ckpt models/hina-tiny-moe --runs 3

Needs an x86-64 CPU with AVX-512 BW and g++ (a study, not a path of the package).

Question: Would bf16 weights stored losslessly in fewer bytes make lossless decode faster?
Answered in benchmarks/log/whole-model.md, "A fresh machine's int4 share, the rotary table and final
  norm, and a lossless packing study (2026-11-30)".
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def panel_stats(w) -> tuple[int, int, int, int, list[int]]:
    """(plain bytes, packed bytes, blocks, plain blocks, high-byte histogram) of a [M, K] bf16
    matrix (numpy int16 view) in the studied format; M is cut to a multiple of 16, K of 4."""
    import numpy as np

    M, K = w.shape[0] // 16 * 16, w.shape[1] // 4 * 4
    if M == 0 or K == 0:
        return 0, 0, 0, 0, [0] * 256
    hb = (w[:M, :K].view(np.uint16) >> 8).astype(np.int64).reshape(M // 16, 16, K)
    P = M // 16
    counts = np.bincount((np.arange(P)[:, None, None] * 256 + hb).ravel(), minlength=P * 256).reshape(P, 256)
    top = np.argsort(-counts, axis=1, kind="stable")[:, :16]
    in_table = np.zeros((P, 256), dtype=bool)
    in_table[np.arange(P)[:, None], top] = True
    member = in_table[np.arange(P)[:, None, None], hb]  # [P, 16, K]
    ok = member.reshape(P, 16, K // 4, 4).all(axis=(1, 3))  # blocks of 4 k x 16 rows
    blocks = ok.size
    raw = int(blocks - ok.sum())
    flag_bytes = (K // 4 + 511) // 512 * 64
    packed = P * (64 + flag_bytes) + (blocks - raw) * 96 + raw * 128
    return M * K * 2, packed, blocks, raw, counts.sum(axis=0).tolist()


def tensors(ckpt: Path, max_gb: float):
    """(name, [M, K] int16 numpy) of the checkpoint's 2-D weights read per token, as bf16; routed
    experts' matrices sampled evenly up to max_gb of them."""
    import torch
    from safetensors import safe_open

    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{ckpt}: no *.safetensors files")
    names = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names += [(f, n) for n in st.keys()]
    keep = [(f, n) for f, n in names if n.endswith(".weight") and "embed_tokens" not in n and "norm" not in n]
    experts = [(f, n) for f, n in keep if ".experts." in n]
    dense = [(f, n) for f, n in keep if ".experts." not in n]
    # routed experts: every step-th, spread over the layers, until max_gb of bf16
    with safe_open(str(experts[0][0]), framework="pt") as st:
        one = st.get_slice(experts[0][1]).get_shape() if experts else [0]
    per = math.prod(one) * 2 if experts else 1
    step = max(1, math.ceil(len(experts) * per / (max_gb * 1e9))) if experts else 1
    for f, n in dense + experts[::step]:
        with safe_open(str(f), framework="pt") as st:
            t = st.get_tensor(n)
        if t.dim() == 3:  # fused experts [E, M, K]: each expert its own matrix
            for e in range(t.shape[0]):
                yield f"{n}[{e}]", t[e].to(torch.bfloat16).view(torch.int16).numpy()
        elif t.dim() == 2 and t.is_floating_point():
            yield n, t.to(torch.bfloat16).view(torch.int16).numpy()


def compressibility(ckpt: Path, max_gb: float) -> dict:
    plain = packed = blocks = raw = 0
    hist = [0] * 256
    kinds: dict[str, list[int]] = {}
    for name, w in tensors(ckpt, max_gb):
        p, q, b, r, h = panel_stats(w)
        plain, packed, blocks, raw = plain + p, packed + q, blocks + b, raw + r
        hist = [a + c for a, c in zip(hist, h)]
        kind = "experts" if ".experts." in name else "lm_head" if "lm_head" in name else "dense"
        k = kinds.setdefault(kind, [0, 0])
        k[0] += p
        k[1] += q
    total = sum(hist)
    entropy = -sum(c / total * math.log2(c / total) for c in hist if c)
    return {"ckpt": str(ckpt), "plain_gb": plain / 1e9, "packed_over_plain": packed / plain,
            "plain_blocks_share": raw / blocks, "high_byte_entropy_bits": entropy,
            "entropy_bound_over_plain": (8 + entropy) / 16,
            "by_kind": {k: v[1] / v[0] for k, v in kinds.items()}}


def kernel(gib: float, runs: int, reps: int, std: float) -> list[dict]:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("part 2 needs g++ (or c++) on PATH")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "study_lossless_compression")
        subprocess.run([cxx, "-O3", "-march=native", "-std=c++17", "-o", exe,
                        str(HERE / "study_lossless_compression.cpp"), "-lpthread"], check=True)
        K = 2048
        rows = int(gib * (1 << 30) / (2 * K)) // 16 * 16
        for run in range(runs):
            for pf in ([], ["--no-prefetch"]):
                res = subprocess.run([exe, str(rows), str(K), str(reps), "2", str(std), *pf],
                                     capture_output=True, text=True)
                if res.returncode != 0:
                    raise SystemExit(f"kernel run failed ({res.returncode}): {res.stdout}{res.stderr}")
                r = json.loads(res.stdout)
                r["run"] = run
                out.append(r)
                print(f"  run {run}, prefetch {'on ' if r['prefetch'] else 'off'}: plain {r['plain_ms']:.1f} ms "
                      f"({r['plain_gbs']:.1f} GB/s), compressed {r['packed_ms']:.1f} ms ({r['packed_gbs']:.1f} GB/s "
                      f"of its {r['packed_bytes'] / r['plain_bytes']:.3f}x bytes): {r['speedup']:.2f}x, "
                      f"same bits: {r['equal']}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", action="append", default=[], help="a checkpoint directory (repeatable)")
    ap.add_argument("--max-gb", type=float, default=1.0, help="routed experts' bf16 GB sampled per checkpoint")
    ap.add_argument("--gib", type=float, default=1.0, help="size of the kernel's matrix, GiB of bf16")
    ap.add_argument("--runs", type=int, default=3, help="kernel runs (each: both prefetch settings)")
    ap.add_argument("--reps", type=int, default=7, help="GEMVs per arm per run (median)")
    ap.add_argument("--std", type=float, default=0.02, help="std of the kernel's normal weights")
    ap.add_argument("--json", help="write everything here")
    args = ap.parse_args()
    result: dict = {"compressibility": [], "kernel": []}
    for c in args.ckpt:
        r = compressibility(Path(c), args.max_gb)
        result["compressibility"].append(r)
        kinds = ", ".join(f"{k} {v:.3f}" for k, v in r["by_kind"].items())
        print(f"{c}: {r['plain_gb']:.2f} GB of bf16 studied; compressed / plain {r['packed_over_plain']:.3f} "
              f"({kinds}); blocks left plain {100 * r['plain_blocks_share']:.2f} %; high byte entropy "
              f"{r['high_byte_entropy_bits']:.2f} bits (bound {r['entropy_bound_over_plain']:.3f})", flush=True)
    print(f"kernel: one-token GEMV over {args.gib} GiB of bf16 (K 2048), 2 threads, arms alternating")
    result["kernel"] = kernel(args.gib, args.runs, args.reps, args.std)
    best = {}
    for r in result["kernel"]:
        for arm in ("plain", "packed"):
            best.setdefault((r["run"], arm), []).append(r[f"{arm}_ms"])
    ratios = [min(best[(run, "plain")]) / min(best[(run, "packed")]) for run in range(args.runs)]
    result["best_vs_best"] = ratios
    print(f"best plain / best compressed per run (either prefetch setting): "
          f"{', '.join(f'{x:.2f}x' for x in ratios)}; median {statistics.median(ratios):.2f}x")
    if not all(r["equal"] for r in result["kernel"]):
        print("OUTPUTS DIFFER", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
