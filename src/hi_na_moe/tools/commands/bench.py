"""`hi-na-moe bench`: native and accelerated on the same prompt, prefill and each decode step timed."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from ...core.config import (
    MAX_THREADS,
)
from ...core.formats import LOSSLESS_FORMATS, Format
from ...core.native import native_module
from ...core.registry import decode_call_counts
from ...integrate.adapters import _is_interface_experts, discover
from ...integrate.patching import disable_for_model, enable_for_model
from ...integrate.patching import stats as hina_stats
from ..plan import format_table, packed_expert_bytes, plan_for_model
from ..quality import logits_agreement
from . import common
from .common import UserError, _config_up_front, _exactly, shipped_model_dir
from .demo import OWN_RATE_NOTE, PROBE_READ_BYTES, read_limit


def _peak_rss_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS (Linux)
    except OSError:
        pass


def _peak_rss() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, -(-int(q * len(s) * 100) // 100) - 1)] if s else float("nan")


def _timed_generate(model, ids, n, kv_cache: str = "dynamic"):
    """Greedy generation of exactly n tokens; returns (tokens, prefill+first-token seconds,
    per-token decode latencies) using a logits processor as the per-step clock. kv_cache:
    "dynamic" (transformers' default cache) or "static" (a StaticCache, preallocated)."""
    stamps: list[float] = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    t0 = [time.perf_counter()]

    def restart():  # _exactly's fallback generates again: a fresh clock
        stamps.clear()
        t0[0] = time.perf_counter()

    with torch.inference_mode():
        extra = {"cache_implementation": "static"} if kv_cache == "static" else {}
        out = _exactly(model, ids, n, on_retry=restart, logits_processor=LogitsProcessorList([Clock()]), **extra)
    return out, stamps[0] - t0[0], [b - a for a, b in zip(stamps, stamps[1:])]


def _experts_read_per_step(model, ids, n: int, kv_cache: str) -> dict[str, float] | None:
    """For a batch of rows: per MoE block, the mean over decode steps of the distinct experts the
    step's rows route to (a step reads each of them once), from one untimed greedy generation
    of n tokens on the model as it is (native), watching the top_k_index transformers passes its
    experts modules. None when some block's experts do not take that argument (llama4, jetmoe,
    doge: then the byte figures stay one token's)."""


    blocks = [m for m in discover(model) if m.spec is not None]
    if not blocks or not all(_is_interface_experts(m.module) for m in blocks):
        return None
    rows = ids.shape[0]
    seen: dict[str, list[int]] = {m.name: [] for m in blocks}

    def watch(name):
        def hook(_module, args, kwargs):
            idx = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if isinstance(idx, torch.Tensor) and idx.dim() == 2 and idx.shape[0] == rows:  # a decode step
                seen[name].append(int(torch.unique(idx).numel()))
        return hook

    handles = [m.module.register_forward_pre_hook(watch(m.name), with_kwargs=True) for m in blocks]
    try:
        _timed_generate(model, ids, n, kv_cache)
    finally:
        for h in handles:
            h.remove()
    if any(not v for v in seen.values()):
        return None
    return {name: statistics.fmean(v) for name, v in seen.items()}


def _step_bytes(per_token: float | None, top_k: int | None, report, union: dict | None, expert_bytes) -> float | None:
    """Bytes one decode step reads: one token's (`per_token`), with each block's top_k experts
    replaced by the union the step's rows read (`union`, None: one token's); expert_bytes(block)
    gives one expert's bytes in the arm's format."""
    if per_token is None or not union or not top_k:
        return per_token
    extra = 0.0
    for b in report.blocks:
        if b.experts and b.name in union:
            extra += (union[b.name] - top_k) * expert_bytes(b)
    return per_token + extra


def _md_cell(text: str) -> str:
    """A Markdown table cell: a kernel name pair ("decode|prefill") would split the row."""
    return str(text).replace("|", "\\|")


def cmd_bench(args) -> int:

    arms = [a.strip() for a in args.compare.split(",") if a.strip()]
    bad = [a for a in arms if a not in ("native", "hina")]
    if bad or not arms:
        raise UserError(f"--compare has {', '.join(map(repr, bad)) or 'nothing'}", "use native, hina or native,hina")
    for name in ("batch_size", "seq_len", "gen_tokens", "num_iters"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.gen_tokens < 2:
        raise UserError("--gen-tokens must be >= 2 (decode latency needs a second token)")
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    if not 0 <= args.threads <= MAX_THREADS:
        raise UserError(f"--threads must be from 0 to {MAX_THREADS}, got {args.threads}",
                        "0 means torch.get_num_threads()")
    if args.json_file:  # written at the end: a path that cannot be written is known now
        out = Path(args.json_file).expanduser()
        if out.is_dir():
            raise UserError(f"--json-file {args.json_file!r} is a directory", "name a file to write")
        if not out.parent.is_dir():
            raise UserError(f"--json-file {args.json_file!r}: the directory {str(out.parent)!r} does not exist")
    mem_limit = getattr(args, "memory_limit", None)
    top_k = getattr(args, "top_k", None)
    top_k = int(top_k) if top_k is not None and top_k.strip().isdigit() else top_k
    trim_keys = {k: v for k, v in (("top_k", top_k), ("top_k_threshold", getattr(args, "top_k_threshold", None)))
                 if v is not None}
    cfg = _config_up_front({"weights": (args.weights, "--weights"), "group_size": (args.group_size, "--group-size"),
                            "scope": (args.scope, "--scope"),
                            **({"memory_limit": (mem_limit, "--memory-limit")} if mem_limit else {}),
                            **{k: (v, "--" + k.replace("_", "-")) for k, v in trim_keys.items()}})
    trimmed = cfg.top_k != "model"  # (the option, or HINA_MOE_TOP_K / the config file)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = shipped_model_dir() if args.model == "builtin" else args.model
    if path is None:
        raise UserError("--model builtin: the shipped model (models/hina-tiny-moe) is not in this installation",
                        "pass --model PATH")
    model, _ = common._load(path, args.dtype)
    bw = common._bandwidth(threads)
    bw = bw if bw == bw else None  # NaN: no native library
    plan = plan_for_model(model, bw, args.group_size)
    if not plan["report"].blocks:
        raise UserError(f"no MoE block found in {str(path)!r}", "bench compares MoE acceleration; is this an MoE model?")
    # the probe above plans the model; the shares of the table are of reads paired with each
    # timed generation (read_limit): one probe taken minutes before can read slower than the runs
    native, _ = native_module()
    probe = native.BandwidthProbe(1 << 30, threads) if native is not None else None
    probe_bytes = probe.size if probe is not None else 0
    g = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(min(10, vocab - 1), vocab, (args.batch_size, args.seq_len), generator=g)
    active = plan["active_bytes_per_token"]
    if args.weights != Format.LOSSLESS:  # the format's packed bytes, not the model's own
        # the experts-only row: with scope="all" the enabled report's dense layers are added below
        row = next((f for f in format_table(plan, bw, args.group_size)
                    if f["weights"].startswith(args.weights) and f["scope"] == "experts"), None)
        active_hina = row["active_bytes_per_token"] if row else None
    else:
        active_hina = active
    count_union = args.batch_size > 1 and bool(plan["top_k"])
    bar = tqdm(total=len(arms) * (args.warmup + args.num_iters) + count_union, desc="bench", unit="run",
               leave=False)
    # a batch's step reads the union of its rows' experts: counted on the native model first
    union = None
    if count_union:
        bar.set_postfix_str("experts a batch step reads")
        union = _experts_read_per_step(model, ids, args.gen_tokens, args.kv_cache)
        bar.update()
    k = plan["top_k"]
    def native_expert(b):
        return b.expert_bytes / b.experts

    def hina_expert(b):  # one expert in the arm's format (lossless: the model's own bytes)
        n = packed_expert_bytes(b, args.weights, args.group_size) if args.weights != Format.LOSSLESS else None
        return n / b.experts if n is not None else native_expert(b)

    step_native = _step_bytes(active, k, plan["report"], union, native_expert)
    quality: dict = {}
    native_logits = None
    if args.weights not in LOSSLESS_FORMATS or trimmed:
        with torch.inference_mode():
            native_logits = model(ids).logits.float()
    results, tokens = {}, {}
    for arm in arms:
        report = enable_for_model(model, weights=args.weights, group_size=args.group_size,
                                  **({"scope": args.scope} if args.scope else {}),
                                  **({"memory_limit": mem_limit} if mem_limit else {}), **trim_keys) \
            if arm == "hina" else None
        if report is not None and (args.weights not in LOSSLESS_FORMATS or trimmed):
            quality[arm] = _quality_vs_native(model, ids, native_logits, report)
        if report is not None and report.dense and active_hina:
            # scope="all": the dense layers read their packed bytes instead of the model's own
            esize = next(model.parameters()).element_size()
            active_hina += sum(d.packed_bytes - d.out_features * d.in_features * esize for d in report.dense)
        step_bytes = (_step_bytes(active_hina, k, plan["report"], union, hina_expert) if arm == "hina"
                      else step_native)
        _peak_rss_reset()
        bar.set_postfix_str(arm)
        for _ in range(args.warmup):
            _timed_generate(model, ids, 2, args.kv_cache)
            bar.update()
        prefill, decode, outs, reads = [], [], [], []
        for _ in range(args.num_iters):
            out, pre, lat = _timed_generate(model, ids, args.gen_tokens, args.kv_cache)
            if probe is not None:
                reads.append(probe.read(PROBE_READ_BYTES))
            bar.update()
            prefill.append(pre)
            decode += lat
            outs.append(out)
        tokens[arm] = outs[0]
        tier_stats = hina_stats(model) if report is not None and mem_limit else None
        # the experts a token used, counted by the kernels over the arm's runs (warm-up included)
        ept = hina_stats(model)["experts_per_token"] if report is not None else None
        if report is not None and trimmed and step_bytes and k:
            # the bytes the trim did not read: a token's dropped experts (a batch step's union was
            # counted at the model's own k: not known then)
            step_bytes = (step_bytes - sum((k - ept) * hina_expert(b) for b in plan["report"].blocks if b.experts)
                          if args.batch_size == 1 and ept is not None else None)
        if report is not None:
            counts = decode_call_counts(model)
            # matched on the probe, yet every decode call at runtime took the module's own forward
            refused = sorted(n for n, (native, own) in counts.items() if own and not native)
        step = statistics.median(decode)
        achieved = step_bytes / step / 1e9 if step_bytes else None
        paired = statistics.median(reads) if reads else None
        limit, own = read_limit(achieved, paired) if achieved and paired else (None, False)
        peak = _peak_rss()
        results[arm] = {
            "kernel": (report.blocks[0].kernel if report and report.blocks else "transformers"),
            "prefill_s": statistics.median(prefill),
            "pp_tokens_per_s": args.batch_size * args.seq_len / statistics.median(prefill),
            "tg_tokens_per_s": args.batch_size / step,
            "latency_ms": {"avg": 1e3 * statistics.fmean(decode), "p50": 1e3 * _pct(decode, 0.5),
                           "p95": 1e3 * _pct(decode, 0.95), "p99": 1e3 * _pct(decode, 0.99)},
            "weights": args.weights if arm == "hina" else plan["dtype"],
            "bytes_per_token": (active_hina if arm == "hina" else active),
            # a step of batch_size rows: one token's bytes with the union of the rows' experts
            "bytes_per_step": step_bytes,
            "achieved_gbs": achieved,
            "memory_bandwidth_util_pct": 100 * (achieved / limit) if limit else None,  # exactly 100 at its own rate
            "paired_read_probe_gbs": paired,
            "read_limit_gbs": limit,
            "read_limit_is_own_rate": own,
            "quality_vs_native": quality.get(arm),
            "experts_per_token": ept if report is not None else k,
            "top_k": cfg.top_k if report is not None else None,
            # memory_limit: the memory tier's counters over the arm's runs, warm-up included (hi_na_moe.stats)
            "memory_tier": tier_stats,
            "dense_layers": len(report.dense) if report is not None else 0,
            "attention_decode_calls": ({n: {"native": a, "own_forward": b} for n, (a, b) in counts.items()}
                                       if report is not None else None),
            "attention_refused_at_runtime": refused if report is not None else None,
            # the probe's buffer was resident before the reset: not the arm's
            "peak_rss_bytes": peak - probe_bytes if peak else peak,
            "samples": {"prefill_s": prefill, "decode_step_s": decode, "paired_read_probe_gbs": reads},
        }
        if report is not None:
            disable_for_model(model)
    bar.close()
    same = None
    if "native" in tokens and "hina" in tokens:
        same = bool(torch.equal(tokens["native"], tokens["hina"]))
    data = {"model": str(path), "dtype": plan["dtype"], "threads": threads, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "gen_tokens": args.gen_tokens, "num_iters": args.num_iters,
            "kv_cache": args.kv_cache, "machine_read_bandwidth_gbs": bw, "active_bytes_per_token": active,
            "experts_read_per_step": union,
            "greedy_tokens_identical": same, "arms": results}
    if args.output == "json":
        print(json.dumps(data, indent=2))
    else:
        print(f"model {path} ({plan['dtype']}), batch {args.batch_size}, prompt {args.seq_len}, "
              f"{args.gen_tokens} new tokens x {args.num_iters}, {args.kv_cache} KV cache, {threads} threads"
              + (f"; {active / 1e9:.3f} GB read per decode token" if active else ""))
        if probe is not None:
            print(f"read limit: the native read probe, one {PROBE_READ_BYTES >> 20} MiB read right after each timed "
                  "generation (median of an arm's reads), or the arm's own rate where it read faster")
        if args.batch_size > 1 and step_native:
            print(f"a decode step of {args.batch_size} rows reads {step_native / 1e9:.3f} GB natively"
                  + (f" (the union of the rows' experts: {statistics.fmean(union.values()):.1f} of each block's "
                     f"experts on average, against top-{k} for one token)" if union else
                     " (counted as one token's: this family's experts do not show their routing)"))
        print("| arm | kernels | pp t/s | tg t/s | avg ms | p50 ms | p95 ms | p99 ms | GB/s | paired probe GB/s | "
              "bw util % | peak RSS GiB | speedup tg |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        base = results[arms[0]]["tg_tokens_per_s"]
        for arm, r in results.items():
            lat = r["latency_ms"]
            gbs = f"{r['achieved_gbs']:.1f}" if r["achieved_gbs"] else "-"
            util = (f"{r['memory_bandwidth_util_pct']:.0f}" + (" *" if r["read_limit_is_own_rate"] else "")
                    if r["memory_bandwidth_util_pct"] else "-")
            paired = f"{r['paired_read_probe_gbs']:.1f}" if r["paired_read_probe_gbs"] else "-"
            rss = f"{r['peak_rss_bytes'] / 2**30:.2f}" if r["peak_rss_bytes"] else "-"
            print(f"| {arm} | {_md_cell(r['kernel'])} | {r['pp_tokens_per_s']:.1f} | {r['tg_tokens_per_s']:.1f} | {lat['avg']:.2f} | "
                  f"{lat['p50']:.2f} | {lat['p95']:.2f} | {lat['p99']:.2f} | {gbs} | {paired} | {util} | {rss} | "
                  f"{r['tg_tokens_per_s'] / base:.2f}x |")
        if any(r["read_limit_is_own_rate"] for r in results.values()):
            print(OWN_RATE_NOTE)
        for arm, r in results.items():
            if r["top_k"] is not None and r["top_k"] != "model" and r["experts_per_token"] is not None:
                print(f"{arm} top_k={r['top_k']!r}: {r['experts_per_token']:.2f} experts a token of the model's {k}"
                      + (f" ({1 - r['experts_per_token'] / k:.1%} fewer expert bytes)" if k else ""))
        for arm, q in quality.items():
            sqnr = (f", block SQNR {q['sqnr_min_db']:.1f}-{q['sqnr_max_db']:.1f} dB (random probe)"
                    if q["sqnr_min_db"] == q["sqnr_min_db"] else "")  # (lossless weights: no SQNR)
            print(f"{arm} ({args.weights}{', top_k=' + repr(cfg.top_k) if trimmed else ''}) vs native on the prompt: "
                  f"logits KL {q['kl']:.4f} nats/token, top-1 agreement {100 * q['top1']:.1f} %{sqnr}")
        for arm, r in results.items():
            if r["attention_refused_at_runtime"]:
                bad = r["attention_refused_at_runtime"]
                print(f"note: {len(bad)} attention module(s) matched their probe at enable but took their own forward "
                      f"at every decode step of this run (e.g. {bad[0]}): a runtime argument the native path does "
                      "not take; please report it")
        for arm, r in results.items():
            t = r.get("memory_tier")
            if t and t.get("memory_tier"):
                runs = args.warmup + args.num_iters
                pct = (lambda v: f"{100 * v:.1f} %" if v is not None else "-")
                print(f"{arm} memory tier (memory_limit {mem_limit}): hit rate {pct(t['hit_rate'])}, "
                      f"{t['bytes_read'] / 1e6 / max(1, runs * args.gen_tokens):.1f} MB read from the store per token, "
                      f"prediction precision {pct(t['prefetch_precision'])} / recall {pct(t['prefetch_recall'])}, "
                      f"{t['io_wait_s']:.2f} s waiting for reads over {runs} runs")
            elif t:
                print(f"{arm}: no memory tier ({t['why']})")
        if same is not None:
            print("greedy tokens: " + ("identical" if same else "DIFFERENT between native and hina")
                  + ("" if args.weights in LOSSLESS_FORMATS and not trimmed else
                     f" (expected to differ with {args.weights} weights)" if not trimmed else
                     f" (top_k={cfg.top_k!r}: they may differ)"))
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(data, indent=2))
    # lossless: any difference in greedy tokens is a failure; quantised: differences are expected
    return 0 if same is not False or args.weights not in LOSSLESS_FORMATS or trimmed else 1


def _quality_vs_native(model, ids, native_logits, report) -> dict:
    """KL and top-1 agreement of the enabled model's logits on `ids` against native, and the
    range of the report's per-block SQNR."""

    with torch.inference_mode():
        kl, top1 = logits_agreement(native_logits, model(ids).logits)
    sq = [b.sqnr_db for b in report.blocks if b.sqnr_db is not None]
    return {"kl": kl, "top1": top1,
            "sqnr_min_db": min(sq) if sq else float("nan"), "sqnr_max_db": max(sq) if sq else float("nan")}
