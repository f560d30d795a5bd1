"""The packed-expert store: file format, every corruption class, stale entries, atomic writes
on a full disk, refusal of symlinks and loose permissions, locking across processes, identities."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import runpy
import stat
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hi_na_moe.core import store as store_mod
from hi_na_moe.core.store import CorruptEntry, MissingEntry, PackedStore, StaleEntry, StoreError, UnsafeEntry, checkpoint_identity, decode_name, default_cache_dir, encode_name, entry_key, tensor_identity

KEY = entry_key("0" * 64, format="bf16", tier="avx512", layout_version=1)
NAME = "model.layers.3.mlp.experts"
META = {"format": "bf16", "group_size": 64, "tier": "avx512", "layout_version": 1, "E": 8, "shape": [3, 4]}


def sections():
    return [
        ("gate_up", np.arange(3000, dtype=np.float32)),  # 12000 bytes: several pages
        ("down", bytes(range(256)) * 20 + b"x"),  # 5121 bytes: odd size, tail inside a page
        ("scales", b""),  # empty section: two padding gaps meet
        ("bias", np.ones(7, np.float16)),  # 14 bytes: tiny last section
    ]


def section_bytes():
    return {n: bytes(memoryview(b).cast("B")) if not isinstance(b, bytes) else b for n, b in sections()}


@pytest.fixture
def store(tmp_path):
    return PackedStore(tmp_path / "cache")


@pytest.fixture
def written(store):
    path = store.write(KEY, NAME, META, sections())
    return store, path


def layout(path):
    """Parse the file as the module docstring documents it, independently of the reader."""
    data = Path(path).read_bytes()
    n = int.from_bytes(data[12:16], "little")
    doc = json.loads(data[24 : 24 + n])
    return {"data": data, "n": n, "header_end": 28 + n, "sections": doc["sections"], "doc": doc}


def flip(path, offset, xor=0xFF):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ xor]))


# ---------------------------------------------------------------------------------------------
# Import, paths, names


def test_import_needs_neither_torch_nor_numpy():
    # the store module alone, without the package (whose __init__ imports torch)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {store_mod.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "bad = [n for n in ('torch', 'numpy', 'hi_na_moe') if any(k.split('.')[0] == n for k in sys.modules)]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("HINA_MOE_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "x" / "hi_na_moe"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # invalid per the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "hi_na_moe"
    assert PackedStore().root == tmp_path / "home" / ".cache" / "hi_na_moe"


@pytest.mark.parametrize("name", [
    "model.layers.3.mlp.experts",  # the usual case: unchanged
    "..",  # would climb out of the key directory
    ".",  # the directory itself
    ".hidden",  # would look like a temp file
    "a/../../etc/passwd",  # path separators
    "back\\slash and space",
    "nul\x00byte",
    "ünïcødé.layers",
    "%41",  # the escape character itself
    "x~y",  # the shortened-name marker
])
def test_path_for_is_one_safe_file_name_and_reversible(store, name):
    path = store.path_for(KEY, name)
    assert path.parent == store.root / KEY
    assert "/" not in path.name and "\x00" not in path.name and not path.name.startswith(".")
    assert path.name.endswith(".hnm")
    assert decode_name(path.name[: -len(".hnm")]) == name


def test_long_names_are_shortened_and_still_listed(store):
    long_name = "model.layers.0." + "x" * 400
    path = store.write(KEY, long_name, {}, {"a": b"1"})
    assert len(path.name) < 200 and decode_name(path.name[:-4]) is None
    assert store.open(KEY, long_name).name == long_name
    assert [e.name for e in store.entries()] == [long_name]  # read back from the header
    assert encode_name(long_name + "y") != encode_name(long_name)


@pytest.mark.parametrize("key", ["../" + "a" * 20, "A" * 64, "abc", "g" * 64, ""])
def test_bad_keys_are_refused(store, key):
    with pytest.raises(ValueError, match="hex"):
        store.path_for(key, NAME)


# ---------------------------------------------------------------------------------------------
# Round trip and format


def test_roundtrip_bytes_meta_alignment(store):
    progress = []
    path = store.write(KEY, NAME, META, sections(), progress=lambda d, t: progress.append((d, t)))
    total = sum(len(b) for b in section_bytes().values())
    assert progress[-1] == (total, total) and progress == sorted(progress)
    with store.open(KEY, NAME, expect={"format": "bf16", "shape": (3, 4)}) as entry:
        assert entry.meta == META
        assert list(entry.sections) == ["gate_up", "down", "scales", "bias"]  # order kept
        for name, want in section_bytes().items():
            view = entry.sections[name]
            assert view.readonly and bytes(view) == want
            arr = entry.array(name, np.uint8)
            assert arr.ctypes.data % 64 == 0 and arr.ctypes.data % 4096 == 0
        gu = entry.array("gate_up", np.float32, (30, 100))
        assert gu.shape == (30, 100) and not gu.flags.writeable
        np.testing.assert_array_equal(gu.reshape(-1), np.arange(3000, dtype=np.float32))
        with pytest.raises(ValueError, match="shape"):
            entry.array("gate_up", np.float32, (7, 7))
        with pytest.raises(ValueError, match="multiple"):
            entry.array("down", np.float32)
        assert entry.size == path.stat().st_size


def test_sections_larger_than_a_chunk(store, monkeypatch):
    # real sections span many 64 MiB chunks; a small chunk runs the same loops on small data
    monkeypatch.setattr(store_mod, "CHUNK_BYTES", 1000)
    data = np.random.default_rng(0).integers(0, 256, 10_500, dtype=np.uint8)
    progress = []
    path = store.write(KEY, NAME, {}, {"a": data, "b": data[:3000]}, progress=lambda d, t: progress.append(d))
    assert progress == [1000 * i for i in range(1, 11)] + [10_500] + [10_500 + 1000 * i for i in (1, 2, 3)]
    assert int(layout(path)["sections"][0]["checksum"], 16) == zlib.crc32(data.tobytes())
    seen = []
    with store.open(KEY, NAME, progress=lambda d, t: seen.append((d, t))) as entry:
        assert bytes(entry.sections["a"]) == data.tobytes()
    assert [d for d, _ in seen] == progress and {t for _, t in seen} == {13_500}
    flip(path, layout(path)["sections"][0]["offset"] + 9_999)  # in the last chunk but one
    with pytest.raises(CorruptEntry, match="section 'a'"):
        store.open(KEY, NAME)


def test_file_layout_is_as_documented(written):
    _, path = written
    lay = layout(path)
    data = lay["data"]
    assert data[:8] == b"HINAMOE\x00"
    assert int.from_bytes(data[8:12], "little") == store_mod.STORE_FORMAT_VERSION == 1
    assert int.from_bytes(data[16:24], "little") == len(data)
    assert int.from_bytes(data[24 + lay["n"] : 28 + lay["n"]], "little") == zlib.crc32(data[: 24 + lay["n"]])
    assert lay["doc"]["meta"] == META and lay["doc"]["key"] == KEY and lay["doc"]["name"] == NAME
    end = lay["header_end"]
    for s, (name, want) in zip(lay["sections"], section_bytes().items()):
        assert s["name"] == name and s["offset"] % 4096 == 0 and s["offset"] >= end
        assert data[end : s["offset"]] == bytes(s["offset"] - end)  # zero padding
        assert data[s["offset"] : s["offset"] + s["nbytes"]] == want
        assert s["algorithm"] == "crc32" and int(s["checksum"], 16) == zlib.crc32(want)
        end = s["offset"] + s["nbytes"]
    assert end == len(data)


def test_torch_tensor_and_iterable_sections(store):
    t = torch.arange(10, dtype=torch.bfloat16)
    store.write(KEY, NAME, {}, iter([("t", t), ("b", bytearray(b"abc"))]))
    with store.open(KEY, NAME) as entry:
        assert bytes(entry.sections["t"]) == t.view(torch.uint8).numpy().tobytes()
        assert bytes(entry.sections["b"]) == b"abc"


def test_views_outlive_close_safely(written):
    store, _ = written
    entry = store.open(KEY, NAME)
    arr = entry.array("gate_up", np.float32)
    entry.close()
    assert entry.closed and arr[2999] == 2999.0  # the mapping lives as long as the array


def test_entry_with_no_sections(store):
    store.write(KEY, NAME, {"empty": True}, {})
    with store.open(KEY, NAME) as entry:
        assert entry.sections == {} and entry.meta == {"empty": True}


@pytest.mark.parametrize("sections_arg,meta,error,match", [
    ({"a": np.arange(10)[::2]}, {}, ValueError, "C-contiguous"),  # strided view: no silent copy
    ([("a", b"1"), ("a", b"2")], {}, ValueError, "given twice"),
    ({"a": 3}, {}, TypeError, "not a bytes-like"),
    ({"": b"1"}, {}, ValueError, "non-empty"),
    ({"a": b"1"}, {"x": float("nan")}, ValueError, "JSON"),
    ({"a": b"1"}, {"x": object()}, ValueError, "JSON"),
])
def test_bad_input_is_refused_before_anything_is_written(store, sections_arg, meta, error, match):
    with pytest.raises(error, match=match):
        store.write(KEY, NAME, meta, sections_arg)
    assert not store.root.exists() or not any(store.root.rglob("*"))


# ---------------------------------------------------------------------------------------------
# Missing, truncated, changed, foreign


def test_missing_entry(store):
    with pytest.raises(MissingEntry, match="no such entry"):
        store.open(KEY, NAME)  # no root at all
    store.write(KEY, "other", {}, {})
    with pytest.raises(MissingEntry):
        store.open(KEY, NAME)  # key directory exists, file does not


def truncation_points(lay):
    s0, s1 = lay["sections"][0], lay["sections"][1]
    return {
        "inside the magic": 5,
        "inside the fixed prefix": 20,
        "inside the header JSON": 24 + lay["n"] // 2,
        "inside the header checksum": lay["header_end"] - 2,
        "in the padding after the header": lay["header_end"] + 10,
        "inside the first section": s0["offset"] + 1,
        "at the end of the first section": s0["offset"] + s0["nbytes"],
        "at the start of the second section": s1["offset"],
        "one byte short": len(lay["data"]) - 1,
    }


def test_truncation_at_every_point_class(written):
    store, path = written
    lay = layout(path)
    for where, size in truncation_points(lay).items():
        for verify in ("full", "header"):
            path.write_bytes(lay["data"][:size])
            with pytest.raises(CorruptEntry, match="truncated") as info:
                store.open(KEY, NAME, verify=verify)
            assert str(path) in str(info.value), where
    path.write_bytes(b"")
    with pytest.raises(CorruptEntry, match="empty file"):
        store.open(KEY, NAME)


def test_trailing_bytes_are_detected(written):
    store, path = written
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptEntry, match="longer than written"):
        store.open(KEY, NAME, verify="header")


def test_every_header_byte_flip_is_detected(written):
    store, path = written
    lay = layout(path)
    for offset in range(lay["header_end"]):
        flip(path, offset)
        try:
            for verify in ("header", "full"):
                # the version field reads as another version (stale); everything else is corrupt
                expected = StaleEntry if 8 <= offset < 12 else CorruptEntry
                with pytest.raises(expected):
                    store.open(KEY, NAME, verify=verify)
        finally:
            flip(path, offset)
    store.open(KEY, NAME).close()  # restored: valid again


def test_section_byte_flips_name_the_section(written):
    store, path = written
    for s in layout(path)["sections"]:
        if not s["nbytes"]:
            continue
        for offset in (s["offset"], s["offset"] + s["nbytes"] // 2, s["offset"] + s["nbytes"] - 1):
            flip(path, offset, 0x01)
            with pytest.raises(CorruptEntry, match=f"checksum mismatch in section '{s['name']}'"):
                store.open(KEY, NAME)
            # verify="header" does not read the sections (documented): the flip goes unseen
            store.open(KEY, NAME, verify="header").close()
            flip(path, offset, 0x01)


def test_padding_byte_flips_are_detected(written):
    # Padding is checked to be zero, so every byte of the file is covered by some check.
    store, path = written
    lay = layout(path)
    end = lay["header_end"]
    gaps = []
    for s in lay["sections"]:
        if s["offset"] > end:
            gaps.append((end, s["offset"]))
        end = s["offset"] + s["nbytes"]
    assert len(gaps) >= 3
    for start, stop in gaps:
        for offset in (start, stop - 1):
            flip(path, offset, 0x80)
            with pytest.raises(CorruptEntry, match=f"padding byte at offset {offset}"):
                store.open(KEY, NAME)
            flip(path, offset, 0x80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_byte_change_anywhere_is_detected(written, data):
    store, path = written
    size = path.stat().st_size
    offset = data.draw(st.integers(0, size - 1), label="offset")
    xor = data.draw(st.integers(1, 255), label="xor")
    flip(path, offset, xor)
    try:
        with pytest.raises((CorruptEntry, StaleEntry)):
            store.open(KEY, NAME)
    finally:
        flip(path, offset, xor)


@pytest.mark.parametrize("content,match", [
    (b"", "empty file"),
    (os.urandom(5000), "not a hi_na_moe store file"),
    (json.dumps({"format": "bf16"}).encode(), "not a hi_na_moe store file"),
    (b"HINA", "truncated inside the header"),  # a prefix of the magic: cut short, not foreign
    (b"HINAMOE\x00" + b"\x01\x00\x00\x00" + b"\xff" * 40, "header length"),
])
def test_foreign_files_are_corrupt(store, content, match):
    path = store.path_for(KEY, NAME)
    store.write(KEY, "other", {}, {})  # creates the key directory
    path.write_bytes(content)
    with pytest.raises(CorruptEntry, match=match) as info:
        store.open(KEY, NAME)
    assert str(path) in str(info.value)


def test_an_entry_copied_under_another_name_is_corrupt(written):
    store, path = written
    other = store.path_for(KEY, "model.layers.4.mlp.experts")
    other.write_bytes(path.read_bytes())
    with pytest.raises(CorruptEntry, match="belongs to entry 'model.layers.3.mlp.experts'"):
        store.open(KEY, "model.layers.4.mlp.experts")


# ---------------------------------------------------------------------------------------------
# Stale entries


def test_store_version_bump_makes_entries_stale(written, monkeypatch):
    store, _ = written
    monkeypatch.setattr(store_mod, "STORE_FORMAT_VERSION", 2)
    with pytest.raises(StaleEntry, match="store format version 1; this hi_na_moe reads version 2"):
        store.open(KEY, NAME, verify="header")
    assert entry_key("0" * 64, format="bf16", tier="avx512", layout_version=1) != KEY  # new key too


def test_expect_mismatch_is_stale_and_says_what(written):
    store, _ = written
    with pytest.raises(StaleEntry) as info:
        store.open(KEY, NAME, expect={"format": "int4", "tier": "avx512", "group_size": 128, "missing": 1})
    msg = str(info.value)
    assert "format: entry has 'bf16', expected 'int4'" in msg
    assert "group_size: entry has 64, expected 128" in msg
    assert "missing: entry has no such key" in msg and "tier" not in msg


# ---------------------------------------------------------------------------------------------
# get_or_build


class Builder:
    def __init__(self, meta=META):
        self.calls = 0
        self.meta = meta

    def __call__(self):
        self.calls += 1
        return self.meta, sections()


EXPECT = {"format": "bf16", "tier": "avx512", "layout_version": 1}


def test_get_or_build_builds_once(store):
    build = Builder()
    entry, built, reason = store.get_or_build(KEY, NAME, EXPECT, build)
    assert (built, reason, build.calls) == (True, None, 1)
    assert {n: bytes(v) for n, v in entry.sections.items()} == section_bytes()
    entry.close()
    entry, built, reason = store.get_or_build(KEY, NAME, EXPECT, build)
    assert (built, reason, build.calls) == (False, None, 1)
    entry.close()


def _truncate(store, path):
    path.write_bytes(path.read_bytes()[:-100])


def _flip_section(store, path):
    s = layout(path)["sections"][1]
    flip(path, s["offset"] + 7)


def _flip_header(store, path):
    flip(path, 40)


def _foreign(store, path):
    path.write_bytes(b"{}\n")


def _old_version(store, path):
    flip(path, 8, 0x01 ^ 0x07)  # version 1 -> 7


def _other_format(store, path):
    store.write(KEY, NAME, dict(META, format="int8"), sections())


@pytest.mark.parametrize("damage,reason", [
    (_truncate, "truncated: the file has"),
    (_flip_section, "checksum mismatch in section 'down'"),
    (_flip_header, "header checksum mismatch"),
    (_foreign, "not a hi_na_moe store file"),
    (_old_version, "store format version 7"),
    (_other_format, "format: entry has 'int8', expected 'bf16'"),
])
def test_get_or_build_rebuilds_after_damage_and_says_why(written, damage, reason):
    store, path = written
    damage(store, path)
    build = Builder()
    entry, built, why = store.get_or_build(KEY, NAME, EXPECT, build)
    assert built and build.calls == 1 and reason in why
    assert {n: bytes(v) for n, v in entry.sections.items()} == section_bytes()
    entry.close()
    store.open(KEY, NAME, expect=EXPECT).close()  # the rebuilt file verifies in full


def test_get_or_build_refuses_a_build_that_contradicts_expect(store):
    with pytest.raises(StoreError, match="format: entry has 'int4', expected 'bf16'"):
        store.get_or_build(KEY, NAME, EXPECT, Builder(dict(META, format="int4")))
    assert not store.path_for(KEY, NAME).exists()


_WORKER = r"""
import hashlib, importlib.util, json, os, time
spec = importlib.util.spec_from_file_location("hina_store_child", STORE_FILE)
store = importlib.util.module_from_spec(spec)
spec.loader.exec_module(store)

def build():
    with open(COUNT_FILE, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # long enough for the other process to arrive while this one builds
    return {"format": "bf16"}, {"a": bytes(range(256)) * 4000, "b": b"xyz"}

BARRIER.wait(timeout=60)
entry, built, reason = store.PackedStore(ROOT).get_or_build(KEY, NAME, {"format": "bf16"}, build)
digest = hashlib.sha256(b"".join(bytes(v) for v in entry.sections.values())).hexdigest()
with open(OUT_FILE, "w") as f:
    json.dump({"built": built, "reason": reason, "digest": digest}, f)
"""


def test_two_processes_build_once(tmp_path):
    # Two spawned processes run store.py loaded from its file: importing the package would
    # import torch and transformers in each child (seconds) for nothing the store uses.
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = []
    for i in range(2):
        init = dict(STORE_FILE=store_mod.__file__, COUNT_FILE=str(tmp_path / "builds"), BARRIER=barrier,
                    ROOT=str(tmp_path / "cache"), KEY=KEY, NAME=NAME, OUT_FILE=str(tmp_path / f"out{i}.json"))
        procs.append(ctx.Process(target=runpy.run_path, args=(str(script),), kwargs={"init_globals": init}))
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len((tmp_path / "builds").read_text().splitlines()) == 1
    outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert sorted(o["built"] for o in outs) == [False, True]
    assert outs[0]["digest"] == outs[1]["digest"]
    entry = PackedStore(tmp_path / "cache").open(KEY, NAME, expect={"format": "bf16"})
    assert bytes(entry.sections["a"]) == bytes(range(256)) * 4000
    entry.close()


# ---------------------------------------------------------------------------------------------
# Failures while writing


def _fails_for_files_under(root, real, after=0):
    """A replacement for an os function that fails with ENOSPC on files under `root`, after
    `after` successful calls; other descriptors (pytest's own output) go to the real one."""
    count = {"n": 0}

    def fake(fd, *args):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(str(root)) and os.path.isfile(target):
            count["n"] += 1
            if count["n"] > after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, *args)

    return fake


@pytest.mark.parametrize("func,after", [
    ("write", 0),  # the first write
    ("write", 2),  # after some data reached the file
    ("posix_fallocate", 0),  # space reservation refused up front
    ("fsync", 0),  # delayed allocation failing at the flush
])
def test_disk_full_leaves_nothing_and_says_how_much_was_needed(store, monkeypatch, func, after):
    total = layout(store.write("f" * 64, NAME, META, sections()))["data"].__len__()
    monkeypatch.setattr(os, func, _fails_for_files_under(store.root, getattr(os, func), after))
    with pytest.raises(StoreError) as info:
        store.write(KEY, NAME, META, sections())
    msg = str(info.value)
    assert str(store.path_for(KEY, NAME)) in msg
    assert "disk full" in msg and "No space left on device" in msg and "ENOSPC" in msg
    assert f"needs {total} bytes" in msg
    assert os.listdir(store.root / KEY) == []  # neither the entry nor its temp file


def test_a_failed_overwrite_keeps_the_old_entry(written, monkeypatch):
    store, path = written
    before = path.read_bytes()
    monkeypatch.setattr(os, "write", _fails_for_files_under(store.root, os.write, after=1))
    with pytest.raises(StoreError, match="disk full"):
        store.write(KEY, NAME, dict(META, format="int8"), sections())
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(path.parent) == [path.name]
    store.open(KEY, NAME, expect={"format": "bf16"}).close()


def test_an_interrupt_while_writing_removes_the_temp_file(store):
    def progress(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.write(KEY, NAME, META, sections(), progress=progress)
    assert os.listdir(store.root / KEY) == []


# ---------------------------------------------------------------------------------------------
# Symlinks, ownership, permissions


def _plant_symlink(store, at, target):
    os.makedirs(store.root / KEY, mode=0o700, exist_ok=True)
    os.symlink(target, at)


def test_symlink_at_the_entry_path_is_refused_and_not_followed(store, tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"precious")
    target.chmod(0o600)
    path = store.path_for(KEY, NAME)
    _plant_symlink(store, path, target)
    with pytest.raises(UnsafeEntry, match="symbolic link.*precious"):
        store.open(KEY, NAME)
    build = Builder()
    with pytest.raises(UnsafeEntry):
        store.get_or_build(KEY, NAME, EXPECT, build)
    assert build.calls == 0 and path.is_symlink()  # refused, not rebuilt over
    # an explicit write replaces the link itself, never its target
    store.write(KEY, NAME, META, sections())
    assert not path.is_symlink() and target.read_bytes() == b"precious"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    store.open(KEY, NAME).close()


@pytest.mark.parametrize("dangling", [False, True])
def test_symlink_at_the_lock_path_is_refused_and_not_followed(store, tmp_path, dangling):
    target = tmp_path / "precious"
    if not dangling:
        target.write_bytes(b"precious")
        target.chmod(0o644)
    lock = Path(str(store.path_for(KEY, NAME)) + ".lock")
    _plant_symlink(store, lock, target)
    build = Builder()
    with pytest.raises(UnsafeEntry, match="symbolic link"):
        store.get_or_build(KEY, NAME, EXPECT, build)
    assert build.calls == 0
    if dangling:
        assert not target.exists()  # O_CREAT did not create the link's target
    else:
        assert target.read_bytes() == b"precious" and stat.S_IMODE(target.stat().st_mode) == 0o644


def test_a_symlinked_key_directory_is_refused(store, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    os.makedirs(elsewhere, mode=0o700)
    os.makedirs(store.root, mode=0o700)
    os.symlink(elsewhere, store.root / KEY)
    with pytest.raises(UnsafeEntry, match="symbolic link"):
        store.write(KEY, NAME, META, sections())
    with pytest.raises(UnsafeEntry, match="symbolic link"):
        store.open(KEY, NAME)
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("umask", [
    0o000,  # permissive: must not leak into the store's modes
    0o277,  # takes the owner's write bit: the store must still be usable by its owner
])
def test_files_0600_and_directories_0700_whatever_the_umask(store, umask):
    old = os.umask(umask)
    try:
        entry, _, _ = store.get_or_build(KEY, NAME, EXPECT, Builder())
        entry.close()
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.lstat(p).st_mode)  # noqa: E731
    assert mode(store.root) == 0o700 and mode(store.root / KEY) == 0o700
    assert mode(store.path_for(KEY, NAME)) == 0o600
    assert mode(str(store.path_for(KEY, NAME)) + ".lock") == 0o600


@pytest.mark.parametrize("mode", [0o602, 0o620, 0o666])
def test_an_entry_writable_by_others_is_refused(written, mode):
    store, path = written
    path.chmod(mode)
    with pytest.raises(UnsafeEntry, match="writable by group or others"):
        store.open(KEY, NAME)
    with pytest.raises(UnsafeEntry):
        store.get_or_build(KEY, NAME, EXPECT, Builder())


def test_an_entry_owned_by_someone_else_is_refused(written, monkeypatch):
    store, _ = written
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 12345)
    with pytest.raises(UnsafeEntry, match="owned by uid"):
        store.open(KEY, NAME)


def test_a_fifo_at_the_entry_path_is_refused_without_hanging(written):
    store, path = written
    path.unlink()
    os.mkfifo(path, 0o600)
    with pytest.raises(UnsafeEntry, match="not a regular file"):
        store.open(KEY, NAME)


# ---------------------------------------------------------------------------------------------
# Identities


def _checkpoint(d, tensors, config=b'{"model_type": "olmoe"}'):
    from safetensors.numpy import save_file

    d.mkdir(exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    save_file({"lm_head": np.ones((4, 4), np.float32)}, str(d / "model-2.safetensors"))
    if config is not None:
        (d / "config.json").write_bytes(config)
    return d


def test_checkpoint_identity_covers_headers_sizes_data_and_config(tmp_path):
    base = {"w": np.arange(4096, dtype=np.float32)}
    ref = checkpoint_identity(_checkpoint(tmp_path / "a", base))
    assert len(ref) == 64 and checkpoint_identity(_checkpoint(tmp_path / "b", base)) == ref  # a copy

    renamed = _checkpoint(tmp_path / "c", {"v": base["w"]})  # header differs, size does not
    assert (renamed / "model.safetensors").stat().st_size == (tmp_path / "a/model.safetensors").stat().st_size
    assert checkpoint_identity(renamed) != ref

    grown = _checkpoint(tmp_path / "d", base)  # size differs, header does not
    with open(grown / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    assert checkpoint_identity(grown) != ref

    assert checkpoint_identity(_checkpoint(tmp_path / "e", base, config=b'{"model_type": "qwen"}')) != ref
    assert checkpoint_identity(_checkpoint(tmp_path / "f", base, config=None)) != ref

    finetuned = _checkpoint(tmp_path / "g", {"w": base["w"] + 1})  # same header and size
    assert checkpoint_identity(finetuned) != ref

    os.utime(tmp_path / "a" / "model.safetensors", (1, 1))  # mtime is not identity
    os.utime(tmp_path / "a" / "config.json", (1, 1))
    assert checkpoint_identity(tmp_path / "a") == ref


def test_checkpoint_identity_follows_hub_style_symlinks(tmp_path):
    real = _checkpoint(tmp_path / "real", {"w": np.zeros(8, np.float32)})
    snap = tmp_path / "snapshot"
    snap.mkdir()
    for p in real.iterdir():
        os.symlink(p, snap / p.name)
    assert checkpoint_identity(snap) == checkpoint_identity(real)


def test_checkpoint_identity_errors(tmp_path):
    with pytest.raises(StoreError, match="no \\*.safetensors"):
        checkpoint_identity(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(StoreError, match="not a safetensors file"):
        checkpoint_identity(tmp_path)


def test_tensor_identity():
    t = torch.randn(16, 32).to(torch.bfloat16)
    ref = tensor_identity([t, t[0]])
    assert tensor_identity([t.clone(), t[0].clone()]) == ref
    u = t.clone()
    u[7, 9] += 1  # one element
    assert tensor_identity([u, t[0]]) != ref
    assert tensor_identity([t.view(torch.int16), t[0]]) != ref  # same bytes, other dtype
    assert tensor_identity([t.reshape(32, 16), t[0]]) != ref  # same bytes, other shape
    assert tensor_identity([t[0], t]) != ref  # order matters
    assert tensor_identity([t.t()]) == tensor_identity([t.t().contiguous()])  # values, not strides
    assert tensor_identity([torch.empty(0)]) != tensor_identity([torch.empty(0, 2)])
    with pytest.raises(TypeError):
        tensor_identity([np.zeros(3)])


def test_entry_key():
    k = entry_key("abc", format="int4", group_size=64, tier="avx512", layout_version=2)
    assert len(k) == 64 and int(k, 16) >= 0
    assert k == entry_key("abc", tier="avx512", layout_version=2, group_size=64, format="int4")
    assert k != entry_key("abd", format="int4", group_size=64, tier="avx512", layout_version=2)
    assert k != entry_key("abc", format="int4", group_size=128, tier="avx512", layout_version=2)
    with pytest.raises(ValueError, match="JSON"):
        entry_key("abc", weird=object())


# ---------------------------------------------------------------------------------------------
# Housekeeping


def test_entries_size_remove_clear(store, tmp_path):
    k2 = "e" * 64
    store.write(KEY, "a", {}, {"x": b"1" * 5000})
    store.write(KEY, "b", {}, {"x": b"2"})
    store.write(k2, "c", {}, {})
    store.get_or_build(k2, "d", None, lambda: ({}, {"x": b"3"}))[0].close()  # leaves a lock file
    (store.root / KEY / ".a.hnm.tmp-999-deadbeef").write_bytes(b"partial")  # a crashed writer's
    (store.root / "README").write_text("not ours")
    (store.root / KEY / "notes.txt").write_text("not ours")

    listed = store.entries()
    sizes = {(e.key, e.name): e.size for e in listed}
    assert sorted(sizes) == sorted([(KEY, "a"), (KEY, "b"), (k2, "c"), (k2, "d")])
    assert all(sizes[(k, n)] == store.path_for(k, n).stat().st_size for k, n in sizes)
    assert store.size_bytes() == sum(sizes.values()) + len(b"partial")

    assert store.remove(KEY, "b") is True and store.remove(KEY, "b") is False
    with pytest.raises(MissingEntry):
        store.open(KEY, "b")

    freed = store.clear(k2)
    assert freed == sizes[(k2, "c")] + sizes[(k2, "d")] and not (store.root / k2).exists()
    assert [(e.key, e.name) for e in store.entries()] == [(KEY, "a")]

    store.clear()
    assert store.entries() == [] and store.size_bytes() == 0
    # only the store's own files go: foreign files and their directory stay
    assert (store.root / "README").exists() and (store.root / KEY / "notes.txt").exists()
    assert os.listdir(store.root / KEY) == ["notes.txt"]


def test_a_directory_named_like_an_entry_is_not_the_stores(store):
    # someone's directory with an entry's or a lock's suffix inside a key directory: listed as
    # not the store's, left in place by clear (it used to stop clear with IsADirectoryError)
    store.write(KEY, "a", {}, {"x": b"1" * 100})
    odd = store.root / KEY / "mine.hnm"
    (odd / "inner").mkdir(parents=True)
    (store.root / KEY / "other.lock").mkdir()
    assert [(e.key, e.name) for e in store.entries()] == [(KEY, "a")]
    assert store.size_bytes() == store.path_for(KEY, "a").stat().st_size
    kinds = {f.file: f.kind for k in store.summary() for f in k.files}
    assert kinds["mine.hnm"] == "other" and kinds["other.lock"] == "other"
    freed = store.clear()
    assert freed > 0 and store.entries() == []
    assert (odd / "inner").is_dir() and (store.root / KEY / "other.lock").is_dir()


def test_verify_argument_is_checked(written):
    store, _ = written
    with pytest.raises(ValueError, match="verify"):
        store.open(KEY, NAME, verify="fast")
