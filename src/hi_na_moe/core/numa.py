"""NUMA placement of the experts' pool (config `numa_node`, env HINA_MOE_NUMA_NODE).

On a machine of several NUMA nodes a core reads its own node's memory faster than a remote one's,
so the pool of packed experts is bound to one node and the kernel threads run on that node's CPUs.
Linux only, unprivileged, and without libnuma (a dependency few machines have installed): the
memory-policy syscalls are called through libc's `syscall`.

- Topology.read(): the nodes, their CPUs and memory, from /sys/devices/system/node.
- check_node(): a node that does not exist is a clear error naming the ones that do.
- bind(): mbind(MPOL_BIND, MPOL_MF_MOVE) of the pool's range. Where the kernel or a container's
  seccomp filter does not allow it (ENOSYS, EPERM), the binding is skipped and the returned
  BindStatus says why, for the caller to report: the pool still works, only not node-local.
- where(), mempolicy(): where the pool's pages are (move_pages' query form) and the range's policy
  (get_mempolicy with MPOL_F_ADDR); describe() makes the one line the enable report shows.
- pin_threads(): this thread's CPU affinity to the node's CPUs.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import mmap
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from .system import SYS_NODE

# Syscall numbers: x86_64 from arch/x86/entry/syscalls/syscall_64.tbl, aarch64 from the generic
# table (include/uapi/asm-generic/unistd.h) that arm64 uses.
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {"mbind": 237, "get_mempolicy": 239, "move_pages": 279},
    "aarch64": {"mbind": 235, "get_mempolicy": 236, "move_pages": 239},
}
_MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}

# include/uapi/linux/mempolicy.h
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE, MPOL_LOCAL = 0, 1, 2, 3, 4
MPOL_PREFERRED_MANY, MPOL_WEIGHTED_INTERLEAVE = 5, 6
POLICY_NAMES = {MPOL_DEFAULT: "default", MPOL_PREFERRED: "preferred", MPOL_BIND: "bind",
                MPOL_INTERLEAVE: "interleave", MPOL_LOCAL: "local",
                MPOL_PREFERRED_MANY: "preferred_many", MPOL_WEIGHTED_INTERLEAVE: "weighted_interleave"}
# mode flags get_mempolicy may OR into the mode (MPOL_F_STATIC_NODES, _RELATIVE_NODES, _NUMA_BALANCING)
_MODE_FLAGS = (1 << 15) | (1 << 14) | (1 << 13)
MPOL_F_ADDR = 1 << 1
MPOL_MF_MOVE = 1 << 1

# The node masks passed to the kernel: its largest MAX_NUMNODES (CONFIG_NODES_SHIFT=10). A mask
# shorter than the kernel's node count makes get_mempolicy fail with EINVAL.
MASK_BITS = 1024
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_MASK_WORDS = MASK_BITS // _ULONG_BITS
# The kernel decrements maxnode before use (as libnuma, pass the mask's bits + 1).
_MAXNODE = MASK_BITS + 1

# where(): every page up to this many, then this many spread evenly over the range
DEFAULT_SAMPLE = 65536
# where()'s key for pages move_pages reports -ENOENT: never touched, so not placed on any node yet
NOT_TOUCHED = -_errno.ENOENT

# errno of bind()/where() that mean "this kernel or container does not do NUMA policy": the
# binding is skipped (BindStatus.bound False), not an error. mbind's own EPERM is only for
# MPOL_MF_MOVE_ALL, which bind() does not use, so EPERM here is a seccomp filter's (Docker's
# default profile denies these syscalls to a container without CAP_SYS_NICE).
UNSUPPORTED_ERRNOS = (_errno.ENOSYS, _errno.EPERM)

_MEANINGS = {
    _errno.ENOSYS: "the kernel has no NUMA memory policy (built without CONFIG_NUMA, or a sandbox "
                   "such as gVisor that does not implement it)",
    _errno.EPERM: "denied by a seccomp filter (a container's default profile denies the NUMA "
                  "syscalls without CAP_SYS_NICE)",
    _errno.EINVAL: "the kernel rejected the arguments: the node is not online or not in this "
                   "process's cpuset (Mems_allowed_list in /proc/self/status), or the range is not "
                   "page-aligned",
    _errno.EFAULT: "the range is not (wholly) mapped in this process",
    _errno.ENOMEM: "the kernel is out of memory",
    _errno.EIO: "some pages could not be moved to the node",
}


class NumaError(ValueError):
    """A `numa_node` this machine cannot honour (no such node, no CPUs or memory on it)."""


# --- topology -------------------------------------------------------------------------------------

def parse_cpulist(text: str, source: str = "cpulist") -> frozenset[int]:
    """'0-3,8-11' (the kernel's list format; '' for none) -> {0, 1, 2, 3, 8, 9, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{source}: {part!r} in {text.strip()!r} is neither N nor N-M") from None
        if b < a or a < 0:
            raise ValueError(f"{source}: range {part!r} in {text.strip()!r} is empty or negative")
        out.update(range(a, b + 1))
    return frozenset(out)


def format_cpulist(ids) -> str:
    """{0, 1, 2, 3, 8} -> '0-3,8' (the kernel's list format)."""
    ids = sorted(set(ids))
    runs: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        runs.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(runs)


@dataclass(frozen=True)
class Node:
    id: int
    cpus: frozenset[int]
    mem_total: int | None  # bytes (nodeN/meminfo MemTotal); None when unreadable
    mem_free: int | None


def _node_meminfo(text: str) -> dict[str, int]:
    """nodeN/meminfo ('Node 0 MemTotal:  24683772 kB') -> {'MemTotal': bytes, ...}."""
    out = {}
    for line in text.splitlines():
        head, _, rest = line.partition(":")
        parts = rest.split()
        if head.split() and parts and parts[0].isdigit():
            out[head.split()[-1]] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


@dataclass(frozen=True)
class Topology:
    root: Path
    nodes: dict[int, Node]

    @classmethod
    def read(cls, root: Path = SYS_NODE) -> Topology:
        """The nodes under `root` (a kernel without NUMA support has no such directory: no nodes)."""
        root = Path(root)
        nodes = {}
        dirs = root.glob("node[0-9]*") if root.is_dir() else ()
        for d in dirs:
            if not d.name[4:].isdigit():
                continue
            n = int(d.name[4:])
            try:
                cpus = parse_cpulist((d / "cpulist").read_text(), str(d / "cpulist"))
            except FileNotFoundError:
                cpus = frozenset()
            try:
                mem = _node_meminfo((d / "meminfo").read_text())
            except OSError:
                mem = {}
            nodes[n] = Node(n, cpus, mem.get("MemTotal"), mem.get("MemFree"))
        return cls(root, dict(sorted(nodes.items())))

    def describe_nodes(self) -> str:
        return format_cpulist(self.nodes) if self.nodes else "none"


def check_node(node: int, topo: Topology) -> None:
    """Raise NumaError unless `node` is one of the machine's NUMA nodes."""
    if isinstance(node, bool) or not isinstance(node, int):
        raise NumaError(f"numa_node {node!r}: a NUMA node is a number (one of {topo.describe_nodes()} "
                        f"on this machine, {topo.root})")
    if not topo.nodes:
        raise NumaError(f"numa_node {node}: this machine shows no NUMA nodes ({topo.root} is missing "
                        "or empty: a kernel without NUMA support); unset numa_node (HINA_MOE_NUMA_NODE)")
    if node not in topo.nodes:
        raise NumaError(f"numa_node {node}: this machine has NUMA nodes {topo.describe_nodes()} "
                        f"({topo.root}); set numa_node (HINA_MOE_NUMA_NODE) to one of them")


def cpus_of(node: int, topo: Topology) -> set[int]:
    check_node(node, topo)
    return set(topo.nodes[node].cpus)


def pin_threads(node: int, topo: Topology) -> set[int]:
    """Restrict the calling thread to `node`'s CPUs that it may run on now; returns them.

    sched_setaffinity(0) sets the calling thread only: threads it starts afterwards inherit the
    mask, and the native kernel pool starts its workers lazily from the thread that first runs a
    kernel, so call this on that thread before the first kernel runs. Workers already started
    (and torch's OpenMP pool, if it already ran) keep the mask they had."""
    cpus = cpus_of(node, topo)
    if not cpus:
        raise NumaError(f"numa_node {node}: node {node} has no CPUs ({topo.root}/node{node}/cpulist is "
                        "empty: a memory-only node); choose a node with CPUs: "
                        + ", ".join(f"{n.id} (CPUs {format_cpulist(n.cpus)})" for n in topo.nodes.values() if n.cpus))
    allowed = os.sched_getaffinity(0)
    target = cpus & allowed
    if not target:
        raise NumaError(f"numa_node {node}: none of node {node}'s CPUs ({format_cpulist(cpus)}) is allowed to "
                        f"this process (CPUs {format_cpulist(allowed)}, set by taskset or a cgroup cpuset); "
                        "choose a node whose CPUs it may use, or widen its CPU set")
    try:
        os.sched_setaffinity(0, target)
    except OSError as exc:
        raise OSError(exc.errno, f"sched_setaffinity to CPUs {format_cpulist(target)} of NUMA node {node}: "
                                 f"{exc.strerror}") from None
    return set(target)


# --- syscalls --------------------------------------------------------------------------------------

_libc = None


def _syscall_numbers() -> dict[str, int]:
    machine = platform.machine().lower()
    machine = _MACHINE_ALIASES.get(machine, machine)
    if machine not in SYSCALLS:
        raise OSError(_errno.ENOSYS, f"NUMA syscalls: no syscall numbers for this architecture "
                                     f"({platform.machine()}); known: {', '.join(SYSCALLS)}")
    return SYSCALLS[machine]


def _explain(name: str, err: int) -> str:
    code = _errno.errorcode.get(err, str(err))
    return f"{name}: {code} ({os.strerror(err)}): {_MEANINGS.get(err, 'unexpected error')}"


def _syscall(name: str, *args) -> int:
    """libc syscall(SYS_<name>, *args); an OSError names the syscall, the errno and its meaning."""
    global _libc
    number = _syscall_numbers()[name]
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
        _libc = lib
    ctypes.set_errno(0)
    r = _libc.syscall(ctypes.c_long(number), *args)
    if r == -1:
        err = ctypes.get_errno()
        raise OSError(err, _explain(name, err))
    return r


def page_size() -> int:
    return mmap.PAGESIZE


def _page_range(addr: int, nbytes: int) -> tuple[int, int]:
    """(start, length): `addr` rounded down and the end rounded up to pages."""
    if addr <= 0 or nbytes <= 0:
        raise ValueError(f"NUMA range: address {addr:#x} and size {nbytes} must both be > 0")
    ps = page_size()
    start = addr - addr % ps
    end = -(-(addr + nbytes) // ps) * ps
    return start, end - start


def _nodemask(nodes) -> ctypes.Array:
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    for n in nodes:
        if not 0 <= n < MASK_BITS:
            raise NumaError(f"numa_node {n}: beyond the {MASK_BITS} nodes a Linux kernel supports")
        mask[n // _ULONG_BITS] |= 1 << (n % _ULONG_BITS)
    return mask


def _mask_nodes(mask) -> frozenset[int]:
    return frozenset(w * _ULONG_BITS + b for w in range(_MASK_WORDS) for b in range(_ULONG_BITS)
                     if mask[w] >> b & 1)


# --- binding and placement -------------------------------------------------------------------------

@dataclass(frozen=True)
class BindStatus:
    """What bind() did: `bound`, or skipped with the `errno` and `reason` to report (a warning)."""
    node: int
    start: int  # the page-aligned range the policy covers
    nbytes: int
    bound: bool
    errno: int | None = None
    reason: str | None = None


def bind(addr: int, nbytes: int, node: int, topo: Topology | None = None) -> BindStatus:
    """Bind the pages of [addr, addr + nbytes) to `node` (MPOL_BIND) and move those already
    faulted in elsewhere (MPOL_MF_MOVE); pages touched later are allocated there.

    NumaError for a node the machine does not have (`topo`: the machine's, read when None);
    OSError naming mbind and its errno when the kernel rejects it; a BindStatus with bound False
    when this kernel or container does not allow NUMA policy (UNSUPPORTED_ERRNOS)."""
    topo = Topology.read() if topo is None else topo
    check_node(node, topo)
    mem = topo.nodes[node].mem_total
    if mem == 0:
        raise NumaError(f"numa_node {node}: node {node} has no memory ({topo.root}/node{node}/meminfo "
                        "MemTotal 0: a CPU-only node); choose a node with memory: "
                        + ", ".join(str(n.id) for n in topo.nodes.values() if n.mem_total))
    start, length = _page_range(addr, nbytes)
    mask = _nodemask([node])
    try:
        _syscall("mbind", ctypes.c_void_p(start), ctypes.c_ulong(length), ctypes.c_int(MPOL_BIND),
                 mask, ctypes.c_ulong(_MAXNODE), ctypes.c_uint(MPOL_MF_MOVE))
    except OSError as exc:
        if exc.errno in UNSUPPORTED_ERRNOS:
            return BindStatus(node, start, length, False, exc.errno, f"binding skipped: {exc.strerror}")
        raise OSError(exc.errno, f"binding {length} bytes at {start:#x} to NUMA node {node}: "
                                 f"{exc.strerror}") from None
    return BindStatus(node, start, length, True)


@dataclass(frozen=True)
class Policy:
    mode: int  # MPOL_* (flags masked off)
    nodes: frozenset[int]

    @property
    def name(self) -> str:
        return POLICY_NAMES.get(self.mode, f"mode {self.mode}")


def mempolicy(addr: int) -> Policy:
    """The memory policy of the page at `addr` (get_mempolicy with MPOL_F_ADDR); the default
    policy reports no nodes."""
    ps = page_size()
    mode = ctypes.c_int()
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    _syscall("get_mempolicy", ctypes.byref(mode), mask, ctypes.c_ulong(_MAXNODE),
             ctypes.c_void_p(addr - addr % ps), ctypes.c_ulong(MPOL_F_ADDR))
    return Policy(mode.value & ~_MODE_FLAGS, _mask_nodes(mask))


def where(addr: int, nbytes: int, sample: int = DEFAULT_SAMPLE) -> dict[int, int]:
    """Pages of [addr, addr + nbytes) per NUMA node, from move_pages' query form (nodes NULL).

    Every page when there are at most `sample`, else `sample` pages spread evenly (the counts are
    then of those). A negative key is a page on no node, by the status move_pages gave it:
    NOT_TOUCHED (-ENOENT) for a page never touched, -EFAULT for one not mapped. Raises OSError
    (move_pages and its errno) where the kernel does not answer, e.g. UNSUPPORTED_ERRNOS."""
    if sample < 1:
        raise ValueError(f"where(): sample={sample} must be >= 1")
    start, length = _page_range(addr, nbytes)
    ps = page_size()
    total = length // ps
    count = min(total, sample)
    pages = (ctypes.c_void_p * count)(*(start + (i * total // count) * ps for i in range(count)))
    status = (ctypes.c_int * count)()
    _syscall("move_pages", ctypes.c_int(0), ctypes.c_ulong(count), pages, None, status, ctypes.c_int(0))
    counts: dict[int, int] = {}
    for s in status:
        counts[s] = counts.get(s, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] < 0, abs(kv[0]))))


def describe(addr: int, nbytes: int, status: BindStatus | None = None, *, sample: int = DEFAULT_SAMPLE,
             what: str = "experts' pool") -> str:
    """One line for the enable report: the binding (or why it was skipped), the range's policy and
    where its pages are, e.g. "experts' pool bound to NUMA node 0 (policy bind): 1234 pages on
    node 0, 12 not yet touched". `status`: bind()'s, None when no node was asked for."""
    if status is None:
        head = what
    elif status.bound:
        head = f"{what} bound to NUMA node {status.node}"
    else:
        head = f"{what} not bound to NUMA node {status.node} ({status.reason})"
    try:
        head += f" (policy {mempolicy(addr).name})"
    except OSError as exc:
        head += f" (policy unknown: {exc.strerror})"
    try:
        counts = where(addr, nbytes, sample)
    except OSError as exc:
        return f"{head}: page placement unknown ({exc.strerror})"
    parts = []
    for key, n in counts.items():
        if key >= 0:
            parts.append(f"{n} page{'s' if n != 1 else ''} on node {key}")
        elif key == NOT_TOUCHED:
            parts.append(f"{n} not yet touched")
        else:
            code = _errno.errorcode.get(-key, str(-key))
            parts.append(f"{n} on no node (move_pages {code}: {os.strerror(-key)})")
    line = f"{head}: {', '.join(parts)}"
    total = _page_range(addr, nbytes)[1] // page_size()
    if total > sample:
        line += f" (a sample of {sample} of its {total} pages)"
    return line
