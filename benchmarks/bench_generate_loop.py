"""model.generate() against hi_na_moe.generate() against a plain loop of forwards, per decode step.

Loads --model with hi_na_moe.from_pretrained (--weights, --scope; the packed-expert store in
--cache-dir, packed on a first run), or builds a small random OLMoE in the process (--tiny: no
files, enabled with enable_for_model), and times in one process, --repeats rounds, the arms'
order rotated every round so that a slow phase of the host hits each of them:

  model.generate      model.generate(prompt, max_new_tokens=N, do_sample=False, eos_token_id=None)
  hi_na_moe.generate  hi_na_moe.generate(model, the same arguments)
  loop                model(prompt, past_key_values=DynamicCache, use_cache=True, logits_to_keep=1),
                      then N - 1 times model(token, cache, ...), each token picked as generate
                      picks it (the last logits row copied to float32, argmax): the floor

All three must decode the same tokens (the script stops otherwise). Every arm is timed by the
same streamer, whose put() records time.perf_counter() (generate calls it once a token, a
Python call the other two arms make too; a logits processor would add LogitsProcessorList's
signature inspection to generate's arm, benchmarks/log/decode-step.md): a decode step is one
stamp to the next, from the second new token on (the first follows the prefill). Greedy with
eos_token_id=None, so every call decodes N tokens. Prints the CPU, the date (UTC), the commit,
the threads, per arm the median ms a step (p10, p90, the median of the rounds' medians, the
median wall time of a call) and the ratios of the medians; --json writes them with records of
lib/record.py's schema.

    python benchmarks/bench_generate_loop.py --model /work/ckpt/olmoe-1b-7b --weights int4 --scope all \\
        --new-tokens 64 --repeats 5
    python benchmarks/bench_generate_loop.py --tiny --new-tokens 16 --repeats 1      # a smoke run
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

from lib import record

ARMS = ("model.generate", "hi_na_moe.generate", "loop")


class Stamps:
    """A streamer that records when each put() came (generate's streamer protocol)."""

    def __init__(self):
        self.t: list[float] = []

    def put(self, value) -> None:
        self.t.append(time.perf_counter())

    def end(self) -> None:
        pass


def tiny_model(weights: str, scope: str):
    """A random OLMoE (hidden 256, 2 layers, 8 experts, top-2, vocabulary 4096) in bf16, enabled."""
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    import hi_na_moe

    cfg = OlmoeConfig(hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=4096, num_experts=8, num_experts_per_tok=2,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = OlmoeForCausalLM(cfg).eval().to(torch.bfloat16)
    hi_na_moe.enable_for_model(model, weights=weights, scope=scope, cache=False)
    return model


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local checkpoint directory (hi_na_moe.from_pretrained)")
    src.add_argument("--tiny", action="store_true", help="a small random OLMoE built in the process (a smoke run)")
    ap.add_argument("--weights", default="int4", choices=("lossless", "lossless12", "int8", "int4"))
    ap.add_argument("--scope", default="all", choices=("experts", "all"))
    ap.add_argument("--cache-dir", help="the packed-expert store (default: the configuration's)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="prompts a call (unpadded, of one length)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds of the three arms, their order rotated each round")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--json", help="write the figures and records here")
    args = ap.parse_args()
    if args.new_tokens < 3 or args.repeats < 1 or args.batch < 1 or args.prompt_tokens < 1:
        ap.error("--new-tokens must be at least 3 (two decode steps to time); --repeats, --batch and "
                 "--prompt-tokens at least 1")
    import torch
    import transformers
    from transformers import DynamicCache

    import hi_na_moe

    # a fallback would time model.generate twice under two names: stop with its reason instead
    warnings.simplefilter("error", hi_na_moe.GenerateFallbackWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    at = record.host()
    t0 = time.perf_counter()
    if args.tiny:
        model, name = tiny_model(args.weights, args.scope), "tiny OLMoE (random, hidden 256, 2 layers, vocab 4096)"
    else:
        extra = {"cache_dir": args.cache_dir} if args.cache_dir else {}
        model = hi_na_moe.from_pretrained(args.model, weights=args.weights, scope=args.scope, dtype=torch.bfloat16,
                                          progress=False, **extra).eval()
        name = args.model
    load_s = time.perf_counter() - t0
    rep = hi_na_moe.report_for(model)
    vocab = model.config.vocab_size
    prompt = torch.randint(10, min(vocab, 30000), (args.batch, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(0))
    n = args.new_tokens
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False, eos_token_id=None)

    def run_generate(stamps: Stamps) -> torch.Tensor:
        return model.generate(prompt, streamer=stamps, **kw)[:, prompt.shape[1]:]

    def run_hina(stamps: Stamps) -> torch.Tensor:
        return hi_na_moe.generate(model, prompt, streamer=stamps, **kw)[:, prompt.shape[1]:]

    def run_loop(stamps: Stamps) -> torch.Tensor:
        with torch.no_grad():
            stamps.put(prompt)
            cache = DynamicCache(config=model.config)
            out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            toks = []
            for i in range(n):
                nxt = torch.argmax(out.logits[:, -1].to(copy=True, dtype=torch.float32), dim=-1)
                toks.append(nxt)
                stamps.put(nxt)
                if i + 1 < n:
                    out = model(nxt.unsqueeze(1), past_key_values=cache, use_cache=True, logits_to_keep=1)
            return torch.stack(toks, dim=1)

    fns = {"model.generate": run_generate, "hi_na_moe.generate": run_hina, "loop": run_loop}
    want = {a: fn(Stamps()) for a, fn in fns.items()}  # warm-up (first calls' set-up), and the tokens
    same = all(torch.equal(want[a], want["loop"]) for a in ARMS)
    if not same:
        print("the arms decode different tokens: " + "; ".join(f"{a}: {want[a][0, :8].tolist()}" for a in ARMS))
        return 1
    steps = {a: [] for a in ARMS}
    round_med = {a: [] for a in ARMS}
    wall = {a: [] for a in ARMS}
    for r in range(args.repeats):
        order = ARMS[r % 3:] + ARMS[:r % 3]
        for arm in order:
            stamps = Stamps()
            t = time.perf_counter()
            got = fns[arm](stamps)
            wall[arm].append((time.perf_counter() - t) * 1e3)
            if not torch.equal(got, want[arm]):
                print(f"{arm}: round {r} decoded other tokens than its warm-up")
                return 1
            if len(stamps.t) != n + 1:  # the prompt's put, then one a token
                print(f"{arm}: {len(stamps.t)} streamer puts, expected {n + 1}")
                return 1
            # stamps: the prompt, then token 1 (after the prefill), 2, ...: steps from token 1 to 2 on
            s = [(b - a) * 1e3 for a, b in zip(stamps.t[1:], stamps.t[2:])]
            steps[arm] += s
            round_med[arm].append(statistics.median(s))
    med = {a: statistics.median(v) for a, v in steps.items()}
    print(f"bench_generate_loop: {at['cpu_model']}; {at['date']} UTC; commit {at['commit']}; "
          f"{torch.get_num_threads()} threads; torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{name}: weights {args.weights}, scope {args.scope} (loaded in {load_s:.1f} s; "
          f"causal LM path: {bool(rep and rep.causal_lms)}); batch {args.batch}, prompt {args.prompt_tokens} tokens, "
          f"{n} new tokens a call, greedy, {args.repeats} rounds interleaved; the same tokens in every arm")
    print("| arm | ms a decode step (median) | p10 | p90 | median of the rounds' medians | wall ms a call (median) |")
    print("|---|---|---|---|---|---|")
    for a in ARMS:
        print(f"| {a} | {med[a]:.3f} | {pct(steps[a], 0.1):.3f} | {pct(steps[a], 0.9):.3f} | "
              f"{statistics.median(round_med[a]):.3f} | {statistics.median(wall[a]):.1f} |")
    g, h, lp = med["model.generate"], med["hi_na_moe.generate"], med["loop"]
    ratios = {"model.generate / loop": g / lp, "hi_na_moe.generate / loop": h / lp,
              "model.generate / hi_na_moe.generate": g / h}
    print("ratios of the medians: " + "; ".join(f"{k} {v:.3f}" for k, v in ratios.items())
          + f"; model.generate - hi_na_moe.generate {g - h:+.3f} ms a step")
    if args.json:
        threads = torch.get_num_threads()
        place = dict(model=name, weights=args.weights, scope=args.scope, batch=args.batch,
                     prompt_tokens=args.prompt_tokens, new_tokens=n)
        recs = [record.make(a, steps[a], threads=threads, tool="bench_generate_loop.py", at=at, **place) for a in ARMS]
        result = {**at, "threads": threads, **place, "repeats": args.repeats, "torch": torch.__version__,
                  "transformers": transformers.__version__, "median_step_ms": med,
                  "round_median_step_ms": round_med, "median_wall_ms": {a: statistics.median(v) for a, v in wall.items()},
                  "ratios": ratios}
        record.write(args.json, result, recs)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
