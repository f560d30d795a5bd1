"""The config object: precedence of sources, and every error path with its message."""

from __future__ import annotations

import pytest

import hi_na_moe
from hi_na_moe.core.config import ConfigError, HinaConfig, load_config


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in list(__import__("os").environ):
        if name.startswith("HINA_MOE_"):
            monkeypatch.delenv(name)
    # no user config file leaks into the tests
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def test_defaults():
    cfg = load_config()
    assert (cfg.backend, cfg.isa, cfg.threads, cfg.strict) == ("auto", "auto", 0, False)
    assert cfg.sources["isa"] == "default"


def test_precedence_kwargs_over_env_over_file(monkeypatch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("backend: reference\nthreads: 1\nstrict: true\n")
    monkeypatch.setenv("HINA_MOE_CONFIG", str(f))
    monkeypatch.setenv("HINA_MOE_THREADS", "2")
    cfg = load_config(backend="auto")
    assert cfg.backend == "auto" and cfg.sources["backend"] == "keyword argument"
    assert cfg.threads == 2 and cfg.sources["threads"] == "env HINA_MOE_THREADS"
    assert cfg.strict is True and cfg.sources["strict"].startswith("file ")


def test_user_config_dir_file(monkeypatch, tmp_path):
    d = tmp_path / "xdg" / "hi_na_moe"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("backend: reference\n")
    assert load_config().backend == "reference"


def test_unknown_kwarg_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown config key 'thread'.*did you mean 'threads'"):
        load_config(thread=2)


def test_bad_value_names_key_value_and_choices():
    with pytest.raises(ConfigError, match=r"'backend'.*'natve'.*'auto', 'native', 'reference'.*did you mean 'native'"):
        load_config(backend="natve")


def test_bad_threads():
    with pytest.raises(ConfigError, match=r"'threads'.*-1.*whole number from 0 to"):
        load_config(threads=-1)
    with pytest.raises(ConfigError, match=r"'threads'.*True"):
        HinaConfig(threads=True)


def test_bad_env_value(monkeypatch):
    monkeypatch.setenv("HINA_MOE_THREADS", "two")
    with pytest.raises(ConfigError, match=r"'threads' \(env HINA_MOE_THREADS\) has bad value 'two'"):
        load_config()


def test_bad_env_bool(monkeypatch):
    monkeypatch.setenv("HINA_MOE_STRICT", "maybe")
    with pytest.raises(ConfigError, match=r"'strict' \(env HINA_MOE_STRICT\).*'maybe'.*true or false"):
        load_config()


def test_unknown_env_var_warns_once_with_did_you_mean(monkeypatch):
    """A variable the library does not know (a typo, or one from a newer or older version) must
    not break every call of a process that merely inherited it: one warning, naming it."""
    import warnings

    from hi_na_moe.core import config as config_mod

    monkeypatch.setattr(config_mod, "_WARNED_ENV", set(), raising=False)
    monkeypatch.setenv("HINA_MOE_BACKEN", "native")
    with pytest.warns(UserWarning, match=r"ignoring unknown environment variable HINA_MOE_BACKEN "
                      r"\(did you mean HINA_MOE_BACKEND\?\); known: HINA_MOE_BACKEND, "):
        cfg = load_config()
    assert cfg.backend == "auto" and "backen" not in cfg.to_dict()  # ignored, not taken as a key
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        load_config()
        hi_na_moe.capabilities()
    assert [str(w.message) for w in again if "HINA_MOE_BACKEN" in str(w.message)] == []  # once a process
    monkeypatch.setenv("HINA_MOE_THREADS", "two")  # a known variable with a bad value still errors
    with pytest.raises(ConfigError, match=r"'threads' \(env HINA_MOE_THREADS\) has bad value 'two'"):
        load_config()


def test_threads_is_bounded_naming_key_source_and_range(monkeypatch):
    from hi_na_moe.core.config import MAX_THREADS

    with pytest.raises(ConfigError, match=rf"'threads' \(keyword argument\) has bad value 1000000000000: "
                       rf"expected a whole number from 0 to {MAX_THREADS}"):
        load_config(threads=10**12)
    monkeypatch.setenv("HINA_MOE_THREADS", "99999999999999999999")
    with pytest.raises(ConfigError, match=rf"'threads' \(env HINA_MOE_THREADS\) has bad value "
                       rf"99999999999999999999: expected a whole number from 0 to {MAX_THREADS}"):
        load_config()
    monkeypatch.setenv("HINA_MOE_THREADS", str(MAX_THREADS))
    assert load_config().threads == MAX_THREADS
    with pytest.raises(ConfigError, match=rf"from 0 to {MAX_THREADS}"):
        HinaConfig(threads=MAX_THREADS + 1)


@pytest.mark.parametrize("kind", ["not_utf8", "directory"])
def test_config_file_that_cannot_be_read_names_file_and_variable(monkeypatch, tmp_path, kind):
    if kind == "not_utf8":
        f = tmp_path / "c.yaml"
        f.write_bytes(b"isa: \xff\xfe auto\n")
        want = r"is not UTF-8 text \(byte 0xff at offset 5\)"
    else:
        f = tmp_path / "confdir"
        f.mkdir()
        want = r"is a directory, not a file"
    monkeypatch.setenv("HINA_MOE_CONFIG", str(f))
    with pytest.raises(ConfigError, match=rf"config file '{f}' \(from HINA_MOE_CONFIG\) {want}"):
        load_config()


def test_the_user_config_file_that_cannot_be_read_is_named_too(tmp_path):
    d = tmp_path / "xdg" / "hi_na_moe"
    d.mkdir(parents=True)
    (d / "config.yaml").write_bytes(b"\x80\x81\n")
    with pytest.raises(ConfigError, match=r"config file '.*xdg/hi_na_moe/config.yaml' \(the user's config file\) "
                       r"is not UTF-8 text"):
        load_config()


def test_unknown_constructor_argument_did_you_mean():
    import dataclasses
    import pickle

    with pytest.raises(ConfigError, match=r"unknown config key 'threadz' \(HinaConfig argument\); known keys: "
                       r".*did you mean 'threads'\?"):
        HinaConfig(threadz=2)
    with pytest.raises(TypeError, match="threadz"):  # still the TypeError an unexpected argument is
        HinaConfig(threadz=2)
    # the dataclass is as before: fields, replace, equality, pickling, positional arguments
    cfg = HinaConfig(threads=2, isa="generic")
    assert dataclasses.replace(cfg, threads=3).threads == 3 and dataclasses.replace(cfg) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert HinaConfig("reference").backend == "reference"
    assert [f.name for f in dataclasses.fields(HinaConfig)][:3] == ["backend", "isa", "threads"]
    with pytest.raises(ConfigError, match="did you mean 'threads'"):
        dataclasses.replace(cfg, threadz=1)


def test_bad_yaml(monkeypatch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("backend: [auto\n")
    monkeypatch.setenv("HINA_MOE_CONFIG", str(f))
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config()


def test_yaml_not_a_mapping(monkeypatch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("- auto\n")
    monkeypatch.setenv("HINA_MOE_CONFIG", str(f))
    with pytest.raises(ConfigError, match=r"must hold a mapping.*not a list"):
        load_config()


def test_yaml_unknown_key(monkeypatch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("isaa: avx2\n")
    monkeypatch.setenv("HINA_MOE_CONFIG", str(f))
    with pytest.raises(ConfigError, match=r"unknown config key 'isaa' \(file .*c.yaml\).*did you mean 'isa'"):
        load_config()


def test_missing_config_file(monkeypatch, tmp_path):
    monkeypatch.setenv("HINA_MOE_CONFIG", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match=r"nope.yaml.*does not exist"):
        load_config()


def test_isa_above_cpu_is_refused(monkeypatch):
    # Pretend to be a CPU without AMX, so the refusal is tested on every machine.
    import types

    from hi_na_moe.core import config as config_mod

    fake = types.SimpleNamespace(isa_supported=lambda t: t in ("generic", "avx2", "avx512"), best_isa=lambda: "avx512")
    monkeypatch.setattr(config_mod, "native_module", lambda: (fake, None))
    with pytest.raises(ConfigError, match=r"'isa' \(keyword argument\) asks for 'amx'.*does not support.*best available: 'avx512'"):
        load_config(isa="amx")


@pytest.mark.parametrize(
    ("tiers", "best", "asked", "arch", "listed"),
    [(("generic", "avx2", "avx512"), "avx512", "dotprod", "aarch64", "'generic', 'avx2', 'avx512'"),
     (("generic", "neon", "dotprod"), "dotprod", "avx2", "x86-64", "'generic', 'neon', 'dotprod'"),
     (("generic", "avx2", "avx512"), "avx512", "bf16", "aarch64", "'generic', 'avx2', 'avx512'")],
)
def test_isa_of_another_architecture_is_refused_as_such(monkeypatch, tiers, best, asked, arch, listed):
    # An Arm tier on an x86 CPU (and the reverse) is not a tier "too high" for it: the refusal
    # names the tier's architecture and the tiers this CPU has, never "pick a lower tier".
    import types

    from hi_na_moe.core import config as config_mod

    fake = types.SimpleNamespace(isa_supported=lambda t: t in tiers, best_isa=lambda: best)
    monkeypatch.setattr(config_mod, "native_module", lambda: (fake, None))
    monkeypatch.setenv("HINA_MOE_ISA", asked)
    with pytest.raises(ConfigError) as e:
        load_config()
    msg = str(e.value)
    assert f"'isa' (env HINA_MOE_ISA) asks for {asked!r}, a tier of {arch} CPUs" in msg, msg
    assert f"this CPU's tiers: {listed}" in msg, msg
    assert "lower tier" not in msg, msg


def test_arm_bf16_tier_above_cpu_is_refused(monkeypatch):
    # An Arm CPU with i8mm but no BF16 (the hwcaps without bf16): tier bf16 is refused as too high.
    import types

    from hi_na_moe.core import config as config_mod

    fake = types.SimpleNamespace(isa_supported=lambda t: t in ("generic", "neon", "dotprod", "i8mm"),
                                 best_isa=lambda: "i8mm")
    monkeypatch.setattr(config_mod, "native_module", lambda: (fake, None))
    with pytest.raises(ConfigError, match=r"'isa' \(keyword argument\) asks for 'bf16'.*does not support.*best available: 'i8mm'"):
        load_config(isa="bf16")


def test_isa_without_native_library_is_refused(monkeypatch):
    from hi_na_moe.core import config as config_mod

    monkeypatch.setattr(config_mod, "native_module", lambda: (None, "ImportError: not built"))
    with pytest.raises(ConfigError, match=r"'isa'.*native library is not loaded \(ImportError: not built\)"):
        load_config(isa="avx2")


def test_supported_isa_accepted():
    native = pytest.importorskip("hi_na_moe._native")
    for tier in ("generic", "avx2", "avx512", "amx"):
        if native.isa_supported(tier):
            assert load_config(isa=tier).isa == tier


def test_enable_rejects_bad_config_before_touching_model():
    from torch import nn

    m = nn.Linear(2, 2)
    with pytest.raises(ConfigError):
        hi_na_moe.enable_for_model(m, backend="fast")
    assert not hi_na_moe.is_enabled(m)


def _prefetch_in_subprocess(value: str | None) -> tuple[tuple[int, int, int, int], str, str]:
    """((prefetch_distance, rows_prefetch_distance at 1, 2-3 and 4 rows), the check line, the CPU
    vendor) in a fresh interpreter, whose native library loads with HINA_MOE_PREFETCH_BYTES set to
    `value` (None: unset)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HINA_MOE_PREFETCH_BYTES"}
    if value is not None:
        env["HINA_MOE_PREFETCH_BYTES"] = value
    code = ("import hi_na_moe; from hi_na_moe import _native as n; from hi_na_moe.tools.capabilities import capabilities; "
            "c = capabilities(); print(n.prefetch_distance(), n.rows_prefetch_distance(1), n.rows_prefetch_distance(3), "
            "n.rows_prefetch_distance(4)); print(c['prefetch']); print(c['vendor'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    n, line, vendor = out.stdout.strip().splitlines()
    return tuple(int(v) for v in n.split()), line, vendor


@pytest.mark.skipif(not hi_na_moe.capabilities().get("cpu"), reason="native library not built")
def test_the_prefetch_distance_comes_from_the_environment_or_the_cpu_vendor():
    d, line, vendor = _prefetch_in_subprocess(None)
    amd = vendor == "AuthenticAMD"
    # several rows on AMD (2026-12-05): none for 2-3, 16 KiB for 4 or more; the one-row distance elsewhere
    defaults = (1024, 1024, 0, 16384) if amd else (4096,) * 4
    assert d == defaults
    several = ("; int8 / int4 calls of 2-3 rows: none, the hardware prefetchers alone, of 4 rows or more: "
               "16384 bytes") if amd else ""
    l12 = "; lossless12's decode kernel: none, the hardware prefetchers alone" if amd else ""
    assert line == f"{d[0]} bytes ahead into L2 (the default for {vendor} CPUs{several}){l12}"
    d, line, _ = _prefetch_in_subprocess("2048")  # neither vendor's default: every kernel and job
    assert d == (2048,) * 4
    assert line == "2048 bytes ahead into L2 (HINA_MOE_PREFETCH_BYTES; lossless12's decode kernel too)"
    for bad in ("100", "70000"):  # not a multiple of 64 in [0, 65536]: the defaults, and why
        d, line, _ = _prefetch_in_subprocess(bad)
        assert d == defaults
        assert f"HINA_MOE_PREFETCH_BYTES={bad!r} is not used: it must be a multiple of 64 in [0, 65536]" in line


def test_the_native_prefetch_variable_is_not_a_config_key(monkeypatch):
    monkeypatch.setenv("HINA_MOE_PREFETCH_BYTES", "1024")
    assert "prefetch_bytes" not in load_config().to_dict()  # accepted, not taken as a key
    from hi_na_moe.core import config as config_mod

    monkeypatch.setattr(config_mod, "_WARNED_ENV", set(), raising=False)
    monkeypatch.setenv("HINA_MOE_BACKEN", "native")
    with pytest.warns(UserWarning, match="HINA_MOE_PREFETCH_BYTES"):  # listed among the known ones
        load_config()


def test_scope_all_with_the_reference_backend_names_both_keys_and_where_they_came_from(monkeypatch):
    monkeypatch.setenv("HINA_MOE_SCOPE", "all")
    with pytest.raises(ConfigError, match=r"'scope' \(env HINA_MOE_SCOPE\) = 'all' and 'backend' \(keyword argument\) "
                                          r"= 'reference' do not go together"):
        load_config(backend="reference")
    assert load_config(backend="native").scope == "all"  # the other backends are fine with it
    monkeypatch.delenv("HINA_MOE_SCOPE")
    assert load_config(backend="reference").scope == "experts"


def test_choices_are_typed_and_keep_their_strings():
    """weights, isa, scope, pool and memory become str enums: equal to, hashed, printed and repr'd as
    the strings they were given as, so reports, JSON and comparisons see what they always did."""
    import json

    from hi_na_moe.core.formats import Format, Isa, MemoryMode, Pool, Scope

    cfg = load_config(weights="int4", isa="generic", scope="all", pool="own", memory="copy")
    for key, kind in (("weights", Format), ("isa", Isa), ("scope", Scope), ("pool", Pool), ("memory", MemoryMode)):
        value = getattr(cfg, key)
        assert type(value) is kind and value == str(value) and isinstance(value, str)
        assert f"{value}" == str(value) == value.value and repr(value) == repr(value.value)
        assert {value.value: 1}[value] == 1
    assert json.dumps(cfg.to_dict()["weights"]) == '"int4"'
    assert "weights='int4'" in repr(cfg)
    assert Format("lossless12").lossless and not Format.INT8.lossless and Format.INT4.paired


# ---- the memory tier's keys (issue 42) ----

GiB = 1 << 30
TIER_DEFAULTS = {"memory_limit": None, "prefetch": True, "prediction_window": 2, "io_threads": 4,
                 "direct_io": "auto", "eviction": "auto", "numa_node": None}


def _config_file(monkeypatch, tmp_path, text: str):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    monkeypatch.setenv("HINA_MOE_CONFIG", str(f))
    return f


def test_memory_tier_defaults_are_listed_with_their_sources():
    cfg = load_config()
    shown = cfg.to_dict()
    assert {k: shown[k] for k in TIER_DEFAULTS} == TIER_DEFAULTS
    assert all(cfg.sources[k] == "default" for k in TIER_DEFAULTS)
    assert cfg.memory_limit_bytes() is None
    assert HinaConfig() == load_config()


def test_memory_tier_keys_from_the_environment(monkeypatch):
    for name, value in (("MEMORY_LIMIT", "8GiB"), ("PREFETCH", "off"), ("PREDICTION_WINDOW", "8"),
                        ("IO_THREADS", "64"), ("DIRECT_IO", "on"), ("NUMA_NODE", "1"), ("EVICTION", "freq-decay")):
        monkeypatch.setenv(f"HINA_MOE_{name}", value)
    cfg = load_config()
    assert (cfg.memory_limit, cfg.prefetch, cfg.prediction_window, cfg.io_threads, cfg.direct_io, cfg.numa_node,
            cfg.eviction) == ("8GiB", False, 8, 64, "on", 1, "freq-decay")
    assert cfg.sources["memory_limit"] == "env HINA_MOE_MEMORY_LIMIT"
    assert cfg.memory_limit_bytes() == 8 * GiB
    for text, want in (("1", True), ("0", False), ("true", True), ("false", False), ("on", True), ("off", False)):
        monkeypatch.setenv("HINA_MOE_PREFETCH", text)
        assert load_config().prefetch is want
    for unset in ("none", "None", ""):  # an environment variable cannot hold null: these unset the key
        monkeypatch.setenv("HINA_MOE_MEMORY_LIMIT", unset)
        monkeypatch.setenv("HINA_MOE_NUMA_NODE", unset)
        cfg = load_config()
        assert cfg.memory_limit is None and cfg.numa_node is None
    monkeypatch.setenv("HINA_MOE_MEMORY_LIMIT", "50%")
    cfg = load_config()
    assert cfg.memory_limit == "50%"  # kept as written, for reports
    assert cfg.memory_limit_bytes(meminfo=lambda: 16 * GiB, cgroup=lambda: None) == 8 * GiB
    assert cfg.memory_limit_bytes(meminfo=lambda: 16 * GiB, cgroup=lambda: 6 * GiB) == 3 * GiB
    with pytest.raises(ConfigError, match=r"memory_limit '50%' \(env HINA_MOE_MEMORY_LIMIT\) is a share of the memory "
                                          r"this process may use, which cannot be read here"):
        cfg.memory_limit_bytes(meminfo=lambda: None, cgroup=lambda: None)


def test_memory_limit_kwargs_keep_what_was_written():
    assert load_config(memory_limit=8 * GiB).memory_limit_bytes() == 8 * GiB
    assert load_config(memory_limit="1.5 GB").memory_limit_bytes() == 1_500_000_000
    assert load_config(memory_limit="512MiB").to_dict()["memory_limit"] == "512MiB"


@pytest.mark.parametrize("key, value, want", [
    ("memory_limit", "12 parsecs", r"memory_limit '12 parsecs' \(keyword argument\) is not a size: write bytes with "
                                   r"a unit \(8GiB, 512MB\) or a percentage \(50%\)"),
    ("memory_limit", 0, r"memory_limit 0 \(keyword argument\) is 0 bytes"),
    ("memory_limit", "-2GiB", r"memory_limit '-2GiB' \(keyword argument\) is below 0 bytes"),
    ("memory_limit", "120%", r"memory_limit '120%' \(keyword argument\) is not a share of memory: a percentage must "
                             r"be more than 0 and at most 100"),
    ("memory_limit", 1.5, r"memory_limit 1.5 \(keyword argument\) is not a size"),
    ("prefetch", "yes", r"'prefetch' \(keyword argument\) has bad value 'yes': expected true or false"),
    ("prediction_window", 9, r"'prediction_window' \(keyword argument\) has bad value 9: expected a whole number "
                             r"from 0 to 8"),
    ("prediction_window", -1, r"'prediction_window' .* bad value -1: expected a whole number from 0 to 8"),
    ("prediction_window", True, r"'prediction_window' .* bad value True"),
    ("io_threads", 0, r"'io_threads' \(keyword argument\) has bad value 0: expected a whole number from 1 to 64"),
    ("io_threads", 65, r"'io_threads' .* bad value 65: expected a whole number from 1 to 64"),
    ("io_threads", "4", r"'io_threads' .* bad value '4'"),
    ("direct_io", "of", r"'direct_io' \(keyword argument\) has bad value 'of': expected one of 'auto', 'on', 'off' "
                        r"\(did you mean 'off'\?\)"),
    ("direct_io", True, r"'direct_io' .* bad value True: expected one of 'auto', 'on', 'off'"),
    ("eviction", "lru2", r"'eviction' \(keyword argument\) has bad value 'lru2': expected one of 'auto', 'lru', 'lfu', "
                         r"'lru-2', 'freq-decay' \(did you mean 'lru-2'\?\)"),
    ("numa_node", -1, r"'numa_node' \(keyword argument\) has bad value -1: expected a whole number from 0"),
    ("numa_node", False, r"'numa_node' .* bad value False"),
    ("numa_node", "0", r"'numa_node' .* bad value '0'"),
    ("numa_node", 1.0, r"'numa_node' .* bad value 1.0"),
])
def test_memory_tier_bad_values_name_key_value_and_what_is_accepted(key, value, want):
    with pytest.raises(ConfigError, match=want):
        load_config(**{key: value})


@pytest.mark.parametrize("name, value, want", [
    ("MEMORY_LIMIT", "12 parsecs", r"memory_limit '12 parsecs' \(env HINA_MOE_MEMORY_LIMIT\) is not a size: write "
                                   r"bytes with a unit \(8GiB, 512MB\) or a percentage \(50%\)"),
    ("MEMORY_LIMIT", "0", r"memory_limit '0' \(env HINA_MOE_MEMORY_LIMIT\) is 0 bytes"),
    ("PREFETCH", "sometimes", r"'prefetch' \(env HINA_MOE_PREFETCH\) has bad value 'sometimes': expected true or false"),
    ("PREDICTION_WINDOW", "two", r"'prediction_window' \(env HINA_MOE_PREDICTION_WINDOW\) has bad value 'two': "
                                 r"expected a whole number"),
    ("PREDICTION_WINDOW", "12", r"'prediction_window' \(env HINA_MOE_PREDICTION_WINDOW\) has bad value 12"),
    ("IO_THREADS", "0", r"'io_threads' \(env HINA_MOE_IO_THREADS\) has bad value 0: expected a whole number from 1 to 64"),
    ("DIRECT_IO", "yes", r"'direct_io' \(env HINA_MOE_DIRECT_IO\) has bad value 'yes': expected one of 'auto', 'on', "
                         r"'off'"),
    ("NUMA_NODE", "-1", r"'numa_node' \(env HINA_MOE_NUMA_NODE\) has bad value -1"),
    ("NUMA_NODE", "first", r"'numa_node' \(env HINA_MOE_NUMA_NODE\) has bad value 'first': expected a whole number"),
])
def test_memory_tier_bad_env_values_name_the_variable(monkeypatch, name, value, want):
    monkeypatch.setenv(f"HINA_MOE_{name}", value)
    with pytest.raises(ConfigError, match=want):
        load_config()


def test_nested_yaml_form(monkeypatch, tmp_path):
    f = _config_file(monkeypatch, tmp_path, "memory: {limit: 8GiB, io_threads: 4, direct_io: auto, eviction: lfu}\n"
                                            "prefetch: {enabled: true, prediction_window: 2}\n"
                                            "numa: {node: 0}\n")
    cfg = load_config()
    assert (cfg.memory_limit, cfg.io_threads, cfg.direct_io, cfg.prefetch, cfg.prediction_window, cfg.numa_node) == (
        "8GiB", 4, "auto", True, 2, 0)
    assert cfg.eviction == "lfu" and cfg.sources["eviction"] == f"file {f}: memory.eviction"
    assert cfg.memory == "auto" and cfg.sources["memory"] == "default"  # the section is not the flat key
    assert cfg.sources["memory_limit"] == f"file {f}: memory.limit"
    assert cfg.sources["numa_node"] == f"file {f}: numa.node"
    _config_file(monkeypatch, tmp_path, "memory:\n  limit: 25%\n  io_threads: 16\n  direct_io: off\n"
                                        "prefetch:\n  enabled: off\n  prediction_window: 0\nnuma:\n  node: 1\n")
    cfg = load_config()
    # YAML 1.1 reads a bare off as false: direct_io takes it as the 'off' it was written as
    assert (cfg.memory_limit, cfg.io_threads, cfg.direct_io, cfg.prefetch, cfg.prediction_window, cfg.numa_node) == (
        "25%", 16, "off", False, 0, 1)
    monkeypatch.setenv("HINA_MOE_IO_THREADS", "2")  # the environment still overrides the file
    assert load_config().io_threads == 2 and load_config(io_threads=3).io_threads == 3


def test_flat_yaml_form_of_the_new_keys(monkeypatch, tmp_path):
    _config_file(monkeypatch, tmp_path, "memory_limit: 8589934592\nprefetch: false\nprediction_window: 3\n"
                                        "io_threads: 8\ndirect_io: 'on'\nnuma_node: 0\nmemory: map\n")
    cfg = load_config()
    assert (cfg.memory_limit, cfg.prefetch, cfg.prediction_window, cfg.io_threads, cfg.direct_io, cfg.numa_node,
            cfg.memory) == (8589934592, False, 3, 8, "on", 0, "map")
    _config_file(monkeypatch, tmp_path, "memory_limit: null\nnuma_node: ~\n")
    cfg = load_config()
    assert cfg.memory_limit is None and cfg.numa_node is None


def test_memory_section_keeps_the_flat_memory_key(monkeypatch, tmp_path):
    f = _config_file(monkeypatch, tmp_path, "memory: map\n")
    assert load_config().memory == "map"  # a string: the existing key (where packed blocks live)
    _config_file(monkeypatch, tmp_path, "memory: {mode: map, limit: 8GiB}\n")
    cfg = load_config()
    assert (cfg.memory, cfg.memory_limit) == ("map", "8GiB") and cfg.sources["memory"] == f"file {f}: memory.mode"
    _config_file(monkeypatch, tmp_path, "memory: {mode: mapp}\n")
    with pytest.raises(ConfigError, match=rf"'memory' \(file {f}: memory.mode\) has bad value 'mapp'.*did you mean "
                                          r"'map'"):
        load_config()
    _config_file(monkeypatch, tmp_path, "memory: {limit: 12 parsecs}\n")
    with pytest.raises(ConfigError, match=rf"memory_limit '12 parsecs' \(file {f}: memory.limit\) is not a size"):
        load_config()


@pytest.mark.parametrize("text, both", [
    ("memory_limit: 4GiB\nmemory: {limit: 8GiB}\n", ("memory_limit", "memory.limit")),
    ("memory: {limit: 8GiB}\nmemory_limit: 4GiB\n", ("memory.limit", "memory_limit")),
    ("prediction_window: 1\nprefetch: {prediction_window: 2}\n", ("prediction_window", "prefetch.prediction_window")),
    ("numa_node: 0\nnuma: {node: 1}\n", ("numa_node", "numa.node")),
    ("io_threads: 2\nmemory: {io_threads: 2}\n", ("io_threads", "memory.io_threads")),
])
def test_a_key_given_flat_and_nested_is_an_error_naming_both(monkeypatch, tmp_path, text, both):
    f = _config_file(monkeypatch, tmp_path, text)
    with pytest.raises(ConfigError, match=rf"config file '{f}' sets config key '\w+' twice, as '{both[0]}' and as "
                                          rf"'{both[1]}'; keep one of them"):
        load_config()


@pytest.mark.parametrize("text, want", [
    ("memory: {limt: 8GiB}\n", r"unknown config key 'memory.limt' \(file .*c.yaml\); known under 'memory': mode, "
                               r"limit, io_threads, direct_io, eviction; did you mean 'memory.limit'\?"),
    ("prefetch: {enable: true}\n", r"unknown config key 'prefetch.enable' .*did you mean 'prefetch.enabled'\?"),
    ("prefetch: {window: 3}\n", r"unknown config key 'prefetch.window' .*known under 'prefetch': enabled, "
                                r"prediction_window; did you mean 'prefetch.prediction_window'\?"),
    ("memory: {memory_limit: 1GiB}\n", r"unknown config key 'memory.memory_limit' .*did you mean 'memory.limit'\?"),
    ("numa: {nod: 0}\n", r"unknown config key 'numa.nod' .*did you mean 'numa.node'\?"),
    ("numa: {cpus: 0-3}\n", r"unknown config key 'numa.cpus' .*known under 'numa': node$"),
    ("numa: 0\n", r"config key 'numa' \(file .*c.yaml\) has bad value 0: expected a mapping of node "
                  r"\(e.g. 'numa: \{node: ...\}'\), or the flat key 'numa_node'"),
    ("numa: {node: -1}\n", r"'numa_node' \(file .*c.yaml: numa.node\) has bad value -1"),
    ("prefetch: {prediction_window: 9}\n", r"'prediction_window' \(file .*: prefetch.prediction_window\) has bad "
                                           r"value 9: expected a whole number from 0 to 8"),
    ("memory: {direct_io: maybe}\n", r"'direct_io' \(file .*: memory.direct_io\) has bad value 'maybe'"),
    ("memory: [map]\n", r"'memory' \(file .*c.yaml\) has bad value \['map'\]: expected a string"),
])
def test_nested_yaml_errors(monkeypatch, tmp_path, text, want):
    _config_file(monkeypatch, tmp_path, text)
    with pytest.raises(ConfigError, match=want):
        load_config()


def test_new_variables_are_known_and_do_not_warn(monkeypatch):
    import warnings

    from hi_na_moe.core import config as config_mod

    monkeypatch.setattr(config_mod, "_WARNED_ENV", set())
    for name, value in (("MEMORY_LIMIT", "8GiB"), ("PREFETCH", "1"), ("PREDICTION_WINDOW", "2"),
                        ("IO_THREADS", "4"), ("DIRECT_IO", "auto"), ("NUMA_NODE", "0"), ("PREFETCH_BYTES", "1024")):
        monkeypatch.setenv(f"HINA_MOE_{name}", value)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        load_config()
    assert [str(w.message) for w in seen if "HINA_MOE_" in str(w.message)] == []


@pytest.mark.parametrize("typo, suggested", [
    ("HINA_MOE_MEMORY_LIMT", "HINA_MOE_MEMORY_LIMIT"), ("HINA_MOE_PREFETCH_BYTE", "HINA_MOE_PREFETCH_BYTES"),
    ("HINA_MOE_IOTHREADS", "HINA_MOE_IO_THREADS"), ("HINA_MOE_NUMA", "HINA_MOE_NUMA_NODE"),
    ("HINA_MOE_CONFIG_FILE", "HINA_MOE_CONFIG"), ("HINA_MOE_XYZZY", None),
])
def test_unknown_variable_suggests_the_closest_known_one(monkeypatch, typo, suggested):
    from hi_na_moe.core import config as config_mod

    monkeypatch.setattr(config_mod, "_WARNED_ENV", set())
    monkeypatch.setenv(typo, "1")
    hint = rf" \(did you mean {suggested}\?\)" if suggested else ""
    with pytest.warns(UserWarning, match=rf"ignoring unknown environment variable {typo}{hint}; known: "):
        cfg = load_config()
    assert cfg == HinaConfig()  # ignored
    if suggested is None:
        with pytest.warns(UserWarning) as seen:
            config_mod._WARNED_ENV.clear()
            load_config()
        assert "did you mean" not in str(seen[0].message)


def test_unknown_variable_never_raises_even_with_warnings_as_errors(monkeypatch, capsys):
    import warnings

    from hi_na_moe.core import config as config_mod

    monkeypatch.setattr(config_mod, "_WARNED_ENV", set())
    monkeypatch.setenv("HINA_MOE_MEMORY_LIMT", "8GiB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config().memory_limit is None
    assert "ignoring unknown environment variable HINA_MOE_MEMORY_LIMT (did you mean HINA_MOE_MEMORY_LIMIT?)" in (
        capsys.readouterr().err)


def test_every_hina_moe_variable_the_project_reads_or_documents_is_known():
    """A variable read by the package, the native library, scripts or benchmarks, or named in the
    docs, must never be warned about as unknown."""
    import re
    from pathlib import Path

    from hi_na_moe.core.config import known_env

    root = Path(__file__).resolve().parents[1]
    files = [*root.glob("src/**/*.py"), *root.glob("csrc/**/*.[ch]*"), *root.glob("scripts/*"),
             *root.glob("benchmarks/**/*.py"), *root.glob("benchmarks/**/*.md"), *root.glob("docs/*.md"),
             root / "README.md", root / "CHANGELOG.md"]
    name = re.compile(r"\bHINA_MOE_[A-Z0-9_]*[A-Z0-9]")
    found = {n for f in files if f.is_file() for n in name.findall(f.read_text(errors="replace"))}
    # tests may set any name (typos on purpose); the ones they read must be known too
    read = re.compile(r"(?:environ\.get|getenv|environ\[)\(?\s*[\"'](HINA_MOE_[A-Z0-9_]+)")
    found |= {n for f in root.glob("tests/*.py") for n in read.findall(f.read_text())}
    assert {"HINA_MOE_PREFETCH_BYTES", "HINA_MOE_CACHE_DIR", "HINA_MOE_ISA", "HINA_MOE_CONFIG"} <= found
    assert sorted(found - set(known_env())) == []


def test_every_experimental_switch_names_a_boolean_of_its_module():
    import importlib

    from hi_na_moe.core.config import EXPERIMENTAL

    for name, (module, attr) in EXPERIMENTAL.items():
        assert isinstance(getattr(importlib.import_module(module), attr), bool), name


def test_experimental_switches_are_set_at_enable_and_named_in_the_report(tmp_path, monkeypatch):
    import torch

    import hi_na_moe
    from hi_na_moe.fastpath import linear, stack
    from tiny_models import build_tiny

    m = build_tiny("olmoe", dtype=torch.float32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                   hidden_size=64, intermediate_size=32).model
    x = torch.randint(3, 100, (1, 8))
    hi_na_moe.enable_for_model(m, scope="all")
    try:
        with torch.no_grad():
            want = m.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
    finally:
        hi_na_moe.disable_for_model(m)
    monkeypatch.setattr(stack, "ONE_CALL", True)  # (restored after the test)
    monkeypatch.setattr(linear, "PAIRED", True)
    f = tmp_path / "c.yaml"
    f.write_text("experimental: {stack.one_call: off}\n")
    monkeypatch.setenv("HINA_MOE_CONFIG", str(f))
    report = hi_na_moe.enable_for_model(m, scope="all")
    try:
        assert stack.ONE_CALL is False and linear.PAIRED is True  # a switch not named keeps its value
        assert "experimental switches (process-wide, for A/B runs): stack.one_call=off" in str(report)
        with torch.no_grad():
            assert torch.equal(m.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0), want)
    finally:
        hi_na_moe.disable_for_model(m)
    with pytest.raises(ConfigError, match="did you mean 'stack.one_call'"):
        HinaConfig(experimental="stack.onecall=off")
    with pytest.raises(ConfigError, match="expected on or off"):
        HinaConfig(experimental="stack.one_call=2")
