"""The memory tier inside a trained model, on real routing: eviction policy x prediction x pool size.

The trained E64 model (models/hina-moe-e64: 4 layers, 64 experts top-8, OLMoE's granularity;
benchmarks/log/memory-tier.md says how to train it) is enabled with int4 experts,
scope="experts" (its routers run in PyTorch, so a hook records what they choose) and a
memory_limit of --fractions of its packed experts, and decodes --windows windows of
data/heldout.txt token by token with a KV cache, each window's real next token fed (teacher
forcing: the routing is the text's, the same in every run). Per run, the tier's own counters:
hit rate, experts read from the store per token, predicted reads evicted before any use, and
prediction's precision and recall per layer. Beside them Belady's MIN on the very routing the
run recorded, with the same number of slots (the simulator of hi_na_moe.core.cache_policy, one
pool, a layer's k experts one step; it starts empty where the tier starts with what enable's
probes left, forgotten as uses).

    OMP_NUM_THREADS=1 python benchmarks/studies/study_tier_trained.py --json out.json
    # refine (a second prediction from each layer's output) on and off side by side:
    OMP_NUM_THREADS=1 python benchmarks/studies/study_tier_trained.py --policies freq-decay --prefetch on \
        --refine on,off --json out.json

Question: on real routing, with prediction on as it ships, which eviction policy serves the
  tier best, and does prediction reach 80 % recall in every layer?
Answered in benchmarks/log/memory-tier.md, "The tier in the trained E64 model (2026-12-07)".
Also: does refine (a second prediction from each layer's output, experimental tier.refine) lift
  recall? Answered in the same log, "Refine: a second prediction from each layer's output (2026-12-08)".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lib import record  # noqa: E402

from hi_na_moe.core.config import EVICTION_POLICIES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
POLICIES = tuple(p for p in EVICTION_POLICIES if p != "auto")


def fail(msg: str) -> None:
    raise SystemExit(f"study_tier_trained: {msg}")


def run(model, windows: torch.Tensor, hooks_out: list, **enable_kw) -> dict:
    import hi_na_moe
    from transformers import DynamicCache

    hi_na_moe.enable_for_model(model, weights="int4", scope="experts", **enable_kw)
    try:
        hooks_out.clear()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for w in windows:
                cache = DynamicCache(config=model.config)
                for t in range(w.numel()):
                    model(input_ids=w[t:t + 1].view(1, 1), past_key_values=cache, use_cache=True)
        secs = time.perf_counter() - t0
        return {"stats": hi_na_moe.stats(model), "seconds": secs}
    finally:
        hi_na_moe.disable_for_model(model)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "hina-moe-e64")
    ap.add_argument("--data", type=Path, default=REPO / "data" / "heldout.txt")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--fractions", default="0.1,0.3,0.5")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--prefetch", default="off,on", help="prediction off and/or on (comma-separated)")
    ap.add_argument("--refine", default="on",
                    help="with prediction on: refine (experimental tier.refine) on and/or off (comma-separated)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        fail(f"--model {args.model}: no config.json (train it: benchmarks/log/memory-tier.md)")
    policies = args.policies.split(",")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        fail(f"--policies: unknown {bad}; known: {', '.join(POLICIES)}")
    onoff = {"on": True, "off": False}
    for name in ("prefetch", "refine"):
        bad = [v for v in getattr(args, name).split(",") if v not in onoff]
        if bad:
            fail(f"--{name}: {bad} is not on or off; give on, off or on,off")
    prefetches = [onoff[v] for v in args.prefetch.split(",")]
    refines = [onoff[v] for v in args.refine.split(",")]
    import hi_na_moe
    from hi_na_moe.core import cache_policy as cp
    from hi_na_moe.core.native import native_module
    from hi_na_moe.core.registry import patched_experts
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor(tok(args.data.read_text(encoding="utf-8"), add_special_tokens=False).input_ids)
    if ids.numel() < args.windows * args.seq_len:
        fail(f"--data {args.data}: {ids.numel()} tokens, fewer than {args.windows} windows of {args.seq_len}")
    windows = ids[: args.windows * args.seq_len].view(args.windows, args.seq_len)
    layers = model.model.layers
    L, E = len(layers), int(model.config.num_experts)

    routing: list = []  # per forward: per layer the experts chosen
    def hook(layer):
        def f(m, a, o):
            routing.append((layer, o[2].detach().reshape(-1).tolist()))
        return f
    hs = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]

    native, _ = native_module()
    res = {"model": str(args.model.relative_to(REPO)) if args.model.resolve().is_relative_to(REPO) else str(args.model),
           "tokens": windows.numel(), "layers": L, "experts": E, "top_k": int(model.config.num_experts_per_tok),
           "runs": []}
    with tempfile.TemporaryDirectory() as cache:
        hi_na_moe.enable_for_model(model, weights="int4", scope="experts", cache_dir=cache)
        info = native.header_info(patched_experts(layers[0].mlp.experts).packed.header)
        slot = int(native.tier_slot_bytes(info["gu_expert_bytes"], info["down_expert_bytes"]))
        hi_na_moe.disable_for_model(model)
        res["slot_bytes"] = slot
        reference = None
        for frac in [float(f) for f in args.fractions.split(",")]:
            slots = max(int(model.config.num_experts_per_tok), int(frac * L * E))
            for prefetch, refine in [(p, r) for p in prefetches for r in (refines if p else [None])]:
                for pol in policies:
                    # (the switch is process-wide and kept when not named: named at every run)
                    out = run(model, windows, routing, cache_dir=cache, memory_limit=slots * slot, eviction=pol,
                              prefetch=prefetch, experimental=f"tier.refine={'off' if refine is False else 'on'}")
                    steps = [tuple(e) for _, e in routing]
                    if reference is None:
                        reference = steps
                        per_layer = [[] for _ in range(L)]
                        for layer, e in routing:
                            per_layer[layer].append(e)
                        trace = cp.make_trace(per_layer)
                    elif steps != reference:
                        fail("the routing differed between runs: teacher forcing should make it the text's")
                    s = out["stats"]
                    mn = cp.simulate(trace, slots, "belady").hit_rate
                    row = {"fraction": frac, "slots": slots, "policy": pol, "prefetch": prefetch, "refine": refine,
                           "hit_rate": s["hit_rate"], "min_hit_rate": mn, "of_min": s["hit_rate"] / mn if mn else None,
                           "expert_reads_per_token": s["reads"] / windows.numel(),
                           "prefetch_issued": s["prefetch_issued"], "prefetch_unused": s["prefetch_unused"],
                           "refined": s["refined"],
                           "prefetch_precision": s["prefetch_precision"], "prefetch_recall": s["prefetch_recall"],
                           "recall_per_layer": [l.get("recall") for l in s["layers"]],
                           "precision_per_layer": [l.get("precision") for l in s["layers"]],
                           "seconds": out["seconds"]}
                    res["runs"].append(row)
                    print(f"{100 * frac:.0f} % ({slots} slots) {pol:10s} prefetch={'on ' if prefetch else 'off'} "
                          f"refine={'-  ' if refine is None else 'on ' if refine else 'off'} "
                          f"hits {100 * row['hit_rate']:.1f} % (MIN {100 * mn:.1f} %, {100 * row['of_min']:.1f} % of it) "
                          f"reads/token {row['expert_reads_per_token']:.2f} unused {row['prefetch_unused']} "
                          f"recall/layer {[None if r is None else round(r, 3) for r in row['recall_per_layer']]} "
                          f"precision/layer {[None if r is None else round(r, 3) for r in row['precision_per_layer']]}",
                          flush=True)
    for h in hs:
        h.remove()
    if args.json:
        meta = {"tool": "study_tier_trained.py", "commit": record.commit(), "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                "cpu_model": record.cpu_model(), "argv": sys.argv[1:]}
        Path(args.json).write_text(json.dumps({**meta, **res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
