"""What this CPU and this build can do: detected features (cpuid + OS support via XCR0, AMX
permission) from the native core, the best kernel tier, and which kernel each path uses."""

from __future__ import annotations

import functools
import os
from types import ModuleType


@functools.lru_cache(maxsize=1)
def native_module() -> tuple[ModuleType | None, str | None]:
    """(the native extension, None) or (None, why it could not be loaded)."""
    try:
        from .. import _native  # type: ignore[attr-defined]  # optional dependency: the extension may not be built
    except ImportError as exc:  # not built, or built for another Python/CPU
        return None, f"{type(exc).__name__}: {exc}"
    return _native, None


def native_kernels_available() -> bool:
    native, _ = native_module()
    return native is not None and hasattr(native, "PackedExperts")


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
