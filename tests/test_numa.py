"""hi_na_moe.core.numa: the topology read from a fake two-node sysfs tree, and the real syscalls
(mbind, get_mempolicy, move_pages, sched_setaffinity) on this machine's node 0. What the kernel
here does not allow (ENOSYS, or EPERM from a seccomp filter) skips with the reason, nothing else."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from pathlib import Path

import pytest

from hi_na_moe.core import numa
from hi_na_moe.core.numa import (MPOL_BIND, NOT_TOUCHED, BindStatus, NumaError, Topology, bind, check_node,
                                 cpus_of, describe, mempolicy, parse_cpulist, pin_threads, where)

PAGE = mmap.PAGESIZE


def _fake_node(root: Path, n: int, cpulist: str | None, total_kb: int, free_kb: int) -> None:
    d = root / f"node{n}"
    d.mkdir(parents=True)
    if cpulist is not None:
        (d / "cpulist").write_text(cpulist + "\n")
    (d / "meminfo").write_text(
        f"Node {n} MemTotal:       {total_kb} kB\nNode {n} MemFree:        {free_kb} kB\n"
        f"Node {n} MemUsed:        {total_kb - free_kb} kB\nNode {n} HugePages_Total:     0\n")


@pytest.fixture
def two_nodes(tmp_path) -> Topology:
    root = tmp_path / "node"
    _fake_node(root, 0, "0-3,8-11", 16 << 20, 12 << 20)
    _fake_node(root, 1, "4-7,12-15", 8 << 20, 1 << 20)
    (root / "online").write_text("0-1\n")
    (root / "possible").write_text("0-1\n")
    (root / "power").mkdir()
    return Topology.read(root=root)


@contextlib.contextmanager
def _unless_unsupported():
    """Skip only for the errno meaning this kernel or container has no NUMA policy."""
    try:
        yield
    except OSError as exc:
        if exc.errno in numa.UNSUPPORTED_ERRNOS:
            pytest.skip(f"this kernel does not allow it: {exc.strerror}")
        raise


def _bound_or_skip(status: BindStatus) -> None:
    if not status.bound:
        assert status.errno in numa.UNSUPPORTED_ERRNOS, status
        pytest.skip(f"this kernel does not allow mbind: {status.reason}")


@pytest.fixture
def region():
    """(address, size) of a fresh anonymous mapping of 64 pages, none touched."""
    n = 64 * PAGE
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = (ctypes.c_char * n).from_buffer(m)
    try:
        yield m, ctypes.addressof(buf), n
    finally:
        del buf
        m.close()


# --- topology (fake two-node machine) --------------------------------------------------------------

def test_parse_cpulist():
    assert parse_cpulist("0-3,8-11\n") == {0, 1, 2, 3, 8, 9, 10, 11}
    assert parse_cpulist("5") == {5}
    assert parse_cpulist("\n") == frozenset()
    with pytest.raises(ValueError, match=r"node0/cpulist: 'a-3'"):
        parse_cpulist("a-3", "node0/cpulist")
    with pytest.raises(ValueError, match="empty"):
        parse_cpulist("3-1")


def test_topology_reads_nodes_cpus_and_memory(two_nodes):
    assert list(two_nodes.nodes) == [0, 1]
    n0, n1 = two_nodes.nodes[0], two_nodes.nodes[1]
    assert n0.cpus == {0, 1, 2, 3, 8, 9, 10, 11} and n1.cpus == {4, 5, 6, 7, 12, 13, 14, 15}
    assert (n0.mem_total, n0.mem_free) == (16 << 30, 12 << 30)
    assert (n1.mem_total, n1.mem_free) == (8 << 30, 1 << 30)


def test_topology_of_a_kernel_without_numa(tmp_path):
    topo = Topology.read(root=tmp_path / "absent")
    assert topo.nodes == {}
    with pytest.raises(NumaError, match=r"numa_node 0: this machine shows no NUMA nodes .*absent"):
        check_node(0, topo)


def test_check_node_names_the_nodes_that_exist(two_nodes):
    check_node(0, two_nodes)
    check_node(1, two_nodes)
    msg = f"numa_node 3: this machine has NUMA nodes 0-1 ({two_nodes.root}); set numa_node (HINA_MOE_NUMA_NODE)"
    with pytest.raises(NumaError) as info:
        check_node(3, two_nodes)
    assert str(info.value).startswith(msg)
    with pytest.raises(NumaError, match="numa_node '1': a NUMA node is a number"):
        check_node("1", two_nodes)


def test_cpus_of(two_nodes):
    assert cpus_of(1, two_nodes) == {4, 5, 6, 7, 12, 13, 14, 15}
    with pytest.raises(NumaError, match="numa_node 2: this machine has NUMA nodes 0-1"):
        cpus_of(2, two_nodes)


def test_memory_only_and_cpu_only_nodes_are_refused(tmp_path):
    root = tmp_path / "node"
    _fake_node(root, 0, "0-1", 1 << 20, 1 << 20)
    _fake_node(root, 1, "", 1 << 20, 1 << 20)  # memory only (CXL)
    _fake_node(root, 2, "2-3", 0, 0)  # CPUs only
    topo = Topology.read(root=root)
    with pytest.raises(NumaError, match=r"numa_node 1: node 1 has no CPUs .*choose a node with CPUs: 0 \(CPUs 0-1\), 2"):
        pin_threads(1, topo)
    with pytest.raises(NumaError, match=r"numa_node 2: node 2 has no memory .*choose a node with memory: 0, 1"):
        bind(1 << 20, PAGE, 2, topo)


# --- syscalls on this machine --------------------------------------------------------------------

def test_syscall_numbers_by_architecture(monkeypatch):
    monkeypatch.setattr(numa.platform, "machine", lambda: "aarch64")
    assert numa._syscall_numbers() == {"mbind": 235, "get_mempolicy": 236, "move_pages": 239}
    monkeypatch.setattr(numa.platform, "machine", lambda: "x86_64")
    assert numa._syscall_numbers() == {"mbind": 237, "get_mempolicy": 239, "move_pages": 279}
    monkeypatch.setattr(numa.platform, "machine", lambda: "riscv64")
    with pytest.raises(OSError, match="no syscall numbers for this architecture .riscv64.") as info:
        numa._syscall_numbers()
    assert info.value.errno == errno.ENOSYS


def test_bind_touch_where_and_policy(region):
    m, addr, n = region
    with _unless_unsupported():
        assert mempolicy(addr).mode != MPOL_BIND  # a fresh mapping has the default policy
    status = bind(addr, n, 0)
    _bound_or_skip(status)
    assert (status.start, status.nbytes, status.node) == (addr, n, 0)
    with _unless_unsupported():
        pol = mempolicy(addr)
        assert (pol.mode, pol.name, pol.nodes) == (MPOL_BIND, "bind", {0})
        assert where(addr, n) == {NOT_TOUCHED: 64}
        m[:40 * PAGE] = b"\x01" * (40 * PAGE)
        assert where(addr, n) == {0: 40, NOT_TOUCHED: 24}
        assert where(addr, n, sample=8) == {0: 5, NOT_TOUCHED: 3}  # pages 0, 8, .., 56
        m[40 * PAGE:] = b"\x02" * (24 * PAGE)
        assert where(addr, n) == {0: 64}
        assert describe(addr, n, status) == "experts' pool bound to NUMA node 0 (policy bind): 64 pages on node 0"
        assert describe(addr, n, status, sample=16) == (
            "experts' pool bound to NUMA node 0 (policy bind): 16 pages on node 0 (a sample of 16 of its 64 pages)")


def test_bind_rounds_to_pages_and_describe_counts_untouched(region):
    m, addr, _ = region
    status = bind(addr + PAGE + 100, PAGE, 0)  # the range spans pages 1 and 2
    _bound_or_skip(status)
    assert (status.start, status.nbytes) == (addr + PAGE, 2 * PAGE)
    with _unless_unsupported():
        assert mempolicy(addr).mode != MPOL_BIND
        assert mempolicy(addr + 2 * PAGE).mode == MPOL_BIND
        assert mempolicy(addr + 3 * PAGE).mode != MPOL_BIND
        m[PAGE:PAGE + 1] = b"\x01"
        assert describe(addr + PAGE, 2 * PAGE, status) == (
            "experts' pool bound to NUMA node 0 (policy bind): 1 page on node 0, 1 not yet touched")


def test_where_reports_unmapped_pages():
    # a mapping of 4 pages whose last 2 are unmapped again: move_pages finds no mapping there
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, 4 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        assert libc.munmap(addr + 2 * PAGE, 2 * PAGE) == 0
        ctypes.memset(addr, 1, 1)
        with _unless_unsupported():
            got = where(addr, 4 * PAGE)
            line = describe(addr, 4 * PAGE)
        # the touched page is on this machine's node (whichever it is)
        on_nodes = {k: v for k, v in got.items() if k >= 0}
        assert len(on_nodes) == 1 and sum(on_nodes.values()) == 1, got
        assert got[NOT_TOUCHED] == 1 and got[-errno.EFAULT] == 2, got
        assert line.startswith("experts' pool (policy default): 1 page on node ")
        assert line.endswith(", 1 not yet touched, 2 on no node (move_pages EFAULT: Bad address)")
    finally:
        libc.munmap(addr, 2 * PAGE)


def test_bind_to_a_missing_node_is_a_clear_error(region):
    _, addr, n = region
    topo = Topology.read()
    missing = max(topo.nodes, default=-1) + 1
    with pytest.raises(NumaError, match=rf"numa_node {missing}: this machine has NUMA nodes .*/sys/devices/system/node"):
        bind(addr, n, missing)


def test_kernel_refusal_names_mbind_and_errno(region, two_nodes, monkeypatch):
    # the fake topology claims node 1; this kernel has no node 1 and answers EINVAL
    _, addr, n = region
    if 1 in Topology.read().nodes:
        pytest.skip("this machine has a node 1")
    with pytest.raises(OSError) as info:
        bind(addr, n, 1, two_nodes)
    if info.value.errno in numa.UNSUPPORTED_ERRNOS:
        pytest.skip(f"this kernel does not allow mbind: {info.value}")
    assert info.value.errno == errno.EINVAL
    assert f"binding {n} bytes at {addr:#x} to NUMA node 1: mbind: EINVAL" in str(info.value)
    assert "Mems_allowed_list" in str(info.value)


def test_unsupported_kernel_skips_the_binding(region, monkeypatch):
    # a kernel without NUMA policy (ENOSYS) or a seccomp filter (EPERM) cannot be had here: the
    # syscall's failure is what such a kernel returns
    _, addr, n = region
    for err, word in ((errno.ENOSYS, "ENOSYS"), (errno.EPERM, "EPERM")):
        def refuse(name, *args, err=err):
            raise OSError(err, numa._explain(name, err))
        monkeypatch.setattr(numa, "_syscall", refuse)
        status = bind(addr, n, 0)
        assert not status.bound and status.errno == err
        assert status.reason.startswith(f"binding skipped: mbind: {word} (")
        line = describe(addr, n, status)
        assert line.startswith(f"experts' pool not bound to NUMA node 0 (binding skipped: mbind: {word} (")
        assert line.endswith(f": page placement unknown (move_pages: {word} ({os.strerror(err)}): "
                             f"{numa._MEANINGS[err]})")


def test_pin_threads_to_node0_and_a_fake_node(two_nodes):
    before = os.sched_getaffinity(0)
    try:
        topo = Topology.read()
        got = pin_threads(0, topo)
        assert got == cpus_of(0, topo) & before and os.sched_getaffinity(0) == got
        if len(before) > 1:
            # the fake node 0 has CPUs 0-3,8-11: only those this process may use are kept
            os.sched_setaffinity(0, before)
            assert pin_threads(0, two_nodes) == {0, 1, 2, 3, 8, 9, 10, 11} & before
            assert os.sched_getaffinity(0) == {0, 1, 2, 3, 8, 9, 10, 11} & before
    finally:
        os.sched_setaffinity(0, before)


def test_pin_threads_to_cpus_not_allowed_is_a_clear_error(tmp_path):
    root = tmp_path / "node"
    _fake_node(root, 0, "4096-4097", 1 << 20, 1 << 20)
    before = os.sched_getaffinity(0)
    with pytest.raises(NumaError, match=r"numa_node 0: none of node 0's CPUs \(4096-4097\) is allowed to this process"):
        pin_threads(0, Topology.read(root=root))
    assert os.sched_getaffinity(0) == before
