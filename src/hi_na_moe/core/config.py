"""One validated configuration object, read from keyword arguments, environment variables and a
YAML file, in that order of precedence.

Every key here changes what the library does; a key that would do nothing does not exist.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from .formats import Format, Isa, MemoryMode, Pool, Scope
from .limits import LimitError, check_memory_limit, resolve_memory_limit
from .native import native_module
from .store import default_cache_dir

ENV_PREFIX = "HINA_MOE_"
# The environment variable naming a YAML config file; not itself a config key.
ENV_CONFIG_FILE = "HINA_MOE_CONFIG"
# Read by the native library when it loads, not a config key: the kernels' prefetch distance
# (hi_na_moe._native.prefetch_distance; csrc/moe/prefetch.h).
ENV_NATIVE = ("HINA_MOE_PREFETCH_BYTES",)
# read by a command, not a config key: `hi-na-moe serve`'s API key (kept out of the process list)
ENV_COMMANDS = ("HINA_MOE_API_KEY",)

BACKENDS = ("auto", "native", "reference")
ISA_TIERS = Isa.values()
WEIGHT_FORMATS = Format.values()
QDOT_MODES = ("auto", "int", "expand")
GROUP_SIZES = (32, 64, 128)
# int4's default group: with layout 5's one-byte scale codes as many bytes as group 64 had with
# bfloat16 scales, and more faithful than llama.cpp's Q4_0 (benchmarks/weight_fidelity.py)
DEFAULT_GROUP_SIZE = 32
POOLS = Pool.values()
MEMORY_MODES = MemoryMode.values()
SCOPES = Scope.values()
# The most threads `threads` may ask for: the most logical CPUs a Linux x86-64 kernel supports
# (CONFIG_NR_CPUS <= 8192), so more can never mean one thread a CPU; well inside the native pool's
# limit (16-bit thread ids a region: csrc/include/hina_moe/thread_pool.h, kTidBits) and the C int
# the binding takes, past which the value used to fail deep inside a kernel call.
MAX_THREADS = 8192
# The memory tier's keys (issue 42): the prediction window in MoE layers ahead, the I/O threads
# that read experts from the store, and O_DIRECT for those reads.
MAX_PREDICTION_WINDOW = 8
IO_THREADS_RANGE = (1, 64)
DIRECT_IO_MODES = ("auto", "on", "off")
# the memory tier's eviction policies (csrc/experts/tier.cpp); auto: the one the project ships
# (hi_na_moe.core.tier.DEFAULT_POLICY, named in the enable report)
EVICTION_POLICIES = ("auto", "lru", "lfu", "lru-2", "freq-decay")
# The most NUMA nodes Linux supports: 2^CONFIG_NODES_SHIFT, at most 2^10 on x86-64; whether the
# node exists on this machine is checked where it is used.
MAX_NUMA_NODE = 1023
# The `experimental` key's switches: name -> (module, attribute). Each turns one scope="all" native
# path off for the whole process (its module's own code runs: outputs stay exact either way), for
# A/B measurements (docs/configuration.md, "experimental").
EXPERIMENTAL = {
    "linear.paired": ("hi_na_moe.fastpath.linear", "PAIRED"),
    "linear.reuse_unpaired": ("hi_na_moe.fastpath.linear", "REUSE_UNPAIRED"),
    "routers.native_select": ("hi_na_moe.fastpath.routers", "NATIVE_SELECT"),
    "attention.prefill": ("hi_na_moe.fastpath.attention", "PREFILL"),
    "mla.quant_weight": ("hi_na_moe.fastpath.mla", "QUANT_WEIGHT"),
    "layers.fuse_experts": ("hi_na_moe.fastpath.layers", "FUSE_EXPERTS"),
    "layers.fuse_shared": ("hi_na_moe.fastpath.layers", "FUSE_SHARED"),
    "layers.hold_plan_args": ("hi_na_moe.fastpath.layers", "HOLD_PLAN_ARGS"),
    "stack.one_call": ("hi_na_moe.fastpath.stack", "ONE_CALL"),
    "stack.final_norm": ("hi_na_moe.fastpath.stack", "FINAL_NORM"),
    "stack.rope_table": ("hi_na_moe.fastpath.stack", "ROPE_TABLE"),
    "stack.causal_lm": ("hi_na_moe.fastpath.stack", "CAUSAL_LM"),
    "stack.head_in_call": ("hi_na_moe.fastpath.stack", "HEAD_IN_CALL"),
    "kv_cache.in_place": ("hi_na_moe.fastpath.kv_cache", "IN_PLACE"),
    "kv_cache.group": ("hi_na_moe.fastpath.kv_cache", "GROUP"),
    "tier.skip_unused_reads": ("hi_na_moe.core.tier", "SKIP_UNUSED_READS"),
    "tier.refine": ("hi_na_moe.core.tier", "REFINE"),
}
# the words a true / false value may be written as (environment, YAML, `experimental`)
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# Fewer experts a token (hi_na_moe.core.trim): top_k's words, top_k_renorm's modes
TOP_K_WORDS = ("model", "adaptive")
TOP_K_RENORM_MODES = ("auto", "on", "off")
# The YAML file's nested form: section -> {subkey: config key}. A section that is also a flat key
# (memory, prefetch) keeps its flat meaning when given a scalar (`memory: map`).
NESTED = {
    "memory": {"mode": "memory", "limit": "memory_limit", "io_threads": "io_threads", "direct_io": "direct_io",
               "eviction": "eviction"},
    "prefetch": {"enabled": "prefetch", "prediction_window": "prediction_window"},
    "numa": {"node": "numa_node"},
    "top_k": {"mode": "top_k", "threshold": "top_k_threshold", "min": "top_k_min", "renorm": "top_k_renorm"},
}


class ConfigError(ValueError):
    """A configuration key or value is wrong. The message names the key, the bad value, where it
    came from and what is allowed."""


class UnknownKeyError(ConfigError, TypeError):
    """A key HinaConfig does not have, passed to its constructor: a TypeError too, as any
    unexpected keyword argument is, with the config's own message (known keys, did you mean)."""


@dataclass(frozen=True)
class HinaConfig:
    """What `enable_for_model` does.

    Attributes:
        backend: "auto" runs each MoE block on the native C++ kernels where one fits and on the
            pure-PyTorch reference otherwise (the report says which, and why); "native" refuses
            to enable a block that has no native kernel; "reference" always uses the pure-PyTorch
            reference path (the oracle the kernels are tested against).
        isa: kernel tier for native kernels: "auto" (the best this CPU and OS allow) or one of
            "generic", "avx2", "avx512", "amx" (x86), "neon", "dotprod", "i8mm", "bf16" (aarch64). Asking for a
            tier the CPU lacks is an error.
        threads: threads for the native kernels, 0 to MAX_THREADS (8192); 0 means
            `torch.get_num_threads()`.
        strict: if true, `enable_for_model` raises when any MoE block found in the model would be
            left running natively (instead of reporting it and going on).
        keep_weights: if true, the model's own expert tensors stay in memory beside the packed
            copy the native kernels read (twice the expert memory; needed to run backward
            through enabled blocks). By default they are released while enabled and rebuilt
            bit-exactly by `disable_for_model` (lossless: from the packed copy; int8/int4: from
            an exact backup written to the packed-expert store).
        weights: how the native kernels store expert weights: "lossless" (the model's own dtype,
            the default), "lossless12" (bfloat16 weights bit for bit in about 75 % of their
            bytes: the same outputs as "lossless", and decode reads fewer bytes; a block of
            another dtype, or whose weights do not fit the packing, is stored "lossless" and
            the report says so), "int8" (per output channel) or "int4" (per group of
            `group_size` weights along the reduction). Quantised formats are lossy; the enable
            report gives each block's measured SQNR.
        group_size: int4 group size: 32 (default), 64 or 128. Smaller groups: more accurate,
            more scale bytes (4.25, 4.125, 4.0625 bits a weight, plus 32 bits a row). Against
            llama.cpp's Q4_0 (4.5 bits), group 32 is 0.3 dB more faithful, 64 0.5 dB less
            (weight SQNR, benchmarks/weight_fidelity.py).
        qdot: how the native kernels compute int8/int4 experts: "int" (integer dot products,
            W8A8 / W4A8: activations quantised per token in blocks of 32, see moe.h), "expand"
            (weights expanded to fp32/bf16 in registers, activations unquantised) or "auto"
            (default: "int" where the tier has an integer-dot kernel, except the AMX prefill
            path of bf16 models, which keeps its bf16 tiles). Ignored for lossless weights.
        cache: if true (default), quantised experts are written to the packed-expert store on
            first enable and loaded from it afterwards (no re-quantising; copied or mapped: see
            memory), and the exact
            originals are backed up there so disable can restore them. If false, quantising
            happens on every enable and the originals stay in memory.
        cache_dir: the store's directory; "" means the default (`$XDG_CACHE_HOME/hi_na_moe`, else
            `~/.cache/hi_na_moe`).
        memory: where the packed blocks loaded from the store live. "copy": each is copied into
            memory of its own at load (transparent huge pages requested), which the kernels
            stream at one speed, while a file mapping's speed depends on the page cache's state
            (13-17 % slower decode measured in one, as fast in another: hi_na_moe.core.memory). "map":
            the kernels read the store's read-only file mapping: quicker loads, and the OS may
            drop its pages under memory pressure and read them again from disk, so a model
            larger than RAM still runs (slowly). "auto" (default): copy while a copy leaves
            headroom in the memory this process may use, map the rest. The enable report says
            which.
        pool: which threads run the native kernels' parallel regions: "openmp" runs them on the
            team of the GNU OpenMP runtime PyTorch already loaded (the threads that just ran
            torch's ops, so the two never compete for cores), "own" on hi_na_moe's own workers
            (spin briefly, then sleep; a worker the scheduler has not run yet leaves its share to
            the caller), "auto" (default) picks under scope="all" the own workers with the
            regions of prefill-sized calls on OpenMP's team (native "mixed"), and otherwise openmp
            when a libgomp is loaded in the process (HinaConfig.kernel_pool). Decode steps through
            a stack's one native call run hosted on OpenMP's team on own and mixed (one join a
            step). Process-wide: the last enable's value applies.
        scope: "experts" (default) accelerates the MoE experts only; "all" also runs the model's
            dense linear layers (attention projections, shared experts, dense MLPs, lm_head) on
            the native kernels, in the `weights` format (see hi_na_moe.fastpath.linear).
        dense_lossless: with scope="all" and int8/int4 weights, the dense layers whose names
            match these comma-separated fnmatch patterns stay in the model's own dtype (default
            "lm_head").
        dense_exclude: with scope="all", dense layers whose names match these patterns are left
            to PyTorch (default: none).
        dense_fuse: with scope="all", sibling projections that read the same input (q/k/v,
            gate/up) run as one kernel call (default true; exact: the same outputs as one call
            per layer).
        memory_limit: the most memory the memory tier may hold, as written (reports show it):
            None (default: no limit), bytes as an int or a string with a unit ("8GiB", "8G",
            "512MiB", "1.5 GB"; decimal units powers of 1000, binary of 1024), or a percentage
            ("50%") of the memory this process may use (MemTotal, or the cgroup memory limit
            when smaller). `memory_limit_bytes()` gives bytes (hi_na_moe.core.limits).
        prefetch: if true (default), the memory tier reads ahead the experts it predicts the
            next layers will use.
        prediction_window: how many MoE layers ahead those predictions reach, 0 to 8 (default 2).
        io_threads: threads reading experts from the store, 1 to 64 (default 4).
        direct_io: whether those reads bypass the page cache (O_DIRECT): "auto" (default), "on"
            or "off".
        eviction: which resident expert the memory tier's pool gives up for a read: "auto"
            (default: the policy the project ships, named in the enable report), "lru", "lfu",
            "lru-2" or "freq-decay" (a use's weight halves every 32 tokens).
        numa_node: the NUMA node whose memory the memory tier uses; None (default) leaves it to
            the OS. Whether the node exists is checked where it is used.
        experimental: switches of single scope="all" native paths, for A/B measurements:
            comma-separated `name=on|off` (names: EXPERIMENTAL, e.g. "stack.one_call=off"); ""
            (default) changes none. Process-wide, set when a model is enabled; a switch not named
            keeps its value. Outputs stay exact either way (the module's own code runs).
        profile: a `hi-na-moe profile-router --out` directory (or its expert_prior.json): the
            memory tier's pool starts with that prior's most frequent experts, read at enable;
            "" (default): it starts empty. Unused without a memory tier (the report says so).
        top_k: how many of the experts its router chose a token uses (hi_na_moe.core.trim):
            "model" (default: all of them, the model's own outputs), a whole number n >= 1 (the n
            of largest weight), or "adaptive" (an expert stays while its weight is at least
            top_k_threshold x an even share of the token's routing weight, and the top_k_min
            largest stay). Anything but
            "model" changes the outputs, lossless weights included; the enable report,
            `hi_na_moe.stats(model)` and `bench` give the experts a token used.
        top_k_threshold: adaptive's threshold, >= 0, in even shares: an expert stays while its
            weight is at least threshold / k of the token's routing weight (the k weights' sum when
            top_k_renorm renormalises them, else 1: a router's probabilities over every expert);
            0 keeps all; default 0.3.
        top_k_min: the experts adaptive keeps whatever their weight, >= 1 (default 1).
        top_k_renorm: whether the kept weights are scaled back to the sum of the token's weights:
            "auto" (default: when the model's config says its router normalises, norm_topk_prob;
            when the config does not say, they are), "on" or "off".
    """

    backend: str = "auto"
    isa: str = "auto"
    threads: int = 0
    strict: bool = False
    keep_weights: bool = False
    weights: str = "lossless"
    group_size: int = DEFAULT_GROUP_SIZE
    qdot: str = "auto"
    cache: bool = True
    cache_dir: str = ""
    memory: str = "auto"
    pool: str = "auto"
    scope: str = "experts"
    dense_lossless: str = "lm_head"
    dense_exclude: str = ""
    dense_fuse: bool = True
    # the memory tier's (hi_na_moe.integrate.tiering)
    memory_limit: int | str | None = None
    prefetch: bool = True
    prediction_window: int = 2
    io_threads: int = 4
    direct_io: str = "auto"
    eviction: str = "auto"
    numa_node: int | None = None
    profile: str = ""
    experimental: str = ""
    # fewer experts a token (hi_na_moe.core.trim)
    top_k: int | str = "model"
    top_k_threshold: float = 0.3
    top_k_min: int = 1
    top_k_renorm: str = "auto"
    # Where each value came from ("default", "kwarg", "env HINA_MOE_ISA", "file ~/.config/..."),
    # so that errors and reports can say it.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        src = lambda key: self.sources.get(key, "argument")  # noqa: E731
        _check_choice("backend", self.backend, BACKENDS, src("backend"))
        _check_choice("isa", self.isa, ISA_TIERS, src("isa"))
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 0 <= self.threads <= MAX_THREADS:
            raise ConfigError(
                f"config key 'threads' ({src('threads')}) has bad value {self.threads!r}: "
                f"expected a whole number from 0 to {MAX_THREADS} (0 means torch.get_num_threads(); "
                f"{MAX_THREADS}, the most CPUs Linux supports, is the cap)"
            )
        _check_choice("weights", self.weights, WEIGHT_FORMATS, src("weights"))
        _check_choice("pool", self.pool, POOLS, src("pool"))
        _check_choice("memory", self.memory, MEMORY_MODES, src("memory"))
        if isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES:
            raise ConfigError(
                f"config key 'group_size' ({src('group_size')}) has bad value {self.group_size!r}: "
                f"expected one of {', '.join(map(str, GROUP_SIZES))}"
            )
        _check_choice("qdot", self.qdot, QDOT_MODES, src("qdot"))
        _check_choice("scope", self.scope, SCOPES, src("scope"))
        for key in ("dense_lossless", "dense_exclude"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(
                    f"config key {key!r} ({src(key)}) has bad value {getattr(self, key)!r}: expected a "
                    "comma-separated list of module-name patterns, e.g. 'lm_head,*.self_attn.*'"
                )
        for key in ("cache_dir", "profile"):  # a pathlib.Path is a path too
            if isinstance(getattr(self, key), os.PathLike):
                object.__setattr__(self, key, os.fspath(getattr(self, key)))
        self.experimental_switches()  # (a bad name or value: ConfigError naming it)
        if not isinstance(self.profile, str):
            raise ConfigError(
                f"config key 'profile' ({src('profile')}) has bad value {self.profile!r}: expected a path (a "
                "profile-router --out directory or its expert_prior.json), or '' for none"
            )
        if not isinstance(self.cache_dir, str):
            raise ConfigError(
                f"config key 'cache_dir' ({src('cache_dir')}) has bad value {self.cache_dir!r}: expected a path"
            )
        try:
            check_memory_limit(self.memory_limit, src("memory_limit"))
        except LimitError as exc:
            raise ConfigError(str(exc)) from None
        for key, low, high, what in (
                ("prediction_window", 0, MAX_PREDICTION_WINDOW, "MoE layers ahead"),
                ("io_threads", *IO_THREADS_RANGE, "threads"),
                ("numa_node", 0, MAX_NUMA_NODE, "a NUMA node's number; unset: the OS chooses")):
            value = getattr(self, key)
            if key == "numa_node" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(
                    f"config key {key!r} ({src(key)}) has bad value {value!r}: expected a whole number "
                    f"from {low} to {high} ({what})"
                )
        _check_choice("direct_io", self.direct_io, DIRECT_IO_MODES, src("direct_io"))
        _check_choice("eviction", self.eviction, EVICTION_POLICIES, src("eviction"))
        if isinstance(self.top_k, bool) or not (isinstance(self.top_k, int) and self.top_k >= 1
                                                or self.top_k in TOP_K_WORDS):
            raise ConfigError(
                f"config key 'top_k' ({src('top_k')}) has bad value {self.top_k!r}: expected 'model' (the "
                "router's own experts), 'adaptive', or a whole number >= 1 (the experts a token keeps)"
            )
        threshold = self.top_k_threshold
        if (isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold)
                or threshold < 0):
            raise ConfigError(
                f"config key 'top_k_threshold' ({src('top_k_threshold')}) has bad value {threshold!r}: expected a "
                "number >= 0 (an expert stays while its weight is at least that many even shares of the token's "
                "routing weight; 0 keeps all)"
            )
        if isinstance(self.top_k_min, bool) or not isinstance(self.top_k_min, int) or self.top_k_min < 1:
            raise ConfigError(
                f"config key 'top_k_min' ({src('top_k_min')}) has bad value {self.top_k_min!r}: expected a whole "
                "number >= 1 (the experts a token keeps whatever their weight)"
            )
        _check_choice("top_k_renorm", self.top_k_renorm, TOP_K_RENORM_MODES, src("top_k_renorm"))
        for key in ("strict", "keep_weights", "cache", "dense_fuse", "prefetch"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"config key {key!r} ({src(key)}) has bad value {getattr(self, key)!r}: expected true or false"
                )
        if self.isa not in ("auto", "generic"):
            _check_isa_available(self.isa, src("isa"))
        if self.scope == Scope.ALL and self.backend == "reference":
            raise ConfigError(
                f"config keys 'scope' ({src('scope')}) = 'all' and 'backend' ({src('backend')}) = 'reference' "
                "do not go together: scope='all' runs the dense layers on the native kernels, which "
                "backend='reference' turns off. Use backend='auto' (or 'native') with scope='all', or "
                "scope='experts' with backend='reference'"
            )
        # the typed values (str enums: equal to, and printed as, the strings they were given as)
        for key, kind in (("weights", Format), ("isa", Isa), ("scope", Scope), ("pool", Pool), ("memory", MemoryMode)):
            object.__setattr__(self, key, kind(getattr(self, key)))

    def experimental_switches(self) -> dict[str, bool]:
        """`experimental` parsed: {name: on}. ConfigError names a bad entry, an unknown name (with
        a "did you mean") or a bad value."""
        src = self.sources.get("experimental", "argument")
        if not isinstance(self.experimental, str):
            raise ConfigError(f"config key 'experimental' ({src}) has bad value {self.experimental!r}: expected "
                              "comma-separated name=on|off, e.g. 'stack.one_call=off'")
        out: dict[str, bool] = {}
        for part in filter(None, (p.strip() for p in self.experimental.split(","))):
            name, eq, value = (t.strip() for t in part.partition("="))
            if not eq or not name:
                raise ConfigError(f"config key 'experimental' ({src}): {part!r} is not name=on|off")
            if name not in EXPERIMENTAL:
                hint = difflib.get_close_matches(name, EXPERIMENTAL, n=1)
                raise ConfigError(f"config key 'experimental' ({src}): unknown switch {name!r}"
                                  + (f" (did you mean {hint[0]!r}?)" if hint else "")
                                  + f"; known: {', '.join(EXPERIMENTAL)}")
            if value.lower() not in _ON + _OFF:
                raise ConfigError(f"config key 'experimental' ({src}): {name}={value!r}: expected on or off")
            out[name] = value.lower() in _ON
        return out

    def kernel_pool(self) -> str:
        """The thread pool backend `pool` asks for (native set_pool_backend): "auto" is "mixed"
        under scope="all": the own workers, whose decode step is one native call (on OpenMP's
        team, whose threads spin at its barriers, a decode step under one competing process took
        2.4-2.7x as long as on the own workers; benchmarks/log/threads.md, 2026-12-02; hosted on that
        team since 2026-12-05, one join a step, backing off to the own workers under a
        competitor), and prefill-sized calls on OpenMP's team (a prefill interleaves torch's ops
        with the kernels: 1.06-1.09x, about even under a competitor; 2026-12-05). Otherwise the
        native "auto" (OpenMP's team when a libgomp is loaded: between torch's ops, whose team
        keeps spinning for a while, the own workers measured 22 % slower)."""
        return "mixed" if self.pool == Pool.AUTO and self.scope == Scope.ALL else self.pool

    def store_root(self) -> Path:
        """The packed-expert store's directory under this config."""
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    def memory_limit_bytes(self, *, meminfo=None, cgroup=None) -> int | None:
        """memory_limit in bytes (None: no limit), a percentage taken of the memory this process
        may use now; `meminfo` and `cgroup` as hi_na_moe.core.limits.resolve_memory_limit's."""
        try:
            return resolve_memory_limit(self.memory_limit, meminfo=meminfo, cgroup=cgroup,
                                        source=self.sources.get("memory_limit", "argument"))
        except LimitError as exc:
            raise ConfigError(str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sources"}


KEYS = tuple(f.name for f in dataclasses.fields(HinaConfig) if f.name != "sources")


def _checked_init(generated):
    """HinaConfig's __init__: the dataclass's own, after refusing an unknown keyword with the
    config's message (a plain TypeError would name no key it could have been). Wrapped rather
    than written, so fields, defaults, replace() and pickling stay the dataclass's."""
    names = frozenset(f.name for f in dataclasses.fields(HinaConfig) if f.init)

    @functools.wraps(generated)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in names:
                raise _unknown_key(key, "HinaConfig argument", UnknownKeyError)
        generated(self, *args, **kwargs)

    return __init__


HinaConfig.__init__ = _checked_init(HinaConfig.__init__)  # type: ignore[method-assign]
_TYPES = {"backend": str, "isa": str, "threads": int, "strict": bool, "keep_weights": bool,
          "weights": str, "group_size": int, "qdot": str, "cache": bool, "cache_dir": str,
          "memory": str, "pool": str, "scope": str, "dense_lossless": str, "dense_exclude": str, "dense_fuse": bool,
          "memory_limit": "size", "prefetch": bool, "prediction_window": int, "io_threads": int,
          "direct_io": str, "eviction": str, "numa_node": "int or none", "profile": str, "experimental": str, "top_k": "int or word", "top_k_threshold": float,
          "top_k_min": int, "top_k_renorm": str}


def _check_choice(key: str, value: Any, allowed: tuple[str, ...], source: str) -> None:
    if value not in allowed:
        hint = difflib.get_close_matches(str(value), allowed, n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"config key {key!r} ({source}) has bad value {value!r}: expected one of "
            f"{', '.join(repr(a) for a in allowed)}{extra}"
        )


# The architecture of each SIMD tier ("generic" runs everywhere), in ascending order per
# architecture; a tier of another architecture than this CPU's is refused as such.
ISA_ARCH = {"generic": None, "avx2": "x86-64", "avx512": "x86-64", "amx": "x86-64",
            "neon": "aarch64", "dotprod": "aarch64", "i8mm": "aarch64",
            "bf16": "aarch64"}


def _check_isa_available(isa: str, source: str) -> None:
    native, why = native_module()
    if native is None:
        raise ConfigError(
            f"config key 'isa' ({source}) asks for {isa!r}, but the native library is not loaded ({why}); "
            "use isa='auto' or rebuild the package"
        )
    if not native.isa_supported(isa):
        have = [t for t in ISA_ARCH if native.isa_supported(t)]
        listed = ", ".join(repr(t) for t in have)
        arch = ISA_ARCH.get(isa)
        if arch and not any(native.isa_supported(t) for t, a in ISA_ARCH.items() if a == arch):
            # not a tier too high for this CPU: one of another architecture's
            raise ConfigError(
                f"config key 'isa' ({source}) asks for {isa!r}, a tier of {arch} CPUs, and this CPU is not "
                f"one; this CPU's tiers: {listed} (best: {native.best_isa()!r}); use one of those or 'auto'"
            )
        raise ConfigError(
            f"config key 'isa' ({source}) asks for {isa!r}, which this CPU/OS does not support "
            f"(best available: {native.best_isa()!r}; this CPU's tiers: {listed}); pick a lower tier or 'auto'"
        )


def _unknown_key(key: str, source: str, cls: type[ConfigError] = ConfigError) -> ConfigError:
    hint = difflib.get_close_matches(key, KEYS, n=1)
    extra = f"; did you mean {hint[0]!r}?" if hint else ""
    return cls(f"unknown config key {key!r} ({source}); known keys: {', '.join(KEYS)}{extra}")


def _coerce(key: str, raw: Any, source: str) -> Any:
    """Turn a value from a text source (env var) or YAML into the key's type, or explain why not."""
    want = _TYPES[key]
    if want in ("size", "int or none"):
        # "" and "none" unset the key (an environment variable cannot hold YAML's null)
        if raw is None or isinstance(raw, str) and raw.strip().lower() in ("", "none"):
            return None
        if want == "size":  # kept as written; HinaConfig says what is wrong with it
            return raw.strip() if isinstance(raw, str) else raw
        want = int
    if want == "int or word":  # top_k: a whole number, or a word HinaConfig checks
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        text = str(raw).strip()
        return int(text) if text.lstrip("+-").isdigit() else text
    if want is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        try:
            return float(str(raw).strip())
        except ValueError:
            raise ConfigError(f"config key {key!r} ({source}) has bad value {raw!r}: expected a number") from None
    if key == "experimental" and isinstance(raw, Mapping):  # YAML: {stack.one_call: off, ...}
        return ",".join(f"{k}={'on' if v is True else 'off' if v is False else v}" for k, v in raw.items())
    if key in ("direct_io", "top_k_renorm") and isinstance(raw, bool):
        return "on" if raw else "off"  # YAML 1.1 reads a bare on / off as true / false
    if want is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _ON:
            return True
        if text in _OFF:
            return False
        raise ConfigError(f"config key {key!r} ({source}) has bad value {raw!r}: expected true or false")
    if want is int:
        if isinstance(raw, bool):
            raise ConfigError(f"config key {key!r} ({source}) has bad value {raw!r}: expected a whole number")
        if isinstance(raw, int):
            return raw
        try:
            return int(str(raw).strip())
        except ValueError:
            raise ConfigError(
                f"config key {key!r} ({source}) has bad value {raw!r}: expected a whole number"
            ) from None
    if not isinstance(raw, str):
        raise ConfigError(f"config key {key!r} ({source}) has bad value {raw!r}: expected a string")
    return raw.strip()


def default_config_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "hi_na_moe" / "config.yaml"


def _read_file(path: Path, required: bool) -> dict[str, Any]:
    """The YAML mapping in `path`; required: it came from $HINA_MOE_CONFIG (else it is the user's
    default file, which may be absent)."""
    origin = f"from {ENV_CONFIG_FILE}" if required else "the user's config file"
    if not path.exists():
        if required:
            raise ConfigError(f"config file {str(path)!r} ({origin}) does not exist")
        return {}
    fix = f"point {ENV_CONFIG_FILE} at a YAML file" if required else "fix or remove it"
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} ({origin}) is a directory, not a file; {fix}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} ({origin}) cannot be read: {exc.strerror or exc}; {fix}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} ({origin}) is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8 YAML, or {fix}"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of keys to values (e.g. 'isa: avx512'), "
            f"not a {type(data).__name__}"
        )
    return data


def _file_values(path: Path, data: Mapping[Any, Any]) -> dict[str, tuple[Any, str]]:
    """key -> (value, source) for the keys a config file's mapping sets, flat (`memory_limit:
    8GiB`) or nested (`memory: {limit: 8GiB}`, NESTED); a key set both ways is an error naming
    both, as is a nested key that is none of its section's."""
    out: dict[str, tuple[Any, str, str]] = {}

    def put(key: str, raw: Any, written: str) -> None:
        if key in out:
            raise ConfigError(
                f"config file {str(path)!r} sets config key {key!r} twice, as {out[key][2]!r} and as {written!r}; "
                "keep one of them"
            )
        out[key] = (raw, f"file {path}" if written == key else f"file {path}: {written}", written)

    for name, raw in data.items():
        name = str(name)
        section = NESTED.get(name)
        if section is not None and isinstance(raw, dict):
            for sub, value in raw.items():
                if str(sub) not in section:
                    raise _unknown_nested(name, str(sub), path)
                put(section[str(sub)], value, f"{name}.{sub}")
        elif name in KEYS:
            put(name, raw, name)
        elif section is not None:
            flat = ", ".join(repr(k) for k in section.values())
            raise ConfigError(
                f"config key {name!r} (file {path}) has bad value {raw!r}: expected a mapping of "
                f"{', '.join(section)} (e.g. '{name}: {{{next(iter(section))}: ...}}'), or the flat key {flat}"
            )
        else:
            raise _unknown_key(name, f"file {path}")
    return {key: (raw, source) for key, (raw, source, _) in out.items()}


def _unknown_nested(name: str, sub: str, path: Path) -> ConfigError:
    section = NESTED[name]
    # close in spelling, else the flat key's name written inside the section, else a part of one
    hint = (difflib.get_close_matches(sub, section, n=1) or [k for k, v in section.items() if v == sub]
            or [k for k in section if len(sub) >= 3 and sub in k])
    extra = f"; did you mean '{name}.{hint[0]}'?" if hint else ""
    return ConfigError(
        f"unknown config key '{name}.{sub}' (file {path}); known under '{name}': {', '.join(section)}{extra}"
    )


# the unknown HINA_MOE_* variables already warned about in this process
_WARNED_ENV: set[str] = set()


def _warn_unknown_env(name: str, key: str) -> None:
    """An environment variable with the prefix that is no key is ignored, said once a process: a
    process inherits its environment, and a typo (or a variable of another hi_na_moe version)
    there must not break every call."""
    if name in _WARNED_ENV:
        return
    _WARNED_ENV.add(name)
    known = known_env()
    # matched without the prefix, which every name shares and would make any two look alike
    by_suffix = {k[len(ENV_PREFIX):].lower(): k for k in known}
    hint = difflib.get_close_matches(key, by_suffix, n=1)
    extra = f" (did you mean {by_suffix[hint[0]]}?)" if hint else ""
    message = f"hi_na_moe: ignoring unknown environment variable {name}{extra}; known: {', '.join(known)}"
    try:
        warnings.warn(message, UserWarning, stacklevel=3)
    except Warning:
        # under warnings-as-errors (-W error) too, a stray variable must not fail the call
        sys.stderr.write(f"warning: {message}\n")


def known_env() -> tuple[str, ...]:
    """Every HINA_MOE_* variable hi_na_moe reads: one a config key, the config file's, the
    native library's and the commands' own."""
    return (*(ENV_PREFIX + k.upper() for k in KEYS), ENV_CONFIG_FILE, *ENV_NATIVE, *ENV_COMMANDS)


def load_config(config: HinaConfig | None = None, *, where: Mapping[str, str] | None = None,
                **kwargs: Any) -> HinaConfig:
    """Build the effective config: kwargs > `HINA_MOE_*` env vars > YAML file > defaults.

    `config`, if given, replaces the file and environment layers (it was built by the caller);
    kwargs still override it. `where` names where a kwarg came from, for errors (e.g. the command
    line's {"isa": "--isa"}); default "keyword argument".
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config is not None:
        if not isinstance(config, HinaConfig):
            raise ConfigError(f"'config' must be a hi_na_moe.HinaConfig, not {type(config).__name__}")
        values.update(config.to_dict())
        sources.update({k: config.sources.get(k, "config object") for k in KEYS})
    else:
        env_file = os.environ.get(ENV_CONFIG_FILE)
        path = Path(env_file).expanduser() if env_file else default_config_file()
        for key, (raw, source) in _file_values(path, _read_file(path, required=bool(env_file))).items():
            values[key] = _coerce(key, raw, source)
            sources[key] = source
        for name, raw in os.environ.items():
            if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE or name in ENV_NATIVE:
                continue
            key = name[len(ENV_PREFIX):].lower()
            source = f"env {name}"
            if key not in KEYS:
                _warn_unknown_env(name, key)
                continue
            values[key] = _coerce(key, raw, source)
            sources[key] = source
    for key, raw in kwargs.items():
        if key not in KEYS:
            raise _unknown_key(key, "keyword argument")
        values[key] = raw
        sources[key] = (where or {}).get(key, "keyword argument")
    for key in KEYS:
        sources.setdefault(key, "default")
    return HinaConfig(**values, sources=sources)
