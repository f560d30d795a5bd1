"""What this CPU and this build can do: detected features (cpuid + OS support via XCR0, AMX
permission) from the native core, the best kernel tier, and which kernel each path uses."""

from __future__ import annotations

import functools
import os
import platform
from types import ModuleType
from typing import Any


@functools.lru_cache(maxsize=1)
def native_module() -> tuple[ModuleType | None, str | None]:
    """(the native extension, None) or (None, why it could not be loaded)."""
    try:
        from . import _native  # type: ignore[attr-defined]
    except ImportError as exc:  # not built, or built for another Python/CPU
        return None, f"{type(exc).__name__}: {exc}"
    return _native, None


def native_kernels_available() -> bool:
    native, _ = native_module()
    return native is not None and hasattr(native, "PackedExperts")


def capabilities(config: Any = None) -> dict[str, Any]:
    """Detected CPU features and the kernel each path would use under `config` (default: the
    effective config from env/file)."""
    from .config import load_config

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
        selected_isa=best if cfg.isa == "auto" else cfg.isa,
        build=getattr(native, "__build__", "unknown"),
    )
    from .ops import kernel_plan

    info["kernels"] = kernel_plan(cfg)
    info["pool"] = pool_description(cfg.kernel_pool())
    info["prefetch"] = prefetch_description()
    from .memory import describe

    info["store_blocks"] = describe(cfg.memory)
    from .attention import math_kernel, prefill_math

    info["attention"] = math_kernel(info["selected_isa"])
    info["attention_prefill"] = prefill_math(info["selected_isa"])
    from .mla import math_kernel as latent_math

    info["attention_latent"] = latent_math(info["selected_isa"])
    return info


def prefetch_description() -> str:
    """How far ahead the kernels prefetch their weight stream, and why that distance."""
    native, _ = native_module()
    n = native.prefetch_distance()
    env = os.environ.get("HINA_MOE_PREFETCH_BYTES")
    if env is not None and env.strip() == str(n):
        return f"{n} bytes ahead into L2 (HINA_MOE_PREFETCH_BYTES; lossless12's decode kernel too)"
    why = f"the default for {native.cpu_features()['vendor'] or 'this'} CPUs"
    if env is not None:  # read when the library loaded: set later, or not a valid value
        why += (f"; HINA_MOE_PREFETCH_BYTES={env!r} is not used: it must be a multiple of 64 in [0, 65536], "
                "set before hi_na_moe's native library loads")
    few, many = native.rows_prefetch_distance(2), native.rows_prefetch_distance(4)
    if (few, many) != (n, n):
        def said(b: int) -> str:
            return f"{b} bytes" if b else "none, the hardware prefetchers alone"
        why += (f"; int8 / int4 calls of 2-3 rows: {said(few)}, of 4 rows or more: {said(many)}" if few != many
                else f"; int8 / int4 calls of several rows: {said(few)}")
    l12 = "" if native.l12_prefetch() else "; lossless12's decode kernel: none, the hardware prefetchers alone"
    return f"{n} bytes ahead into L2 ({why}){l12}"


def pool_description(pool: str) -> str:
    """What the native kernels' parallel regions would run on under config key `pool`."""
    native, _ = native_module()
    return native.pool_backend(pool) if native is not None else "own"
