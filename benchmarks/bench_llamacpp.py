"""Time llama.cpp (through llama-cpp-python) on a GGUF file: decode, prefill-512, memory.

The llama.cpp arm of the end-to-end comparison: the GGUF comes from the same checkpoint the
transformers/hi_na_moe runs load (benchmarks/make_checkpoint.py -> benchmarks/make_gguf.py).
Runs in the llama.cpp venv (benchmarks/requirements-llamacpp.txt).

    python benchmarks/bench_llamacpp.py /work/ckpt/gguf/olmoe-1b-7b-q4_0.gguf --repeats 3 --json

What is measured (all on one llama_context: n_threads = n_threads_batch = --threads,
n_ctx 1024, n_batch = n_ubatch = 512, weights memory-mapped unless --no-mmap, flash attention
off unless --flash-attn (llama-cpp-python's default), llama.cpp's CPU weight repacking as built,
i.e. on):
- load: wall time of `Llama(...)` (file mapping, repacking, context creation).
- warm-up (not timed): one prefill of --prompt-warmup tokens and 4 decode steps, so that the
  weights' pages are resident and the thread pool is up before anything is timed.
- tg (decode), per repeat: the KV cache is cleared, a --prompt-len (16) token prompt is
  evaluated (not part of tg; its time is reported as `prompt_ms`), then --gen (128) tokens are
  generated greedily, one llama_decode of one token per step. A step's time is the wall time
  of that llama_decode call; the greedy pick (argmax over the last-token logits, read from
  llama.cpp's logits buffer) happens outside it. tokens/s = gen / sum(step times). Reported:
  tokens/s, median and p90 ms/step, all step times in the JSON.
- pp (prefill), per repeat: the KV cache is cleared and --prefill (512) tokens are evaluated
  as one batch; reported as ms and tokens/s.
- memory: peak RSS of this process (getrusage ru_maxrss: includes mapped weight pages that
  were touched), and RSS after load split into anonymous and file-backed pages
  (/proc/self/status).
Prompts are random token ids (seeded; ids above the synthetic vocabulary's special and byte
tokens): with random weights there is no meaningful text, and the work per token does not
depend on the ids. Every step's logits are checked to be finite, so a broken build or file
fails instead of timing garbage. Repeats report the median over repeats, with every sample
kept in the JSON.

Check the build (no AMX: ggml's AMX path died with SIGILL here): the JSON's `system_info` must
not list AMX_INT8; `llama_cpp.llama_print_system_info()` prints the same string.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from lib.procstat import percentile, proc_status


def rss_breakdown() -> dict:
    fields = proc_status()
    return {
        "rss_bytes": fields.get("VmRSS"),
        "rss_anon_bytes": fields.get("RssAnon"),
        "rss_file_bytes": fields.get("RssFile"),
    }


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class Runner:
    """Thin wrapper over one llama_context: clear, evaluate, read last logits."""

    def __init__(self, llm, llama_cpp):
        self.llm = llm
        self.lc = llama_cpp
        self.n_vocab = llm.n_vocab()

    def clear(self) -> None:
        self.llm.reset()  # n_tokens = 0; the next eval removes every cached position

    def eval(self, tokens: list[int]) -> float:
        t0 = time.perf_counter()
        self.llm.eval(tokens)
        return time.perf_counter() - t0

    def last_logits(self) -> np.ndarray:
        ptr = self.lc.llama_get_logits_ith(self.llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        if not np.isfinite(logits).all():
            raise RuntimeError("non-finite logits")
        return logits

    def decode(self, prompt: list[int], n_gen: int, after_step=None) -> tuple[float, list[float], list[int], int]:
        """(prompt seconds, step seconds, tokens, major page faults (reads from disk) during the steps).
        after_step: called after each step, untimed (the paired probe)."""
        self.clear()
        prompt_s = self.eval(prompt)
        tok = int(np.argmax(self.last_logits()))
        steps, out = [], []
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        for _ in range(n_gen):
            steps.append(self.eval([tok]))
            out.append(tok)
            tok = int(np.argmax(self.last_logits()))
            if after_step is not None:
                after_step()
        return prompt_s, steps, out, resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0

    def prefill(self, tokens: list[int]) -> float:
        self.clear()
        t = self.eval(tokens)
        self.last_logits()
        return t


class Batched:
    """Several sequences decoded together, one token of each a llama_decode (what llama.cpp's
    server does for concurrent requests), on a second llama_context of the same model: the main
    context's parameters with n_seq_max sequences sharing one KV cache (kv_unified), through
    llama.cpp's batch API (llama-cpp-python's Llama decodes one sequence)."""

    def __init__(self, llm, llama_cpp, n_seq_max: int, n_ctx: int):
        lc = self.lc = llama_cpp
        params = type(llm.context_params).from_buffer_copy(llm.context_params)
        params.n_seq_max, params.kv_unified, params.n_ctx = n_seq_max, True, n_ctx
        self.ctx = lc.llama_init_from_model(llm._model.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed for {n_seq_max} sequences, n_ctx {n_ctx}")
        self.n_vocab = llm.n_vocab()
        self.cap = max(n_seq_max, int(params.n_batch))
        self.batch = lc.llama_batch_init(self.cap, 0, n_seq_max)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> float:
        """One llama_decode of (token, position, sequence, wants logits) items: seconds."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        t0 = time.perf_counter()
        rc = self.lc.llama_decode(self.ctx, b)
        t = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return t

    def _argmax(self, i: int) -> int:
        logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        if not np.isfinite(logits).all():
            raise RuntimeError("non-finite logits")
        return int(np.argmax(logits))

    def decode(self, prompts: list[list[int]], steps: int) -> list[float]:
        """A fresh KV cache, every prompt evaluated (untimed, in batches of at most n_batch
        tokens), then `steps` steps of one greedy token a sequence: each step's seconds."""
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        items = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        last = {}
        for c in range(0, len(items), self.cap):
            chunk = items[c:c + self.cap]
            self._decode(chunk)
            for i, (_, _, seq, out) in enumerate(chunk):
                if out:
                    last[seq] = self._argmax(i)
        toks = [last[s] for s in range(len(prompts))]
        times = []
        for k in range(steps):
            times.append(self._decode([(toks[s], len(p) + k, s, True) for s, p in enumerate(prompts)]))
            toks = [self._argmax(s) for s in range(len(prompts))]
        return times


def generate_tokens(run: Runner, prompt: list[int], n: int) -> list[float]:
    """llama-cpp-python's own generation loop (Llama.generate, greedy: temp 0) for n tokens after
    `prompt`: the ms between consecutive tokens (n - 1 of them; each one llama_decode and the
    loop's sampling and bookkeeping), as a user of its generator gets them."""
    stamps = []
    for i, _ in enumerate(run.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True)):
        stamps.append(time.perf_counter())
        if i + 1 == n:
            break
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]


def serve(run: Runner, ids, prompt_len: int, gen: int, after_step, probe_gbs: list[float], probe_read,
          batched: Batched | None = None) -> int:
    """--serve: decode steps in bursts on command (bench_interleaved.py), the sequence restarted
    with a new prompt every `gen` steps ("steps N"); or "generate N": one paired-probe read,
    then Llama.generate of N tokens on a new prompt (generate_tokens); or "batch B N" (with
    --batched): B new prompts decoded together for N steps (Batched.decode), then one paired-probe
    read (bench_batch_decode.py)."""
    print(json.dumps({"ready": True}), flush=True)
    done, tok = gen, None  # (a new sequence at the first burst)
    for line in sys.stdin:
        cmd = line.split()
        if cmd == ["quit"]:
            break
        if len(cmd) == 3 and cmd[0] == "batch" and cmd[1].isdigit() and cmd[2].isdigit() and batched is not None:
            steps = batched.decode([ids(prompt_len) for _ in range(int(cmd[1]))], int(cmd[2]))
            gbs = probe_read()
            print(json.dumps({"step_ms": [round(x * 1e3, 4) for x in steps], "probe_gbs": [gbs]}), flush=True)
            continue
        if len(cmd) == 2 and cmd[0] == "generate" and cmd[1].isdigit():
            gbs = probe_read()
            run.clear()
            steps = generate_tokens(run, ids(prompt_len), int(cmd[1]))
            done = gen  # (the next "steps" burst starts a new sequence)
            print(json.dumps({"step_ms": [round(x, 4) for x in steps], "probe_gbs": [gbs]}), flush=True)
            continue
        if len(cmd) != 2 or cmd[0] != "steps" or not cmd[1].isdigit():
            print(json.dumps({"error": f"unknown command {line.strip()!r}"}), flush=True)
            continue
        steps, n0 = [], len(probe_gbs)
        for _ in range(int(cmd[1])):
            if done == gen:
                run.clear()
                run.eval(ids(prompt_len))
                tok, done = int(np.argmax(run.last_logits())), 0
            steps.append(run.eval([tok]) * 1e3)
            tok = int(np.argmax(run.last_logits()))
            done += 1
            after_step()
        print(json.dumps({"step_ms": [round(x, 4) for x in steps], "probe_gbs": probe_gbs[n0:]}), flush=True)
    return 0


PROBE_BYTES = 1 << 30  # the paired probe's buffer, as bench_full_model.py's
PROBE_READ = 256 << 20
PROBE_SETTLE_S = 0.03


def load_native(path: str):
    """hi_na_moe's compiled extension from its file, without the package (and torch) around it:
    its BandwidthProbe is the torch arms' paired probe."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hi_na_moe._native", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--paired-probe-native {path}: not a loadable extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--prompt-warmup", type=int, default=512, help="tokens of the untimed warm-up prefill (0: no warm-up)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-mmap", action="store_true", help="read the weights into anonymous memory at load")
    ap.add_argument("--flash-attn", action="store_true", help="flash_attn=True (llama-cpp-python's default: False)")
    ap.add_argument("--paired-probe-native", metavar="PATH",
                    help="hi_na_moe's _native extension file: after every timed decode step, untimed, a 256 MB "
                         "read of a 1 GiB buffer with its BandwidthProbe (bench_full_model.py's paired probe)")
    ap.add_argument("--serve", action="store_true",
                    help="after the warm-up, take commands on stdin, one a line, and answer each with one JSON "
                         "line on stdout: 'steps N' decodes N steps of the current sequence (a new --prompt-len "
                         "prompt, untimed, once --gen steps were decoded), each followed by the paired probe's "
                         "read (needs --paired-probe-native): {\"step_ms\": [...], \"probe_gbs\": [...]}; 'quit' "
                         "ends (bench_interleaved.py drives it)")
    ap.add_argument("--batched", type=int, default=0, metavar="N",
                    help="with --serve: a second context for up to N sequences decoded together ('batch B N')")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--verbose", action="store_true", help="let llama.cpp log")
    args = ap.parse_args(argv)
    if args.prompt_len + args.gen > args.n_ctx or args.prefill > args.n_ctx or args.prompt_warmup > args.n_ctx:
        ap.error("prompt-len + gen, prefill and prompt-warmup must each fit in n-ctx")

    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(args.gguf),
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=args.n_ctx,
        n_batch=512,
        n_ubatch=512,
        use_mmap=not args.no_mmap,
        flash_attn=args.flash_attn,
        logits_all=False,
        verbose=args.verbose,
    )
    load_s = time.perf_counter() - t0
    mem_after_load = rss_breakdown()
    run = Runner(llm, llama_cpp)

    rng = np.random.default_rng(args.seed)
    lo = 259 if run.n_vocab > 1000 else 0  # past <unk>, <s>, </s> and the 256 byte tokens

    def ids(n: int) -> list[int]:
        return [int(x) for x in rng.integers(lo, run.n_vocab, size=n)]

    if args.prompt_warmup:
        run.prefill(ids(args.prompt_warmup))
        run.decode(ids(args.prompt_len), 4)

    probe, probe_gbs, peak_before_probe, pool = None, [], None, None
    if args.paired_probe_native:
        native = load_native(args.paired_probe_native)
        peak_before_probe = peak_rss_bytes()
        probe = native.BandwidthProbe(PROBE_BYTES, args.threads)
        pool = native.pool_backend(None)  # llama.cpp's libgomp is loaded: the probe runs on its team

    def after_step() -> None:
        probe_gbs.append(probe.read(PROBE_READ))
        time.sleep(PROBE_SETTLE_S)

    if args.serve:
        if probe is None:
            ap.error("--serve needs --paired-probe-native")
        def probe_read() -> float:
            g = probe.read(PROBE_READ)
            time.sleep(PROBE_SETTLE_S)
            return g

        batched = None
        if args.batched:
            batched = Batched(llm, llama_cpp, args.batched, args.batched * (args.prompt_len + args.gen))
            batched.decode([ids(args.prompt_len) for _ in range(args.batched)], 2)  # warm-up
        return serve(run, ids, args.prompt_len, args.gen, after_step, probe_gbs, probe_read, batched)

    tg, pp = [], []
    for _ in range(args.repeats):
        n0 = len(probe_gbs)
        prompt_s, steps, out, faults = run.decode(ids(args.prompt_len), args.gen,
                                                  after_step if probe is not None else None)
        ms = [s * 1e3 for s in steps]
        tg.append({
            "tokens_per_s": len(steps) / sum(steps),
            "median_ms": statistics.median(ms),
            "p90_ms": percentile(ms, 90),
            "prompt_ms": prompt_s * 1e3,
            "distinct_tokens": len(set(out)),
            "major_faults": faults,
            "step_ms": [round(x, 3) for x in ms],
        })
        if probe is not None:
            tg[-1]["probe_gbs"] = [round(g, 2) for g in probe_gbs[n0:]]
        pp_s = run.prefill(ids(args.prefill))
        pp.append({"ms": pp_s * 1e3, "tokens_per_s": args.prefill / pp_s})

    meta = llm.metadata
    ftype = meta.get("general.file_type")
    result = {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "gguf": str(args.gguf),
        "gguf_bytes": args.gguf.stat().st_size,
        "architecture": meta.get("general.architecture"),
        "file_type": int(ftype) if ftype is not None else None,
        "n_vocab": run.n_vocab,
        "threads": args.threads,
        "n_ctx": args.n_ctx,
        "mmap": not args.no_mmap,
        "flash_attn": args.flash_attn,
        "repeats": args.repeats,
        "load_s": load_s,
        f"tg{args.gen}": {
            "prompt_len": args.prompt_len,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in tg),
            "median_ms": statistics.median(r["median_ms"] for r in tg),
            "p90_ms": statistics.median(r["p90_ms"] for r in tg),
            "runs": tg,
        },
        f"pp{args.prefill}": {
            "ms": statistics.median(r["ms"] for r in pp),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in pp),
            "runs": pp,
        },
        "memory": {"after_load": mem_after_load, "peak_rss_bytes": peak_rss_bytes()},
        "paired_probe": None if probe is None else {"pool_backend": pool, "median_gbs": statistics.median(probe_gbs)},
        "host": {"cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]},
    }
    if peak_before_probe is not None:  # the probe's buffer left out, as bench_full_model.py does
        hwm = result["memory"]["peak_rss_bytes"]
        result["memory"]["peak_rss_with_probe_bytes"] = hwm
        result["memory"]["peak_rss_bytes"] = max(peak_before_probe, hwm - PROBE_BYTES)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        g, p = result[f"tg{args.gen}"], result[f"pp{args.prefill}"]
        gib = 1 << 30
        print("| file | test | t/s | median ms | p90 ms |")
        print("|---|---|---|---|---|")
        print(f"| {args.gguf.name} | tg{args.gen} | {g['tokens_per_s']:.2f} | {g['median_ms']:.1f} | {g['p90_ms']:.1f} |")
        print(f"| {args.gguf.name} | pp{args.prefill} | {p['tokens_per_s']:.1f} | {p['ms']:.0f} | |")
        print(
            f"load {load_s:.1f} s; RSS after load {mem_after_load['rss_bytes'] / gib:.2f} GiB "
            f"(anon {mem_after_load['rss_anon_bytes'] / gib:.2f}), peak {result['memory']['peak_rss_bytes'] / gib:.2f} GiB; "
            f"{args.threads} threads, {args.repeats} repeat(s), loadavg {result['host']['loadavg_1m']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
