"""A full-size MoE checkpoint end to end: transformers vs hi_na_moe (lossless/lossless12/int8/int4) vs llama.cpp.

One "arm" per process, so peak RSS is per arm; the driver runs the arms one after another as
subprocesses (under `chrt -f 1` when it works) and prints a markdown table and JSON.

    python benchmarks/bench_full_model.py --ckpt /work/ckpt/olmoe-1b-7b \\
        --arms transformers,hina-lossless,hina-int8,hina-int4,llamacpp-q8_0,llamacpp-q4_0 --json out.json
    python benchmarks/bench_full_model.py --ckpt /tmp/olmoe2 --new-tokens 8 --prefill 64 \\
        --gguf-pattern '/tmp/gguf/olmoe2-{type}.gguf' --cache-dir /tmp/hina-cache   # a small check

Arms (each is `--arm X --child` of this script; the driver runs it):
- `transformers`: `AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)`, default
  experts implementation (grouped_mm on CPU in 5.23), eval mode.
- `hina-lossless`, `hina-lossless12`, `hina-int8`, `hina-int4`: `hi_na_moe.from_pretrained(ckpt, weights=...,
  dtype=torch.bfloat16, config=hi_na_moe.load_config(cache_dir=<cache-dir>/<format>))`; and
  `hina-int4g32` / `hina-int4g64`, int4 at group_size 32 (the default since layout 5: 4.25 bits a
  weight, more faithful than Q4_0's 4.5: benchmarks/weight_fidelity.py) / 64 (4.125 bits): the
  expert tensors are streamed into hi_na_moe's packed-expert store and mapped from it (lossless
  too goes through the store). Each runs twice, as two processes: "cold" (that format's store
  emptied first with `PackedStore.clear()`; the load packs/quantises every block and writes the
  store) and then "warm" (the entries are present; the load maps them and skips the experts'
  tensors in the checkpoint). The store is cleared only inside a --cache-dir this script owns:
  one it created (it leaves a marker file there) or an empty one. "Cold" is about the store
  only: the OS page cache (checkpoint files, store files) is whatever earlier runs left.
- `hina-<format>-all`: the same with `scope="all"` (the dense linear layers on the native
  kernels too, lm_head kept lossless: hi_na_moe.fastpath.linear). Warm only: it maps the store its
  format's `hina-<format>` arm wrote (run that arm first, or in the same series before it).
- `llamacpp-<type>` (bf16, q8_0, q4_0): benchmarks/bench_llamacpp.py, run with the llama.cpp
  venv's python (--llamacpp-python) on --gguf-pattern with {type} filled in (by default
  /work/ckpt/gguf/<checkpoint directory name>-<type>.gguf, e.g. olmoe-1b-7b-q4_0.gguf or
  qwen1.5-moe-a2.7b-4l-q4_0.gguf: the names benchmarks/LLAMACPP.md gives the files that
  benchmarks/make_gguf.py writes from the same checkpoint). Its JSON is read back and its raw samples
  go through the same formulas as the other arms. Flash attention off (llama-cpp-python's
  default) unless --llamacpp-flash-attn.
- `ikllamacpp-<type>`: ik_llama.cpp, the fastest CPU fork of llama.cpp, through its own
  llama-bench (--ik-bench; built as benchmarks/LLAMACPP.md says) on the same GGUF with fused MoE
  and run-time repacking (`-fmoe 1 -rtr 1`): prefill of --prefill tokens and --new-tokens decode
  steps, --repeats runs each. llama-bench reports each run's total, not its steps: the arm's
  "steps" are its runs' ms a token, its load time is the whole llama-bench run, and it has no
  paired probe. ik_llama.cpp has no OLMoE architecture: use the Qwen3-30B-A3B shape.

Definitions (the same for every arm; --threads 2 by default: torch.set_num_threads and the
hi_na_moe kernels in the torch arms, n_threads/n_threads_batch in llama.cpp):
- Token ids: random, from numpy's default_rng(--seed) over [259, vocab) (past the synthetic GGUF
  vocabulary's special and byte tokens), drawn in exactly bench_llamacpp.py's order (warm-up
  prefill, warm-up prompt, then per round a decode prompt and a prefill batch), so every arm
  sees the same ids: random weights make text meaningless, and the work does not depend on them.
- Warm-up (not timed): one prefill of --prefill tokens and 4 decode steps.
- load s: wall time of the load call (from_pretrained / Llama(...)), imports excluded.
- decode: per round, a fresh KV cache, the --prompt-len (16) token prompt in one forward (its
  time is `prompt_ms` in the JSON, not part of decode), then --new-tokens (128) greedy tokens,
  one forward of one token per step. Torch arms: a manual loop over `model(input_ids,
  past_key_values=DynamicCache, use_cache=True, logits_to_keep=1)` (not `generate`); a step's
  time is the wall time of that forward call; the argmax and a finite-logits check happen
  outside it (as bench_llamacpp.py times one llama_decode per step). tok/s = steps / sum of
  step times over --repeats rounds; median and p90 ms/step over all those steps.
- disk reads in decode: the arm process's major page faults (getrusage) during those steps: a
  step that waits on the disk (a mapped weight's page the page cache had dropped) counts here.
- prefill-N: one forward of --prefill (512) tokens on a fresh KV cache (logits of the last
  position only, like llama.cpp's), median over --prefill-reps (3) rounds. The llama.cpp arm
  runs max(--repeats, --prefill-reps) rounds of bench_llamacpp.py (each round decodes and
  prefills); decode figures use its first --repeats rounds.
- RSS after load: VmRSS right after the load call (the JSON splits anonymous / file-backed);
  peak RSS: VmHWM at the end of the arm's process (llama.cpp: getrusage ru_maxrss, the same
  high-water mark), less the paired probe's buffer (below). Mapped files count when touched (transformers keeps the safetensors mapped;
  hi_na_moe maps its store; llama.cpp maps the GGUF).
- GB/token: bytes one decode token reads. Dense (non-expert) parameters in full (attention and
  its biases, norms, routers, shared experts and their gates, lm_head; the input embedding as
  one row unless tied), plus per MoE block top_k/E of its routed experts' bytes: the bf16
  bytes for transformers, the packed bytes from `hi_na_moe.report_for(model)` for the hina
  arms, the GGUF tensors' bytes for llama.cpp (only `*_exps` tensors are routed experts; a
  shared expert's `*_shexp` tensors count as dense). Computed from a meta-device model / the
  GGUF header. (hi_na_moe's blocks are the routed experts' modules, so a shared expert is in
  the dense total on the torch side too; under scope="all" with its packed bytes; a latent
  attention module's packed kv_b_proj with the bytes of the copy its decode reads instead,
  `attention_latent_bytes`: an int8 / int4 layer's codes and scales, others dense.) Plus the KV
  cache a step reads, averaged over the decode's steps (`kv_cache` in the JSON: every layer's
  keys and values at 2 bytes an element for each position attended; the same for every arm;
  not counted for latent attention): about 10 MB on OLMoE-1B-7B after the 16-token prompt,
  277 MB after 2048 tokens. (Before 2026-12-05 at 9fbcceb the KV cache was not counted.)
- GB/s = GB/token / median decode step; "share" = GB/s / the machine's read bandwidth, measured
  once by the driver before the arms (`hi_na_moe._native.measure_read_bandwidth(1 << 30,
  threads, 3)['best_gbs']`, in a short subprocess at the driver's priority, before any
  competitor starts).
- paired share (--paired-probe, every arm; llama.cpp's from 2026-12-05, 9fbcceb: bench_llamacpp.py loads
  hi_na_moe's extension by its file in llama.cpp's venv and reads on llama.cpp's OpenMP team,
  libgomp being loaded there too): after every timed decode step, untimed, a 256 MB
  read of a 1 GiB probe buffer (`_native.BandwidthProbe`, round robin, as bench_moe_layer.py's
  decode pairing); the share is the median over steps of (GB/token / step time) / that step's
  probe. The machine's bandwidth swings within minutes, so the driver's one probe before the
  arms cannot judge a run taken later; the paired one can. The probe buffer adds 1 GiB to RSS,
  which the peak RSS column leaves out (the JSON's peak_rss_with_probe_bytes keeps it; before
  2026-12-05 (e54e1ff) the column included it), and the probe evicts the caches between steps (conservative for every arm). The probe reads
  on the OpenMP team torch loaded, whose threads then spin for several ms (libgomp's default
  wait policy); the script sleeps PROBE_SETTLE_S after each probe read so that the next timed
  step does not share a core with them, which the probe, not the model, would have caused
  (2026-12-02, f944edb: without the sleep, the first layer's ops of an own-pool scope-all step took
  ~1 ms longer).
- same tokens: how many of the first round's greedy tokens equal the transformers arm's before
  the first that differs (torch arms; llama.cpp's JSON does not list its tokens). Each arm
  decodes from its own tokens, so after a difference the two sequences are no longer comparable;
  on a random-weight model whose top two tokens nearly tie, a rounding difference shows early.

--series N runs the arm list N times in turn (the cold phases only the first time) and prints, per
series, each warm hina arm's decode tok/s over its width's llama.cpp arm's (int4: Q4_0, int8:
Q8_0, lossless and lossless12: BF16) and over transformers', with the median over the series: on a
host whose bandwidth moves from minute to minute, one series' ratio moves with it.

--compete starts `python -c 'while True: pass'` (no affinity) for the whole series of arms, as
in MEASURED.md's contention figures; the arms then run without chrt (a SCHED_FIFO arm would
simply preempt the competitor). OMP_WAIT_POLICY and the other environment variables are passed
through unchanged and recorded (README, "Performance": PASSIVE matters for hi_na_moe).

Disk: the hina arms' stores stay in --cache-dir after the run (for warm reruns), about the
experts' size per format (lossless ≈ the bf16 experts); --clear-cache-after removes them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lib import record
from lib.procstat import percentile, proc_status

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HINA_FORMATS = ("lossless", "lossless12", "int8", "int4", "int4g32", "int4g64")
# arm format -> (the weights config key, its group_size); "int4" takes the config's default group
FORMAT_CONFIG = {"int4g32": ("int4", 32), "int4g64": ("int4", 64)}
LLAMA_TYPES = ("bf16", "q8_0", "q4_0")
ARMS = (("transformers",) + tuple(f"hina-{f}" for f in HINA_FORMATS) + tuple(f"hina-{f}-all" for f in HINA_FORMATS)
        + tuple(f"llamacpp-{t}" for t in LLAMA_TYPES) + tuple(f"ikllamacpp-{t}" for t in LLAMA_TYPES))
OWNER_MARK = ".bench_full_model-owned"
GIB = 1 << 30
PROBE_BYTES = 1 << 30  # the paired probe's buffer
# after each paired probe read: longer than libgomp's threads spin after a region (see the docstring)
PROBE_SETTLE_S = 0.03
WARMUP_DECODE_STEPS = 4  # as bench_llamacpp.py


# --------------------------------------------------------------------------------------------
# helpers shared by driver and children


def decode_summary(rounds: list[list[float]], prompt_ms: list[float]) -> dict:
    """rounds: step times in ms per decode round -> the figures every arm reports."""
    steps = [x for r in rounds for x in r]
    return {
        "rounds": len(rounds),
        "tokens_per_s": len(steps) / (sum(steps) / 1e3) if steps else float("nan"),
        "median_ms": statistics.median(steps) if steps else float("nan"),
        "p90_ms": percentile(steps, 90),
        "prompt_ms": statistics.median(prompt_ms) if prompt_ms else None,
        "step_ms": [[round(x, 3) for x in r] for r in rounds],
    }


def prefill_summary(ms: list[float], n: int) -> dict:
    med = statistics.median(ms)
    return {"tokens": n, "ms": med, "tokens_per_s": n / (med / 1e3), "runs_ms": [round(x, 2) for x in ms]}


class IdStream:
    """Token ids in bench_llamacpp.py's exact order of draws (same seed -> same ids)."""

    def __init__(self, seed: int, vocab: int):
        import numpy as np

        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.lo = 259 if vocab > 1000 else 0

    def ids(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(self.lo, self.vocab, size=n)]


def sched_fifo() -> bool:
    try:
        return os.sched_getscheduler(0) == os.SCHED_FIFO
    except (AttributeError, OSError):
        return False


def host_facts() -> dict:
    return {"loadavg_1m": os.getloadavg()[0], "sched_fifo": sched_fifo(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


# --------------------------------------------------------------------------------------------
# the packed-expert store directory (hina arms)


def store_root(cache_dir: Path, fmt: str) -> Path:
    return cache_dir / fmt


def own_cache_dir(cache_dir: Path) -> None:
    """Make sure --cache-dir is ours to clear: created here (marker file) or empty when adopted."""
    mark = cache_dir / OWNER_MARK
    if cache_dir.exists():
        if mark.is_file():
            return
        if any(cache_dir.iterdir()):
            raise SystemExit(
                f"--cache-dir {cache_dir} exists, is not empty and was not created by this script "
                f"(no {OWNER_MARK}): refusing to clear entries in it; pass a new or empty directory")
    cache_dir.mkdir(parents=True, exist_ok=True)
    mark.write_text("packed-expert stores of benchmarks/bench_full_model.py; safe for it to clear\n")


def store_stats(root: Path) -> dict:
    from hi_na_moe.core.store import PackedStore

    st = PackedStore(root)
    entries = st.entries()
    return {"root": str(root), "entries": len(entries), "entry_bytes": sum(e.size for e in entries)}


# --------------------------------------------------------------------------------------------
# bytes read per decode token


def _top_k(config) -> int:
    for c in (config, getattr(config, "text_config", None)):
        for key in ("num_experts_per_tok", "moe_top_k", "top_k", "moe_topk"):
            v = getattr(c, key, None) if c is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    raise SystemExit("cannot find top-k (num_experts_per_tok) in the model config")


def dense_and_expert_bytes(ckpt: Path) -> dict:
    """From a meta-device model of the checkpoint's config (no weight read): dense bytes read per
    token and, per MoE block, the bf16 experts' bytes and expert count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hi_na_moe

    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    seen, total = set(), 0
    for p in meta.parameters():  # tied weights counted once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    report = hi_na_moe.inspect_model(meta)
    blocks = {b.name: {"expert_bytes": b.expert_bytes, "experts": b.experts} for b in report.blocks if b.experts}
    experts = sum(b["expert_bytes"] for b in blocks.values())
    inp, out = meta.get_input_embeddings(), meta.get_output_embeddings()
    tied = out is not None and out.weight is inp.weight
    table = inp.weight.numel() * inp.weight.element_size()
    row = inp.weight.shape[1] * inp.weight.element_size()
    dense = total - experts - (0 if tied else table - row)
    return {"dense_bytes": dense, "top_k": _top_k(config), "blocks": blocks, "vocab": int(config.vocab_size)}


def kv_bytes_per_token(ckpt: Path, prompt_len: int, new_tokens: int) -> int | None:
    """The KV cache one decode step reads, averaged over the decode's steps: every attention
    layer's keys and values at 2 bytes an element (bf16 in the torch arms, f16 in llama.cpp's) for
    each position the step attends to (step i of n after a prompt of p: p + i + 1, at most a
    sliding layer's window). None for latent attention, whose caches differ between engines."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    if cfg.get("kv_lora_rank"):
        return None
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") or 0
    total = 0
    for kind in types:
        for i in range(new_tokens):
            n = prompt_len + i + 1
            total += 2 * kv_heads * head_dim * 2 * (min(n, window) if kind == "sliding_attention" and window else n)
    return round(total / new_tokens)


def gguf_bytes_per_token(python: str, gguf_path: Path) -> dict:
    """Bytes one decode token reads from a GGUF file, from its header (in the llama.cpp venv)."""
    code = r"""
import json, sys, gguf
r = gguf.GGUFReader(sys.argv[1])
arch = r.fields["general.architecture"].contents()
E = int(r.fields[arch + ".expert_count"].contents())
k = int(r.fields[arch + ".expert_used_count"].contents())
dense = experts = 0
for t in r.tensors:
    n = int(t.n_bytes)
    if "_exps." in t.name:          # routed experts; ffn_*_shexp (shared expert) is dense
        experts += n
    elif t.name == "token_embd.weight" and any(x.name == "output.weight" for x in r.tensors):
        rows = 1
        for d in list(t.shape)[1:]:
            rows *= int(d)
        dense += n // rows          # one row looked up per token
    else:
        dense += n
print(json.dumps({"dense_bytes": dense, "expert_bytes": experts, "experts": E, "top_k": k,
                  "bytes_per_token": dense + experts * k / E}))
"""
    out = subprocess.run([python, "-c", code, str(gguf_path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


# --------------------------------------------------------------------------------------------
# child: one arm in this process


def run_torch_arm(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    import hi_na_moe

    arm, ckpt = args.arm, Path(args.ckpt)
    res: dict = {"arm": arm, "phase": args.phase, "engine": "transformers" if arm == "transformers" else "hi_na_moe",
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "threads": torch.get_num_threads(), "host_start": host_facts()}
    fmt = arm.split("-")[1] if arm.startswith("hina-") else None
    scope = "all" if arm.endswith("-all") else "experts"
    if scope == "all":
        res["dense_lossless"] = args.dense_lossless
    if fmt:
        from hi_na_moe.core.store import PackedStore

        cache_dir = Path(args.cache_dir)
        root = store_root(cache_dir, fmt)
        if args.phase == "cold":
            own_cache_dir(cache_dir)
            res["store_cleared_bytes"] = PackedStore(root).clear()
        elif not PackedStore(root).entries():
            raise SystemExit(f"{arm} warm: the store {root} has no entries (run the cold phase first)")
    mem_before = proc_status()

    t0 = time.perf_counter()
    if fmt:
        weights, group = FORMAT_CONFIG.get(fmt, (fmt, None))
        group_key = {} if group is None else {"group_size": group}
        model = hi_na_moe.from_pretrained(ckpt, weights=weights, dtype=torch.bfloat16, progress=False,
                                          config=hi_na_moe.load_config(cache_dir=str(root), scope=scope,
                                                                       dense_lossless=args.dense_lossless,
                                                                       **group_key))
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    model.eval()
    res["load_s"] = time.perf_counter() - t0
    mem_load = proc_status()
    res["memory"] = {"rss_before_load_bytes": mem_before["VmRSS"], "rss_after_load_bytes": mem_load["VmRSS"],
                     "rss_anon_after_load_bytes": mem_load.get("RssAnon"),
                     "rss_file_after_load_bytes": mem_load.get("RssFile"),
                     "peak_rss_after_load_bytes": mem_load["VmHWM"]}

    # bytes per decode token
    shape = dense_and_expert_bytes(ckpt)
    k = shape["top_k"]
    if fmt:
        report = hi_na_moe.report_for(model)
        if report is None:
            raise SystemExit(f"{arm}: hi_na_moe.report_for(model) is None after hi_na_moe.from_pretrained")
        got = {b.name: b for b in report.blocks}
        experts_active = 0.0
        for name, b in shape["blocks"].items():
            rb = got.get(name)
            packed = rb.packed_bytes if rb is not None and rb.packed_bytes else b["expert_bytes"]
            experts_active += packed / b["experts"] * k
        res["report"] = {
            "summary": report.to_dict()["summary"],
            "kernels": sorted({b.kernel or "-" for b in report.blocks}),
            "weights": sorted({b.weights or "-" for b in report.blocks}),
            "cache_events": [b.cache for b in report.blocks],
            "sqnr_db": [b.sqnr_db for b in report.blocks],
            "packed_bytes": sum(b.packed_bytes or 0 for b in report.blocks),
            "dense_layers": len(report.dense),
            "dense_formats": sorted({d.weights for d in report.dense}),
            "dense_packed_bytes": sum(d.packed_bytes for d in report.dense),
        }
        res["store"] = store_stats(root)
    else:
        experts_active = sum(b["expert_bytes"] / b["experts"] * k for b in shape["blocks"].values())
    dense_bytes = shape["dense_bytes"]
    if fmt and report.dense:  # scope="all": the packed layers replace their bf16 bytes
        dense_bytes += sum(d.packed_bytes - 2 * d.out_features * d.in_features for d in report.dense)
    if fmt and report.attention_latent_bytes:
        # latent attention's decode reads a copy of each packed kv_b_proj (hi_na_moe.fastpath.mla), not it
        kvb = {f"{n}.kv_b_proj" for n in report.attention_latent}
        dense_bytes += report.attention_latent_bytes - sum(d.packed_bytes for d in report.dense if d.name in kvb)
    kv = kv_bytes_per_token(ckpt, args.prompt_len, args.new_tokens)
    res["bytes_per_token"] = {"total": dense_bytes + experts_active + (kv or 0), "dense": dense_bytes,
                              "experts_active": experts_active, "kv_cache": kv, "top_k": k}

    # timings
    cfg = model.config
    stream = IdStream(args.seed, shape["vocab"])

    def fwd(ids: list[int], cache):
        return model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)

    def last_logits(out):
        logits = out.logits[0, -1]
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError(f"{arm}: non-finite logits")
        return logits

    probe, probe_gbs = None, []
    hwm_before_probe = None
    if args.paired_probe:
        from hi_na_moe import _native

        hwm_before_probe = proc_status()["VmHWM"]
        probe = _native.BandwidthProbe(PROBE_BYTES, args.threads)  # 256 MB per step, round robin

    def decode(prompt: list[int], n: int, paired: bool = False):
        cache = DynamicCache(config=cfg)
        t = time.perf_counter()
        out = fwd(prompt, cache)
        prompt_s = time.perf_counter() - t
        tok = int(last_logits(out).argmax())
        steps, toks = [], []
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        for _ in range(n):
            t = time.perf_counter()
            out = fwd([tok], cache)
            steps.append(time.perf_counter() - t)
            toks.append(tok)
            tok = int(last_logits(out).argmax())
            if paired:
                probe_gbs.append(probe.read(256 << 20))
                time.sleep(PROBE_SETTLE_S)
        decode_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0)
        return prompt_s, steps, toks

    def prefill(ids: list[int]) -> float:
        cache = DynamicCache(config=cfg)
        t = time.perf_counter()
        out = fwd(ids, cache)
        s = time.perf_counter() - t
        last_logits(out)
        return s

    rounds = max(args.repeats, args.prefill_reps)
    dec_rounds, prompt_ms, pre_ms, tokens = [], [], [], None
    decode_faults: list[int] = []  # major page faults (reads from disk) during each decode's steps
    with torch.inference_mode():
        prefill(stream.ids(args.prefill))  # warm-up, as bench_llamacpp.py
        decode(stream.ids(args.prompt_len), WARMUP_DECODE_STEPS)
        for r in range(rounds):
            prompt = stream.ids(args.prompt_len)  # drawn every round, to stay in step with llama.cpp
            if r < args.repeats:
                p_s, steps, toks = decode(prompt, args.new_tokens, paired=probe is not None)
                dec_rounds.append([s * 1e3 for s in steps])
                prompt_ms.append(p_s * 1e3)
                tokens = tokens or toks
            batch = stream.ids(args.prefill)
            if r < args.prefill_reps:
                pre_ms.append(prefill(batch) * 1e3)
    res["decode"] = decode_summary(dec_rounds, prompt_ms)
    res["decode"].update(new_tokens=args.new_tokens, prompt_len=args.prompt_len, tokens=tokens,
                         major_faults=sum(decode_faults[1:1 + args.repeats]))  # (the warm-up decode is [0])
    res["prefill"] = prefill_summary(pre_ms, args.prefill)
    if probe is not None:
        res["paired_probe"] = paired_summary(res["bytes_per_token"]["total"], dec_rounds, probe_gbs)
    hwm = proc_status()["VmHWM"]
    if hwm_before_probe is None:
        res["memory"]["peak_rss_bytes"] = hwm
    else:  # the probe's buffer (touched when made, resident to the end) is not the model's
        res["memory"]["peak_rss_bytes"] = max(hwm_before_probe, hwm - PROBE_BYTES)
        res["memory"]["peak_rss_with_probe_bytes"] = hwm
    res["host_end"] = host_facts()
    return res


def paired_summary(bytes_per_token: float, step_ms_rounds: list[list[float]], probe_gbs: list[float]) -> dict:
    """The paired probe's figures: its reads (GB/s, one after each decode step, in step order) and
    the median over steps of the step's GB/s over its probe's."""
    steps_s = [x / 1e3 for r in step_ms_rounds for x in r]
    return {"gbs": [round(g, 2) for g in probe_gbs], "median_gbs": statistics.median(probe_gbs),
            "share": statistics.median(bytes_per_token / s / 1e9 / g for s, g in zip(steps_s, probe_gbs))}


def gguf_step_bytes(args, gguf: Path) -> dict:
    """The bytes a decode token of a llama.cpp engine reads: the GGUF's (gguf_bytes_per_token) and
    its KV cache's, with their total."""
    out = gguf_bytes_per_token(args.llamacpp_python, gguf)
    kv = kv_bytes_per_token(Path(args.ckpt), args.prompt_len, args.new_tokens)
    out["kv_cache"] = kv
    out["total"] = out.pop("bytes_per_token") + (kv or 0)
    return out


def run_llamacpp_arm(args) -> dict:
    typ = args.arm.split("-", 1)[1]
    gguf = Path(args.gguf_pattern.format(type=typ))
    if not gguf.is_file():
        raise SystemExit(f"{args.arm}: no GGUF file {gguf} (benchmarks/make_gguf.py writes it; see LLAMACPP.md)")
    rounds = max(args.repeats, args.prefill_reps)
    n_ctx = max(1024, args.prefill, args.prompt_len + args.new_tokens)
    cmd = [args.llamacpp_python, str(HERE / "bench_llamacpp.py"), str(gguf), "--json",
           "--threads", str(args.threads), "--n-ctx", str(n_ctx), "--prompt-len", str(args.prompt_len),
           "--gen", str(args.new_tokens), "--prefill", str(args.prefill), "--prompt-warmup", str(args.prefill),
           "--repeats", str(rounds), "--seed", str(args.seed)] + (["--flash-attn"] if args.llamacpp_flash_attn else [])
    if args.paired_probe:  # the torch arms' probe, hi_na_moe's extension loaded by file in llama.cpp's venv
        import importlib.util

        cmd += ["--paired-probe-native", importlib.util.find_spec("hi_na_moe._native").origin]
    res: dict = {"arm": args.arm, "phase": args.phase, "engine": "llama.cpp", "gguf": str(gguf),
                 "command": " ".join(cmd), "host_start": host_facts()}
    res["bytes_per_token"] = gguf_step_bytes(args, gguf)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{args.arm}: bench_llamacpp.py exited with {proc.returncode}")
    j = json.loads(proc.stdout)
    tg, pp = j[f"tg{args.new_tokens}"], j[f"pp{args.prefill}"]
    runs = tg["runs"][: args.repeats]
    res["decode"] = decode_summary([r["step_ms"] for r in runs], [r["prompt_ms"] for r in runs])
    res["decode"].update(new_tokens=args.new_tokens, prompt_len=args.prompt_len, tokens=None,
                         distinct_tokens=[r["distinct_tokens"] for r in runs],
                         major_faults=sum(r["major_faults"] for r in runs))
    res["prefill"] = prefill_summary([r["ms"] for r in pp["runs"][: args.prefill_reps]], args.prefill)
    mem = j["memory"]
    res["load_s"] = j["load_s"]
    res["memory"] = {"rss_after_load_bytes": mem["after_load"]["rss_bytes"],
                     "rss_anon_after_load_bytes": mem["after_load"]["rss_anon_bytes"],
                     "rss_file_after_load_bytes": mem["after_load"]["rss_file_bytes"],
                     "peak_rss_bytes": mem["peak_rss_bytes"]}
    if j.get("paired_probe"):
        res["paired_probe"] = paired_summary(res["bytes_per_token"]["total"], [r["step_ms"] for r in runs],
                                             [g for r in runs for g in r["probe_gbs"]])
        res["paired_probe"]["pool_backend"] = j["paired_probe"]["pool_backend"]
        res["memory"]["peak_rss_with_probe_bytes"] = mem["peak_rss_with_probe_bytes"]
    res["threads"] = j["threads"]
    res["llama_cpp_python"] = j["llama_cpp_python"]
    res["system_info"] = j["system_info"]
    res["gguf_bytes"] = j["gguf_bytes"]
    res["host_end"] = host_facts()
    if "AMX_INT8 = 1" in j["system_info"]:
        res["warning"] = "this llama.cpp build has AMX on (SIGILL on Q8_0/Q4_0 here; see LLAMACPP.md)"
    return res


def run_ik_arm(args) -> dict:
    """ik_llama.cpp's own llama-bench (--ik-bench) on the arm's GGUF, with its fused MoE (-fmoe 1)
    and run-time repacking (-rtr 1): pp<prefill> and tg<new-tokens>, --repeats runs each. It
    reports each run's total time, not its steps: a run's ms a token stands in for its steps."""
    import resource

    typ = args.arm.split("-", 1)[1]
    gguf = Path(args.gguf_pattern.format(type=typ))
    if not gguf.is_file():
        raise SystemExit(f"{args.arm}: no GGUF file {gguf} (benchmarks/make_gguf.py writes it; see LLAMACPP.md)")
    if not Path(args.ik_bench).is_file():
        raise SystemExit(f"{args.arm}: no ik_llama.cpp llama-bench at {args.ik_bench} (see LLAMACPP.md)")
    reps = max(args.repeats, args.prefill_reps)
    cmd = [args.ik_bench, "-m", str(gguf), "-p", str(args.prefill), "-n", str(args.new_tokens), "-t", str(args.threads),
           "-r", str(reps), "-fmoe", "1", "-rtr", "1", "-o", "json"]
    res: dict = {"arm": args.arm, "phase": args.phase, "engine": "ik_llama.cpp", "gguf": str(gguf),
                 "command": " ".join(cmd), "host_start": host_facts()}
    res["bytes_per_token"] = gguf_step_bytes(args, gguf)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{args.arm}: llama-bench exited with {proc.returncode}")
    rows = json.loads(proc.stdout)
    tg = next(r for r in rows if r["n_gen"] == args.new_tokens and r["n_prompt"] == 0)
    pp = next(r for r in rows if r["n_prompt"] == args.prefill and r["n_gen"] == 0)
    tg_ms = [ns / 1e6 / args.new_tokens for ns in tg["samples_ns"]]  # a run's ms a token
    res["decode"] = {"rounds": len(tg_ms), "tokens_per_s": 1e3 / statistics.median(tg_ms),
                     "median_ms": statistics.median(tg_ms), "p90_ms": max(tg_ms), "prompt_ms": None,
                     "step_ms": [[round(x, 3)] for x in tg_ms], "per_run": "ms a token of each run (llama-bench)",
                     "new_tokens": args.new_tokens, "prompt_len": 0, "tokens": None}
    res["prefill"] = prefill_summary([ns / 1e6 for ns in pp["samples_ns"]], args.prefill)
    # (the child's peak: llama-bench's, the only child this process ran)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    res["load_s"] = wall  # (the whole llama-bench run: it does not report its load)
    res["memory"] = {"rss_after_load_bytes": None, "peak_rss_bytes": peak}
    res["threads"] = args.threads
    res["build"] = {k: tg.get(k) for k in ("build_commit", "build_number", "cpu_info", "model_type", "type_k")}
    res["host_end"] = host_facts()
    return res


def child_main(args) -> int:
    if args.arm not in ARMS:
        raise SystemExit(f"unknown arm {args.arm!r}; known: {', '.join(ARMS)}")
    res = (run_llamacpp_arm(args) if args.arm.startswith("llamacpp-") else run_ik_arm(args)
           if args.arm.startswith("ikllamacpp-") else run_torch_arm(args))
    text = json.dumps(res, indent=1)
    if args.result:
        Path(args.result).write_text(text)
    else:
        print(text)
    d, m = res["decode"], res["memory"]
    print(f"# {args.arm} {args.phase or ''}: load {res['load_s']:.1f} s, decode {d['tokens_per_s']:.2f} tok/s "
          f"(median {d['median_ms']:.1f} ms), prefill-{args.prefill} {res['prefill']['ms'] / 1e3:.2f} s, "
          f"peak RSS {m['peak_rss_bytes'] / GIB:.2f} GiB", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# driver


def chrt_works() -> tuple[bool, str]:
    exe = shutil.which("chrt")
    if exe is None:
        return False, "chrt not found"
    p = subprocess.run([exe, "-f", "1", "true"], capture_output=True, text=True)
    if p.returncode != 0:
        return False, f"`chrt -f 1 true` failed: {p.stderr.strip() or p.returncode}"
    return True, exe


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "csrc", "benchmarks"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+uncommitted changes" if dirty else "")
    except OSError:
        return "?"


def fmt_gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def table(results: list[dict], bw: float, args) -> str:
    base = next((r for r in results if r.get("arm") == "transformers" and "decode" in r), None)
    lines = [
        f"| arm | load | load s | RSS after load GiB | peak RSS GiB | decode tok/s | median ms/step | p90 ms "
        f"| disk reads in decode | GB/token | GB/s | share of {bw:.1f} GB/s | decode vs transformers | prefill-{args.prefill} s "
        f"| same tokens as transformers (to the first difference) | store |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    several = any(r.get("series", 0) for r in results)
    for r in results:
        label = r["arm"] + (f" #{r.get('series', 0) + 1}" if several else "")
        if "error" in r:
            lines.append(f"| {label} | {r.get('phase') or '-'} | failed: {r['error']} |" + " |" * 13)
            continue
        d, m, b = r["decode"], r["memory"], r["bytes_per_token"]["total"]
        gbs = b / (d["median_ms"] / 1e3) / 1e9
        vs = f"{d['tokens_per_s'] / base['decode']['tokens_per_s']:.2f}x" if base else "-"
        same = "-"
        if base and d.get("tokens") and base["decode"].get("tokens"):
            n = 0
            for a, c in zip(d["tokens"], base["decode"]["tokens"]):
                if a != c:
                    break
                n += 1
            same = f"{n}/{len(d['tokens'])}"
        paired = ""
        if "paired_probe" in r:
            pp = r["paired_probe"]
            paired = f" (paired {100 * pp['share']:.0f} % of {pp['median_gbs']:.1f})"
        store = "-"
        if "report" in r:
            ev = r["report"]["cache_events"]
            kinds = sorted(set(ev), key=str)
            store = ", ".join(f"{k} {ev.count(k)}/{len(ev)}" for k in kinds)
            store += f"; {r['store']['entry_bytes'] / 1e9:.2f} GB"
        lines.append(
            f"| {label} | {r.get('phase') or '-'} | {r['load_s']:.1f} | {fmt_gib(m['rss_after_load_bytes'])} "
            f"| {fmt_gib(m['peak_rss_bytes'])} | {d['tokens_per_s']:.2f} | {d['median_ms']:.1f} | {d['p90_ms']:.1f} "
            f"| {d.get('major_faults', '-')} | {b / 1e9:.3f} | {gbs:.1f} | {100 * gbs / bw:.0f} %{paired} | {vs} | {r['prefill']['ms'] / 1e3:.2f} "
            f"| {same} | {store} |")
    return "\n".join(lines)


# the llama.cpp arm of a hina format's width
LLAMACPP_WIDTH = {"int4": "llamacpp-q4_0", "int4g32": "llamacpp-q4_0", "int4g64": "llamacpp-q4_0", "int8": "llamacpp-q8_0",
                  "lossless": "llamacpp-bf16", "lossless12": "llamacpp-bf16"}


def ratio_table(results: list[dict]) -> str:
    """Per series (--series), each warm hina arm's decode tok/s over its width's llama.cpp arm's and
    over transformers' in the same series, then the median over the series: arms of one series run
    minutes apart, so a single series' ratio moves with the host's bandwidth."""
    by = {}
    for r in results:
        if "decode" in r and r.get("phase") in (None, "warm"):
            by[(r.get("series", 0), r["arm"])] = r["decode"]["tokens_per_s"]
    series = sorted({s for s, _ in by})
    hina = [a for a in dict.fromkeys(a for _, a in by) if a.startswith("hina-")]
    rows = []
    for a in hina:
        fmt = a[len("hina-"):].removesuffix("-all")
        ik = LLAMACPP_WIDTH.get(fmt, "").replace("llamacpp-", "ikllamacpp-") or None
        for other in (LLAMACPP_WIDTH.get(fmt), ik, "transformers"):
            got = [by[(s, a)] / by[(s, other)] for s in series if (s, a) in by and (s, other) in by]
            if got:
                rows.append(f"| {a} / {other} | {' / '.join(f'{x:.2f}x' for x in got)} | "
                            f"{statistics.median(got):.2f}x |")
    if not rows:
        return ""
    return "\n".join(["| decode tok/s ratio | per series | median |", "|---|---|---|"] + rows)


def brief(r: dict) -> dict:
    """A result without its per-step samples (for printing)."""
    out = dict(r)
    if "decode" in out:
        out["decode"] = {k: v for k, v in out["decode"].items() if k not in ("step_ms", "tokens")}
    return out


def driver_main(args) -> int:
    if args.series < 1:
        raise SystemExit(f"--series {args.series}: give 1 or more")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; known: {', '.join(ARMS)}")
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").is_file():
        raise SystemExit(f"--ckpt {ckpt}: no config.json")
    for a in arms:
        if a.startswith("ikllamacpp-") and not Path(args.ik_bench).is_file():
            raise SystemExit(f"{a}: no ik_llama.cpp llama-bench at {args.ik_bench} (--ik-bench; see LLAMACPP.md)")
        if a.startswith(("llamacpp-", "ikllamacpp-")):
            g = Path(args.gguf_pattern.format(type=a.split("-", 1)[1]))
            if not g.is_file():
                raise SystemExit(f"{a}: no GGUF file {g} (see benchmarks/LLAMACPP.md)")
            if not Path(args.llamacpp_python).is_file():
                raise SystemExit(f"{a}: no llama.cpp python at {args.llamacpp_python}")
    cache_dir = Path(args.cache_dir)
    if any(a.startswith("hina-") for a in arms):
        own_cache_dir(cache_dir)  # fail before running anything if it is not ours

    runs = []
    for a in arms:
        phases = [ph for ph in ("cold", "warm") if ph in args.phases.split(",")]
        if a.endswith("-all"):
            phases = ["warm"]  # shares its format's store with hina-<format>: never clears it
        runs += [(a, ph) for ph in phases] if a.startswith("hina-") else [(a, None)]
    # --series: the arm list again, in the same order, its cold phases only the first time
    runs = [(s, a, ph) for s in range(args.series) for a, ph in runs if s == 0 or ph != "cold"]

    # in a short subprocess: the driver itself stays free of torch (~0.25 GB) while the arms run
    probe = ("from hi_na_moe import _native; "
             f"print(_native.measure_read_bandwidth(1 << 30, {args.threads}, 3)['best_gbs'])")
    bw = float(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              check=True).stdout.split()[-1])
    use_chrt, chrt_note = chrt_works()
    if args.compete or args.no_chrt:
        use_chrt, chrt_note = False, ("--compete: arms run without chrt so that the competitor really competes"
                                      if args.compete else "--no-chrt")
    head = {
        "ckpt": str(ckpt), "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "threads": args.threads, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
        "prefill": args.prefill, "repeats": args.repeats, "prefill_reps": args.prefill_reps, "seed": args.seed,
        "read_bandwidth_gbs": bw, "chrt": use_chrt, "chrt_note": None if use_chrt else chrt_note,
        "compete": args.compete, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "llamacpp_flash_attn": args.llamacpp_flash_attn,
        "cache_dir": str(cache_dir), "loadavg_1m_start": os.getloadavg()[0],
    }
    print(f"# {ckpt} | commit {head['commit']} | {args.threads} threads | read bandwidth {bw:.1f} GB/s "
          f"(best of 3, measured now) | OMP_WAIT_POLICY={head['omp_wait_policy'] or 'unset'} "
          f"| loadavg {head['loadavg_1m_start']:.2f}")
    print("# arms run under chrt -f 1" if use_chrt else f"# arms run WITHOUT chrt ({chrt_note})")

    common = ["--ckpt", str(ckpt), "--threads", str(args.threads), "--new-tokens", str(args.new_tokens),
              "--prompt-len", str(args.prompt_len), "--prefill", str(args.prefill), "--repeats", str(args.repeats),
              "--prefill-reps", str(args.prefill_reps), "--seed", str(args.seed), "--cache-dir", str(cache_dir),
              "--gguf-pattern", args.gguf_pattern, "--llamacpp-python", args.llamacpp_python,
              "--dense-lossless", args.dense_lossless, "--ik-bench", args.ik_bench] + (["--paired-probe"] if args.paired_probe else []) \
        + (["--llamacpp-flash-attn"] if args.llamacpp_flash_attn else [])
    results = []
    competitor = None
    tmp = Path(tempfile.mkdtemp(prefix="bench_full_model-"))
    try:
        if args.compete:
            competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            print(f"# a competing busy process (pid {competitor.pid}, no affinity) runs during the arms")
        for series, arm, phase in runs:
            name = arm + (f"-{phase}" if phase else "") + (f"-s{series}" if args.series > 1 else "")
            out, log = tmp / f"{name}.json", tmp / f"{name}.log"
            cmd = (["chrt", "-f", "1"] if use_chrt else []) + [sys.executable, str(Path(__file__).resolve()),
                                                               "--child", "--arm", arm, "--result", str(out)] + common
            if phase:
                cmd += ["--phase", phase]
            print(f"# running {name} ...", flush=True)
            t0 = time.perf_counter()
            with open(log, "w") as lf:
                rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT).returncode
            wall = time.perf_counter() - t0
            text = log.read_text(errors="replace")
            if rc != 0 or not out.is_file():
                tail = "\n".join(text.strip().splitlines()[-40:])
                print(f"# {name} FAILED (exit {rc}); last lines of its output:\n{tail}", flush=True)
                results.append({"arm": arm, "phase": phase, "series": series, "error": f"exit {rc}",
                                "log_tail": tail})
                continue
            r = json.loads(out.read_text())
            r["wall_s"], r["series"] = wall, series
            results.append(r)
            summary = [ln for ln in text.splitlines() if ln.startswith(f"# {arm}")]
            print(summary[-1] if summary else f"# {name} done", f"(process wall {wall:.0f} s)", flush=True)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    head["loadavg_1m_end"] = os.getloadavg()[0]
    print()
    print(table(results, bw, args))
    print()
    ratios = ratio_table(results)
    if ratios:
        print(ratios)
        print()
    print(json.dumps({"setup": head, "results": [brief(r) for r in results]}, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        at = {"commit": head["commit"], "date": head["date"], "cpu_model": record.cpu_model()}
        recs = [record.make(f"{r['arm']}" + (f" ({r['phase']})" if r.get("phase") else ""),
                            [x for rnd in r["decode"]["step_ms"] for x in rnd], threads=r.get("threads", args.threads),
                            probe_gbs=(r.get("paired_probe") or {}).get("median_gbs"), tool="bench_full_model.py", at=at,
                            model=Path(args.ckpt).name, what="decode step", prefill_ms=(r.get("prefill") or {}).get("ms"))
                for r in results if "step_ms" in (r.get("decode") or {})]
        record.write(args.json, {"setup": head, "results": results}, recs)
        print(f"# full results (with per-step samples and tokens) written to {args.json}")
    if args.clear_cache_after and (cache_dir / OWNER_MARK).is_file():
        from hi_na_moe.core.store import PackedStore

        freed = sum(PackedStore(store_root(cache_dir, f)).clear() for f in HINA_FORMATS)
        print(f"# --clear-cache-after: {freed / 1e9:.2f} GB of store entries removed from {cache_dir}")
    return 1 if any("error" in r for r in results) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default="/work/ckpt/olmoe-1b-7b", help="checkpoint directory (safetensors)")
    ap.add_argument("--arms", default="transformers,hina-lossless,hina-int8,hina-int4,llamacpp-q8_0,llamacpp-q4_0",
                    help=f"comma list of: {', '.join(ARMS)}")
    ap.add_argument("--new-tokens", type=int, default=128, help="decode steps per round")
    ap.add_argument("--series", type=int, default=1,
                    help="run the arm list this many times in turn (cold phases the first time only) and print "
                         "each hina arm's decode ratio to llama.cpp at its width and to transformers per series, "
                         "with their median")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt tokens before decode")
    ap.add_argument("--prefill", type=int, default=512, help="tokens in the timed prefill forward")
    ap.add_argument("--repeats", type=int, default=1, help="decode rounds per arm")
    ap.add_argument("--prefill-reps", type=int, default=3, help="prefill rounds per arm (median reported)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="token ids (same for every arm)")
    ap.add_argument("--cache-dir", default=None,
                    help="packed-expert stores of the hina arms, one per format below it "
                         "(default /work/ckpt/hina-cache/bench_full_model-<checkpoint name>)")
    ap.add_argument("--gguf-pattern", default=None,
                    help="GGUF file of the llamacpp-<type> arms; {type} is bf16, q8_0 or q4_0 "
                         "(default /work/ckpt/gguf/<checkpoint name>-{type}.gguf)")
    ap.add_argument("--llamacpp-python", default="/work/venv-llamacpp/bin/python")
    ap.add_argument("--ik-bench", default="/work/ik/build/bin/llama-bench",
                    help="ik_llama.cpp's llama-bench, for the ikllamacpp-<type> arms (run with -fmoe 1 -rtr 1)")
    ap.add_argument("--llamacpp-flash-attn", action="store_true",
                    help="llama.cpp arms with flash_attn=True (llama-cpp-python's default is False)")
    ap.add_argument("--compete", action="store_true",
                    help="run a busy-looping process (no affinity) during the arms; the arms then run without chrt")
    ap.add_argument("--no-chrt", action="store_true", help="do not run the arms under chrt -f 1")
    ap.add_argument("--dense-lossless", default="lm_head",
                    help="hina-<format>-all arms: the config key dense_lossless (default lm_head; '' quantises "
                         "every dense layer, as llama.cpp's pure q8_0/q4_0 files made by make_gguf.py)")
    ap.add_argument("--paired-probe", action="store_true",
                    help="every arm: a 256 MB read-bandwidth probe after every decode step (untimed); "
                         "the share is then also given against those paired probes")
    ap.add_argument("--phases", default="cold,warm",
                    help="hina arms: cold,warm (default) or warm alone (the store entries must exist)")
    ap.add_argument("--clear-cache-after", action="store_true", help="remove the hina arms' store entries at the end")
    ap.add_argument("--json", help="write the full results (per-step samples, tokens) to this file")
    # child mode (the driver runs these)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=("cold", "warm"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cache_dir is None:
        args.cache_dir = f"/work/ckpt/hina-cache/bench_full_model-{Path(args.ckpt).resolve().name}"
    if args.gguf_pattern is None:
        args.gguf_pattern = f"/work/ckpt/gguf/{Path(args.ckpt).resolve().name}-{{type}}.gguf"
    for key in ("new_tokens", "prompt_len", "prefill", "repeats", "prefill_reps", "threads"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.child:
        if not args.arm:
            ap.error("--child needs --arm")
        if args.arm.startswith("hina-") and args.phase is None:
            ap.error("hina arms need --phase cold|warm")
        return child_main(args)
    if args.arm or args.phase or args.result:
        ap.error("--arm/--phase/--result are for --child runs; use --arms")
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
