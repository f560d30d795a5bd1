"""A bounded soak of `hi-na-moe serve`: many requests mixed with disconnects, oversized and
malformed ones; checks that nothing crashes, no response is lost or mixed up, and the server's
memory stays flat after warm-up.

    .venv/bin/python benchmarks/soak_serve.py [--requests 10000] [--concurrency 32] [--max-batch 16]
        [--model builtin] [--weights lossless] [--url http://127.0.0.1:PORT --pid PID]

Without --url it starts the server itself (the shipped model unless --model). Each request is one of:
- ok: a greedy completion of one of --prompts fixed prompts (streaming or not, at random), whose
  text must equal what that prompt gave alone before the soak (so a response given to the wrong
  request, or cut short, is caught);
- disconnect: a long streaming request closed after its first chunk (the server frees its row);
- oversized: a body larger than the server's limit (413);
- malformed: a body that is not JSON (400);
- bad-field: an unknown field or a max_tokens out of range (400 naming the field);
- long-prompt: more prompt tokens than the server takes (400).
The server's resident memory (VmRSS) is read every --rss-every requests while the load runs, and
once more when the server is idle at the end. "Flat" is judged on a least-squares line through the
readings after the first tenth of the requests (the warm-up): the growth that line gives over the
rest of the run must be within --rss-slack-mb. It prints the slope (KB a request, with its standard
error) and the readings' range.

Why a fitted line, not the last reading less one early one: RSS under this load is noisy, and is
not the memory in use. glibc's malloc raises its mmap threshold to the size of any mmapped block
freed (up to 32 MiB), so afterwards the large blocks (activations, the batch's KV rows and their
join/leave copies, request bodies) come from the arenas, and what they free is kept there for
reuse: RSS counts those kept pages, moves with the load's peaks and creeps up as more of them get
touched, towards the arenas' size. Measured on 2026-12-07 (the serve code of 2cac6c6, the shipped
model, 32 clients, passes of 1,000 or 2,000 soak requests, the server in-process with glibc's
mallinfo2 and gc read while idle between passes; benchmarks/log/serving.md, the soak section):
with 1 OpenMP thread, over 8,265 engine requests the heap in use stayed at 133.1-133.3 MB and the
Python objects at 391,074-391,077, while RSS moved between 484 and 530 MB with the arenas' free
bytes (97-178 MB); malloc_trim(0) brought it to 434-457 MB; with MALLOC_MMAP_THRESHOLD_=131072
(a fixed threshold) idle RSS was 420.5 MB after every pass. With 2 OpenMP threads the arenas
stopped growing by 4,862 engine requests (297.9 MB mapped, 164 MB of it free when idle, 133.7 MB
in use) while RSS still crept from 533 to 544 MB by 8,112. So a 10,000-request run at glibc's
defaults can show RSS growth beyond the slack that is not memory in use: --malloc-mmap-threshold
131072 runs the server with the fixed threshold, where RSS follows what is in use and a leak of
ours still shows. (The earlier judgement, two single readings 9,000 requests apart, read this as
2.8 KB a request.)

Exit status 1 when any check fails. Prints a markdown summary (date, commit, CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"ok": 0.70, "disconnect": 0.10, "oversized": 0.05, "malformed": 0.05, "bad-field": 0.05, "long-prompt": 0.05}
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "to", "school", "with", "her", "dog",
         "once", "upon", "time", "little", "house", "morning", "went", "saw", "big", "tree")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def text_of(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, stream: bool) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    parts = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                if "error" in obj:
                    raise RuntimeError(obj["error"]["message"])
                parts.extend(c["text"] for c in obj["choices"])
    return "".join(parts)


async def soak(args, url: str, pid: int | None) -> int:
    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(args.prompts)]
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        expected = {p: await text_of(client, url, p, args.max_tokens, False) for p in prompts}  # each alone
        counts, failures = Counter(), []
        rss: list[tuple[int, float]] = []
        done = 0
        kinds = list(KINDS)
        weights = [KINDS[k] for k in kinds]
        t0 = time.monotonic()

        async def one(i: int) -> None:
            kind = rng.choices(kinds, weights)[0]
            try:
                if kind == "ok":
                    p = rng.choice(prompts)
                    got = await text_of(client, url, p, args.max_tokens, rng.random() < 0.5)
                    if got != expected[p]:
                        failures.append(f"request {i}: mixed up or cut: {p!r} gave {got!r}, alone {expected[p]!r}")
                elif kind == "disconnect":
                    body = {"prompt": rng.choice(prompts), "max_tokens": 200, "stream": True, "ignore_eos": True}
                    async with client.stream("POST", url + "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            break  # close after the first line
                elif kind == "oversized":
                    r = await client.post(url + "/v1/completions", content=b'{"prompt": "' + b"x" * args.oversize + b'"}',
                                          headers={"content-type": "application/json"})
                    if r.status_code != 413:
                        failures.append(f"request {i}: oversized body answered {r.status_code}")
                elif kind == "malformed":
                    r = await client.post(url + "/v1/completions", content=b'{"prompt": "unterminated',
                                          headers={"content-type": "application/json"})
                    if r.status_code != 400 or "not valid JSON" not in r.json()["error"]["message"]:
                        failures.append(f"request {i}: malformed JSON answered {r.status_code} {r.text[:200]}")
                elif kind == "bad-field":
                    field, body = rng.choice([("frobnicate", {"prompt": "x", "frobnicate": 1}),
                                              ("max_tokens", {"prompt": "x", "max_tokens": -5})])
                    r = await client.post(url + "/v1/completions", json=body)
                    if r.status_code != 400 or r.json()["error"]["param"] != field:
                        failures.append(f"request {i}: bad {field} answered {r.status_code} {r.text[:200]}")
                elif kind == "long-prompt":
                    r = await client.post(url + "/v1/completions", json={"prompt": [5] * args.long_prompt})
                    if r.status_code != 400 or r.json()["error"]["param"] != "prompt":
                        failures.append(f"request {i}: long prompt answered {r.status_code} {r.text[:200]}")
            except Exception as exc:  # a transport error, a 5xx: counted as a failure, the soak goes on
                failures.append(f"request {i} ({kind}): {type(exc).__name__}: {exc}")
            counts[kind] += 1

        queue: asyncio.Queue = asyncio.Queue()
        for i in range(args.requests):
            queue.put_nowait(i)

        async def worker() -> None:
            nonlocal done
            while not queue.empty():
                i = queue.get_nowait()
                await one(i)
                done += 1
                if pid is not None and done % args.rss_every == 0:
                    rss.append((done, rss_mb(pid)))
                if done % 1000 == 0:
                    print(f"  {done} requests, {len(failures)} failures, {time.monotonic() - t0:.0f} s", flush=True)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - t0
        # the server afterwards: healthy, nothing left running
        await asyncio.sleep(2.0)
        health = (await client.get(url + "/health")).json()
        metrics = (await client.get(url + "/metrics")).text
    gauges = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line.startswith(("hina_moe_batch_size", "hina_moe_queue_depth", "hina_moe_prefilling"))}
    if health.get("status") != "ok":
        failures.append(f"/health after the soak: {health}")
    if any(gauges.values()):
        failures.append(f"rows left after the soak: {gauges}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"\n## soak_serve: {args.requests} requests, {args.concurrency} concurrent "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, {cpu_model()})\n")
    print("| kind | requests |\n|---|---|")
    for k in kinds:
        print(f"| {k} | {counts[k]} |")
    print(f"\n{elapsed:.0f} s, {args.requests / elapsed:.1f} requests/s; failures: {len(failures)}")
    for f in failures[:20]:
        print("  -", f)
    flat = True
    if rss:
        idle = rss_mb(pid)
        print(f"\nserver RSS (MB) by requests done: " + ", ".join(f"{n}: {m:.0f}" for n, m in rss)
              + f"; idle at the end: {idle:.0f}")
        flat = judge_rss(rss, args.requests, args.rss_slack_mb)
    return 0 if not failures and flat else 1


def judge_rss(rss: list[tuple[int, float]], requests: int, slack_mb: float) -> bool:
    """Print the least-squares line through the readings after the first tenth of the requests, and
    whether the growth it gives over them is within slack_mb (see the module docstring for why a
    line and not two readings)."""
    pts = [(n, m) for n, m in rss if n >= requests // 10]
    if len(pts) < 3:
        print(f"only {len(pts)} RSS readings after the first tenth: too few to judge (lower --rss-every)")
        return len(pts) == 0 or pts[-1][1] - pts[0][1] <= slack_mb
    k = len(pts)
    mx, my = sum(n for n, _ in pts) / k, sum(m for _, m in pts) / k
    sxx = sum((n - mx) ** 2 for n, _ in pts)
    slope = sum((n - mx) * (m - my) for n, m in pts) / sxx  # MB a request
    resid = sum((m - my - slope * (n - mx)) ** 2 for n, m in pts)
    se = (resid / (k - 2) / sxx) ** 0.5
    growth = slope * (pts[-1][0] - pts[0][0])
    flat = growth <= slack_mb
    lo, hi = min(m for _, m in pts), max(m for _, m in pts)
    print(f"after the first tenth: {k} readings, {lo:.0f}-{hi:.0f} MB; fitted slope {slope * 1024:+.2f} "
          f"+- {se * 1024:.2f} KB a request, {growth:+.1f} MB over {pts[-1][0] - pts[0][0]} requests: "
          f"{'flat' if flat else 'GROWING'} (slack {slack_mb} MB)")
    return flat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=24, help="distinct prompts of the ok requests")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--weights", default="lossless")
    ap.add_argument("--url", help="a running server (with --pid for its memory)")
    ap.add_argument("--pid", type=int)
    ap.add_argument("--oversize", type=int, default=2 << 20, help="bytes of the oversized bodies (default 2 MiB)")
    ap.add_argument("--long-prompt", type=int, default=9000, help="tokens of the too-long prompts")
    ap.add_argument("--rss-every", type=int, default=250)
    ap.add_argument("--rss-slack-mb", type=float, default=32.0)
    ap.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                    help="start the server with glibc's MALLOC_MMAP_THRESHOLD_=BYTES (a fixed threshold: freed large "
                         "blocks go back to the system, so RSS follows the memory in use; see above)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.url:
        if args.malloc_mmap_threshold is not None:
            ap.error("--malloc-mmap-threshold applies to a server this script starts: give it without --url")
        return asyncio.run(soak(args, args.url.rstrip("/"), args.pid))
    port = free_port()
    cmd = [str(ROOT / ".venv/bin/hi-na-moe"), "serve", "--model", args.model, "--weights", args.weights,
           "--port", str(port), "--max-batch", str(args.max_batch), "--log-level", "warning"]
    env = dict(os.environ)
    if args.malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                print(proc.stderr.read()[-3000:], file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return asyncio.run(soak(args, url, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if proc.returncode not in (0, -signal.SIGTERM, None):
            print(f"the server exited with {proc.returncode}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
