"""What this CPU and this build can do: detected features (cpuid + OS support via XCR0, AMX
permission) from the native core, the best kernel tier, and which kernel each path uses."""

from __future__ import annotations

import platform
from typing import Any

from ..core.formats import Isa

from ..core.config import load_config
from ..core.limits import format_bytes
from ..core.memory import describe
from ..core.native import native_module, pool_description, prefetch_description
from ..core.ops import kernel_plan
from ..fastpath.attention import math_kernel, prefill_math
from ..fastpath.mla import math_kernel as latent_math


def capabilities(config: Any = None) -> dict[str, Any]:
    """Detected CPU features and the kernel each path would use under `config` (default: the
    effective config from env/file)."""
    cfg = config if config is not None else load_config()
    native, why = native_module()
    info: dict[str, Any] = {
        "machine": platform.machine(),
        "native_library": "loaded" if native is not None else f"not loaded ({why})",
    }
    if native is None:
        info.update(cpu=None, os=None, best_isa=None, selected_isa=None)
        info["kernels"] = {"decode": "reference", "prefill": "reference"}
        info["note"] = "native library missing: every MoE block runs on the pure-PyTorch reference path"
        return info
    feats = native.cpu_features()
    best = native.best_isa()
    info.update(
        arch=feats["arch"], vendor=feats["vendor"], brand=feats["brand"].strip(),
        cpu=feats["cpu"], os=feats["os"], best_isa=best,
        selected_isa=best if cfg.isa == Isa.AUTO else cfg.isa,
        build=getattr(native, "__build__", "unknown"),
    )
    info["kernels"] = kernel_plan(cfg)
    info["pool"] = pool_description(cfg.kernel_pool())
    info["prefetch"] = prefetch_description()
    info["store_blocks"] = describe(cfg.memory)
    info["memory_tier"] = _memory_tier(cfg)
    info["attention"] = math_kernel(info["selected_isa"])
    info["attention_prefill"] = prefill_math(info["selected_isa"])
    info["attention_latent"] = latent_math(info["selected_isa"])
    return info


def _memory_tier(cfg) -> str:
    """What memory_limit does on this machine (hi_na_moe.core.tier)."""
    if cfg.memory_limit is None:
        return "off (no memory_limit: every block's packed experts are held as memory= says)"
    limit = cfg.memory_limit_bytes()
    window = cfg.prediction_window if cfg.prefetch else 0
    where = f", NUMA node {cfg.numa_node}" if cfg.numa_node is not None else ""
    return (f"memory_limit {cfg.memory_limit!r} = {format_bytes(limit)}: packed experts beyond it stay in the store and "
            f"are read by {cfg.io_threads} I/O threads (direct_io {cfg.direct_io}), "
            + (f"predicted {window} layer(s) ahead" if window else "no prediction") + where)
