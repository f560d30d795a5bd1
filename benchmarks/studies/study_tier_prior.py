"""Question: does starting the memory tier's pool from profile-router's expert prior (the
`profile` key) raise the hit rate of a run's first tokens, and for how long?

A trained model (default models/hina-moe-e64) is profiled on the first --profile-tokens of
data/heldout.txt; then, for each of --prompts disjoint stretches later in the text, the model is
enabled afresh at --weights with memory_limit holding --fraction of its packed experts, cold
(no profile) or warm (profile=), and fed the stretch one token at a time (teacher-forced decode
steps with a KV cache). Printed: the hit rate over the first 8, 32 and all --tokens steps per arm,
over all prompts, and what the warm-up read at enable and how long it took (the report's line).

    python benchmarks/studies/study_tier_prior.py [--model DIR] [--fraction 0.3] [--tokens 64] [--prompts 8]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import hi_na_moe
from hi_na_moe.integrate import patching
from hi_na_moe.tools import profile_router as prm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from lib import record  # noqa: E402


def steps(model, ids: torch.Tensor, marks: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """Teacher-forced decode of ids [1, n]: {mark: (hits, misses) over the first mark steps}."""
    cache, out = DynamicCache(config=model.config), {}
    with torch.inference_mode():
        for t in range(ids.shape[1]):
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            if t + 1 in marks:
                s = hi_na_moe.stats(model)
                out[t + 1] = (s["hits"], s["misses"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "hina-moe-e64")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--fraction", type=float, default=0.3, help="of the packed experts memory_limit holds")
    ap.add_argument("--profile-tokens", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps a prompt")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor(tok((ROOT / "data" / "heldout.txt").read_text(encoding="utf-8"),
                           add_special_tokens=False).input_ids)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    marks = tuple(sorted({m for m in (8, 32) if m < args.tokens} | {args.tokens}))
    with tempfile.TemporaryDirectory() as tmp:
        prof = prm.profile_router(model, None, ids[: args.profile_tokens])
        prof.save(Path(tmp) / "prof", plots=False)
        hi_na_moe.enable_for_model(model, weights=args.weights, cache_dir=tmp)
        experts = sum(r.packed.nbytes for _, r in patching.native_runners(model))
        hi_na_moe.disable_for_model(model)
        limit = int(experts * args.fraction)
        totals = {arm: {m: [0, 0] for m in marks} for arm in ("cold", "warm")}
        warm_note = None
        start = args.profile_tokens + 256  # stretches the profile did not see
        for p in range(args.prompts):
            stretch = ids[start + p * 1024: start + p * 1024 + args.tokens][None]
            for arm in (("cold", "warm") if p % 2 == 0 else ("warm", "cold")):
                kw = {"profile": str(Path(tmp) / "prof")} if arm == "warm" else {}
                report = hi_na_moe.enable_for_model(model, weights=args.weights, cache_dir=tmp, memory_limit=limit, **kw)
                try:
                    if arm == "warm":
                        warm_note = report.memory_tier[-1].strip()
                    for m, (h, miss) in steps(model, stretch, marks).items():
                        totals[arm][m][0] += h
                        totals[arm][m][1] += miss
                finally:
                    hi_na_moe.disable_for_model(model)
    at = record.host()
    print(f"{args.model.name}, {args.weights}, memory_limit {limit} B ({args.fraction:.0%} of {experts} B of experts), "
          f"prior from {args.profile_tokens} tokens, {args.prompts} prompts x {args.tokens} teacher-forced steps; "
          f"{at['date']}, {at['commit']}, {at['cpu_model']}")
    print("| arm | " + " | ".join(f"hit rate, first {m} steps" for m in marks) + " |")
    print("|---|" + "---|" * len(marks))
    res = {}
    for arm, t in totals.items():
        rates = {m: h / (h + miss) if h + miss else None for m, (h, miss) in t.items()}
        res[arm] = {"hit_rate": rates}
        print(f"| {arm} | " + " | ".join(f"{100 * r:.1f} %" for r in rates.values()) + " |")
    print(f"warm: {warm_note}")
    if args.json:
        args.json.write_text(json.dumps(dict(at, args={k: str(v) for k, v in vars(args).items()}, limit=limit,
                                             experts_bytes=experts, arms=res, warm=warm_note), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
