"""Sizes and the memory limit (HinaConfig.memory_limit): text such as "8GiB", "1.5 GB" or "50%"
to bytes, bytes to text, and the memory this process may use, the smaller of the machine's
(MemTotal) and its cgroup's memory limit (v1 or v2).

The config keeps memory_limit as written, so reports show what the user asked for; it is turned
into bytes where it is used (resolve_memory_limit), since a percentage is of the memory of the
machine or container the process runs in then.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path
from typing import Callable

# Decimal units are powers of 1000 and binary ones of 1024, as IEC 80000-13 has them; "8G" is
# 8 * 1000**3 (as Kubernetes reads it), "8Gi" and "8GiB" 8 * 1024**3. Matched case-insensitively.
_DECIMAL = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5, "e": 6}
UNITS: dict[str, int] = {"": 1, "b": 1}
for _p, _e in _DECIMAL.items():
    UNITS[_p] = UNITS[_p + "b"] = 1000 ** _e
    UNITS[_p + "i"] = UNITS[_p + "ib"] = 1024 ** _e
UNIT_NAMES = "B, kB, MB, GB, TB, PB, EB (powers of 1000), KiB, MiB, GiB, TiB, PiB, EiB (powers of 1024)"

# The largest size accepted: what a signed 64-bit byte count (the native code's) holds.
MAX_BYTES = 2**63 - 1
# cgroup v1 writes "no limit" as the largest page-aligned counter, 9223372036854771712 (2^63 -
# 4096; read on this machine, 2026-12-07); no machine has 2^62 bytes, so anything from there up
# is read as no limit even where MemTotal, which it would also exceed, cannot be read.
_CGROUP_NO_LIMIT = 2**62

_NUMBER = r"([+-]?)(\d+(?:\.\d*)?|\.\d+)"
_SIZE = re.compile(rf"{_NUMBER}\s*([a-z]*)", re.IGNORECASE)
_PERCENT = re.compile(rf"{_NUMBER}\s*%")


class LimitError(ValueError):
    """A size or memory limit that cannot be read or met; the message names the value, what it
    is for, and what is accepted."""


class _NotASize(Exception):
    """Why a value is no size: `detail` follows the message; `syntax`: it is not written as one
    (else it is one, negative or too large)."""

    def __init__(self, detail: str, syntax: bool):
        super().__init__(detail)
        self.detail, self.syntax = detail, syntax


_HOW = "write bytes with a unit (8GiB, 512MB)"


def parse_bytes(text: str | int) -> int:
    """Bytes from an int or a size written with an optional unit: "8589934592", "8GiB", "8G",
    "512MiB", "1.5 GB" (case-insensitive; a fraction of a byte is rounded down). Negative
    sizes and anything else raise LimitError."""
    try:
        return _bytes_of(text)
    except _NotASize as exc:
        if exc.syntax:
            raise LimitError(f"{text!r} is not a size: {_HOW}{exc.detail}") from None
        raise LimitError(f"{text!r} is not a usable size: {exc.detail}") from None


def _bytes_of(text: object) -> int:
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise _NotASize(f", as a string or a whole number, not a {type(text).__name__}", True)
    if isinstance(text, int):
        value = Fraction(text)
    else:
        m = _SIZE.fullmatch(text.strip())
        if m is None:
            raise _NotASize("", True)
        sign, number, unit = m.groups()
        if unit.lower() not in UNITS:
            raise _NotASize(f"; {unit!r} is not a unit ({UNIT_NAMES})", True)
        if not unit and "." in number:
            raise _NotASize("; a number without a unit is whole bytes", True)
        value = Fraction(number) * UNITS[unit.lower()] * (-1 if sign == "-" else 1)
    if value < 0:
        raise _NotASize("a size cannot be negative", False)
    if value > MAX_BYTES:
        raise _NotASize(f"it is more than {format_bytes(MAX_BYTES + 1)}, the most a 64-bit byte count holds", False)
    return math.floor(value)


def format_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit it reaches, to two decimals at most: 512 -> "512 B",
    8 * 2**30 -> "8 GiB", 1536 * 2**20 -> "1.5 GiB", 10**9 -> "953.67 MiB"."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise LimitError(f"{n!r} is not a byte count: expected a whole number from 0")
    for power, unit in ((6, "EiB"), (5, "PiB"), (4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024**power:
            return f"{f'{n / 1024**power:.2f}'.rstrip('0').rstrip('.')} {unit}"
    return f"{n} B"


def _limit(value: object, source: str | None) -> tuple[str, int | Fraction] | None:
    """memory_limit read: None, ("bytes", n) or ("percent", p); LimitError naming the key, the
    value, `source` (where it came from) and what is accepted."""
    if value is None:
        return None
    where = f" ({source})" if source else ""
    give = "give the most memory hi_na_moe may use (8GiB, 512MB, 50%), or leave it unset for no limit"
    if isinstance(value, str):
        m = _PERCENT.fullmatch(value.strip())
        if m is not None:
            sign, number = m.groups()
            p = Fraction(number) * (-1 if sign == "-" else 1)
            if not 0 < p <= 100:
                raise LimitError(f"memory_limit {value!r}{where} is not a share of memory: a percentage must be "
                                 "more than 0 and at most 100 (50%), or give bytes (8GiB)")
            return "percent", p
    try:
        n = _bytes_of(value)
    except _NotASize as exc:
        if exc.syntax:
            raise LimitError(f"memory_limit {value!r}{where} is not a size: {_HOW} or a percentage "
                             f"(50%){exc.detail}") from None
        if exc.detail.endswith("negative"):
            raise LimitError(f"memory_limit {value!r}{where} is below 0 bytes: {give}") from None
        raise LimitError(f"memory_limit {value!r}{where} is not a usable size: {exc.detail}") from None
    if n == 0:
        raise LimitError(f"memory_limit {value!r}{where} is 0 bytes: {give}")
    return "bytes", n


def check_memory_limit(value: object, source: str | None = None) -> None:
    """Raise LimitError if `value` is no memory_limit (None, bytes as an int or with a unit, or a
    percentage); the memory a percentage is of is not read here."""
    _limit(value, source)


def mem_total(path: Path = Path("/proc/meminfo")) -> int | None:
    """MemTotal in bytes, or None when it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key == "MemTotal" and parts and parts[0].isdigit():
            return int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return None


def cgroup_memory_limit(self_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
                        ) -> int | None:
    """This process's cgroup memory limit in bytes, or None when it has none or it cannot be read.

    /proc/self/cgroup names the memory controller's group: a v1 line `N:memory:/path` (the
    controller's hierarchy mounted at root/memory; on hybrid systems the memory controller is
    there even when a `0::` line exists too), else the v2 line `0::/path` (mounted at root). The
    limit in force is the smallest of the group's and its ancestors' (memory.limit_in_bytes on
    v1, memory.max on v2), so every existing directory from the group up to the mount is read;
    in a container the group's path may not exist under the mount (it is the host's), and the
    mount's own directory, the container's group, then holds the limit.
    """
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if "memory" in controllers.split(","):
            v1 = path
        elif hid == "0" and controllers == "":
            v2 = path
    if v1 is not None:
        base, name, rel = root / "memory", "memory.limit_in_bytes", v1
    elif v2 is not None:
        base, name, rel = root, "memory.max", v2
    else:
        return None
    found = []
    d = base / rel.strip("/")
    while True:
        try:
            text = (d / name).read_text().strip()
        except OSError:
            text = None
        if text and text != "max":
            try:
                found.append(int(text))
            except ValueError:
                pass
        if d == base or base not in d.parents:
            break
        d = d.parent
    limit = min(found, default=None)
    return None if limit is None or limit >= _CGROUP_NO_LIMIT else limit


def process_memory(*, meminfo: Callable[[], int | None] | None = None,
                   cgroup: Callable[[], int | None] | None = None) -> int | None:
    """The memory this process may use, in bytes: MemTotal, or the cgroup memory limit when that
    is smaller (a v1 "no limit" is larger); None when neither can be read. `meminfo` and
    `cgroup` read them (defaults: mem_total, cgroup_memory_limit)."""
    total = (meminfo or mem_total)()
    limit = (cgroup or cgroup_memory_limit)()
    if limit is not None and (total is None or limit < total):
        return limit
    return total


def resolve_memory_limit(value: object, *, meminfo: Callable[[], int | None] | None = None,
                         cgroup: Callable[[], int | None] | None = None, source: str | None = None
                         ) -> int | None:
    """memory_limit in bytes: None (no limit) stays None, bytes are bytes (a limit above the
    memory there is is kept as given), a percentage is of process_memory(meminfo=, cgroup=),
    rounded down. LimitError, naming the value and `source`, for a value that is no limit or a
    percentage when the memory it is of cannot be read."""
    read = _limit(value, source)
    if read is None:
        return None
    kind, amount = read
    if kind == "bytes":
        return int(amount)
    where = f" ({source})" if source else ""
    total = process_memory(meminfo=meminfo, cgroup=cgroup)
    if total is None:
        raise LimitError(f"memory_limit {value!r}{where} is a share of the memory this process may use, which "
                         "cannot be read here (no MemTotal in /proc/meminfo and no cgroup memory limit): "
                         "give bytes instead (8GiB)")
    n = math.floor(total * amount / 100)
    if n == 0:
        raise LimitError(f"memory_limit {value!r}{where} is 0 bytes of the {format_bytes(total)} this process "
                         "may use: give a larger percentage or bytes (8GiB)")
    return n
