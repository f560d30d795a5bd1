"""One packed linear layer of a stored model (the lm_head by default) timed alone at 1-16 rows,
under settings switched call by call in one process.

Loads the checkpoint with scope="all" from its store (benchmarks/lib/stored.py), takes the module
--module (a dotted name; lm_head: Qwen1.5-MoE 4L's 151936 x 2048, 175 MB at int4, far larger
than the caches, so every call streams it; a layer's o_proj stays cached) and, per row count,
times --calls pairs of calls under each setting in turn (the order reversed every call), after
one untimed call each time. A setting is an environment assignment the kernels read at every
job: the tuning build's HINA_PF / HINA_PFM / HINA_PFH (csrc/moe/prefetch.h; build with
-Ccmake.define.HINA_PREFETCH_TUNING=ON), "-" for none. Prints per row count the median ms of a
call under each setting and the first setting's time over each other's.

    chrt -f 1 python benchmarks/studies/study_linear_rows.py --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen1.5-moe-a2.7b-4l/int4 \\
        --settings HINA_PFM=1024,HINA_PFM=0,HINA_PFM=4096,HINA_PFM=16384

Question: Which prefetch distance suits a packed linear layer's calls of 1-16 rows on AMD?
Answered in benchmarks/log/batched.md, "Batched decode: the int8 / int4 kernels' prefetch for
  several rows on AMD, batches of up to 256 sequences, against transformers and llama.cpp
  (2026-12-05)".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package
from lib import stored


def apply(setting: str, keys: set[str]) -> None:
    """Sets the setting's variables and unsets the other settings' ones."""
    given = dict(kv.split("=", 1) for kv in setting.split("+") if "=" in kv)
    for k in keys:
        if k in given:
            os.environ[k] = given[k]
        else:
            os.environ.pop(k, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stored.add_args(ap)
    ap.add_argument("--module", default="lm_head")
    ap.add_argument("--rows", default="1,2,3,4,5,8,16")
    ap.add_argument("--settings", default="-", help="comma-separated; each VAR=VALUE[+VAR=VALUE] or -")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch

    from hi_na_moe import _native

    torch.set_num_threads(args.threads)
    settings = args.settings.split(",")
    keys = {kv.split("=", 1)[0] for s in settings for kv in s.split("+") if "=" in kv}
    if keys and not _native.step_trace_compiled():
        raise SystemExit("these settings need the tuning build (HINA_PREFETCH_TUNING=ON): a release build reads "
                         "its prefetch distances once, when the library loads")
    model = stored.load(args.ckpt, args.weights, args.cache_dir)
    mod = model.get_submodule(args.module)
    res = {"module": args.module, "settings": settings, "rows": {}}
    with torch.inference_mode():
        for r in (int(x) for x in args.rows.split(",")):
            x = torch.randn(r, 1, mod.in_features).to(torch.bfloat16)
            ms = {s: [] for s in settings}
            for c in range(args.calls):
                for s in (settings if c % 2 == 0 else settings[::-1]):
                    apply(s, keys)
                    mod(x)
                    t = time.perf_counter()
                    mod(x)
                    mod(x)
                    ms[s].append((time.perf_counter() - t) / 2 * 1e3)
            med = {s: statistics.median(v) for s, v in ms.items()}
            res["rows"][r] = med
            print(f"rows {r:3d}: " + "  ".join(f"{s} {med[s]:.2f} ms" for s in settings)
                  + "".join(f"  {med[settings[0]] / med[s]:.3f}x" for s in settings[1:]), flush=True)
    apply("-", keys)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
