"""Sizes and the memory limit (hi_na_moe.core.limits): parsing and printing sizes, the memory this
process may use under cgroup v1 and v2 (files laid out in a temporary directory), and percentages
of it. Pure Python, no native code."""

from __future__ import annotations

import sys

import pytest

from hi_na_moe.core.limits import (
    MAX_BYTES,
    LimitError,
    cgroup_memory_limit,
    check_memory_limit,
    format_bytes,
    mem_total,
    parse_bytes,
    process_memory,
    resolve_memory_limit,
)

GiB = 1 << 30
# what cgroup v1 writes for "no limit" (memory.limit_in_bytes of an unlimited group)
V1_NO_LIMIT = 9223372036854771712


@pytest.mark.parametrize("text, want", [
    ("8GiB", 8 * GiB), ("8G", 8 * 10**9), ("8GB", 8 * 10**9), ("512MiB", 512 << 20), ("1.5 GB", 1_500_000_000),
    ("8589934592", 8589934592), (8589934592, 8589934592), ("8gib", 8 * GiB), ("8 Gi", 8 * GiB), ("8GIB", 8 * GiB),
    ("  4 kb ", 4000), ("4KiB", 4096), ("2T", 2 * 10**12), ("1TiB", 1 << 40), ("100B", 100), ("0", 0),
    ("1.5GiB", 3 * GiB // 2), ("0.3KiB", 307),  # a fraction of a byte is rounded down
    (".5M", 500_000), ("8EiB", None),
])
def test_parse_bytes(text, want):
    if want is None:
        with pytest.raises(LimitError, match=r"'8EiB' is not a usable size: it is more than 8 EiB"):
            parse_bytes(text)
    else:
        assert parse_bytes(text) == want


def test_parse_bytes_takes_up_to_a_64_bit_count():
    assert parse_bytes(str(MAX_BYTES)) == MAX_BYTES
    with pytest.raises(LimitError, match=r"more than 8 EiB, the most a 64-bit byte count holds"):
        parse_bytes(MAX_BYTES + 1)


@pytest.mark.parametrize("text, want", [
    ("12 parsecs", r"'12 parsecs' is not a size: write bytes with a unit \(8GiB, 512MB\); 'parsecs' is not a unit "
                   r"\(B, kB, MB, GB"),
    ("lots", r"'lots' is not a size: write bytes with a unit \(8GiB, 512MB\)$"),
    ("", r"'' is not a size"),
    ("1.5", r"'1.5' is not a size: .*a number without a unit is whole bytes"),
    ("-1GiB", r"'-1GiB' is not a usable size: a size cannot be negative"),
    (-5, r"-5 is not a usable size: a size cannot be negative"),
    (True, r"True is not a size: .*not a bool"),
    (1.5e9, r"1500000000.0 is not a size: .*not a float"),
    ("8 GiB GiB", r"'8 GiB GiB' is not a size"),
])
def test_parse_bytes_errors_name_the_value(text, want):
    with pytest.raises(LimitError, match=want):
        parse_bytes(text)


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 512, 1023, 1024, 1536 << 20, 8 * GiB, 10**9, 2**63)] == [
        "0 B", "512 B", "1023 B", "1 KiB", "1.5 GiB", "8 GiB", "953.67 MiB", "8 EiB"]
    for n in (1, 4096, 3 * GiB // 2, 8 * GiB, 5 << 40):  # what it writes reads back
        assert parse_bytes(format_bytes(n)) == n
    for bad in (-1, 1.5, True):
        with pytest.raises(LimitError, match="is not a byte count"):
            format_bytes(bad)


def test_memory_limit_values_and_errors():
    for ok in (None, 1, "8GiB", "50%", "12.5 %", "100%", 8 * GiB):
        check_memory_limit(ok)
    # the message names the key, the value, where it came from and what is accepted
    with pytest.raises(LimitError, match=r"^memory_limit '12 parsecs' is not a size: write bytes with a unit "
                                         r"\(8GiB, 512MB\) or a percentage \(50%\)"):
        check_memory_limit("12 parsecs")
    with pytest.raises(LimitError, match=r"^memory_limit '12 parsecs' \(env HINA_MOE_MEMORY_LIMIT\) is not a size"):
        check_memory_limit("12 parsecs", "env HINA_MOE_MEMORY_LIMIT")
    for zero in (0, "0", "0GiB", "0.1B"):
        with pytest.raises(LimitError, match=rf"memory_limit {zero!r} is 0 bytes: give the most memory .*"
                                             r"or leave it unset for no limit"):
            check_memory_limit(zero)
    for negative in (-1, "-8GiB"):
        with pytest.raises(LimitError, match=rf"memory_limit {negative!r} is below 0 bytes"):
            check_memory_limit(negative)
    for pct in ("0%", "150%", "-5%", "100.5%"):
        with pytest.raises(LimitError, match=rf"memory_limit '{pct}' is not a share of memory: a percentage must be "
                                             r"more than 0 and at most 100"):
            check_memory_limit(pct)
    for bad in (1.5, True, ["8GiB"]):
        with pytest.raises(LimitError, match=r"memory_limit .* is not a size"):
            check_memory_limit(bad)


def test_resolve_bytes_and_percentages():
    meminfo, no_cgroup = (lambda: 16 * GiB), (lambda: None)
    assert resolve_memory_limit(None, meminfo=meminfo, cgroup=no_cgroup) is None
    assert resolve_memory_limit("8GiB", meminfo=meminfo, cgroup=no_cgroup) == 8 * GiB
    # bytes above the memory there is are kept: the limit is what was asked
    assert resolve_memory_limit("64GiB", meminfo=meminfo, cgroup=no_cgroup) == 64 * GiB
    assert resolve_memory_limit("50%", meminfo=meminfo, cgroup=no_cgroup) == 8 * GiB
    assert resolve_memory_limit("12.5 %", meminfo=meminfo, cgroup=no_cgroup) == 2 * GiB
    assert resolve_memory_limit("100%", meminfo=lambda: 1001, cgroup=no_cgroup) == 1001
    assert resolve_memory_limit("50%", meminfo=lambda: 1001, cgroup=no_cgroup) == 500  # rounded down
    # a cgroup limit below MemTotal is what the process may use; one above it (v1's "no limit") is not
    assert resolve_memory_limit("50%", meminfo=meminfo, cgroup=lambda: 4 * GiB) == 2 * GiB
    assert resolve_memory_limit("50%", meminfo=meminfo, cgroup=lambda: 32 * GiB) == 8 * GiB
    assert resolve_memory_limit("50%", meminfo=lambda: None, cgroup=lambda: 4 * GiB) == 2 * GiB
    with pytest.raises(LimitError, match=r"memory_limit '50%' \(file c.yaml: memory.limit\) is a share of the memory "
                                         r"this process may use, which cannot be read here .*give bytes instead"):
        resolve_memory_limit("50%", meminfo=lambda: None, cgroup=no_cgroup, source="file c.yaml: memory.limit")
    assert resolve_memory_limit("8GiB", meminfo=lambda: None, cgroup=no_cgroup) == 8 * GiB  # bytes need neither
    with pytest.raises(LimitError, match=r"memory_limit '0.001%' is 0 bytes of the 1000 B this process may use"):
        resolve_memory_limit("0.001%", meminfo=lambda: 1000, cgroup=no_cgroup)
    with pytest.raises(LimitError, match=r"memory_limit 'half' is not a size"):
        resolve_memory_limit("half", meminfo=meminfo, cgroup=no_cgroup)


def _cgroup_files(tmp_path, lines: list[str], files: dict[str, str]):
    """/proc/self/cgroup holding `lines`, and a cgroup mount whose files are `files` (path under
    the mount -> content); returns the reader over them."""
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("\n".join(lines) + "\n")
    root = tmp_path / "sys-fs-cgroup"
    root.mkdir()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    return lambda: cgroup_memory_limit(proc, root)


def test_cgroup_v2_limit_is_the_smallest_from_the_group_up(tmp_path):
    read = _cgroup_files(tmp_path, ["0::/user.slice/app.scope"], {
        "user.slice/app.scope/memory.max": str(6 * GiB), "user.slice/memory.max": str(4 * GiB),
        "cgroup.controllers": "cpu memory"})
    assert read() == 4 * GiB
    assert resolve_memory_limit("50%", meminfo=lambda: 16 * GiB, cgroup=read) == 2 * GiB


def test_cgroup_v2_max_is_no_limit(tmp_path):
    read = _cgroup_files(tmp_path, ["0::/app"], {"app/memory.max": "max"})
    assert read() is None
    assert resolve_memory_limit("50%", meminfo=lambda: 16 * GiB, cgroup=read) == 8 * GiB


def test_cgroup_v1_limit(tmp_path):
    read = _cgroup_files(tmp_path, ["5:cpu,cpuacct:/", "4:memory:/docker/abc", "0::/"], {
        "memory/docker/abc/memory.limit_in_bytes": str(3 * GiB), "memory/memory.limit_in_bytes": str(V1_NO_LIMIT),
        "memory.max": str(GiB)})  # a v2 file at the mount is not the memory controller's on a hybrid system
    assert read() == 3 * GiB
    assert resolve_memory_limit("50%", meminfo=lambda: 16 * GiB, cgroup=read) == 3 * GiB // 2


def test_cgroup_v1_no_limit_is_the_huge_number(tmp_path):
    read = _cgroup_files(tmp_path, ["4:memory:/process/x"], {
        "memory/process/x/memory.limit_in_bytes": str(V1_NO_LIMIT),
        "memory/memory.limit_in_bytes": str(V1_NO_LIMIT)})
    assert read() is None
    assert resolve_memory_limit("25%", meminfo=lambda: 16 * GiB, cgroup=read) == 4 * GiB
    # a limit read as a number at or above MemTotal is no limit either
    assert resolve_memory_limit("25%", meminfo=lambda: 16 * GiB, cgroup=lambda: 20 * GiB) == 4 * GiB


def test_cgroup_group_path_missing_in_a_container_reads_the_mount(tmp_path):
    # the host's path, not mounted in the container's namespace: the mount's own directory is its group
    read = _cgroup_files(tmp_path, ["9:memory:/kubepods/pod1/ctr"], {"memory/memory.limit_in_bytes": str(2 * GiB)})
    assert read() == 2 * GiB


@pytest.mark.parametrize("lines, files", [
    (["1:cpu:/", "2:pids:/"], {}),  # no memory controller at all
    (["0::/app"], {"app/memory.max": "garbage"}),
    (["0::/app"], {}),  # no file to read
])
def test_cgroup_unreadable_is_no_limit(tmp_path, lines, files):
    assert _cgroup_files(tmp_path, lines, files)() is None


def test_cgroup_without_proc_file(tmp_path):
    assert cgroup_memory_limit(tmp_path / "missing", tmp_path) is None


def test_mem_total(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemFree:  100 kB\nMemTotal:       24683772 kB\nMemAvailable: 5 kB\n")
    assert mem_total(f) == 24683772 * 1024
    f.write_text("MemFree: 100 kB\n")
    assert mem_total(f) is None
    assert mem_total(tmp_path / "missing") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and /sys/fs/cgroup")
def test_this_machine():
    total = mem_total()
    assert total is not None and total > 0
    mine = process_memory()
    assert mine is not None and 0 < mine <= total
    assert resolve_memory_limit("100%") == mine
    assert resolve_memory_limit("50%") == mine // 2
