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
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        load_config()
        hi_na_moe.capabilities()
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
