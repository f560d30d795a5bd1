"""The typed choices of the config (weight format, kernel tier, scope, thread pool, memory mode)
and the one place that decides which format a block or dense layer is packed in, and why.

Every enum is a str subclass whose value is the config's spelling, so a member equals its string
("int4" == Format.INT4), hashes as it, and prints, formats and reprs as the plain string: configs,
environment variables, reports and JSON keep the values they always had."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import Enum


class _Choice(str, Enum):
    """A config value: compares, hashes, prints and reprs as its string."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)

    def __repr__(self) -> str:
        return repr(str.__str__(self))

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class Format(_Choice):
    """How weights are packed (config key `weights`)."""

    LOSSLESS = "lossless"
    LOSSLESS12 = "lossless12"  # bfloat16 bit for bit in ~75 % of the bytes: bfloat16 weights only
    INT8 = "int8"
    INT4 = "int4"

    @property
    def lossless(self) -> bool:
        """The packed copy holds the weights bit for bit: outputs as "lossless", restored from
        the packed copy, no SQNR to measure."""
        return self in (Format.LOSSLESS, Format.LOSSLESS12)

    @property
    def paired(self) -> bool:
        """A format whose dense layers may be packed paired (two output rows per input broadcast)."""
        return self in (Format.INT8, Format.INT4)


class Isa(_Choice):
    """The kernel tier (config key `isa`)."""

    AUTO = "auto"
    GENERIC = "generic"
    AVX2 = "avx2"
    AVX512 = "avx512"
    AMX = "amx"
    NEON = "neon"  # aarch64 (every CPU)
    DOTPROD = "dotprod"  # aarch64 with the dot-product extension (asimddp)
    I8MM = "i8mm"  # aarch64 with dotprod and the int8 matrix multiply (i8mm: SMMLA)
    BF16 = "bf16"  # aarch64 with i8mm and the bf16 dot products (bf16: BFDOT / BFMMLA)


class Scope(_Choice):
    """What enable accelerates (config key `scope`)."""

    EXPERTS = "experts"
    ALL = "all"


class Pool(_Choice):
    """Where the native kernels' parallel regions run (config key `pool`)."""

    AUTO = "auto"
    OWN = "own"
    OPENMP = "openmp"


class MemoryMode(_Choice):
    """How a block from the store is held (config key `memory`)."""

    AUTO = "auto"
    COPY = "copy"
    MAP = "map"


LOSSLESS_FORMATS = frozenset(f for f in Format if f.lossless)
# the dtypes lossless12 packs (its 12-bit code is of a bfloat16's bits)
_LOSSLESS12_DTYPES = ("bfloat16",)


@dataclass(frozen=True)
class FormatDecision:
    """The format a block or layer is packed in, and why it differs from the one asked for
    (None when it does not)."""

    format: Format
    why: str | None = None


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def decide_format(asked: str, dtype, *, name: str | None = None, routing: bool = False,
                  dense_lossless: str = "") -> FormatDecision:
    """The format weights of `dtype` (a torch dtype or its name) are packed in when `asked` is
    configured. For an MoE block: `name` None. For a dense layer of scope="all": its `name`, whether
    it computes routing (`routing`: always lossless, a few KiB that decide which experts run) and the
    config's `dense_lossless` patterns (layers kept lossless under int8/int4; lossless12 is exact
    already, so they do not apply to it). lossless12 packs bfloat16 weights only: others lossless."""
    fmt = Format(asked)
    if fmt is Format.LOSSLESS:
        return FormatDecision(fmt)
    if routing:
        return FormatDecision(Format.LOSSLESS, "a routing linear: always lossless")
    if fmt is Format.LOSSLESS12:
        dt = _dtype_name(dtype)
        if dt not in _LOSSLESS12_DTYPES:
            return FormatDecision(Format.LOSSLESS, f"stored as lossless: lossless12 packs bfloat16 weights, these are {dtype}")
        return FormatDecision(fmt)
    if name is not None and any(fnmatch.fnmatchcase(name, p.strip()) for p in dense_lossless.split(",") if p.strip()):
        return FormatDecision(Format.LOSSLESS, f"matches dense_lossless {dense_lossless!r}")
    return FormatDecision(fmt)
