"""Serving load against any OpenAI-compatible server: `hi-na-moe serve` against llama.cpp's
llama-server (parallel slots, continuous batching), same weights, same requests.

    # the arms started and stopped by the script, interleaved in rounds (run it on a quiet machine)
    python benchmarks/bench_serve.py --arm hina-int4 --arm llamaserver-q4_0 --streams 1,4,16,64 \
        --requests 8 --prompt-len 128 --max-tokens 128 --rounds 3 --chrt --json out.json
    # a server that is already running (its slots at least the largest --streams)
    python benchmarks/bench_serve.py --url http://127.0.0.1:8080 --label mine --streams 4 --vocab-size 50304

Load: for each concurrency N of --streams, N streams each send --requests streaming
/v1/completions requests one after another (closed loop; or for --duration seconds, after which a
stream starts no new request). A request is `prompt` = --prompt-len token ids, `max_tokens` =
--max-tokens, `ignore_eos: true` (so every answer has the same length), temperature 0,
`stream: true` with `stream_options.include_usage`, and --body-extra's fields. To llama-server
also `cache_prompt: false` (its prefix reuse), to any other server `continuous_usage_stats` (a
running usage a chunk); hi-na-moe serve refuses fields it does not know, so a --url server is
taken for llama-server when GET /props answers as llama-server's does. Each request's prompt
is different (seeded random ids from the vocabulary's word tokens, the same for every arm of a
round), so no server can reuse a cached prefix; --same-prompt sends one prompt for all. Before
each timed run, one untimed request per stream (4 tokens, a prompt of its own) warms the server at
that concurrency.

Per request: TTFT = first token-bearing SSE chunk - request sent; the gaps between consecutive
token-bearing chunks are its inter-token latencies (ITL); TPOT = (last - first token chunk) /
(tokens - 1); tokens = the final `usage.completion_tokens` (the count of token chunks when the
server sends no usage). A token-bearing chunk is one whose choice has no finish_reason, or has
text. A server may pack several tokens into one chunk (llama-server holds back a token that ends
inside a UTF-8 character and sends it with the next); a chunk that carries a running
`usage.completion_tokens` counts as that many tokens and its gap as that many gaps of gap/k,
otherwise a chunk is one token: the `tok/chunk` column (usage tokens over token chunks) shows
when that is not so (then ITL overstates the gap between tokens, TPOT does not).
Per run: output tok/s = all requests' tokens / (last answer's end - first request sent); TTFT
and ITL p50/p99 over all requests and gaps of the run. The table gives medians over --rounds.

Arms (--arm, each started per round and concurrency with slots = N, on --threads threads, its log
in --log-dir; /health polled until 200, stopped with SIGTERM after the run):
  hina-int4, hina-bf16    hi-na-moe serve --model M [--tokenizer] --weights int4|lossless --scope all
                          --max-batch N (OMP_NUM_THREADS=--threads; hi_na_moe's own pool takes the
                          CPUs of its affinity mask: add --hina-arg for another count)
  hina-int4@chunkC        the same with --prefill-chunk C (arms of several chunk sizes side by side)
  llamaserver-<type>      llama-server -m <--gguf-pattern with type> -t T -tb T -np N -cb
                          -c N*ctx (ctx = prompt + max tokens + 8, rounded up to 256: each slot
                          has ctx) --cache-ram 0 (no host prompt cache) --no-webui
The arms of a round run in turn, their order rotated by round. The ratio table divides each hina
arm's median by its width's llama-server arm's (int4: q4_0, bf16: bf16), and gives the median of
the rounds' ratios (each round's pair met the same host phase).

What the arms do differently, by design: hi-na-moe serve prefills a new prompt --prefill-chunk
(64) tokens at a time between decode steps, llama-server a whole prompt in one batch (-b 2048,
-ub 512) while its running slots wait: that shows in TTFT and ITL p99. llama-server's slot context
is fixed at ctx, hi-na-moe serve's at the model's max_position_embeddings (--max-context).

--chrt puts this script under SCHED_FIFO priority 1 (root), so the servers it starts inherit it:
the client then waits for the server's threads no longer than they wait for each other (a client
at normal priority would starve behind a real-time server on 2 cores). The client shares the cores
with the server; its work is per chunk, so equal for arms that send equal chunks.

Paired read-bandwidth probe (as bench_full_model.py pairs one with each step; a server's steps
cannot be reached from outside): a 1 GiB hi_na_moe._native.BandwidthProbe on --threads threads,
three 256 MB reads with the server loaded and idle right before and right after each timed run;
the run's probe GB/s is their median (--no-probe: none).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lib import record
from lib.procstat import percentile

DEFAULT_LLAMA_SERVER = "/work/llama-server/build/bin/llama-server"
DEFAULT_HINA = str(record.REPO / ".venv" / "bin" / "hi-na-moe")
N_FIXED = 3 + 256  # synthetic_tokenizer.py's specials and byte tokens: prompts use the word tokens after them
PROBE_SETTLE_S = 0.03  # after a probe read: the probe's threads stop spinning before the server runs again
WIDTH = {"int4": "q4_0", "bf16": "bf16"}  # a hina arm's llama-server counterpart


@dataclass
class Req:
    sent: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of token-bearing chunks
    end: float = 0.0
    usage_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else sum(k for _, k in self.chunks)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--arm", action="append", default=[],
                    help="hina-int4, hina-bf16 or llamaserver-<gguf type> (repeat for several)")
    ap.add_argument("--url", help="a running server instead of --arm (its slots >= the largest --streams)")
    ap.add_argument("--label", default="server", help="--url: the arm's name in the table")
    ap.add_argument("--streams", default="1,4,16,64", help="concurrencies, comma-separated")
    ap.add_argument("--requests", type=int, default=8, help="requests a stream sends (unless --duration)")
    ap.add_argument("--duration", type=float, default=None, help="seconds a stream starts new requests for")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--body-extra", default="{}", help="JSON object of more fields for every request")
    ap.add_argument("--same-prompt", action="store_true", help="one prompt for every request (prefix caching wins)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="/work/ckpt/olmoe-1b-7b", help="hina arms' checkpoint; its vocab_size too")
    ap.add_argument("--tokenizer", default=None,
                    help="hina arms' tokenizer (default: <model>-tokenizer when it exists, see synthetic_tokenizer.py)")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: --model's config.json")
    ap.add_argument("--gguf-pattern", default="/work/ckpt/gguf/{name}-{type}.gguf",
                    help="llama-server arms' GGUF ({name}: --model's folder name)")
    ap.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER, help="llama-server binary (LLAMACPP.md)")
    ap.add_argument("--hina", default=DEFAULT_HINA, help="hi-na-moe command")
    ap.add_argument("--hina-arg", action="append", default=[], help="one more argument for hi-na-moe serve")
    ap.add_argument("--llama-arg", action="append", default=[], help="one more argument for llama-server")
    ap.add_argument("--chrt", action="store_true", help="run this script and the servers under SCHED_FIFO 1")
    ap.add_argument("--no-probe", action="store_true", help="no paired read-bandwidth probe")
    ap.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds a server may take to load")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--log-dir", default=None, help="servers' logs (default: a new temporary folder)")
    ap.add_argument("--json", default=None, help="write the runs and records here")
    args = ap.parse_args(argv)
    try:
        args.levels = [int(x) for x in args.streams.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--streams {args.streams!r}: expected comma-separated integers such as 1,4,16,64")
    if not args.levels or min(args.levels) < 1:
        ap.error(f"--streams {args.streams!r}: every concurrency must be >= 1")
    if bool(args.url) == bool(args.arm):
        ap.error("give either --url (a running server) or one or more --arm")
    for a in args.arm:
        base, sep, chunk = a.partition("@chunk")
        if not ((base in ("hina-int4", "hina-bf16") and (not sep or chunk.isdigit() and int(chunk) > 0))
                or (a.startswith("llamaserver-") and len(a) > 12)):
            ap.error(f"--arm {a!r}: expected hina-int4, hina-bf16 (either with @chunk<N>: --prefill-chunk N) or "
                     "llamaserver-<type> (llamaserver-q4_0)")
    if args.prompt_len < 1 or args.max_tokens < 1 or args.requests < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--prompt-len, --max-tokens, --requests, --rounds and --threads must be >= 1")
    try:
        args.body_extra = json.loads(args.body_extra)
    except ValueError:
        args.body_extra = None
    if not isinstance(args.body_extra, dict):
        ap.error(f"--body-extra {args.body_extra!r}: expected a JSON object such as '{{\"top_p\": 1.0}}'")
    if args.vocab_size is None:
        cfg = Path(args.model) / "config.json"
        try:
            c = json.loads(cfg.read_text())
            args.vocab_size = int(c.get("text_config", c)["vocab_size"])
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--vocab-size not given and {cfg} gives none ({e.__class__.__name__}: {e}): pass --vocab-size")
    if args.vocab_size <= N_FIXED:
        ap.error(f"--vocab-size {args.vocab_size}: prompts use ids from {N_FIXED} up, so it must exceed {N_FIXED}")
    if args.tokenizer is None and Path(str(Path(args.model)) + "-tokenizer").is_dir():
        args.tokenizer = str(Path(args.model)) + "-tokenizer"
    return args


# ---------------------------------------------------------------------------------------------
# load


def prompts(args, rnd: int, n_streams: int, n_req: int) -> list[list[list[int]]]:
    """prompts[stream][request]: the same for every arm of a round, different across requests."""
    rng = random.Random(f"{args.seed}/{rnd}/{n_streams}")
    if args.same_prompt:
        p = [rng.randrange(N_FIXED, args.vocab_size) for _ in range(args.prompt_len)]
        return [[p] * n_req for _ in range(n_streams)]
    return [[[rng.randrange(N_FIXED, args.vocab_size) for _ in range(args.prompt_len)] for _ in range(n_req)]
            for _ in range(n_streams)]


def body(args, prompt: list[int], max_tokens: int, model: str | None, extra: dict) -> dict:
    b = {"prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature, "ignore_eos": True,
         "stream": True, "stream_options": {"include_usage": True}, **extra}
    if model:
        b["model"] = model
    return b


async def one_request(client, url: str, payload: dict) -> Req:
    r = Req(sent=time.perf_counter())
    last_usage = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                r.error = f"HTTP {resp.status_code}: {text}"
                return r
            async for line in resp.aiter_lines():
                t = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (llama-server's pings)
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = f"server error: {json.dumps(chunk['error'])[:300]}"
                    return r
                usage = chunk.get("usage") or {}
                choices = chunk.get("choices") or []
                if choices:
                    c = choices[0]
                    if c.get("finish_reason") is None or c.get("text"):
                        k = 1
                        if usage.get("completion_tokens") is not None:  # a running count: the chunk's share
                            k = max(1, int(usage["completion_tokens"]) - last_usage)
                        r.chunks.append((t, k))
                if usage.get("completion_tokens") is not None:
                    last_usage = int(usage["completion_tokens"])
                    r.usage_tokens = last_usage
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        r.cached_tokens = int(details["cached_tokens"])
    except Exception as e:  # noqa: BLE001 - any transport failure is this request's error, reported in the table
        r.error = f"{e.__class__.__name__}: {e}"
    finally:
        r.end = time.perf_counter()
    if r.error is None and not r.chunks:
        r.error = "the stream carried no token"
    return r


async def run_load(args, url: str, n: int, rnd: int, model: str | None, extra: dict) -> dict:
    import httpx

    n_req = args.requests if args.duration is None else 10 ** 9
    ps = prompts(args, rnd, n, min(n_req, 256))  # --duration: a stream's 257th request reuses its first prompt
    warm_rng = random.Random(f"warm/{args.seed}/{rnd}/{n}")  # prompts of their own: no prefix for the timed ones
    warm_ps = [[warm_rng.randrange(N_FIXED, args.vocab_size) for _ in range(args.prompt_len)] for _ in range(n)]
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        warm = await asyncio.gather(*(one_request(client, url, body(args, warm_ps[s], 4, model, extra))
                                      for s in range(n)))
        bad = [w.error for w in warm if w.error]
        if bad:
            raise RuntimeError(f"warm-up request failed at {url}: {bad[0]}")
        reqs: list[Req] = []
        t0 = time.perf_counter()

        async def stream(s: int):
            i = 0
            while True:
                if args.duration is None and i >= args.requests:
                    return
                if args.duration is not None and time.perf_counter() - t0 >= args.duration:
                    return
                payload = body(args, ps[s][i % len(ps[s])], args.max_tokens, model, extra)
                reqs.append(await one_request(client, url, payload))
                i += 1

        await asyncio.gather(*(stream(s) for s in range(n)))
    return summarize(args, reqs, t0, n)


def summarize(args, reqs: list[Req], t0: float, n: int) -> dict:
    ok = [r for r in reqs if r.error is None]
    errors = [r.error for r in reqs if r.error is not None]
    short = [r.tokens for r in ok if r.tokens != args.max_tokens]
    wall = max((r.end for r in reqs), default=t0) - t0
    tokens = sum(r.tokens for r in ok)
    ttft = [(r.chunks[0][0] - r.sent) * 1e3 for r in ok]
    itl, tpot = [], []
    for r in ok:
        for (ta, _), (tb, k) in zip(r.chunks, r.chunks[1:]):
            itl += [(tb - ta) * 1e3 / k] * k
        if r.tokens > 1:
            tpot.append((r.chunks[-1][0] - r.chunks[0][0]) * 1e3 / (r.tokens - 1))
    n_chunks = sum(len(r.chunks) for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens]
    return {"streams": n, "requests": len(reqs), "errors": errors[:5], "n_errors": len(errors),
            "wrong_length": short[:5], "n_wrong_length": len(short), "cached_prompt_tokens": sum(cached),
            "no_usage": sum(r.usage_tokens is None for r in ok),
            "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall if wall > 0 else float("nan"),
            "ttft_ms": ttft, "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50), "tok_per_chunk": tokens / n_chunks if n_chunks else float("nan")}


# ---------------------------------------------------------------------------------------------
# servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_for(args, arm: str) -> Path:
    return Path(args.gguf_pattern.format(name=Path(args.model).name, type=arm.split("-", 1)[1]))


def server_cmd(args, arm: str, n: int, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if arm.startswith("hina-"):
        base, _, chunk = arm.partition("@chunk")
        # hina-bf16: the lossless format, the bf16 weights bit for bit
        weights = {"bf16": "lossless"}.get(base.split("-", 1)[1], base.split("-", 1)[1])
        cmd = [args.hina, "serve", "--model", args.model, "--weights", weights, "--scope", "all",
               "--max-batch", str(n), "--host", "127.0.0.1", "--port", str(port)]
        if chunk:
            cmd += ["--prefill-chunk", chunk]
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
        env["OMP_NUM_THREADS"] = str(args.threads)
        return cmd + args.hina_arg, env
    ctx = -(-(args.prompt_len + args.max_tokens + 8) // 256) * 256  # + a few: llama-server stops one short of a full slot
    cmd = [args.llama_server, "-m", str(gguf_for(args, arm)), "-t", str(args.threads), "-tb", str(args.threads),
           "-np", str(n), "-cb", "-c", str(n * ctx), "--cache-ram", "0", "--no-webui",
           "--host", "127.0.0.1", "--port", str(port)]
    return cmd + args.llama_arg, env


def check_arms(args) -> None:
    for a in args.arm:
        if a.startswith("hina-"):
            if not Path(args.hina).is_file():
                raise SystemExit(f"--arm {a}: no hi-na-moe command at {args.hina} (--hina)")
            if not (Path(args.model) / "config.json").is_file():
                raise SystemExit(f"--arm {a}: --model {args.model} has no config.json")
        else:
            if not Path(args.llama_server).is_file():
                raise SystemExit(f"--arm {a}: no llama-server at {args.llama_server}: build it (benchmarks/LLAMACPP.md) "
                                 "or pass --llama-server")
            if not gguf_for(args, a).is_file():
                raise SystemExit(f"--arm {a}: no GGUF file {gguf_for(args, a)} (--gguf-pattern; LLAMACPP.md makes them)")


class Server:
    """One arm's server process for one run: started, waited for, stopped by its own pid."""

    def __init__(self, args, arm: str, n: int, log_dir: Path, tag: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd, env = server_cmd(args, arm, n, self.port)
        self.cmd = cmd
        self.log_path = log_dir / f"{tag}.log"
        self.log = open(self.log_path, "w")
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)
        self.timeout = args.startup_timeout

    def tail(self, n: int = 15) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_healthy(self) -> float:
        import httpx

        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before /health said 200 "
                                   f"({self.log_path}):\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.timeout:
                raise RuntimeError(f"server not healthy after {self.timeout:.0f} s (--startup-timeout; "
                                   f"{self.log_path}):\n{self.tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def is_llama_server(url: str) -> bool:
    """Whether `url` answers GET /props as llama-server does."""
    import httpx

    try:
        r = httpx.get(url + "/props", timeout=10.0)
        return r.status_code == 200 and "default_generation_settings" in r.json()
    except (httpx.HTTPError, ValueError, TypeError):
        return False


def served_model(url: str) -> str | None:
    """The first id of GET /v1/models (sent as `model`), None when the server lists none."""
    import httpx

    try:
        data = httpx.get(url + "/v1/models", timeout=10.0).json().get("data") or []
        return data[0].get("id") if data else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------
# probe and report


class Probe:
    def __init__(self, threads: int):
        from hi_na_moe import _native

        self.p = _native.BandwidthProbe(1 << 30, threads)

    def read(self, k: int = 3) -> list[float]:
        out = []
        for _ in range(k):
            out.append(self.p.read(256 << 20))
            time.sleep(PROBE_SETTLE_S)
        return out


def med(xs):
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else float("nan")


def div(a, b):
    return a / b if b else float("nan")


def fmt(x, nd=1):
    return "-" if x is None or x != x else f"{x:.{nd}f}"


def table(args, runs: list[dict], arms: list[str]) -> str:
    lines = ["| streams | arm | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | TPOT p50 ms "
             "| tok/chunk | probe GB/s | rounds | failed |", "|" + "---|" * 12]
    for n in args.levels:
        for a in arms:
            rs = [r for r in runs if r["arm"] == a and r["streams"] == n]
            if not rs:
                continue
            bad = sum(r["n_errors"] + r["n_wrong_length"] for r in rs)
            lines.append(f"| {n} | {a} | {fmt(med(r['tok_s'] for r in rs))} | {fmt(med(r['ttft_p50_ms'] for r in rs))} "
                         f"| {fmt(med(r['ttft_p99_ms'] for r in rs))} | {fmt(med(r['itl_p50_ms'] for r in rs), 2)} "
                         f"| {fmt(med(r['itl_p99_ms'] for r in rs), 2)} | {fmt(med(r['tpot_p50_ms'] for r in rs), 2)} "
                         f"| {fmt(med(r['tok_per_chunk'] for r in rs), 2)} | {fmt(med(r['probe_gbs'] for r in rs))} "
                         f"| {len(rs)} | {bad} |")
    pairs = [(a, "llamaserver-" + WIDTH[a.split("-", 1)[1]]) for a in arms
             if a.startswith("hina-") and a.split("-", 1)[1] in WIDTH]
    pairs = [(h, l) for h, l in pairs if l in arms]
    if pairs:
        lines += ["", "| streams | hina / llama-server | tok/s: ratio of medians | tok/s: median of rounds' ratios "
                  "| TTFT p50: ratio | ITL p50: ratio |", "|" + "---|" * 6]
        for n in args.levels:
            for h, l in pairs:
                hr = {r["round"]: r for r in runs if r["arm"] == h and r["streams"] == n}
                lr = {r["round"]: r for r in runs if r["arm"] == l and r["streams"] == n}
                both = sorted(set(hr) & set(lr))
                if not both:
                    continue

                def ratio(key):
                    return div(med(hr[k][key] for k in both), med(lr[k][key] for k in both))

                per_round = med(div(hr[k]["tok_s"], lr[k]["tok_s"]) for k in both)
                lines.append(f"| {n} | {h} / {l} | {fmt(ratio('tok_s'), 3)} | {fmt(per_round, 3)} "
                             f"| {fmt(ratio('ttft_p50_ms'), 3)} | {fmt(ratio('itl_p50_ms'), 3)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.arm:
        check_arms(args)
    if args.chrt:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        except (PermissionError, OSError) as e:
            raise SystemExit(f"--chrt: cannot take SCHED_FIFO priority 1 ({e}); run as root or drop --chrt")
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise SystemExit("bench_serve.py needs httpx: pip install httpx (the project venv has it)")
    probe, probe_note = None, "--no-probe"
    if not args.no_probe:
        try:
            probe, probe_note = Probe(args.threads), "1 GiB BandwidthProbe, 3 x 256 MB before and after each run"
        except Exception as e:  # noqa: BLE001 - the table says why it has no probe column
            probe_note = f"no probe: hi_na_moe._native unavailable ({e.__class__.__name__}: {e})"
    host = record.host()
    policy = {os.SCHED_OTHER: "normal", os.SCHED_FIFO: "FIFO"}.get(os.sched_getscheduler(0), "other")
    prio = os.sched_getparam(0).sched_priority
    head = {**host, "tool": "bench_serve.py", "threads": args.threads, "streams": args.levels,
            "requests_per_stream": args.requests, "duration_s": args.duration, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "temperature": args.temperature, "same_prompt": args.same_prompt,
            "rounds": args.rounds, "seed": args.seed, "sched": f"{policy} {prio}", "probe": probe_note,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "loadavg_1m_start": os.getloadavg()[0],
            "model": args.model, "tokenizer": args.tokenizer, "vocab_size": args.vocab_size}
    arms = args.arm or [args.label]
    print(f"# bench_serve.py | {host['date']} UTC | commit {host['commit']} | {host['cpu_model']}")
    print(f"# {args.threads} threads | prompt {args.prompt_len} tokens, {args.max_tokens} out (ignore_eos) | "
          f"{'duration ' + str(args.duration) + ' s' if args.duration else str(args.requests) + ' requests'} a stream | "
          f"sched {policy} {prio} | OMP_WAIT_POLICY={head['omp_wait_policy'] or 'unset'} | "
          f"loadavg {head['loadavg_1m_start']:.2f} | {probe_note}")
    log_dir = None
    if args.arm:
        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_serve-"))
        log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for n in args.levels:
            order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
            for arm in order:
                server = None
                try:
                    url, load_s = args.url, None
                    if args.arm:
                        server = Server(args, arm, n, log_dir, f"{arm}-n{n}-r{rnd}")
                        load_s = server.wait_healthy()
                        url = server.url
                    model = served_model(url)
                    llama = arm.startswith("llamaserver-") if args.arm else is_llama_server(url)
                    # llama-server: no prefix reuse; others: a running usage a chunk (vLLM's continuous_usage_stats,
                    # hi-na-moe serve accepts the key) lets a packed chunk count its tokens
                    extra = {"cache_prompt": False} if llama else \
                        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
                    extra.update(args.body_extra)
                    before = probe.read() if probe else []
                    res = asyncio.run(run_load(args, url, n, rnd, model, extra))
                    after = probe.read() if probe else []
                except RuntimeError as e:  # a server that did not start or answer: say which, keep what ran
                    if runs:
                        print(table(args, runs, arms))
                    raise SystemExit(f"{arm}, {n} streams, round {rnd}: {e}")
                finally:
                    if server is not None:
                        server.stop()
                res.update(arm=arm, round=rnd, load_s=load_s, probe_gbs=med(before + after) if probe else None,
                           probe_reads=before + after, cmd=server.cmd if server else None)
                runs.append(res)
                flag = "" if not (res["n_errors"] or res["n_wrong_length"]) else \
                    f" | FAILED {res['n_errors']} errors {res['errors'][:1]}, {res['n_wrong_length']} of wrong length"
                print(f"round {rnd} streams {n:>3} {arm:<20} {res['tok_s']:8.1f} tok/s  TTFT p50 "
                      f"{res['ttft_p50_ms']:8.1f} ms  ITL p50 {res['itl_p50_ms']:7.2f} ms  tok/chunk "
                      f"{res['tok_per_chunk']:.2f}" + (f"  load {load_s:.1f} s" if load_s is not None else "") + flag,
                      flush=True)
                if res["cached_prompt_tokens"]:
                    print(f"  note: the server reused {res['cached_prompt_tokens']} cached prompt tokens", flush=True)
    print()
    print(table(args, runs, arms))
    if log_dir is not None:
        print(f"\nservers' logs: {log_dir}")
    if args.json:
        recs = []
        for n in args.levels:
            for a in arms:
                rs = [r for r in runs if r["arm"] == a and r["streams"] == n]
                if rs:
                    recs.append(record.make(a, [r["tok_s"] for r in rs], threads=args.threads, unit="tok/s",
                                            probe_gbs=[r["probe_gbs"] for r in rs if r["probe_gbs"] is not None],
                                            tool="bench_serve.py", at=host, streams=n,
                                            ttft_p50_ms=med(r["ttft_p50_ms"] for r in rs),
                                            itl_p50_ms=med(r["itl_p50_ms"] for r in rs)))
        for r in runs:
            r["ttft_ms"] = [round(x, 3) for x in r["ttft_ms"]]
        record.write(args.json, {**head, "runs": runs}, recs)
        print(f"wrote {args.json}")
    failed = sum(r["n_errors"] + r["n_wrong_length"] for r in runs)
    if failed:
        print(f"{failed} requests failed or came back with other than --max-tokens tokens (see FAILED above)",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
