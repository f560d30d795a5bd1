"""Decode speed of a model whose packed experts exceed the memory it may use (issue 42).

Every arm runs in a child process inside one memory cgroup (the v1 controller) whose limit is
the same for every arm: `--overhead` (the non-expert weights, torch, Python) plus `--fraction`
of the packed experts. The page cache is dropped before each arm; arms are interleaved and
repeated.

  tier      hi_na_moe.from_pretrained(..., memory_limit=fraction x packed experts): the memory tier
  tier-P    the same with the eviction policy P (lru, lfu, lru-2, freq-decay: the `eviction` key)
  tier...:S the same with the `experimental` switches S (e.g. tier-lru:tier.skip_unused_reads=off)
  map       hi_na_moe.from_pretrained(..., memory="map"): every block through the store's mapping
  llamacpp  llama.cpp (llama-cpp-python, use_mmap) on a GGUF of the same weights at the same width
            (Q4_0 for int4, Q8_0 for int8), run with the llama.cpp venv's Python

--replay <trace.npz>: every arm's routing comes from a recorded trace (hi_na_moe.fastpath.replay:
MoE layer l replays trace layer l mod its layers, each layer through a seeded permutation of the
expert ids), so the tier is judged on real routing at this shape. Prediction is off in the tier
arms then: it applies routers to hidden states that did not produce the replayed routing, so it
cannot be judged here (study_tier_trained.py judges it inside the trained model). Beside each tier
arm's hit rate, Belady's MIN (hi_na_moe.core.cache_policy) on the exact access sequence the run
replayed (per forward and MoE layer, the experts its tokens chose), with the tier's slot count.
llama.cpp cannot replay (its routers have no hook): --replay refuses the llamacpp arm.

The disk's large-read bandwidth is measured in the same run (O_DIRECT reads of the store's files,
1 thread x 4 MiB and 4 threads x 2 MiB); a step's disk-bound limit is the bytes it read from the
disk (/proc/self/io read_bytes) divided by that bandwidth.

Setup (once): the store must hold the checkpoint's packed experts in that format:
    python benchmarks/bench_memory_tier.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 --build
Run (root, for the cgroup and drop_caches):
    python benchmarks/bench_memory_tier.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 \\
        --fractions 0.5 --arms tier,map,llamacpp --gguf /work/ckpt/gguf/olmoe-1b-7b-q4_0.gguf --json out.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

CG_ROOT = Path("/sys/fs/cgroup/memory")
LLAMA_PY = "/work/venv-llamacpp/bin/python"


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


# ---- workers (run inside the cgroup) -------------------------------------------------------------
def worker_hina(args) -> dict:
    import torch

    import hi_na_moe
    torch.set_num_threads(args.threads)
    kw = dict(weights=args.weights, cache_dir=args.cache_dir, progress=False, dtype=torch.bfloat16, scope=args.scope)
    if args.arm.startswith("tier"):
        kw["memory_limit"] = args.memory_limit
        if args.replay:
            kw["prefetch"] = False  # (module docstring)
        base, _, switches = args.arm.partition(":")
        if base.startswith("tier-"):
            kw["eviction"] = base[len("tier-"):]
        if switches:
            kw["experimental"] = switches
    else:
        kw["memory"] = "map"
    t0 = time.perf_counter()
    model = hi_na_moe.from_pretrained(args.ckpt, **kw)
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=g)
    times, reads = [], []
    replay = contextlib.nullcontext()
    if args.replay:
        from hi_na_moe.fastpath.replay import replay_routing
        replay = replay_routing(model, args.replay, cycle_layers=True, seed=args.seed)
    from hi_na_moe.integrate import tiering
    state = tiering._STATES.get(model)
    initial = None
    with torch.inference_mode(), replay as rp:
        if rp is not None and state is not None and state.tier is not None:
            # the experts the pool holds before the first token (enable's probes'), per replayed
            # MoE layer, matched by decoder layer ("model.layers.3" of ...mlp.gate and ...mlp.experts)
            held = {name.rsplit(".", 2)[0]: sorted(map(int, state.tier.resident(i)))
                    for i, name in state.layer_names.items()}
            initial = [held.get(name.rsplit(".", 2)[0], []) for name, *_ in rp.routers]
        out = model(ids, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        tokens = []
        for _ in range(args.new_tokens):
            r0, t = read_bytes(), time.perf_counter()
            out = model(nxt, past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - t)
            reads.append(read_bytes() - r0)
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(int(nxt))
    res = dict(load_s=load_s, step_s=times, read_bytes=reads, tokens=tokens)
    if rp is not None:
        res["replay_accesses"] = [[list(map(int, layer)) for layer in f] for f in rp.accesses]
        res["replay_initial"] = initial
    status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
              if line.split(":")[0] in ("RssAnon", "RssFile", "RssShmem", "VmHWM")}
    res["memory"] = dict(status, pool_bytes=state.tier.pool_bytes if state is not None and state.tier is not None else 0)
    if state is not None and state.tier is not None:
        res["slots"] = state.tier.num_slots
    st = hi_na_moe.stats(model)
    if st.get("memory_tier"):
        res["stats"] = st
    res["report_tier"] = hi_na_moe.report_for(model).memory_tier
    return res


def worker_llamacpp(args) -> dict:
    import llama_cpp
    import numpy as np
    # llama.cpp repacks Q4_0 weights into anonymous memory of its own by default (CPU_REPACK: the
    # whole model, so an OOM kill under any limit below it); its mmap arm keeps the weights in the
    # file mapping, which only use_extra_bufts=False gives (not an argument of Llama() in 0.3.36)
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = default_params()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params
    llama_cpp.llama_model_default_params = params
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.prompt_len + args.new_tokens + 8, n_threads=args.threads,
                          n_threads_batch=args.threads, use_mmap=True, logits_all=False, verbose=False, n_batch=64)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def last():  # the last position's logits, as benchmarks/bench_llamacpp.py reads them
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))

    rng = np.random.default_rng(args.seed)
    llm.eval([int(x) for x in rng.integers(259, n_vocab, size=args.prompt_len)])
    tok = last()
    times, reads, tokens = [], [], []
    for _ in range(args.new_tokens):
        r0, t = read_bytes(), time.perf_counter()
        llm.eval([tok])
        times.append(time.perf_counter() - t)
        reads.append(read_bytes() - r0)
        tok = last()
        tokens.append(tok)
    return dict(load_s=load_s, step_s=times, read_bytes=reads, tokens=tokens)


# ---- the parent --------------------------------------------------------------------------------------
def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def disk_bandwidth(files: list[Path], nbytes: int = 1 << 30) -> dict:
    """Large O_DIRECT reads of the store's files, page cache dropped first: 1 thread x 4 MiB and
    4 threads x 2 MiB (the tier's pattern: experts of 1-3 MiB, 4 I/O threads)."""
    import mmap
    out = {}
    for threads, chunk in ((1, 4 << 20), (4, 2 << 20)):
        drop_caches()
        jobs = []
        for f in files:
            size = f.stat().st_size
            for off in range(0, size - chunk, chunk):
                jobs.append((f, off))
        jobs = jobs[: nbytes // chunk]
        lock = threading.Lock()
        done = [0]

        def run():
            buf = mmap.mmap(-1, chunk)
            fds = {}
            while True:
                with lock:
                    if not jobs:
                        break
                    f, off = jobs.pop()
                fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY | os.O_DIRECT))
                n = os.preadv(fd, [buf], off)
                with lock:
                    done[0] += n
            for fd in fds.values():
                os.close(fd)

        t = time.perf_counter()
        ths = [threading.Thread(target=run) for _ in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        out[f"{threads}x{chunk >> 20}MiB"] = done[0] / (time.perf_counter() - t) / 1e6
    return out  # MB/s


def run_arm(arm: str, args, limit_cg: int, memory_limit: int) -> dict:
    cg = CG_ROOT / f"hina-bench-{os.getpid()}"
    cg.mkdir(exist_ok=True)
    try:
        (cg / "memory.limit_in_bytes").write_text(str(limit_cg))
        drop_caches()
        py = LLAMA_PY if arm == "llamacpp" else sys.executable
        cmd = [py, __file__, "--worker", arm, "--ckpt", args.ckpt, "--weights", args.weights, "--cache-dir",
               args.cache_dir, "--memory-limit", str(memory_limit), "--threads", str(args.threads), "--new-tokens",
               str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--seed", str(args.seed), "--scope", args.scope]
        if args.replay:
            cmd += ["--replay", args.replay]
        if args.gguf:
            cmd += ["--gguf", args.gguf]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        wrapped = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", *cmd]
        if args.chrt:
            wrapped = ["chrt", "-f", "1", *wrapped]
        p = subprocess.run(wrapped, capture_output=True, text=True, env=env)
        res = {"arm": arm, "returncode": p.returncode}
        if p.returncode == 0:
            res.update(json.loads(p.stdout.strip().splitlines()[-1]))
        else:
            res["stderr"] = p.stderr[-3000:]
        res["cgroup_limit"] = limit_cg
        res["max_usage"] = int((cg / "memory.max_usage_in_bytes").read_text())
        res["failcnt"] = int((cg / "memory.failcnt").read_text())
        oom = dict(line.split() for line in (cg / "memory.oom_control").read_text().splitlines())
        res["oom_kill"] = int(oom.get("oom_kill", 0))
        return res
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def packed_experts_bytes(args) -> tuple[int, list[Path]]:
    """Bytes of the packed experts in the store for this checkpoint and format, and their files."""
    import hi_na_moe
    from hi_na_moe.core.store import PackedStore
    store = PackedStore(args.cache_dir)
    src = str(Path(args.ckpt).resolve())
    files, total = [], 0
    for key in store.summary():
        for f in key.entries:
            if (f.meta_value("source") == src and f.meta_value("format") == args.weights and f.meta
                    and f.meta.get("up_only") is False and not f.file.endswith(".original.hnm")):  # experts, not dense layers
                p = key.path / f.file
                files.append(p)
                total += p.stat().st_size
    del hi_na_moe
    return total, files


def belady_hit_rate(accesses: list, slots: int, initial: list | None = None) -> float:
    """MIN's hit rate on a replayed run's access sequence (per forward, per MoE layer, its experts:
    one step, in forward order) with `slots` slots, starting with `initial` (per MoE layer, the
    experts the tier's pool held before the first token) or empty."""
    from hi_na_moe.core.cache_policy import Trace, simulate
    steps, times, layers = [], [], []
    start = [(l, e) for l, experts in enumerate(initial or []) for e in experts]
    if start:  # one step loading the starting pool, its misses not counted; MIN then evicts by next use
        steps.append(tuple(start))
        times.append(-1)
        layers.append(0)
    for f, per_layer in enumerate(accesses):
        for l, experts in enumerate(per_layer):
            steps.append(tuple((l, e) for e in experts))
            times.append(f)
            layers.append(l)
    r = simulate(Trace(steps, times, layers, len(accesses[0])), slots, "belady")
    return r.hits / (r.hits + r.misses - len(start))


def summarise(r: dict, bw: float) -> dict:
    if r["returncode"] != 0:
        return {"arm": r["arm"], "failed": r["returncode"], "oom_kill": r.get("oom_kill"), "failcnt": r.get("failcnt")}
    steps = r["step_s"][2:]  # the first two steps fill the cache from cold
    reads = r["read_bytes"][2:]
    med = statistics.median(steps)
    rb = statistics.mean(reads)
    out = {"arm": r["arm"], "tok_s": 1 / med, "tok_s_mean": len(steps) / sum(steps), "median_step_s": med,
           "read_MB_per_token": rb / 1e6, "disk_bound_tok_s": (bw * 1e6 / rb) if rb else None,
           "load_s": r["load_s"], "max_usage_GiB": r["max_usage"] / 2**30, "cgroup_limit_GiB": r["cgroup_limit"] / 2**30,
           "failcnt": r["failcnt"], "oom_kill": r["oom_kill"]}
    if out["disk_bound_tok_s"]:
        out["of_disk_bound"] = (len(steps) / sum(steps)) / out["disk_bound_tok_s"]
    st = r.get("stats")
    if st:
        out.update(hit_rate=st["hit_rate"], prefetch_precision=st["prefetch_precision"],
                   prefetch_recall=st["prefetch_recall"], io_wait_s=st["io_wait_s"],
                   recall_per_layer=[l["recall"] for l in st["layers"]])
    if r.get("replay_accesses") and r.get("slots"):
        out["slots"] = r["slots"]
        out["min_hit_rate"] = belady_hit_rate(r["replay_accesses"], r["slots"], r.get("replay_initial"))
        out["min_hit_rate_empty"] = belady_hit_rate(r["replay_accesses"], r["slots"])
        if out.get("hit_rate") is not None:
            out["of_min"] = out["hit_rate"] / out["min_hit_rate"]
    return out


def table(path: str) -> str:
    """Medians per (fraction, arm) of a --json file as a Markdown table, with the tier's ratios."""
    data = json.loads(Path(path).read_text())
    rows: dict = {}
    for r in data["results"]:
        s = r["summary"]
        rows.setdefault((s["fraction"], s["arm"]), []).append(s)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    out = [f"{data['date']}, {data['cpu']}, disk (O_DIRECT) {data['disk_MBps']['4x2MiB']:.0f} MB/s (4 x 2 MiB), "
           f"packed experts {data['packed_experts_bytes'] / 2**30:.2f} GiB, cgroup limit = "
           f"{data['overhead_bytes'] / 2**30:.2f} GiB + fraction x experts; tok/s and MB read/token over the "
           f"decode steps after the first two, hit rate, precision/recall and I/O wait over the whole run (prompt "
           f"included); medians of {data['args']['repeats']} interleaved repeats",
           "", "| experts held | arm | tok/s | MB read/token | hit rate | pred. precision / recall | I/O wait s | "
           "peak cgroup GiB | failcnt | OOM | tier / arm |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    arms = list(dict.fromkeys(s["arm"] for r in data["results"] for s in [r["summary"]]))
    # a --replay run: MIN's hit rate on each run's replayed accesses, and the tier's share of it
    replayed = any("min_hit_rate" in r["summary"] for r in data["results"])
    if replayed:
        out[0] += f"; routing replayed from {data['args']['replay']}, prediction off"
        out[-2] = out[-2].replace("| hit rate |", "| hit rate | MIN hit rate (slots) | of MIN |")
        out[-1] += "---|---|"
    first = next((a for a in arms if a.startswith("tier")), None)  # the arm the last column compares with
    if first is not None:
        out[-2] = out[-2].replace("tier / arm", f"{first} / arm")
    for frac in sorted({f for f, _ in rows}):
        tier = med([s["tok_s_mean"] for s in rows.get((frac, first), []) if "tok_s_mean" in s])
        for arm in arms:
            ss = rows.get((frac, arm))
            if not ss:
                continue
            ok = [s for s in ss if "tok_s_mean" in s]
            if not ok:
                out.append(f"| {100 * frac:.0f} % | {arm} | failed ({ss[0].get('failed')}) | | | {'| | ' if replayed else ''}| | | "
                           f"{ss[0].get('failcnt')} | {ss[0].get('oom_kill')} | |")
                continue
            t = med([s["tok_s_mean"] for s in ok])
            hit = med([s["hit_rate"] for s in ok if s.get("hit_rate") is not None])
            pr = (f"{100 * med([s['prefetch_precision'] for s in ok]):.0f} / {100 * med([s['prefetch_recall'] for s in ok]):.0f} %"
                  if ok[0].get("prefetch_recall") is not None and ok[0].get("prefetch_precision") is not None
                  else "off" if replayed and arm.startswith("tier") else "-")
            wait = (f"{med([s['io_wait_s'] for s in ok]):.2f}"
                    if ok[0].get("io_wait_s") is not None else "-")
            mins = ""
            if replayed:
                mn = med([s["min_hit_rate"] for s in ok if "min_hit_rate" in s])
                of = med([s["of_min"] for s in ok if "of_min" in s])
                mins = ("- | - | " if mn is None else
                        f"{100 * mn:.1f} % ({ok[0]['slots']}) | {'-' if of is None else f'{100 * of:.1f} %'} | ")
            out.append(f"| {100 * frac:.0f} % | {arm} | {t:.2f} | {med([s['read_MB_per_token'] for s in ok]):.1f} | "
                       f"{'-' if hit is None else f'{100 * hit:.1f} %'} | {mins}{pr} | {wait} | "
                       f"{max(s['max_usage_GiB'] for s in ok):.2f} | {max(s['failcnt'] for s in ok)} | "
                       f"{max(s['oom_kill'] for s in ok)} | {'' if arm == first or not tier else f'{tier / t:.2f}x'} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--cache-dir", default="/work/ckpt/hina-cache/memory-tier")
    ap.add_argument("--gguf")
    ap.add_argument("--arms", default="tier,map")
    ap.add_argument("--fractions", default="0.5")
    ap.add_argument("--overhead", default="auto",
                    help="cgroup limit beyond the experts' share, the same for every arm; auto: hi_na_moe's process's "
                         "anonymous memory besides its expert slots (RssAnon less the slot pool, measured in a first "
                         "run of the tier arm without a cgroup limit) plus 512 MiB for the file pages it needs "
                         "(libraries, the embedding table read in place); its other file pages (the checkpoint's "
                         "mapping of weights packed since) are reclaimable and not counted")
    ap.add_argument("--scope", default="all", help="hi_na_moe's scope: all (dense layers in the format too, the width "
                    "llama.cpp's GGUF has) or experts")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chrt", action="store_true")
    ap.add_argument("--build", action="store_true", help="pack the checkpoint's experts into the store and exit")
    ap.add_argument("--replay", help="a routing trace (.npz, top_k_index [layers, tokens, k]) every arm's routing "
                    "replays; prediction off in the tier arms (module docstring)")
    ap.add_argument("--json")
    ap.add_argument("--table", help="print the Markdown table of a --json file and exit")
    ap.add_argument("--worker")
    ap.add_argument("--memory-limit", type=int)
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return 0
    if args.worker:
        args.arm = args.worker
        res = worker_llamacpp(args) if args.worker == "llamacpp" else worker_hina(args)
        print(json.dumps(res))
        return 0
    if args.build:
        import hi_na_moe
        hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, cache_dir=args.cache_dir, memory="map", scope=args.scope)
        return 0
    from hi_na_moe.core.config import EVICTION_POLICIES
    arms = args.arms.split(",")
    tiers = ["tier"] + [f"tier-{p}" for p in EVICTION_POLICIES if p != "auto"]
    bad = [a for a in arms if a not in ("map", "llamacpp") and a.partition(":")[0] not in tiers]
    if bad:
        sys.exit(f"--arms: unknown {bad}; known: {', '.join(tiers)} (each with :<experimental switches>), map, llamacpp")
    if args.replay and "llamacpp" in arms:
        sys.exit("--replay: llama.cpp cannot replay a routing trace (its routers have no hook); drop llamacpp from --arms")
    if args.replay and not Path(args.replay).is_file():
        sys.exit(f"--replay: no such file {args.replay!r} (an .npz with top_k_index [layers, tokens, k])")
    from hi_na_moe.core.limits import parse_bytes
    from hi_na_moe.tools.capabilities import capabilities
    total, files = packed_experts_bytes(args)
    if not files:
        sys.exit(f"no packed experts of {args.ckpt} in {args.cache_dir} ({args.weights}): run with --build first")
    bw = disk_bandwidth(files)
    if args.overhead == "auto":
        cal = run_arm("tier", args, 64 << 30, int(total * 0.5))
        if cal["returncode"] != 0:
            sys.exit("the calibration run failed:\n" + cal.get("stderr", ""))
        m = cal["memory"]
        overhead = m["RssAnon"] - m["pool_bytes"] + (512 << 20)
        print(f"overhead (hi_na_moe's process's anonymous memory besides its slots, + 512 MiB for the file pages it "
              f"needs: libraries, the embedding table): {overhead / 2**30:.2f} GiB ({m})", flush=True)
    else:
        overhead = parse_bytes(args.overhead)
    cpu = capabilities().get("brand")
    print(f"packed experts: {total / 2**30:.2f} GiB in {len(files)} files; disk (O_DIRECT) MB/s: {bw}", flush=True)
    results = []
    for frac in [float(f) for f in args.fractions.split(",")]:
        mem_limit = int(total * frac)
        for rep in range(args.repeats):
            for arm in (arms if rep % 2 == 0 else arms[::-1]):
                r = run_arm(arm, args, overhead + mem_limit, mem_limit)
                s = summarise(r, bw["4x2MiB"])
                s.update(fraction=frac, repeat=rep)
                results.append({"summary": s, "raw": r})
                print(json.dumps(s), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "disk_MBps": bw,
                                               "overhead_bytes": overhead,
                                               "packed_experts_bytes": total, "args": vars(args), "results": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
