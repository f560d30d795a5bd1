"""Decode speed against llama.cpp (or transformers) with the two engines interleaved, so both see the same host.

bench_full_model.py runs its arms one after the other, each in its own process for a minute or
so; on this shared host the memory bandwidth moves between phases (paired probes of 29-33 and
43-50 GB/s) that last minutes, and an arm that lands in the other phase than its partner moves
the ratio by +-15 % (benchmarks/RESULTS.md, 2026-12-05, 9fbcceb..71b40bd). Here both engines stay loaded, in
two processes: this one (hi_na_moe.from_pretrained, scope="all", --weights from the store
--cache-dir) and bench_llamacpp.py --serve on --gguf in the llama.cpp venv. They decode in
bursts of --burst steps, alternating (the order swapped every round), --rounds rounds, each
step followed by the paired probe's untimed 256 MB read and a 30 ms pause, a 0.2 s pause
between bursts; each engine decodes its own sequences of 128 steps after a 16-token prompt
(untimed), restarted as they end. Prints per engine the median step, the median probe and
tokens/s per GB/s of probe; the ratio of the medians, and the median of the rounds' ratios
(each round's two bursts a few seconds apart, in one phase).

--generate: each burst is instead one generation of --gen (128) greedy tokens by the engine's own
loop, as a user runs it: transformers' generate() (a streamer stamping each token) against
llama-cpp-python's Llama.generate (temp 0), each after one paired-probe read, nothing between
tokens; the figures are the times between consecutive tokens.

--top-k model,5,adaptive:0.3: more hi_na_moe engines on the one loaded model, each running its
bursts with that HinaConfig.top_k (a fixed n, or adaptive at a threshold, optionally
adaptive:T:on|off for top_k_renorm), set by hi_na_moe.set_top_k before its burst; each prints the
experts a token its steps used (the kernels' counts) and its own ratio.

--against transformers: the opponent is transformers' own model in this process instead
(AutoModelForCausalLM.from_pretrained of --ckpt in bfloat16, not enabled), stepped as ours is
(no --gguf then). Both models are resident: the checkpoint's bf16 weights twice in RAM.

    chrt -f 1 python benchmarks/bench_interleaved.py --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen1.5-moe-a2.7b-4l/int4 \\
        --gguf /work/ckpt/gguf/qwen1.5-moe-a2.7b-4l-q4_0.gguf
    chrt -f 1 python benchmarks/bench_interleaved.py --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --weights lossless12 --cache-dir <the lossless12 store> --against transformers
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lib import record, stored

HERE = Path(__file__).resolve().parent
PROMPT_LEN, GEN = 16, 128


class Llama:
    """bench_llamacpp.py --serve in the llama.cpp venv: bursts of decode steps on command."""

    def __init__(self, python: str, gguf: Path, threads: int, batched: int = 0):
        native = importlib.util.find_spec("hi_na_moe._native").origin
        cmd = [python, str(HERE / "bench_llamacpp.py"), str(gguf), "--serve", "--threads", str(threads),
               "--prompt-len", str(PROMPT_LEN), "--gen", str(GEN), "--paired-probe-native", native]
        if batched:  # a second context for "batch B N" (bench_batch_decode.py)
            cmd += ["--batched", str(batched)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()  # {"ready": true} once loaded and warmed up

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench_llamacpp.py --serve ended (exit code {self.proc.wait()})")
        out = json.loads(line)
        if "error" in out:
            raise SystemExit(f"bench_llamacpp.py --serve: {out['error']}")
        return out

    def generate(self, n: int) -> tuple[list[float], list[float]]:
        """One paired-probe read, then Llama.generate of n tokens: (ms between tokens, [probe])."""
        self.proc.stdin.write(f"generate {n}\n")
        self.proc.stdin.flush()
        out = self._answer()
        return out["step_ms"], out["probe_gbs"]

    def batch(self, b: int, n: int) -> tuple[list[float], list[float]]:
        """b new prompts decoded together for n steps: (ms a step, [the probe read after])."""
        self.proc.stdin.write(f"batch {b} {n}\n")
        self.proc.stdin.flush()
        out = self._answer()
        return out["step_ms"], out["probe_gbs"]

    def burst(self, n: int) -> tuple[list[float], list[float]]:
        self.proc.stdin.write(f"steps {n}\n")
        self.proc.stdin.flush()
        out = self._answer()
        return out["step_ms"], out["probe_gbs"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


class OursTopK:
    """Ours's model with another HinaConfig.top_k (hi_na_moe.set_top_k before each burst); the
    kernels' routing counts give the experts a token it used."""

    def __init__(self, ours: "Ours", spec: str):
        parts = spec.split(":")
        self.kw = {"top_k": int(parts[0]) if parts[0].isdigit() else parts[0]}
        if len(parts) > 1:
            self.kw["threshold"] = float(parts[1])
        if len(parts) > 2:
            self.kw["renorm"] = parts[2]
        self.ours, self.spec = ours, spec
        self.tokens = self.slots = 0

    def burst(self, n: int) -> tuple[list[float], list[float]]:
        import hi_na_moe

        hi_na_moe.set_top_k(self.ours.model, **self.kw)  # (the counts start at zero)
        out = self.ours.burst(n)
        routing = hi_na_moe.stats(self.ours.model)["routing"].values()
        self.tokens += sum(r["tokens"] for r in routing)
        self.slots += sum(r["slots"] for r in routing)
        return out

    @property
    def experts_per_token(self) -> float | None:
        return self.slots / self.tokens if self.tokens else None


class Ours:
    """hi_na_moe's model (native=True: transformers' own): bursts of decode steps with the paired
    probe, as Llama's."""

    def __init__(self, args, native: bool = False):
        import torch

        from hi_na_moe import _native

        torch.set_num_threads(args.threads)
        self.torch = torch
        if native:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16).eval()
        else:
            self.model = stored.load(args.ckpt, args.weights, args.cache_dir)
        self.probe = _native.BandwidthProbe(1 << 30, args.threads)
        self.gen = torch.Generator().manual_seed(0)
        self.done, self.cache, self.tok = GEN, None, None
        self.burst(4, probe=False)  # warm-up

    def generate(self, n: int) -> tuple[list[float], list[float]]:
        """One paired-probe read, then generate() of n greedy tokens on a new prompt: (the ms
        between consecutive tokens as a streamer sees them, n - 1 of them; [probe])."""
        torch = self.torch
        gbs = [self.probe.read(256 << 20)]
        time.sleep(0.03)
        ids = torch.randint(300, self.model.config.vocab_size, (1, PROMPT_LEN), generator=self.gen)
        stamps: list[float] = []

        class Stamps:  # transformers' streamer protocol: put(prompt), put(token) per token, end()
            def put(self, value):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                streamer=Stamps(), pad_token_id=0)
        new = stamps[1:]  # (stamps[0]: the prompt)
        self.done = GEN  # (the next burst of steps starts a new sequence)
        return [(b - a) * 1e3 for a, b in zip(new, new[1:])], gbs

    def burst(self, n: int, probe: bool = True) -> tuple[list[float], list[float]]:
        from transformers import DynamicCache

        torch, model = self.torch, self.model
        steps, gbs = [], []
        with torch.inference_mode():
            for _ in range(n):
                if self.done == GEN:
                    self.cache = DynamicCache(config=model.config)
                    ids = torch.randint(300, model.config.vocab_size, (1, PROMPT_LEN), generator=self.gen)
                    out = model(ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
                    self.tok, self.done = out.logits[:, -1:].argmax(-1), 0
                t = time.perf_counter()
                out = model(self.tok, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
                steps.append((time.perf_counter() - t) * 1e3)
                self.tok = out.logits[:, -1:].argmax(-1)
                self.done += 1
                if probe:
                    gbs.append(self.probe.read(256 << 20))
                    time.sleep(0.03)
        return steps, gbs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stored.add_args(ap)
    ap.add_argument("--against", default="llamacpp", choices=("llamacpp", "transformers"))
    ap.add_argument("--gguf", type=Path, help="llama.cpp's weights (make_gguf.py); for --against llamacpp")
    ap.add_argument("--llamacpp-python", default="/work/venv-llamacpp/bin/python")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--burst", type=int, default=16, help="decode steps of one engine before the other's")
    ap.add_argument("--generate", action="store_true",
                    help="each burst one generation of --gen tokens by the engine's own loop (no probe between steps)")
    ap.add_argument("--gen", type=int, default=128, help="--generate's tokens a burst")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top-k", default="model",
                    help="hi_na_moe engines by HinaConfig.top_k, comma-separated: model, a whole number, adaptive:T[:on|off]")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    specs = args.top_k.split(",")
    if specs != ["model"] and args.generate:
        raise SystemExit("--top-k runs bursts of steps; it does not go with --generate")
    if args.against == "llamacpp":
        if args.gguf is None or not args.gguf.is_file():
            raise SystemExit(f"--gguf {args.gguf}: no such file (benchmarks/make_gguf.py writes it)")
        other, them = Llama(args.llamacpp_python, args.gguf, args.threads), "llama.cpp"
    else:
        if args.gguf is not None:
            raise SystemExit("--gguf is for --against llamacpp")
        other, them = Ours(args, native=True), "transformers"
    try:
        ours = Ours(args)
        engines = {("hi_na_moe" if s == "model" else f"hi_na_moe top_k={s}"): (OursTopK(ours, s) if specs != ["model"] else ours)
                   for s in specs}
        engines[them] = other
        ms = {e: [] for e in engines}
        gbs = {e: [] for e in engines}
        rounds = []  # per round: {engine: (median ms, median probe GB/s)}
        for r in range(args.rounds):
            order = list(engines)[r % len(engines):] + list(engines)[:r % len(engines)]
            order = order if r % 2 == 0 else order[::-1]
            this = {}
            for e in order:
                time.sleep(0.2)
                s, g = engines[e].generate(args.gen) if args.generate else engines[e].burst(args.burst)
                ms[e] += s
                gbs[e] += g
                this[e] = (statistics.median(s), statistics.median(g))
            rounds.append(this)
            print(f"# round {r + 1}: " + ", ".join(f"{e} {m:.2f} ms at {g:.1f} GB/s" for e, (m, g) in this.items()),
                  flush=True)
    finally:
        if isinstance(other, Llama):
            other.close()
    med = {e: statistics.median(ms[e]) for e in ms}
    probe = {e: statistics.median(gbs[e]) for e in gbs}
    ours_names = [e for e in engines if e != them]
    per_round = [x[them][0] / x[ours_names[0]][0] for x in rounds]
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ckpt": args.ckpt, "weights": args.weights,
           "against": them, "gguf": str(args.gguf) if args.gguf else None, "rounds": args.rounds, "burst": args.burst, "threads": args.threads,
           "generate": args.generate, "gen": args.gen if args.generate else None,
           "engines": {e: {"median_ms": med[e], "probe_gbs": probe[e], "tok_s": 1e3 / med[e],
                           "tok_s_per_probe_gbs": 1e3 / med[e] / probe[e], "step_ms": ms[e], "probe": gbs[e]}
                       for e in ms},
           "ratio_of_medians": med[them] / med[ours_names[0]],
           "top_k": {e: {"spec": engines[e].spec, "experts_per_token": engines[e].experts_per_token,
                         "ratio_of_medians": med[them] / med[e],
                         "median_round_ratio": statistics.median(x[them][0] / x[e][0] for x in rounds)}
                     for e in ours_names if isinstance(engines[e], OursTopK)},
           "round_ratios": per_round, "median_round_ratio": statistics.median(per_round)}
    print(f"{args.ckpt}, {args.weights} scope all against {args.gguf.name if args.gguf else them}, {args.threads} threads, {args.rounds} "
          + (f"rounds of one {args.gen}-token generation an engine (its own loop), alternating" if args.generate
             else f"rounds of {args.burst} steps an engine, alternating"))
    print("| engine | median ms a step | tok/s | paired probe GB/s | tok/s per probe GB/s |")
    print("|---|---|---|---|---|")
    for e in ms:
        x = res["engines"][e]
        print(f"| {e} | {x['median_ms']:.2f} | {x['tok_s']:.2f} | {x['probe_gbs']:.1f} | {x['tok_s_per_probe_gbs']:.3f} |")
    print(f"{ours_names[0]} / {them} decode speed: {res['ratio_of_medians']:.3f}x (medians of all steps), "
          f"{res['median_round_ratio']:.3f}x (median of the rounds' ratios: "
          f"{min(per_round):.3f}-{max(per_round):.3f}x)")
    if res["top_k"]:
        print("| engine | experts a token | median ms a step | / llama.cpp (medians) | median of the rounds' ratios |")
        print("|---|---|---|---|---|")
        for e, x in res["top_k"].items():
            ept = "-" if x["experts_per_token"] is None else f"{x['experts_per_token']:.3f}"
            print(f"| {e} | {ept} | {med[e]:.2f} | {x['ratio_of_medians']:.3f}x | {x['median_round_ratio']:.3f}x |")
    if args.json:
        at = record.host()
        recs = [record.make(e, ms[e], threads=args.threads, probe_gbs=gbs[e], tool="bench_interleaved.py", at=at,
                            model=Path(args.ckpt).name, weights=args.weights,
                            what="generate() token" if args.generate else "decode step") for e in ms]
        for e in res["engines"].values():
            e["step_ms"] = [round(v, 3) for v in e["step_ms"]]
            e["probe"] = [round(v, 2) for v in e["probe"]]
        record.write(args.json, res, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
