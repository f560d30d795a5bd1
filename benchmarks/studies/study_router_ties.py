"""How often would routing computed outside PyTorch (a float32 softmax with another exp and
summation order, a top-k breaking ties by the lower index) differ from PyTorch's on a trained
model? An input for the choice of whether hi_na_moe may run the routers' softmax/top-k natively
(it does since 2026-11-30, db2870d, with PyTorch's tie order: hi_na_moe.fastpath.routers).

The shipped model (models/hina-tiny-moe, 8 experts, top-2) on the first --tokens tokens of
data/heldout.txt, in 512-token chunks, at float32 and bfloat16; every MoE layer's router logits
(forward hooks on `mlp.gate`). PyTorch: torch.softmax then torch.topk on the float32 logits. The
other: numpy's exp and sum in float32, a stable sort by descending probability. Counted per router
row: the selected set differs; the order of the selected experts differs (the same set, so the
same output up to the order of the sum); the selected weights differ in float32 (largest
difference in float32 ulps); and differ still after rounding to bfloat16 (as routers that cast
their weights to the hidden dtype do). Last, whether torch.topk breaks exact ties by the lower
index: 2000 rows of 64 small integers (ties everywhere), top-8.

A second row per dtype compares hi_na_moe's router_select (csrc/moe/router.cpp: std::exp, and a
top-k that moves ties as torch.topk's CPU kernel does) with PyTorch on the same logits, in the
model's dtype; and on the tie-heavy rows, router_select's indices with torch.topk's. Last,
PyTorch against itself: the bf16 model's logits through torch.softmax in a child process with
ATEN_CPU_CAPABILITY=avx2, against this process's build (AVX-512 on this machine).

    python benchmarks/studies/study_router_ties.py

Question: How often would routing computed outside PyTorch choose differently from PyTorch's on a
  trained model?
Answered in benchmarks/log/decode-step.md, "The router's selection native, and every layer of a
  decode step in one call (2026-11-30)".
"""
from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ROOT / "models" / "hina-tiny-moe"
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok((ROOT / "data" / "heldout.txt").read_text(), return_tensors="pt").input_ids[:, : args.tokens]
    from hi_na_moe.core.native import native_module

    native = native_module()[0]
    codes = {torch.float32: 0, torch.bfloat16: 1}

    def router_select(logits, k):  # softmax-topk, float32 weights
        w = torch.empty(logits.shape[0], k)
        i = torch.empty(logits.shape[0], k, dtype=torch.int64)
        native.router_select_raw(codes[logits.dtype], logits.data_ptr(), logits.shape[0], logits.shape[1], k, 0,
                                 False, 0, w.data_ptr(), i.data_ptr())
        return w.numpy(), i.numpy()

    print("| model dtype | other routing | router rows | selection differs | order differs | weights differ (fp32) | max ulps | weights differ after bf16 rounding |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        logits = []
        for name, mod in model.named_modules():
            if name.endswith("mlp.gate"):
                mod.register_forward_hook(lambda m, i, o: logits.append(o[0] if isinstance(o, tuple) else o))
        with torch.inference_mode():
            for s in range(0, ids.shape[1], 512):
                model(ids[:, s:s + 512])
        own = torch.cat([t.reshape(-1, t.shape[-1]) for t in logits]).contiguous()
        L = own.float()
        k = model.config.num_experts_per_tok
        tw, ti = torch.topk(torch.softmax(L, dim=-1), k, dim=-1)
        tw, ti = tw.numpy(), ti.numpy()
        x = L.numpy()
        e = np.exp(x - x.max(-1, keepdims=True)).astype(np.float32)
        q = (e / e.sum(-1, dtype=np.float32, keepdims=True)).astype(np.float32)
        qi = np.argsort(-q, kind="stable", axis=-1)[:, :k]
        qw = np.take_along_axis(q, qi, -1)
        n = len(x)
        pct = lambda c: f"{int(c)} ({100 * c / n:.3f} %)"  # noqa: E731
        for other, (ow, oi) in (("numpy, lowest index first", (qw, qi)), ("router_select", router_select(own, k))):
            sel = (np.sort(oi, -1) != np.sort(ti, -1)).any(-1)
            order = (oi != ti).any(-1) & ~sel
            same = ~(sel | order)
            diff = np.abs(ow[same] - tw[same])
            ulps = (diff / np.spacing(tw[same])).max()
            bf = (torch.from_numpy(ow[same]).bfloat16() != torch.from_numpy(tw[same]).bfloat16()).any(-1)
            print(f"| {str(dtype).split('.')[-1]} | {other} | {n} | {pct(sel.sum())} | {pct(order.sum())} | "
                  f"{pct((diff > 0).any(-1).sum())} | {ulps:.0f} | {pct(bf.sum().item())} |")
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        torch.save(L, f"{tmp}/logits.pt")
        child = ("import sys, torch; L = torch.load(sys.argv[1]); "
                 "torch.save(torch.softmax(L, dim=-1), sys.argv[2])")
        subprocess.run([sys.executable, "-c", child, f"{tmp}/logits.pt", f"{tmp}/avx2.pt"], check=True,
                       env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"})
        other = torch.load(f"{tmp}/avx2.pt")
    mine = torch.softmax(L, dim=-1)
    ulps = (mine.view(torch.int32) - other.view(torch.int32)).abs()
    print(f"PyTorch's softmax, {torch.backends.cpu.get_cpu_capability()} build vs avx2 build, on the bf16 model's "
          f"{len(L)} router rows: {100 * (ulps > 0).float().mean().item():.1f} % of the probabilities differ, by at most "
          f"{int(ulps.max())} ulps")
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 6, (2000, 64), generator=gen).float()
    got = torch.topk(rows, 8, dim=-1).indices
    lowest = torch.from_numpy(np.argsort(-rows.numpy(), kind="stable", axis=-1)[:, :8].copy())
    print(f"torch.topk on 2000 tie-heavy rows: {int((got != lowest).any(-1).sum())} differ from "
          f"lowest-index-first tie-breaking, {int((got.numpy() != router_select(rows, 8)[1]).any(-1).sum())} "
          f"from router_select")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
