"""`hi-na-moe check`: this CPU, this build, this machine, and optionally a model's plan."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...core.checkpoint import checkpoint_dir
from ...core.system import system_info
from ..capabilities import capabilities
from ..plan import format_table, model_plan
from .common import UserError, _gib

# capabilities() entries printed when present: (key, label)
_OPTIONAL_LINES = (
    ("pool", "kernel threads"),
    ("prefetch", "weight-stream prefetch"),
    ("store_blocks", "blocks from the packed-expert store"),
    ("memory_tier", "memory tier"),
    ("attention", 'attention of decode steps (scope="all")'),
    ("attention_prefill", 'attention of prefill (scope="all")'),
    ("attention_latent", 'latent attention (MLA) of decode steps (scope="all")'),
    ("note", "note"),
)


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
    for key, label in _OPTIONAL_LINES:
        if cap.get(key):
            print(f"  {label}: {cap[key]}")
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
