"""What the module-call chain around the decoder layers costs a decode step: an upper bound for a
model-level decode loop (not a feature; nothing here is part of hi_na_moe).

Loads an OLMoE-like checkpoint with hi_na_moe (scope all), then alternates, four steps at a time
on one DynamicCache, two ways of taking a decode step:
- model: `model(next_token, past_key_values=cache, logits_to_keep=1)`, as generate() does;
- loop: embed_tokens, rotary_emb, each decoder layer's short path called straight
  (`NativeLayer._fast`, no module call, no per-layer hook and mode checks, no argument parsing),
  the final norm and lm_head: what a model-level loop would keep. It checks nothing, so it is
  only valid here, where nothing hooks the model.
Both compute the same function (the layers' short path either way). After each step, untimed, a 256 MB read evicts the caches as bench_full_model.py's paired probe does.

    chrt -f 1 python benchmarks/studies/study_model_loop.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4

Question: What does the module-call chain around the decoder layers cost a decode step?
Answered in benchmarks/log/decode-step.md, "KV-cache appends in place, and where the int4 step's
  time goes (2026-11-30)".
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--weights", default="int4", choices=("lossless", "int8", "int4"))
    ap.add_argument("--cache-dir", required=True, help="the store of --weights")
    ap.add_argument("--steps", type=int, default=96, help="timed steps, both arms together")
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache

    import hi_na_moe
    from hi_na_moe import _native
    from hi_na_moe.core.registry import patched_runner

    torch.set_num_threads(2)
    cfg = hi_na_moe.load_config(cache_dir=args.cache_dir, scope="all", dense_lossless="")
    model = hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, dtype=torch.bfloat16, progress=False,
                                      config=cfg).eval()
    base = model.model
    runners = [patched_runner(layer) for layer in base.layers]
    if any(r is None or r.step is None for r in runners):
        raise SystemExit("not every decoder layer takes the two native calls (hi_na_moe.fastpath.layers)")

    def loop(ids, cache):
        h = base.embed_tokens(ids)
        past = cache.get_seq_length()
        cos, sin = base.rotary_emb(h, torch.arange(past, past + 1).unsqueeze(0))
        for r in runners:
            h = r._fast(h, cos, sin, cache, None)
        return model.lm_head(base.norm(h))

    probe = _native.BandwidthProbe(1 << 30, 2)
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"model": [], "loop": []}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        nxt = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        for i in range(args.steps + 8):
            arm = "model" if (i // 4) % 2 == 0 else "loop"
            t0 = time.perf_counter()
            if arm == "model":
                logits = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            else:
                logits = loop(nxt, cache)
            dt = time.perf_counter() - t0
            nxt = logits[:, -1:].argmax(-1)
            probe.read(256 << 20)
            if i >= 8:
                times[arm].append(dt)
    m, lp = statistics.median(times["model"]), statistics.median(times["loop"])
    print(f"{args.ckpt}, {args.weights}: model {1e3 * m:.2f} ms/step, loop {1e3 * lp:.2f} ms/step "
          f"(medians of {len(times['model'])} and {len(times['loop'])}), {100 * (1 - lp / m):.1f} % off")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
