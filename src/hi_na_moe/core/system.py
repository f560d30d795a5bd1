"""Facts about the machine that decide MoE speed on a CPU: cores, NUMA nodes, caches, memory,
and the read bandwidth measured on the spot. Linux sysfs/procfs; absent files give None."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from .native import native_module

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _size_bytes(text: str | None) -> int | None:
    """'48K' / '2048K' / '300M' (sysfs cache sizes) -> bytes."""
    if not text:
        return None
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    digits = text[:-1] if text[-1].isalpha() else text
    return int(digits) * mult if digits.isdigit() else None


def meminfo() -> dict[str, int]:
    out = {}
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


def caches() -> list[dict[str, Any]]:
    """The caches of CPU 0, by level (L1d, L1i, L2, L3)."""
    found = []
    for idx in sorted((SYS_CPU / "cpu0" / "cache").glob("index*")):
        level, kind = _read(idx / "level"), _read(idx / "type")
        size = _size_bytes(_read(idx / "size"))
        if level is None or size is None:
            continue
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind or "", "")
        shared = _read(idx / "shared_cpu_list")
        found.append({"name": name, "bytes": size, "shared_cpus": shared})
    return found


def numa_nodes() -> list[dict[str, Any]]:
    nodes = []
    for node in sorted(SYS_NODE.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        total = None
        for line in (_read(node / "meminfo") or "").splitlines():
            if "MemTotal" in line:
                total = int(line.split()[-2]) * 1024
        nodes.append({"node": int(node.name[4:]), "cpus": _read(node / "cpulist"), "memory_bytes": total})
    return nodes


def cores() -> dict[str, Any]:
    pairs = set()
    for block in (_read(Path("/proc/cpuinfo")) or "").split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "core id" in fields:
            pairs.add((fields.get("physical id"), fields["core id"]))
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"logical_cpus": os.cpu_count(), "physical_cores": len(pairs) or None, "usable_by_this_process": affinity}


def system_info(measure_bandwidth: bool = True) -> dict[str, Any]:
    """Everything `hi-na-moe check` prints about the machine (the bandwidth probe takes ~1-3 s)."""
    mem = meminfo()
    info: dict[str, Any] = {
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cores": cores(),
        "numa_nodes": numa_nodes(),
        "caches": caches(),
        "memory": {"total_bytes": mem.get("MemTotal"), "available_bytes": mem.get("MemAvailable")},
        "read_bandwidth_gbs": None,
    }
    if measure_bandwidth:
        native, _ = native_module()
        if native is not None:
            threads = info["cores"]["usable_by_this_process"] or 1
            l3 = max((c["bytes"] for c in info["caches"]), default=32 << 20)
            # far above the last-level cache, small enough to finish in about a second
            size = max(512 << 20, 4 * l3)
            r = native.measure_read_bandwidth(size, threads, 3)
            info["read_bandwidth_gbs"] = {"best": r["best_gbs"], "median": r["median_gbs"],
                                          "threads": threads, "bytes": r["bytes"]}
    return info
