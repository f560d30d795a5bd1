"""hi-na-moe command line: `check`, `bench`, `debug`, `demo`, `cache` and `profile-router`.

(distill comes with its own issue.)

User mistakes (missing path, not an MoE model, bad config) print one line and a hint and exit
with status 2; a demo whose accelerated output disagrees with native exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from ..core.checkpoint import CheckpointError, PickleRefused, checkpoint_dir, safetensors_only
from ..core.config import (
    DEFAULT_GROUP_SIZE,
    ISA_TIERS,
    MAX_THREADS,
    WEIGHT_FORMATS,
    ConfigError,
    load_config,
)
from ..core.formats import LOSSLESS_FORMATS, Format
from ..core.native import native_module
from ..core.registry import decode_call_counts
from ..core.store import _KEY_RE, PackedStore, _human
from ..core.system import system_info
from ..integrate.adapters import _is_interface_experts, discover
from ..integrate.patching import disable_for_model, enable_for_model
from .capabilities import capabilities
from .debug import compare
from .plan import format_table, model_plan, packed_expert_bytes, plan_for_model
from .profile_router import ProfileError, builtin_data, profile_router, read_texts
from .quality import logits_agreement
from .workload import build_layers, make_inputs, set_impl, time_arm


class UserError(Exception):
    """A mistake the user can fix; printed as one line plus a hint, no traceback."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def shipped_model_dir() -> Path | None:
    """The small trained MoE shipped in the repository (models/hina-tiny-moe), if present."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "models" / "hina-tiny-moe"
        if (candidate / "config.json").is_file():
            return candidate
    return None


def _load(path: str | Path, dtype: str):
    from transformers import AutoConfig, AutoModelForCausalLM  # import cost: 0.26 s (measured 2026-12-07)


    try:
        p = checkpoint_dir(path)  # each thing wrong with the directory its own message, naming it
    except (OSError, PickleRefused, CheckpointError) as exc:
        raise UserError(str(exc)) from None
    try:
        AutoConfig.from_pretrained(p)
    except Exception as exc:  # unknown model type, broken json
        raise UserError(f"cannot read the config in {str(p)!r}: {exc}") from None

    try:
        with safetensors_only():  # a model directory's pickles are never unpickled
            model = AutoModelForCausalLM.from_pretrained(
                p, dtype=getattr(torch, dtype) if dtype else "auto", use_safetensors=True).eval()
    except PickleRefused as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        if "safetensors" not in str(exc):
            raise
        raise UserError(f"{str(p)!r} has no safetensors weights ({exc})",
                        "hi_na_moe never loads pickled (*.bin) weights; convert the checkpoint with save_pretrained")
    tokenizer = None
    if (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer  # import cost: 0.27 s (measured 2026-12-07)

        tokenizer = AutoTokenizer.from_pretrained(p)
    return model, tokenizer


def _config_up_front(options: dict[str, tuple[object, str]] | None = None):
    """The config a command will enable with, built before anything is loaded: a bad option
    value, HINA_MOE_* variable or config file (or a tier this CPU lacks) is refused then, not
    after a model load. options: key -> (value, the option it came from); None values are left
    out. ConfigError names the key, the value and the option, variable or file."""
    given = {k: v for k, (v, _) in (options or {}).items() if v is not None}
    return load_config(where={k: flag for k, (_, flag) in (options or {}).items()}, **given)


def _tiny_random_model():
    """A small random OLMoE, for when no trained model is available: it shows the mechanics and
    the exactness check, not meaningful text."""
    from transformers import OlmoeConfig, OlmoeForCausalLM  # import cost: 0.23 s (measured 2026-12-07)

    cfg = OlmoeConfig(hidden_size=256, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=512, num_experts=16, num_experts_per_tok=2,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return OlmoeForCausalLM(cfg).eval()


# ---------------------------------------------------------------------------------------------
def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def cmd_check(args) -> int:
    if args.model:  # before the bandwidth probe's seconds
        try:
            checkpoint_dir(args.model, weights=False)  # only its config is read
        except OSError as exc:
            raise UserError(str(exc)) from None
    info: dict = {"capabilities": capabilities(), "system": system_info(measure_bandwidth=not args.no_bandwidth)}
    bw = info["system"]["read_bandwidth_gbs"]
    if args.model:
        path = Path(args.model)
        try:
            plan = model_plan(path, bw["best"] if bw else None, args.group_size)
        except (ValueError, OSError) as exc:
            raise UserError(f"cannot build {args.model!r} from its config: {exc}") from None
        report = plan["report"]
        if not report.blocks:
            raise UserError(f"no MoE block found in {args.model!r} ({report.model_class})",
                            "for a custom model, use hi_na_moe.enable_for_model(model, router_name=...)")
        formats = format_table(plan, bw["best"] if bw else None, args.group_size)
        plan.pop("report")
        info["model"] = {**plan, "blocks": report.to_dict(), "formats": formats}
    if args.output == "json":
        print(json.dumps(info, indent=2))
        return 0
    cap, sysi = info["capabilities"], info["system"]
    print(f"CPU: {cap.get('brand') or cap['machine']}  native library: {cap['native_library']}")
    if cap.get("cpu"):
        have = [k for k, v in cap["cpu"].items() if v]
        print(f"  CPU features: {' '.join(have)}")
        os_ = cap["os"]
        print(f"  OS enables: AVX={os_['avx']} AVX-512={os_['avx512']} AMX={os_['amx']} "
              f"(AMX permission: {os_['amx_permission']})")
        print(f"  best kernel tier: {cap['best_isa']}; selected: {cap['selected_isa']}")
    print(f"  kernels: decode={cap['kernels']['decode']} prefill={cap['kernels']['prefill']}")
    if cap.get("pool"):
        print(f"  kernel threads: {cap['pool']}")
    if cap.get("prefetch"):
        print(f"  weight-stream prefetch: {cap['prefetch']}")
    if cap.get("store_blocks"):
        print(f"  blocks from the packed-expert store: {cap['store_blocks']}")
    if cap.get("attention"):
        print(f"  attention of decode steps (scope=\"all\"): {cap['attention']}")
    if cap.get("attention_prefill"):
        print(f"  attention of prefill (scope=\"all\"): {cap['attention_prefill']}")
    if cap.get("attention_latent"):
        print(f"  latent attention (MLA) of decode steps (scope=\"all\"): {cap['attention_latent']}")
    if cap.get("note"):
        print(f"  note: {cap['note']}")
    c = sysi["cores"]
    print(f"cores: {c['physical_cores']} physical, {c['logical_cpus']} logical, "
          f"{c['usable_by_this_process']} usable by this process; kernel {sysi['kernel']}")
    for node in sysi["numa_nodes"]:
        print(f"  NUMA node {node['node']}: CPUs {node['cpus']}, memory {_gib(node['memory_bytes'])}")
    print("caches: " + ", ".join(f"{x['name']} {x['bytes'] >> 10} KiB" for x in sysi["caches"]))
    print(f"memory: {_gib(sysi['memory']['total_bytes'])} total, {_gib(sysi['memory']['available_bytes'])} available")
    if bw:
        print(f"read bandwidth (measured now, {bw['threads']} threads): {bw['best']:.1f} GB/s best, "
              f"{bw['median']:.1f} median")
    if os.environ.get("OMP_WAIT_POLICY"):
        print(f"note: OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} is set; on the whole-model benchmark PASSIVE "
              "gave no decode gain with hi_na_moe and slowed transformers' own ops (README, Performance)")
    if args.model:
        m = info["model"]
        print(str(report))
        print(f"weights ({m['dtype']}, lossless): {_gib(m['total_bytes'])} total, experts {_gib(m['expert_bytes'])}, "
              f"dense {_gib(m['dense_bytes'])}; RAM needed when enabled ≈ {_gib(m['ram_estimate_bytes'])} "
              "(the packed experts replace the model's own)")
        if m.get("active_bytes_per_token"):
            line = f"bytes read per decode token: {m['active_bytes_per_token'] / 1e9:.3f} GB (top-{m['top_k']})"
            if m.get("roofline_decode_tokens_per_s"):
                line += f" -> roofline {m['roofline_decode_tokens_per_s']:.1f} tokens/s at {bw['best']:.1f} GB/s"
            print(line)
        if m.get("formats"):
            print("per expert format (packed bytes, scales included; hi_na_moe.from_pretrained loads without the bf16 copy; "
                  "'scope all': the dense layers in that format too, except dense_lossless (default lm_head)):")
            print("  | weights | experts | RAM when enabled | read per decode token | roofline tokens/s |")
            for f in m["formats"]:
                roof = f"{f['roofline_decode_tokens_per_s']:.1f}" if f.get("roofline_decode_tokens_per_s") else "-"
                per = f"{f['active_bytes_per_token'] / 1e9:.3f} GB" if f.get("active_bytes_per_token") else "-"
                print(f"  | {f['weights']} | {_gib(f['expert_bytes'])} | ≈ {_gib(f['ram_estimate_bytes'])} | {per} | {roof} |")
    return 0


def _exactly(model, ids, n: int, on_retry=None, **kw):
    """Greedy generate() of exactly n new tokens: end-of-sequence turned off (eos_token_id=None),
    not suppressed at every step with min_new_tokens, whose logits processors (an EOS mask over
    the vocabulary, then a where) cost 1.6 ms a step on a 151936-token vocabulary (Qwen's), for
    transformers and hi_na_moe alike (benchmarks/log/decode-step.md, 2026-12-05). A transformers that
    reads eos_token_id=None as "the model's own" and stops early gets min_new_tokens after all
    (said on stderr, once; on_retry() is called first). Call under inference mode."""
    global _EOS_OFF_IGNORED
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, **kw)
    if out.shape[1] - ids.shape[1] >= n:
        return out
    if not _EOS_OFF_IGNORED:
        _EOS_OFF_IGNORED = True
        print("note: generate() stopped at the end-of-sequence token with eos_token_id=None; "
              "using min_new_tokens instead (its logits processors add to every step's time)", file=sys.stderr)
    if on_retry is not None:
        on_retry()
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


_EOS_OFF_IGNORED = False


def _generate(model, ids, n):
    start = time.perf_counter()
    with torch.inference_mode():
        out = _exactly(model, ids, n)
    return out, time.perf_counter() - start


def cmd_demo(args) -> int:

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    _config_up_front()  # the demo enables with the environment's config
    path = args.model or shipped_model_dir()
    tokenizer = None
    if path is not None:
        model, tokenizer = _load(path, args.dtype)
        print(f"model: {path}")
    else:
        model = _tiny_random_model().to(getattr(torch, args.dtype))
        print("model: no trained model found (models/hina-tiny-moe); using a small random OLMoE "
              "(its text is meaningless; the exactness check is not)")
    torch.manual_seed(0)
    prompts = ["The function returns", "Return a new list of", "This module provides"]
    if tokenizer is not None:
        batch = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    else:
        batch = [torch.randint(3, model.config.vocab_size, (1, 6)) for _ in prompts]
    _generate(model, batch[0], 2)  # warm-up, not timed
    native = [_generate(model, ids, args.max_new_tokens) for ids in batch]
    report = enable_for_model(model)
    print(report)
    _generate(model, batch[0], 2)
    ours = [_generate(model, ids, args.max_new_tokens) for ids in batch]
    disable_for_model(model)

    same = True
    n = args.max_new_tokens
    for prompt, ids, (a, ta), (b, tb) in zip(prompts, batch, native, ours):
        ok = torch.equal(a, b)
        same &= ok
        text = tokenizer.decode(a[0], skip_special_tokens=True) if tokenizer is not None else str(a[0].tolist())
        print(f"\nprompt: {prompt!r}")
        print(f"  native    {n / ta:7.1f} tok/s | {text!r}")
        if not ok:
            other = tokenizer.decode(b[0], skip_special_tokens=True) if tokenizer is not None else str(b[0].tolist())
            print(f"  hi_na_moe {n / tb:7.1f} tok/s | {other!r}  <-- DIFFERS")
        else:
            print(f"  hi_na_moe {n / tb:7.1f} tok/s | identical tokens")
    kernel = "reference path" if not report.accelerated else "native kernels"
    print(f"\n{'all outputs identical' if same else 'OUTPUTS DIFFER'} (lossless mode, hi_na_moe on its {kernel})")
    if report.accelerated:
        _demo_quantised(model, tokenizer, prompts, batch, native, n)
    if args.model is None and not args.skip_workload:
        same &= _demo_workload(args)
    return 0 if same else 1


def _demo_quantised(model, tokenizer, prompts, batch, native, n) -> None:
    """Part 1b: the same prompts with int8 and int4 experts: texts, tokens/s, and how many of the
    generated tokens agree with native (quantised experts are lossy by design: not a failure).
    The packed experts go to a temporary store, so the demo leaves nothing in the user's cache."""

    with tempfile.TemporaryDirectory(prefix="hi_na_moe-demo-") as cache:
        for weights in ("int8", "int4"):
            report = enable_for_model(model, weights=weights, cache_dir=cache)
            try:
                _generate(model, batch[0], 2)
                runs = [_generate(model, ids, n) for ids in batch]
            finally:
                disable_for_model(model)
            label = report.accelerated[0].weights if report.accelerated else weights
            sq = [b.sqnr_db for b in report.blocks if b.sqnr_db is not None]
            agree = total = 0
            print(f"\n{label} experts (block SQNR {min(sq):.1f}-{max(sq):.1f} dB on a random probe):")
            for prompt, ids, (a, _), (b, tb) in zip(prompts, batch, native, runs):
                new_a, new_b = a[0, ids.shape[1]:], b[0, ids.shape[1]:]
                same = int((new_a == new_b).sum())
                first = next((i for i, (x, y) in enumerate(zip(new_a.tolist(), new_b.tolist())) if x != y), len(new_a))
                agree += same
                total += len(new_a)
                text = tokenizer.decode(b[0], skip_special_tokens=True) if tokenizer is not None else str(b[0].tolist())
                print(f"  {prompt!r}: {n / tb:7.1f} tok/s | {text!r}")
                print(f"      {same}/{len(new_a)} tokens equal to native, first difference at token "
                      f"{first if first < len(new_a) else 'none'}")
            print(f"  {label}: {agree}/{total} generated tokens equal to native ({100 * agree / max(1, total):.0f} %)")


def _bandwidth(threads: int) -> float:
    """Best of a few ~1 GiB read passes (GB/s), NaN without the native library."""
    native, _ = native_module()
    return native.measure_read_bandwidth(1 << 30, threads, 3)["best_gbs"] if native is not None else float("nan")


# Each timed call of the demo's workload is followed by one read of this many bytes on the
# native read probe (round robin over a 1 GiB buffer: hi_na_moe._native.BandwidthProbe), so the
# limit a call is held against was measured in the same minute, under the same neighbours.
PROBE_READ_BYTES = 256 << 20


def read_limit(achieved_gbs: float, probe_gbs: float) -> tuple[float, bool]:
    """(the read limit a row of the demo's table is held against, whether it is the row's own
    rate). The limit is the paired probe's median, unless the calls read faster than it: then the
    probe was only a lower bound of the machine's read bandwidth, and the best rate measured, the
    calls' own, is the limit; so no share above 100 % is ever shown. The probe streams without
    software prefetch, in baseline-ISA code on CPUs without AVX-512: a user's AVX2-only CPU showed
    hi_na_moe's decode at 106 % of it, and here (2026-12-07, Zen 4, one thread) prefill calls read
    12.2 GB/s against its 9.1. NaN probe (no native library): NaN limit."""
    if probe_gbs != probe_gbs:
        return float("nan"), False
    return (achieved_gbs, True) if achieved_gbs > probe_gbs else (probe_gbs, False)


def workload_table(rows: list[tuple[str, str, float, float, float, float]]) -> list[str]:
    """The demo's part-2 table: rows of (provider, case, median ms, achieved GB/s, relative
    error, paired probe GB/s), the first provider the speedups' base."""
    base = {case: ms for label, case, ms, *_ in rows if label == rows[0][0]}
    lines = ["| provider | case | median ms | achieved GB/s | paired read probe GB/s | share of read limit | "
             "speedup | rel err |", "|---|---|---|---|---|---|---|---|"]
    capped = False
    for label, case, ms, gbs, err, probe in rows:
        limit, own = read_limit(gbs, probe)
        capped |= own
        share = "-" if limit != limit else f"{100 * gbs / limit:.0f}%" + (" *" if own else "")
        probe_text = "-" if probe != probe else f"{probe:.1f}"
        lines.append(f"| {label} | {case} | {ms:.1f} | {gbs:.1f} | {probe_text} | {share} | {base[case] / ms:.2f}x | "
                     f"{err:.1e} |")
    if capped:
        lines.append("* these calls read faster than the probe read right after them: here the probe is only a lower "
                     "bound of the machine's read bandwidth, so their limit is their own rate")
    return lines


def _demo_workload(args) -> bool:
    """Part 2: a realistic-size stack of OLMoE-1B-7B-shaped MoE layers (random bf16 weights,
    805 MB of experts per layer, cycled so the working set is far larger than the L3 cache):
    transformers' default experts path vs hi_na_moe, decode and prefill, with achieved GB/s
    against a read probe paired with each call (read_limit)."""
    n_layers = 1 if args.quick else 3
    decode_iters, prefill_iters, prefill_t = (4, 1, 32) if args.quick else (16, 3, 128)
    threads = torch.get_num_threads()
    print(f"\n== realistic workload: {n_layers} OLMoE-1B-7B-shaped MoE layer(s) (E64 H2048 I1024 top-8, bf16), "
          f"{threads} threads ==")
    native, _ = native_module()
    probe = native.BandwidthProbe(1 << 30, threads) if native is not None else None
    with tqdm(total=n_layers, desc="building layers", unit="layer", leave=False) as bar:
        cfg, layers = build_layers("olmoe", n_layers, torch.bfloat16, progress=bar.update)
    dtype = torch.bfloat16
    x, idx, w = make_inputs(cfg, 17, dtype, 7)
    set_impl(layers, "grouped_mm")
    with torch.inference_mode():
        want = layers[0](x, idx, w).float()
    rows = []
    arms = [("transformers (grouped_mm)", None), ("hi_na_moe", "enable")]
    ok = True
    kernel = "-"
    for label, how in tqdm(arms, desc="timing", leave=False):
        report = enable_for_model(layers) if how else None
        with torch.inference_mode():
            got = layers[0](x, idx, w).float()
        err = ((got - want).norm() / want.norm()).item()
        ok &= err < 2e-2
        for case, T, iters in (("decode T=1", 1, decode_iters), (f"prefill T={prefill_t}", prefill_t, prefill_iters)):
            reads: list[float] = []
            after = (lambda: reads.append(probe.read(PROBE_READ_BYTES))) if probe is not None else None
            s, b = time_arm(layers, cfg, T, dtype, iters, warmup=n_layers, seed0=100, after=after)
            med = statistics.median(s)
            gbs = statistics.median([bb / ss for bb, ss in zip(b, s)]) / 1e9
            rows.append((label, case, med * 1e3, gbs, err, statistics.median(reads) if reads else float("nan")))
        if report is not None:
            kernel = report.blocks[0].kernel
            disable_for_model(layers)
    del probe
    print(f"read limit: the native read probe, one {PROBE_READ_BYTES >> 20} MiB read right after each timed call "
          f"(median of a row's reads), or the row's own rate where it read faster; hi_na_moe kernels: {kernel}")
    for line in workload_table(rows):
        print(line)
    if not ok:
        print("hi_na_moe output differs from transformers beyond bf16 rounding")
    return ok


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
    _config_up_front({"weights": (args.weights, "--weights"), "group_size": (args.group_size, "--group-size"),
                      "scope": (args.scope, "--scope")})
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = shipped_model_dir() if args.model == "builtin" else args.model
    if path is None:
        raise UserError("--model builtin: the shipped model (models/hina-tiny-moe) is not in this installation",
                        "pass --model PATH")
    model, _ = _load(path, args.dtype)
    bw = _bandwidth(threads)
    bw = bw if bw == bw else None  # NaN: no native library
    plan = plan_for_model(model, bw, args.group_size)
    if not plan["report"].blocks:
        raise UserError(f"no MoE block found in {str(path)!r}", "bench compares MoE acceleration; is this an MoE model?")
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
    if args.weights not in LOSSLESS_FORMATS:
        with torch.inference_mode():
            native_logits = model(ids).logits.float()
    results, tokens = {}, {}
    for arm in arms:
        report = enable_for_model(model, weights=args.weights, group_size=args.group_size,
                                            **({"scope": args.scope} if args.scope else {})) \
            if arm == "hina" else None
        if report is not None and args.weights not in LOSSLESS_FORMATS:
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
        prefill, decode, outs = [], [], []
        for _ in range(args.num_iters):
            out, pre, lat = _timed_generate(model, ids, args.gen_tokens, args.kv_cache)
            bar.update()
            prefill.append(pre)
            decode += lat
            outs.append(out)
        tokens[arm] = outs[0]
        if report is not None:
            counts = decode_call_counts(model)
            # matched on the probe, yet every decode call at runtime took the module's own forward
            refused = sorted(n for n, (native, own) in counts.items() if own and not native)
        step = statistics.median(decode)
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
            "achieved_gbs": step_bytes / step / 1e9 if step_bytes else None,
            "memory_bandwidth_util_pct": 100 * step_bytes / step / 1e9 / bw if step_bytes and bw else None,
            "quality_vs_native": quality.get(arm),
            "dense_layers": len(report.dense) if report is not None else 0,
            "attention_decode_calls": ({n: {"native": a, "own_forward": b} for n, (a, b) in counts.items()}
                                       if report is not None else None),
            "attention_refused_at_runtime": refused if report is not None else None,
            "peak_rss_bytes": _peak_rss(),
            "samples": {"prefill_s": prefill, "decode_step_s": decode},
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
              f"{args.gen_tokens} new tokens x {args.num_iters}, {args.kv_cache} KV cache, {threads} threads; "
              f"machine read bandwidth "
              f"{bw:.1f} GB/s; {active / 1e9:.3f} GB read per decode token" if bw and active else "")
        if args.batch_size > 1 and step_native:
            print(f"a decode step of {args.batch_size} rows reads {step_native / 1e9:.3f} GB natively"
                  + (f" (the union of the rows' experts: {statistics.fmean(union.values()):.1f} of each block's "
                     f"experts on average, against top-{k} for one token)" if union else
                     " (counted as one token's: this family's experts do not show their routing)"))
        print("| arm | kernels | pp t/s | tg t/s | avg ms | p50 ms | p95 ms | p99 ms | GB/s | bw util % | peak RSS GiB | speedup tg |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        base = results[arms[0]]["tg_tokens_per_s"]
        for arm, r in results.items():
            lat = r["latency_ms"]
            gbs = f"{r['achieved_gbs']:.1f}" if r["achieved_gbs"] else "-"
            util = f"{r['memory_bandwidth_util_pct']:.0f}" if r["memory_bandwidth_util_pct"] else "-"
            rss = f"{r['peak_rss_bytes'] / 2**30:.2f}" if r["peak_rss_bytes"] else "-"
            print(f"| {arm} | {r['kernel']} | {r['pp_tokens_per_s']:.1f} | {r['tg_tokens_per_s']:.1f} | {lat['avg']:.2f} | "
                  f"{lat['p50']:.2f} | {lat['p95']:.2f} | {lat['p99']:.2f} | {gbs} | {util} | {rss} | "
                  f"{r['tg_tokens_per_s'] / base:.2f}x |")
        for arm, q in quality.items():
            print(f"{arm} ({args.weights}) vs native on the prompt: logits KL {q['kl']:.4f} nats/token, top-1 agreement "
                  f"{100 * q['top1']:.1f} %, block SQNR {q['sqnr_min_db']:.1f}-{q['sqnr_max_db']:.1f} dB (random probe)")
        for arm, r in results.items():
            if r["attention_refused_at_runtime"]:
                bad = r["attention_refused_at_runtime"]
                print(f"note: {len(bad)} attention module(s) matched their probe at enable but took their own forward "
                      f"at every decode step of this run (e.g. {bad[0]}): a runtime argument the native path does "
                      "not take; please report it")
        if same is not None:
            print("greedy tokens: " + ("identical" if same else "DIFFERENT between native and hina")
                  + ("" if args.weights in LOSSLESS_FORMATS else f" (expected to differ with {args.weights} weights)"))
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(data, indent=2))
    # lossless: any difference in greedy tokens is a failure; quantised: differences are expected
    return 0 if same is not False or args.weights not in LOSSLESS_FORMATS else 1


def _quality_vs_native(model, ids, native_logits, report) -> dict:
    """KL and top-1 agreement of the enabled model's logits on `ids` against native, and the
    range of the report's per-block SQNR."""

    with torch.inference_mode():
        kl, top1 = logits_agreement(native_logits, model(ids).logits)
    sq = [b.sqnr_db for b in report.blocks if b.sqnr_db is not None]
    return {"kl": kl, "top1": top1,
            "sqnr_min_db": min(sq) if sq else float("nan"), "sqnr_max_db": max(sq) if sq else float("nan")}


def cmd_debug(args) -> int:
    if not args.prompt and not args.prompts:
        raise UserError("debug needs --prompt TEXT or --prompts FILE")
    if args.tolerance is not None and not (args.tolerance > 0 and math.isfinite(args.tolerance)):
        raise UserError(f"--tolerance must be a number > 0, got {args.tolerance:g}",
                        "a relative L2 error per layer, e.g. 1e-4")
    config = {k: v for k, v in (("isa", args.isa), ("backend", args.backend), ("weights", args.weights),
                                 ("group_size", args.group_size)) if v}
    _config_up_front({k: (v, "--" + k.replace("_", "-")) for k, v in config.items()})
    baseline = None
    if args.against != "native":
        key, _, value = args.against.partition("=")
        if key not in ("weights", "isa") or not value:
            raise UserError(f"--against {args.against!r}: expected native, weights=FORMAT or isa=TIER",
                            "e.g. --weights int4 --against weights=int8, or --isa avx2 --against isa=avx512")
        baseline = {key: value, **({"group_size": args.group_size} if key == "weights" and args.group_size else {})}
        _config_up_front({k: (v, "--against" if k == key else "--group-size") for k, v in baseline.items()})
    prompts = list(args.prompt or [])
    if args.prompts:
        f = Path(args.prompts)
        if not f.is_file():
            raise UserError(f"--prompts file {args.prompts!r} does not exist")
        prompts += [line for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    model, tokenizer = _load(args.model, args.dtype)
    if tokenizer is None:
        raise UserError(f"{args.model!r} has no tokenizer to encode the prompts",
                        "save the tokenizer next to the model (tokenizer.save_pretrained)")
    reports = []
    for prompt in prompts:
        inputs = dict(tokenizer(prompt, return_tensors="pt"))
        rep = compare(model, inputs, tolerance=args.tolerance, baseline=baseline, **config)
        reports.append((prompt, rep))
    ok = all(r.ok for _, r in reports)
    if args.output == "json":
        print(json.dumps({"ok": ok, "prompts": [{"prompt": p, **r.to_dict()} for p, r in reports]}, indent=2))
    else:
        for prompt, rep in reports:
            print(f"\nprompt: {prompt!r}")
            print(rep)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# cache: what the packed-expert store holds, and removing it

def _cache_store(cache_dir: str | None):
    """The store `cache list/clear` work on, or None when the default store does not exist yet.
    Never creates the directory: looking must not leave one behind, and a mistyped --cache-dir
    must be an error rather than an empty store."""
    if cache_dir:
        root = Path(cache_dir).expanduser()
        if not root.exists():
            raise UserError(f"--cache-dir {cache_dir!r} does not exist",
                            "pass the directory the store is in (the config's cache_dir, HINA_MOE_CACHE_DIR); "
                            "without --cache-dir the configured one is used")
    else:
        root = load_config().store_root()  # what enable_for_model would use: config file and env
        if not root.exists():
            return None
    if not root.is_dir():
        raise UserError(f"the store directory {str(root)!r} is not a directory",
                        "pass the packed-expert store's directory with --cache-dir")
    try:
        os.listdir(root)
    except OSError as exc:
        raise UserError(f"cannot read the store directory {str(root)!r}: {exc.strerror or exc}") from None
    return PackedStore(root)


def _n(count: int, word: str) -> str:
    """'1 entry', '2 entries', '1 file', '3 files'."""
    if count == 1:
        return f"1 {word}"
    return f"{count} {word[:-1]}ies" if word[-1] == "y" and word[-2] not in "aeiou" else f"{count} {word}s"


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _values(vals: list, empty: str = "?") -> str:
    return ",".join(str(v) for v in vals) if vals else empty


def cache_report(store, verify: str = "header") -> dict:
    """What `hi-na-moe cache list` shows, as one JSON-serialisable dict: per key directory what
    its readable entries record (format, tier, layout version, group size, dtype, kind, entry
    names; the key itself is a one-way digest of the weights and these parameters), counts,
    bytes, last change and each unreadable file with the reason; then totals."""
    keys = []
    for ks in store.summary(verify):
        d = ks.describe()
        keys.append({
            "key": ks.key, "path": str(ks.path), **d,
            "entries": len(ks.entries), "unreadable": len(ks.unreadable),
            "size_bytes": ks.size_bytes, "size": _human(ks.size_bytes),
            "modified": None if ks.mtime is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(ks.mtime)),
            "modified_epoch": ks.mtime, "problem": ks.problem,
            "files": [{"file": f.file, "kind": f.kind, "name": f.name, "status": f.status or None,
                       "reason": f.reason, "size_bytes": f.size,
                       "meta": None if f.meta is None else {k: v for k, v in f.meta.items() if k != "header"}}
                      for f in ks.files],
        })
    # related keys together: by what they hold (layer order), then format and tier; the key
    # digests themselves order nothing
    keys.sort(key=lambda k: ([str(v) for v in k["source"]], _natural(k["names"][0]) if k["names"] else [(2, "")],
                             [str(v) for v in k["format"]], [str(v) for v in k["tier"]], k["key"]))
    by_source: dict[str, dict] = {}  # which model the keys belong to, as far as the entries record it
    for k in keys:
        for src in k["source"] or ([NO_SOURCE] if k["entries"] > k["unreadable"] else []):
            slot = by_source.setdefault(src, {"keys": 0, "size_bytes": 0, "formats": set(), "tiers": set()})
            slot["keys"] += 1
            slot["size_bytes"] += k["size_bytes"]
            slot["formats"].update(str(v) for v in k["format"])
            slot["tiers"].update(str(v) for v in k["tier"])
    by_format: dict[str, dict] = {}  # what `cache clear --format F` would free, roughly
    for k in keys:
        fmt = ",".join(str(v) for v in k["format"]) or ("unreadable" if k["entries"] else "empty")
        slot = by_format.setdefault(fmt, {"keys": 0, "size_bytes": 0})
        slot["keys"] += 1
        slot["size_bytes"] += k["size_bytes"]
    foreign = sorted(n for n in os.listdir(store.root) if not _KEY_RE.match(n))
    layout = _current_layout()
    old = [k for k in keys if layout is not None and any(isinstance(v, int) and v != layout for v in k["layout_version"])]
    files = [f for k in keys for f in k["files"]]
    tmp = [f for f in files if f["kind"] == "tmp"]
    total = sum(k["size_bytes"] for k in keys)
    return {
        "root": str(store.root), "verify": verify, "keys": keys,
        "total": {"keys": len(keys), "entries": sum(k["entries"] for k in keys),
                  "unreadable": sum(k["unreadable"] for k in keys), "size_bytes": total, "size": _human(total),
                  "tmp_files": len(tmp), "tmp_bytes": sum(f["size_bytes"] for f in tmp),
                  "tmp_in_use": sum(f["status"] == "in use" for f in tmp),
                  "other_files": sum(f["kind"] == "other" for f in files), "other_in_root": foreign,
                  "by_format": dict(sorted(by_format.items())),
                  # entries of another packed layout version than this build's (None: unknown here)
                  "layout_version": layout, "old_layout": {"keys": len(old),
                                                           "size_bytes": sum(k["size_bytes"] for k in old)},
                  "by_source": {src: {**v, "formats": sorted(v["formats"]), "tiers": sorted(v["tiers"]),
                                      "size": _human(v["size_bytes"])} for src, v in sorted(by_source.items())}},
    }


# what `cache list` says of entries written before the store recorded their source
NO_SOURCE = "(not recorded: written before hi_na_moe kept it)"


def _natural(text: str) -> list[tuple[int, object]]:
    """Sort key putting model.layers.2 before model.layers.10."""
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", text) if t]


def _names(names: list[str], width: int = 60) -> str:
    if not names:
        return "-"
    text = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} more)"
    return text if len(text) <= width else text[: width - 3] + "..."


def _print_cache_report(rep: dict) -> None:
    print(f"packed-expert store: {rep['root']}")
    if not rep["keys"]:
        print("  empty: no key directory")
    else:
        head = ("KEY", "KIND", "FORMAT", "GROUP", "TIER", "LAYOUT", "DTYPE", "ENTRIES", "SIZE", "MODIFIED", "HOLDS")
        rows = []
        for k in rep["keys"]:
            entries = str(k["entries"]) + (f" ({k['unreadable']} bad)" if k["unreadable"] else "")
            groups = [g for g in k["group_size"] if g]  # 0: not grouped (every format but int4)
            unknown = "?" if k["entries"] else "-"  # "?": no entry here could be read
            rows.append((k["key"][:12], _values(k["kind"], unknown), _values(k["format"], unknown),
                         _values(groups, "-"), _values(k["tier"], unknown), _values(k["layout_version"], unknown),
                         _values(k["dtype"], unknown), entries,
                         k["size"], _when(k["modified_epoch"]), _names(k["names"])))
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
        print("  " + "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
        for k, row in zip(rep["keys"], rows):
            print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if k["problem"]:
                print(f"      ! the directory: {k['problem']}")
            for f in k["files"]:
                if f["kind"] == "entry" and f["status"] != "ok":
                    print(f"      ! {f['status']} entry {f['file']} ({_human(f['size_bytes'])}): {f['reason']}")
                elif f["kind"] == "tmp":
                    state = ("being written (" + f["reason"] + ")" if f["status"] == "in use"
                             else "left by an interrupted write")
                    print(f"      ! temp file {f['file']} ({_human(f['size_bytes'])}): {state}")
                elif f["kind"] == "other":
                    print(f"      ! {f['file']}: not a store file, left alone")
    t = rep["total"]
    line = f"total: {_n(t['keys'], 'key')}, {_n(t['entries'], 'entry')}, {t['size']}"
    if t["unreadable"]:
        line += f"; {t['unreadable']} unreadable (corrupt, stale or unsafe)"
    if t["tmp_files"]:
        line += f"; {_n(t['tmp_files'], 'temp file')} ({_human(t['tmp_bytes'])})"
        if t["tmp_in_use"]:
            line += f", {t['tmp_in_use']} of a write in progress"
    print(line)
    if t["by_source"]:
        print("  by source (the checkpoint or model the entries were built from):")
        for src, v in t["by_source"].items():
            print(f"    {src}: {_n(v['keys'], 'key')}, {v['size']} ({', '.join(v['formats']) or '?'}; "
                  f"tier {', '.join(v['tiers']) or '?'})")
    if len(t["by_format"]) > 1:
        print("  by format: " + ", ".join(f"{fmt} {_human(v['size_bytes'])} ({_n(v['keys'], 'key')})"
                                          for fmt, v in t["by_format"].items()))
    if t["unreadable"] or t["tmp_files"] - t["tmp_in_use"]:
        print("  `hi-na-moe cache clear --stale` removes the unreadable entries and leftover temp files")
    if t["old_layout"]["keys"]:
        print(f"  {_n(t['old_layout']['keys'], 'key')} ({_human(t['old_layout']['size_bytes'])}) hold entries of another "
              f"packed layout than this build's ({t['layout_version']}), never read again: "
              "`hi-na-moe cache clear --old-layout` removes them")
    other = ([_n(t["other_files"], "file") + " in key directories"] if t["other_files"] else []) + \
        ([f"{_n(len(t['other_in_root']), 'name')} beside them ({_names(t['other_in_root'])})"]
         if t["other_in_root"] else [])
    if other:
        print(f"  not the store's, never touched: {'; '.join(other)}")
    if rep["verify"] == "header":
        print("  entries checked by their headers; --verify reads every byte (checksums)")


def cmd_cache_list(args) -> int:
    store = _cache_store(args.cache_dir)
    if store is None:
        root = str(load_config().store_root())
        if args.output == "json":
            print(json.dumps({"root": root, "exists": False, "keys": [], "total": {"keys": 0, "entries": 0,
                                                                                   "size_bytes": 0}}, indent=2))
        else:
            print(f"packed-expert store: {root} does not exist yet: nothing is cached")
        return 0
    rep = cache_report(store, "full" if args.verify else "header")
    if args.output == "json":
        print(json.dumps({**rep, "exists": True}, indent=2))
    else:
        _print_cache_report(rep)
    return 0


CLEAR_FILTERS = "--key KEY, --source S, --format F, --tier T, --old-layout, --stale, or --all"


def resolve_key(summaries, prefix: str) -> str:
    """The one key directory whose name starts with `prefix` (a full key or its first digits,
    as `cache list` shows them); UserError when none or several match."""
    want = prefix.strip().lower()
    if not want or any(c not in "0123456789abcdef" for c in want):
        raise UserError(f"--key {prefix!r} is not a key: keys are hexadecimal digests",
                        "copy one from the KEY column of `hi-na-moe cache list`")
    found = [s.key for s in summaries if s.key.startswith(want)]
    if not found:
        raise UserError(f"--key {prefix!r} matches no key directory in the store "
                        f"({len(summaries)} keys there)", "`hi-na-moe cache list` shows the keys")
    if len(found) > 1:
        shown = ", ".join(k[:16] for k in found[:5]) + (", ..." if len(found) > 5 else "")
        raise UserError(f"--key {prefix!r} matches {len(found)} keys: {shown}",
                        "give more of the key's digits")
    return found[0]


def _same_source(recorded, wanted: str) -> bool:
    """Whether an entry's recorded source is `wanted` (as given, or as an absolute path)."""
    if recorded is None:
        return False
    return str(recorded) in (wanted, str(Path(wanted).expanduser().resolve()))


def select_for_clear(summaries, key: str | None = None, format: str | None = None, tier: str | None = None,
                     stale: bool = False, all: bool = False, source: str | None = None,
                     old_layout: int | None = None) -> list:
    """The store files `cache clear` with these filters removes (store.StoreFile, from
    `PackedStore.summary`). Filters combine (and). `all`: every store file. A key alone: all of
    its files. `stale`: entries that are not readable (corrupt, another store format version,
    unsafe), temp files and lock files without an entry. format / tier: the readable entries
    that record them. old_layout (this build's packed layout version): the readable entries
    recording another one, which this build never reads (their keys differ). An entry is chosen
    alone; `PackedStore.delete` takes its lock file along. Files that are not the store's are
    never chosen."""
    if all:
        return [f for s in summaries for f in s.files if f.kind != "other"]
    chosen = []
    for s in summaries:
        if key is not None and s.key != key:
            continue
        if not (format or tier or stale or source or old_layout is not None):  # a key alone: the whole key directory
            chosen += [f for f in s.files if f.kind != "other"]
            continue
        for f in s.entries:
            if stale and f.readable:
                continue
            if format and f.meta_value("format") != format:
                continue
            if tier and f.meta_value("tier") != tier:
                continue
            if source and not _same_source(f.meta_value("source"), source):
                continue
            if old_layout is not None:
                v = f.meta_value("layout_version")
                if not isinstance(v, int) or v == old_layout:
                    continue
            chosen.append(f)
        if stale and not (format or tier or source or old_layout is not None):
            have = {f.file for f in s.entries}
            chosen += [f for f in s.files if f.kind == "tmp"
                       or (f.kind == "lock" and f.file[: -len(".lock")] not in have)]
    return chosen


def _filters_text(args) -> str:
    parts = [f"--key {args.key}" if args.key else "", f"--source {args.source}" if args.source else "",
             f"--format {args.format}" if args.format else "",
             f"--tier {args.tier}" if args.tier else "", "--old-layout" if args.old_layout else "",
             "--stale" if args.stale else "", "--all" if args.all else ""]
    return " ".join(p for p in parts if p)


def _confirm(prompt: str) -> bool:
    sys.stderr.write(prompt)  # stderr: stdout stays clean for --output json
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _current_layout() -> int | None:
    """This build's packed layout version, or None without the native extension."""
    native, _ = native_module()
    return None if native is None else int(native.PACKED_LAYOUT_VERSION)


def _layout_version() -> int:
    """This build's packed layout version, for --old-layout; UserError without the native extension."""
    layout = _current_layout()
    if layout is None:
        raise UserError(f"--old-layout compares entries with this build's packed layout version, which the "
                        f"native extension holds, and it could not be loaded ({native_module()[1]})",
                        "`hi-na-moe check` says more; or select the old entries with --key or --format")
    return layout


def cmd_cache_clear(args) -> int:
    if not (args.key or args.source or args.format or args.tier or args.old_layout or args.stale or args.all):
        raise UserError(f"cache clear needs a filter saying what to remove: {CLEAR_FILTERS}",
                        "`hi-na-moe cache list` shows what is there; add --dry-run to see what would go")
    if args.all and (args.key or args.source or args.format or args.tier or args.old_layout or args.stale):
        raise UserError("--all removes every store file; it cannot be combined with --key, --source, --format, "
                        "--tier, --old-layout or --stale",
                        "drop --all to remove only what the other filters select")
    store = _cache_store(args.cache_dir)
    if store is None:
        print(f"packed-expert store: {load_config().store_root()} does not exist yet: nothing to clear")
        return 0
    summaries = store.summary("full" if args.verify else "header")
    key = resolve_key(summaries, args.key) if args.key else None
    chosen = select_for_clear(summaries, key, args.format, args.tier, args.stale, args.all, args.source,
                              _layout_version() if args.old_layout else None)
    dry = store.delete(chosen, dry_run=True)  # the same checks as the real run: what is in use
    data = {"root": str(store.root), "filters": _filters_text(args), "dry_run": bool(args.dry_run),
            "files": len(dry.removed), "bytes": dry.freed}
    if not dry.removed:
        why = "" if not dry.skipped else f" ({_n(len(dry.skipped), 'file')} skipped, below)"
        held = {what: sorted({str(v) for s in summaries for v in s.describe()[what]})
                for what in ("format", "tier", "source")}
        hint = "; ".join(f"{k}s in the store: {', '.join(v)}" for k, v in held.items() if v and getattr(args, k))
        if args.output == "json":
            print(json.dumps({**data, "removed": [], "skipped": _skipped_json(dry.skipped), "freed_bytes": 0},
                             indent=2))
        else:
            print(f"nothing to clear in {store.root} for {data['filters']}{why}" + (f" ({hint})" if hint else ""))
            _print_skipped(dry.skipped)
        return 1 if dry.skipped else 0
    if args.output != "json":
        print(f"packed-expert store: {store.root}; {data['filters']} selects:")
        _print_selection(dry.removed)
        _print_skipped(dry.skipped)
    if args.dry_run:
        if args.output == "json":
            print(json.dumps({**data, "removed": [_file_json(f) for f in dry.removed],
                              "skipped": _skipped_json(dry.skipped), "freed_bytes": 0}, indent=2))
        else:
            print(f"dry run: would remove {_n(len(dry.removed), 'file')}, {_human(dry.freed)} ({dry.freed} bytes); "
                  "nothing was removed")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise UserError("refusing to remove files without confirmation: stdin is not a terminal",
                            "pass --yes to clear without asking (--dry-run shows what would go)")
        if not _confirm(f"remove {_n(len(dry.removed), 'file')}, {_human(dry.freed)}? [y/N] "):
            print("cancelled; nothing was removed", file=sys.stderr)
            return 1
    res = store.delete(dry.removed)
    if args.output == "json":
        print(json.dumps({**data, "removed": [_file_json(f) for f in res.removed],
                          "skipped": _skipped_json(dry.skipped + res.skipped), "freed_bytes": res.freed,
                          "key_dirs_removed": res.dirs_removed}, indent=2))
    else:
        _print_skipped(res.skipped)
        print(f"removed {_n(len(res.removed), 'file')}, freed {_human(res.freed)} ({res.freed} bytes)"
              + (f"; {_n(len(res.dirs_removed), 'emptied key directory')} removed" if res.dirs_removed else ""))
    return 1 if (dry.skipped or res.skipped) else 0


def _file_json(f) -> dict:
    return {"key": f.key, "file": f.file, "kind": f.kind, "name": f.name, "status": f.status or None,
            "size_bytes": f.size}


def _skipped_json(skipped) -> list[dict]:
    return [{**_file_json(f), "skipped_because": why} for f, why in skipped]


def _print_selection(files) -> None:
    """One line per key: what goes from it (entries by state, other files), bytes, names."""
    by_key: dict[str, list] = {}
    for f in files:
        by_key.setdefault(f.key, []).append(f)
    for key, fs in by_key.items():
        entries = [f for f in fs if f.kind == "entry"]
        ok = [f for f in entries if f.readable]
        fmt = sorted({str(f.meta_value("format")) for f in ok} | {str(f.meta_value("tier")) for f in ok})
        bad = len(entries) - len(ok)
        parts = [_n(len(entries), "entry") + (f" ({bad} unreadable)" if bad else "")]
        tmp = sum(f.kind == "tmp" for f in fs)
        if tmp:
            parts.append(_n(tmp, "temp file"))
        locks = sum(f.kind == "lock" for f in fs)
        if locks:
            parts.append(_n(locks, "lock file"))
        names = sorted({f.name for f in entries if f.name})
        print(f"  {key[:12]}  {' '.join(fmt) or '-'}  {', '.join(parts)}, {_human(sum(f.size for f in fs))}"
              f"  {_names(names)}")


def _print_skipped(skipped) -> None:
    for f, why in skipped:
        print(f"  skipped {f.file} (key {f.key[:12]}): {why}")


def cmd_profile_router(args) -> int:
    """Route text through a model, record every routing decision, and write the profile."""
    for name in ("tokens", "seq_len", "batch_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    path = shipped_model_dir() if args.model == "builtin" else args.model
    if path is None:
        raise UserError("--model builtin: the shipped model (models/hina-tiny-moe) is not in this installation",
                        "pass --model PATH")
    # the data before the model: a bad file is named without waiting for a load
    try:
        if args.data == "builtin":
            data_path = builtin_data()
            if data_path is None:
                raise UserError("--data builtin: the project's held-out corpus (data/heldout.txt) is not in this "
                                "installation", "pass --data FILE (text, or JSONL with a \"text\" field)")
            texts, special = [data_path.read_text(encoding="utf-8")], False  # a stream with its own separators
        else:
            texts, special = read_texts(args.data), True
    except ProfileError as exc:
        raise UserError(str(exc), "pass a UTF-8 text file, JSONL with a \"text\" field a line, or builtin") from None
    model, tokenizer = _load(path, args.dtype)
    if not discover(model):
        raise UserError(f"no MoE block found in {str(path)!r} ({type(model).__name__})",
                        "profile-router records how MoE blocks route tokens to experts; is this an MoE model?")
    if tokenizer is None:
        raise UserError(f"{str(path)!r} has no tokenizer (tokenizer.json / tokenizer_config.json)",
                        "save the model's tokenizer into the directory with tokenizer.save_pretrained")
    try:
        profile = profile_router(model, tokenizer, texts, tokens=args.tokens, seq_len=args.seq_len,
                                 batch_size=args.batch_size, add_special_tokens=special, progress=True)
    except ProfileError as exc:
        raise UserError(f"{str(path)!r}: {exc}") from None
    out = Path(args.out) if args.out else Path(f"router-profile-{Path(path).resolve().name}")
    try:
        saved = profile.save(out)
    except OSError as exc:
        raise UserError(f"cannot write the profile to {str(out)!r}: {exc.strerror or exc}") from None
    if args.json:
        print(profile.to_json())
    else:
        print(profile.summary())
        print()
        print("wrote " + ", ".join(saved["files"]))
    if saved["plots_skipped"]:
        print(saved["plots_skipped"], file=sys.stderr if args.json else sys.stdout)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hi-na-moe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="what this CPU supports, and what hi_na_moe would do with a model")
    p.add_argument("--model", help="a local model directory to plan for: built on the meta device from its "
                   "config (no weight is read); lists its MoE blocks, bytes and the roofline tokens/s")
    p.add_argument("--output", choices=("text", "json"), default="text", help="text for people, json for machines")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the ~1-3 s memory bandwidth measurement")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=DEFAULT_GROUP_SIZE,
                   help=f"int4 group size for the per-format table (default {DEFAULT_GROUP_SIZE})")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("bench", help="prefill/decode speed, latency percentiles and GB/s, native vs hi_na_moe")
    p.add_argument("--model", required=True, help="a local model directory, or 'builtin' for the shipped model")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per batch (default 1)")
    p.add_argument("--seq-len", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--gen-tokens", type=int, default=32, help="new tokens per run (default 32)")
    p.add_argument("--num-iters", type=int, default=3, help="timed runs per arm (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per arm first (default 1)")
    p.add_argument("--threads", type=int, default=0, help="threads (default: torch.get_num_threads())")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="load the weights in this dtype (default: the checkpoint's)")
    p.add_argument("--compare", default="native,hina", help="arms, in order: native (transformers), hina")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="lossless",
                   help="expert format of the hina arm (quantised: also prints KL / top-1 vs native and SQNR)")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=DEFAULT_GROUP_SIZE, help=f"int4 group size (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--scope", choices=("experts", "all"), default=None,
                   help="'all' also runs the dense linear layers on the kernels (default: the config's, 'experts')")
    p.add_argument("--kv-cache", choices=("dynamic", "static"), default="dynamic",
                   help="transformers' KV cache for generate: dynamic (its default) or static (preallocated). "
                        "With a dynamic cache the hina arm under --scope all writes each new position in place; "
                        "the native arm, and the hina arm under --scope experts, copy the whole cache at every "
                        "step, which a static one avoids at long --seq-len (README 'Performance')")
    p.add_argument("--output", choices=("text", "json"), default="text")
    p.add_argument("--json-file", help="also write the full results, raw samples included, here")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("debug", help="replay natively and with hi_na_moe; show where outputs diverge")
    p.add_argument("--model", required=True, help="a local model directory (with its tokenizer)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts", help="a file with one prompt per line")
    p.add_argument("--isa", choices=ISA_TIERS, help="kernel tier to compare against native (default: the config's)")
    p.add_argument("--backend", choices=("auto", "native", "reference"), help="what runs the experts")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, help="expert format (default: the config's)")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), help="int4 group size")
    p.add_argument("--against", default="native",
                   help="what to compare with: native (default), or hi_na_moe with weights=FORMAT / isa=TIER")
    p.add_argument("--tolerance", type=float, help="relative L2 error per layer (default: 1e-4 fp32, 2e-2 bf16/fp16; "
                   "int8 5e-2, int4 2.5e-1)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="load the weights in this dtype (default: the checkpoint's)")
    p.add_argument("--output", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_debug)
    p = sub.add_parser("demo", help="generate natively and with hi_na_moe, compare tokens and speed")
    p.add_argument("--model", help="a local model directory; default: the small MoE shipped with the project")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt (default 24)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights dtype to load (default float32)")
    p.add_argument("--quick", action="store_true",
                   help="reduced workload (1 layer, few iterations): for CI, seconds instead of minutes")
    p.add_argument("--skip-workload", action="store_true", help="only the generation part")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("cache", help="see and remove the packed-expert store's entries (int8/int4/backups on disk)")
    csub = p.add_subparsers(dest="cache_command", required=True)
    c = csub.add_parser("list", help="one row per key directory: format, tier, layout, entries, size, last change")
    c.add_argument("--cache-dir", help="the store's directory (default: the config's cache_dir, HINA_MOE_CACHE_DIR, "
                   "else $XDG_CACHE_HOME/hi_na_moe or ~/.cache/hi_na_moe)")
    c.add_argument("--verify", action="store_true", help="check every entry's checksums (reads the whole store), "
                   "not only its header")
    c.add_argument("--output", choices=("text", "json"), default="text")
    c.set_defaults(func=cmd_cache_list)
    c = csub.add_parser("clear", help="remove store entries chosen by filters (confirmation asked unless --yes)")
    c.add_argument("--cache-dir", help="the store's directory (default: as for `cache list`)")
    c.add_argument("--key", help="one key directory: its full name or a unique prefix (the KEY column of `cache list`)")
    c.add_argument("--source", help="entries built from this checkpoint or model (a path, or a name as `cache list` "
                   "shows it under 'by source')")
    c.add_argument("--format", choices=WEIGHT_FORMATS, help="entries of this weight format")
    c.add_argument("--tier", choices=ISA_TIERS[1:], help="entries packed for this kernel tier")
    c.add_argument("--old-layout", action="store_true",
                   help="entries packed in another layout version than this build's (left behind when an upgrade "
                        "changed the packed layout; never read again)")
    c.add_argument("--stale", action="store_true", help="unreadable entries (corrupt, another store format version, "
                   "unsafe), temp files of interrupted writes, lock files without an entry")
    c.add_argument("--all", action="store_true", help="every store file (files that are not the store's stay)")
    c.add_argument("--verify", action="store_true", help="with --stale: find corrupt entries by their checksums too "
                   "(reads the whole store)")
    c.add_argument("--dry-run", action="store_true",
                   help="show what would be removed and how many bytes; remove nothing")
    c.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation (needed without a terminal)")
    c.add_argument("--output", choices=("text", "json"), default="text")
    c.set_defaults(func=cmd_cache_clear)
    p = sub.add_parser("profile-router", help="where tokens are routed: expert load, reuse, cache hit rates per "
                       "policy, next-layer prediction, cache-size advice")
    p.add_argument("--model", required=True, help="a local model directory (with its tokenizer), or 'builtin'")
    p.add_argument("--data", default="builtin", help="a text file, JSONL with a \"text\" field a line, or 'builtin' "
                   "(the project's held-out corpus, data/heldout.txt; the default)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens to profile (default 8192; the cache replay "
                   "costs a few microseconds per expert access, policy and size)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens a window (default 256, or the model's "
                   "max_position_embeddings if smaller)")
    p.add_argument("--batch-size", type=int, default=8, help="windows a forward (default 8)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="load the weights in this dtype (default: the checkpoint's)")
    p.add_argument("--out", help="directory for profile.json, expert_prior.json, routing.safetensors and the plots "
                   "(default ./router-profile-<model directory name>)")
    p.add_argument("--json", action="store_true", help="print the whole profile as JSON instead of the summary")
    p.set_defaults(func=cmd_profile_router)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"hi-na-moe: error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"hi-na-moe: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
