"""The per-layer path's decode step across two builds: a 16-layer tiny OLMoE (hidden 512, 8
experts top-2, bfloat16, int4, scope="all") with the stack's one call off
(`HINA_MOE_EXPERIMENTAL=stack.one_call=off`), so every decoder layer runs its own two native
calls and the step is mostly their Python and call overhead. Each turn runs this script in each
tree's own interpreter (so each loads its own build), the order alternating turn by turn; prints
the median ms a step of each run (3 rounds of 64 steps after a 16-token prompt) and the ratio of
the trees' medians.

    chrt -f 1 python benchmarks/studies/study_layer_path.py --turns 4 \\
        --a old=/path/to/old-tree --b new=/work/main

Question: did the layers' partial StepPlan (8024cfa: arguments built once and held, scratch and
cache positions filled in C++) make the per-layer path slower than the raw calls it replaced?
Answered in benchmarks/log/decode-step.md, "The per-layer path through a partial StepPlan
(2026-12-07)".
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def step_ms(cache_dir: str) -> float:
    import torch
    from transformers import DynamicCache, OlmoeConfig, OlmoeForCausalLM

    import hi_na_moe

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = OlmoeForCausalLM(OlmoeConfig(
        hidden_size=512, intermediate_size=128, num_hidden_layers=16, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=512, num_experts=8, num_experts_per_tok=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)).eval().bfloat16()
    cfg = hi_na_moe.load_config(cache_dir=cache_dir, scope="all", dense_lossless="", weights="int4")
    hi_na_moe.enable_for_model(model, config=cfg)
    ids = torch.randint(3, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    steps = []
    with torch.inference_mode():
        for _ in range(3):
            cache = DynamicCache(config=model.config)
            nxt = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
            for i in range(68):
                t0 = time.perf_counter()
                out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                dt = time.perf_counter() - t0
                nxt = out.logits[:, -1:].argmax(-1)
                if i >= 4:
                    steps.append(dt)
    return 1e3 * statistics.median(steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="NAME=TREE (its .venv/bin/python runs it)")
    ap.add_argument("--b", required=True, help="NAME=TREE")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(f"{step_ms(args.child):.4f}")
        return 0
    arms = [tuple(x.split("=", 1)) for x in (args.a, args.b)]
    for name, tree in arms:
        if not os.path.isfile(os.path.join(tree, ".venv/bin/python")):
            raise SystemExit(f"--a/--b {name}: no {tree}/.venv/bin/python (set the tree up with scripts/dev.sh setup)")
    env = dict(os.environ, HINA_MOE_EXPERIMENTAL="stack.one_call=off")
    got: dict[str, list[float]] = {name: [] for name, _ in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.turns):
            for name, tree in (arms if turn % 2 == 0 else arms[::-1]):
                out = subprocess.run([os.path.join(tree, ".venv/bin/python"), os.path.abspath(__file__), "--a", "x",
                                      "--b", "x", "--child", os.path.join(tmp, name)], env=env, cwd=tree,
                                     capture_output=True, text=True, check=True)
                got[name].append(float(out.stdout.split()[-1]))
                print(f"turn {turn + 1}: {name} {got[name][-1]:.3f} ms a step", flush=True)
    (a, _), (b, _) = arms
    ma, mb = statistics.median(got[a]), statistics.median(got[b])
    print(f"median ms a step: {a} {ma:.3f}, {b} {mb:.3f}; {a} / {b} = {ma / mb:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
