"""Where a packed block loaded from the store lives (HinaConfig.memory).

The store's blocks are written once and read through a read-only file mapping (hi_na_moe.core.store).
How fast the kernels stream a mapping depends on the state of the page cache behind it, which the
process does not control; a copy in memory of the process's own (huge pages requested) streams at
one speed. Measured on the Xeon measured on 2026-12-02 (benchmarks/RESULTS.md): with the store's pages as
an earlier session had left them cached, the int4 OLMoE-1B-7B experts' gate/up region read at
68-70 % of the paired probe from the mapping against 83-84 % from copies on huge pages, and whole
decode steps were 13-17 % faster from the copies; after those pages had been evicted and read
again (larger folios), the mapping was as fast as the copies (whole-model pairs within noise,
one block at a time 0-10 % slower). A mapping's pages, on the other hand, are the OS's to drop
and read again, so a model larger than memory still runs from it, and it loads faster: a copy
costs fresh memory, which the OS zeroes (about 0.6 GB/s on that VM).

- "copy": every block from the store is copied (PackedExperts.copy; the mapping is closed).
- "map": every block is read through the mapping (PackedExperts.view).
- "auto": a block is copied when the memory this process may still take, less the copy, keeps a
  headroom of HEADROOM_FRACTION of the total (at least HEADROOM_MIN); else mapped, as is every
  block when that memory cannot be read. What the process may take (available_bytes): the
  kernel's MemAvailable (which counts the page cache it can drop, the store's pages included),
  and under a cgroup v2 memory limit that limit less the group's usage plus its inactive file
  pages, whichever is less. Blocks are loaded one after another, so the copies made so far are
  part of the usage the next decision reads.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from .formats import MemoryMode
from .system import meminfo

HEADROOM_FRACTION = 0.10
HEADROOM_MIN = 1 << 30
# embedding tables below this size are not read in (read_in_embeddings)
READ_IN_MIN = 1 << 20


def _meminfo() -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes (hi_na_moe.core.system.meminfo), or None."""
    m = meminfo()
    if "MemAvailable" not in m or "MemTotal" not in m:
        return None
    return m["MemAvailable"], m["MemTotal"]


def _cgroup_room(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
                 ) -> tuple[int, int] | None:
    """(room, limit) under this process's cgroup v2 memory limit: the limit less the usage plus
    the inactive file pages; None when there is no limit or it cannot be read."""
    try:
        line = next((x for x in self_cgroup.read_text().splitlines() if x.startswith("0::")), None)
        if line is None:
            return None
        d = root / line[3:].lstrip("/")
        limit = (d / "memory.max").read_text().strip()
        if limit == "max":
            return None
        limit_b = int(limit)
        used = int((d / "memory.current").read_text())
        inactive = 0
        for s in (d / "memory.stat").read_text().splitlines():
            key, _, value = s.partition(" ")
            if key == "inactive_file":
                inactive = int(value)
        return max(0, limit_b - used + inactive), limit_b
    except (OSError, ValueError):
        return None


def available_bytes() -> tuple[int, int] | None:
    """(bytes this process may still take, the total they are part of), or None if unknown."""
    mem, cg = _meminfo(), _cgroup_room()
    if mem is None:
        return cg
    if cg is None or cg[0] >= mem[0]:
        return mem
    return cg


def headroom(total: int) -> int:
    """What "auto" leaves free of a total of `total` bytes."""
    return max(HEADROOM_MIN, int(HEADROOM_FRACTION * total))


def copies(mode: str, nbytes: int) -> bool:
    """Whether a block of nbytes loaded under HinaConfig.memory `mode` is copied."""
    if mode == MemoryMode.COPY:
        return True
    if mode != MemoryMode.AUTO:
        return False
    room = available_bytes()
    if room is None:
        return False
    avail, total = room
    return avail - nbytes >= headroom(total)


def describe(mode: str) -> str:
    """What `mode` does with blocks from the store on this machine now (`hi-na-moe check`)."""
    if mode == MemoryMode.COPY:
        return "memory='copy': every block copied into memory of its own"
    if mode == MemoryMode.MAP:
        return "memory='map': every block read through the store's file mapping"
    room = available_bytes()
    if room is None:
        return "memory='auto': the available memory cannot be read, so every block is read through the mapping"
    avail, total = room
    keep = headroom(total)
    return (f"memory='auto': copied while {keep / 2**30:.2f} GiB stay free, now up to "
            f"{max(0, avail - keep) / 2**30:.2f} GiB of blocks; the rest read through the store's file mapping")


def load_block(native, entry, mode: str):
    """The block of an open store entry under `mode`: (PackedExperts, the entry when the block is
    a view of its mapping, else None, "copied" or "mapped"). A copied block keeps nothing of the
    mapping, so the entry is closed then, as it is on an error."""
    try:
        header = bytes.fromhex(entry.meta["header"])
        block = entry.array("block", "uint8")
        if not copies(mode, block.nbytes):
            return native.PackedExperts.view(header, block), entry, "mapped"
        pe = native.PackedExperts.copy(header, block)
        del block  # (the array holds an export of the mapping, which close() releases)
    except BaseException:
        entry.close()
        raise
    entry.close()
    return pe, None, "copied"


def read_in_embeddings(model) -> tuple[list[str], int, float]:
    """Read every page of the model's embedding tables once (names, bytes, seconds).

    transformers leaves a tensor it loads without a cast in the checkpoint's file mapping, and an
    embedding table is then read a row per token: a token whose page the page cache does not hold
    (never read since the checkpoint was written, or dropped since) is a read from disk inside
    that decode step. With the weights from the packed-expert store, nothing else reads the
    checkpoint's pages: on a page cache dropped before the load, the stack's Python outside its
    one native call took 1.4-2.4 ms of a Qwen1.5-MoE 4-layer int4 step (151936 x 2048 table),
    0.3 ms with the table read in (benchmarks/log/whole-model.md, 2026-12-04).
    One element per 4 KiB is read here, so the pages are in the page cache and mapped; they stay
    the OS's to drop under memory pressure (clean file pages), as llama.cpp's WILLNEED hint on
    its mapped files leaves them. Tables held in the process's own memory cost a strided read.
    Tables not on the CPU, not contiguous or below READ_IN_MIN bytes are left alone."""
    names, nbytes, t0 = [], 0, time.perf_counter()
    seen: set[int] = set()
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding):
            continue
        w = m._parameters.get("weight")
        if (not isinstance(w, torch.Tensor) or w.device.type != "cpu" or w.layout is not torch.strided
                or not w.is_contiguous() or w.nbytes < READ_IN_MIN or w.data_ptr() in seen):
            continue
        seen.add(w.data_ptr())
        with torch.no_grad():
            w.detach().view(-1)[:: max(1, 4096 // w.element_size())].sum()
        names.append(name)
        nbytes += w.nbytes
    return names, nbytes, time.perf_counter() - t0
