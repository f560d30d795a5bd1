"""`hi-na-moe cache list` / `cache clear` on real stores written with PackedStore.write: what
each row and total says, every clear filter, dry runs, confirmation, entries being built, files
that are not the store's, and the errors for bad input."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hi_na_moe.tools.cli import main
from hi_na_moe.tools.commands.cache import NO_SOURCE
from hi_na_moe.core.store import ENTRY_SUFFIX, PackedStore, encode_name, entry_key, recording_source


# metadata as core/ops.py / fastpath/linear.py write it: native.header_info(...) fields, the packed header (hex),
# the block or layer name, and the `expect` keys (layout_version, weights, isa, group_size)
def experts_meta(weights: str, isa: str, name: str, group_size: int = 0) -> dict:
    return {"magic": 0x484E4D45, "version": 3, "dtype": "bfloat16", "isa": isa, "weights": weights,
            "group_size": group_size, "has_gate": True, "up_only": False, "E": 8, "H": 64, "I": 32,
            "nbytes": 4096, "header": "00" * 64, "block": name, "layout_version": 3}


def linear_meta(weights: str, isa: str, name: str) -> dict:
    return {**experts_meta(weights, isa, name), "up_only": True, "E": 1, "layer": name}


L0, L1, L2 = (f"model.layers.{i}.mlp.experts" for i in range(3))
Q = "model.layers.0.self_attn.q_proj"
K_INT4_0 = entry_key("checkpoint:c0ffee:" + L0, weights="int4", group_size=64, isa="avx512", layout_version=3)
K_INT4_1 = entry_key("checkpoint:c0ffee:" + L1, weights="int4", group_size=64, isa="avx512", layout_version=3)
K_INT8 = entry_key("checkpoint:c0ffee:" + L0, weights="int8", group_size=0, isa="avx2", layout_version=3)
K_BACKUP = entry_key("checkpoint:c0ffee:" + L0, weights="lossless", group_size=0, isa="avx512", layout_version=3)
K_LINEAR = entry_key("tensors:q", kind="linear", weights="int8", isa="avx2", layout_version=3)
# 2**22 is the largest pid_max Linux allows: no process can have this id
DEAD_PID = 2**22 + 1
TMP = f".{encode_name(L0)}{ENTRY_SUFFIX}.tmp-{DEAD_PID}-0badc0de"


@pytest.fixture
def store(tmp_path) -> PackedStore:
    """Five keys in four formats/tiers, plus in K_INT8 a corrupt and a stale entry, in K_INT4_0
    a leftover temp file and a file of the user's, and a directory of the user's beside the keys."""
    s = PackedStore(tmp_path / "store")
    s.write(K_INT4_0, L0, experts_meta("int4", "avx512", L0, 64), {"block": bytes(5000)})
    s.write(K_INT4_1, L1, experts_meta("int4", "avx512", L1, 64), {"block": bytes(6000)})
    s.write(K_INT8, L0, experts_meta("int8", "avx2", L0), {"block": bytes(9000)})
    s.write(K_BACKUP, L0 + ".original", experts_meta("lossless", "avx512", L0 + ".original"), {"block": bytes(20000)})
    s.write(K_LINEAR, Q, linear_meta("int8", "avx2", Q), {"block": bytes(3000)})
    # corrupt: one changed byte inside the header JSON
    bad = s.write(K_INT8, L1, experts_meta("int8", "avx2", L1), {"block": bytes(100)})
    data = bytearray(bad.read_bytes())
    data[40] ^= 0x01
    bad.write_bytes(bytes(data))
    # stale: written by another store format version
    old = s.write(K_INT8, L2, experts_meta("int8", "avx2", L2), {"block": bytes(100)})
    data = bytearray(old.read_bytes())
    data[8:12] = (99).to_bytes(4, "little")
    old.write_bytes(bytes(data))
    # a write that was killed half way, and files that are not the store's
    d0 = s.root / K_INT4_0
    (d0 / TMP).write_bytes(b"\1" * 4096)
    (d0 / "notes.txt").write_text("the user's own file")
    (s.root / "my-stuff").mkdir()
    (s.root / "my-stuff" / "keep.hnm").write_bytes(b"not in a key directory")
    return s


def snapshot(root: Path) -> dict[str, tuple[int, int] | str]:
    """Every path under root: files with their size and mtime, directories as "dir" (their
    mtimes change whenever a file in them goes)."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() and not p.is_symlink() else
            (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


def store_bytes(s: PackedStore) -> int:
    """Bytes of every file in the key directories but the user's notes.txt."""
    return sum(size(p) for p in s.root.glob("*/*") if p.parent.name != "my-stuff" and p.name != "notes.txt")


def size(p: Path) -> int:
    return p.lstat().st_size


def entry(s: PackedStore, key: str, name: str) -> Path:
    return s.path_for(key, name)


def row(out: str, key: str) -> list[str]:
    lines = [line for line in out.splitlines() if line.startswith("  " + key[:12])]
    assert len(lines) == 1, out
    return lines[0].split()


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


# ---- list


def test_list_text_rows_totals_and_problems(store, capsys):
    rc, out, _ = run(["cache", "list", "--cache-dir", str(store.root)], capsys)
    assert rc == 0
    assert out.splitlines()[0] == f"packed-expert store: {store.root}"
    # KEY KIND FORMAT GROUP TIER LAYOUT DTYPE ENTRIES SIZE(2 words) MODIFIED(2 words) HOLDS
    r = row(out, K_INT4_0)
    assert r[1:8] == ["experts", "int4", "64", "avx512", "3", "bfloat16", "1"]
    assert r[-1] == L0
    r = row(out, K_INT8)
    assert r[1:7] == ["experts", "int8", "-", "avx2", "3", "bfloat16"]
    assert r[7:10] == ["3", "(2", "bad)"]
    assert row(out, K_LINEAR)[1:3] == ["linear", "int8"] and row(out, K_LINEAR)[-1] == Q
    assert row(out, K_BACKUP)[2] == "lossless" and row(out, K_BACKUP)[-1] == L0 + ".original"
    # the rows come in layer order, whatever the digests are
    order = [line.split()[0] for line in out.splitlines() if line[2:14] in {k[:12] for k in
             (K_INT4_0, K_INT4_1, K_INT8, K_BACKUP, K_LINEAR)}]
    assert order.index(K_INT4_1[:12]) > max(order.index(K_INT4_0[:12]), order.index(K_INT8[:12]))
    total_bytes = store_bytes(store)
    assert "total: 5 keys, 7 entries, " in out
    assert "2 unreadable (corrupt, stale or unsafe); 1 temp file (4.00 KiB)" in out
    assert f"{total_bytes / 1024:.2f} KiB" in out.split("total:")[1]
    assert f"corrupt entry {encode_name(L1)}.hnm" in out and "header checksum mismatch" in out
    assert f"stale entry {encode_name(L2)}.hnm" in out and "store format version 99" in out
    assert f"temp file {TMP} (4.00 KiB): left by an interrupted write" in out
    assert "notes.txt: not a store file, left alone" in out
    assert "1 file in key directories; 1 name beside them (my-stuff)" in out
    assert "cache clear --stale" in out


def test_entries_record_their_source_and_clear_selects_by_it(tmp_path, capsys, monkeypatch):
    # two models' entries (written inside recording_source, as enable_for_model and
    # from_pretrained write them) and one written before sources were recorded
    s = PackedStore(tmp_path / "store")
    ckpt = tmp_path / "ckpt-a"
    ckpt.mkdir()
    with recording_source(str(ckpt.resolve())):
        s.write(K_INT4_0, L0, experts_meta("int4", "avx512", L0, 64), {"block": bytes(5000)})
        s.write(K_INT4_1, L1, experts_meta("int4", "avx512", L1, 64), {"block": bytes(6000)})
    with recording_source("OlmoeForCausalLM (in memory)"):
        s.write(K_INT8, L0, experts_meta("int8", "avx2", L0), {"block": bytes(9000)})
        # metadata naming a source already keeps it
        s.write(K_LINEAR, Q, {**linear_meta("int8", "avx2", Q), "source": "given"}, {"block": bytes(3000)})
    s.write(K_BACKUP, L0 + ".original", experts_meta("lossless", "avx512", L0 + ".original"), {"block": bytes(20000)})
    assert s.open(K_INT4_0, L0).meta["source"] == str(ckpt.resolve())
    assert "source" not in s.open(K_BACKUP, L0 + ".original").meta
    rc, out, _ = run(["cache", "list", "--cache-dir", str(s.root)], capsys)
    assert rc == 0
    by_source = out.split("by source")[1]
    assert f"    {ckpt.resolve()}: 2 keys, " in by_source and "(int4; tier avx512)" in by_source
    assert "    OlmoeForCausalLM (in memory): 1 key, " in by_source and "    given: 1 key, " in by_source
    assert f"    {NO_SOURCE}: 1 key, " in by_source
    rc, out, _ = run(["cache", "list", "--cache-dir", str(s.root), "--output", "json"], capsys)
    src = json.loads(out)["total"]["by_source"]
    assert src[str(ckpt.resolve())]["keys"] == 2 and src[str(ckpt.resolve())]["formats"] == ["int4"]
    # --source takes the path as given (here relative to the working directory) or absolute
    monkeypatch.chdir(tmp_path)  # (undone after the test: its directory is deleted then)
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(s.root), "--source", "ckpt-a", "--yes"], capsys)
    assert rc == 0 and "removed 2 files" in out
    assert not (s.root / K_INT4_0).exists() and not (s.root / K_INT4_1).exists()
    assert (s.root / K_INT8).exists() and (s.root / K_LINEAR).exists() and (s.root / K_BACKUP).exists()
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(s.root), "--source", "nowhere", "--yes"], capsys)
    assert rc == 0 and "nothing to clear" in out and "sources in the store: " in out and "given" in out


def test_list_json(store, capsys):
    rc, out, _ = run(["cache", "list", "--cache-dir", str(store.root), "--output", "json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["root"] == str(store.root) and data["exists"] is True and data["verify"] == "header"
    keys = {k["key"]: k for k in data["keys"]}
    assert set(keys) == {K_INT4_0, K_INT4_1, K_INT8, K_BACKUP, K_LINEAR}
    k = keys[K_INT4_0]
    assert (k["format"], k["tier"], k["group_size"], k["layout_version"], k["kind"], k["names"]) == (
        ["int4"], ["avx512"], [64], [3], ["experts"], [L0])
    assert k["entries"] == 1 and k["unreadable"] == 0
    assert k["size_bytes"] == size(entry(store, K_INT4_0, L0)) + 4096  # the temp file is the store's
    assert {f["file"]: f["kind"] for f in k["files"]} == {
        encode_name(L0) + ".hnm": "entry", TMP: "tmp", "notes.txt": "other"}
    assert next(f for f in k["files"] if f["kind"] == "entry")["meta"]["weights"] == "int4"
    assert "header" not in next(f for f in k["files"] if f["kind"] == "entry")["meta"]
    bad = {f["name"]: f for f in keys[K_INT8]["files"]}
    assert bad[L1]["status"] == "corrupt" and "header checksum mismatch" in bad[L1]["reason"]
    assert bad[L2]["status"] == "stale" and "version 99" in bad[L2]["reason"]
    assert bad[L0]["status"] == "ok"
    assert keys[K_LINEAR]["kind"] == ["linear"]
    t = data["total"]
    assert (t["keys"], t["entries"], t["unreadable"], t["tmp_files"], t["tmp_bytes"], t["other_files"]) == (
        5, 7, 2, 1, 4096, 1)
    assert t["other_in_root"] == ["my-stuff"]
    assert t["size_bytes"] == sum(k["size_bytes"] for k in data["keys"])
    assert t["by_format"]["int4"]["keys"] == 2 and t["by_format"]["lossless"]["size_bytes"] == size(
        entry(store, K_BACKUP, L0 + ".original"))


def test_list_verify_finds_a_changed_payload_byte(store, capsys):
    p = entry(store, K_INT4_1, L1)
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF  # inside the section: only the checksum can tell
    p.write_bytes(bytes(data))
    rc, out, _ = run(["cache", "list", "--cache-dir", str(store.root), "--output", "json"], capsys)
    assert next(k for k in json.loads(out)["keys"] if k["key"] == K_INT4_1)["unreadable"] == 0
    rc, out, _ = run(["cache", "list", "--cache-dir", str(store.root), "--verify", "--output", "json"], capsys)
    k = next(k for k in json.loads(out)["keys"] if k["key"] == K_INT4_1)
    assert k["unreadable"] == 1 and "checksum mismatch in section 'block'" in k["files"][0]["reason"]
    # --stale finds it only when told to read the checksums
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--stale", "--dry-run", "--output", "json"],
                     capsys)
    assert (K_INT4_1, p.name) not in [(f["key"], f["file"]) for f in json.loads(out)["removed"]]
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--stale", "--verify", "--yes"], capsys)
    assert rc == 0 and not p.exists()


def test_list_of_an_empty_and_of_a_missing_default_store(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path / "never-made"))
    rc, out, _ = run(["cache", "list"], capsys)
    assert rc == 0 and f"{tmp_path / 'never-made'} does not exist yet: nothing is cached" in out
    rc, out, _ = run(["cache", "clear", "--all", "--yes"], capsys)
    assert rc == 0 and "nothing to clear" in out
    assert not (tmp_path / "never-made").exists()  # looking creates nothing
    (tmp_path / "empty").mkdir()
    rc, out, _ = run(["cache", "list", "--cache-dir", str(tmp_path / "empty")], capsys)
    assert rc == 0 and "empty: no key directory" in out and "total: 0 keys, 0 entries, 0 B" in out


def test_unsafe_entry_is_listed_and_a_symlink_is_removed_not_its_target(store, tmp_path, capsys):
    target = tmp_path / "precious.bin"
    target.write_bytes(b"x" * 10)
    link = store.root / K_BACKUP / "evil.hnm"
    link.symlink_to(target)
    rc, out, _ = run(["cache", "list", "--cache-dir", str(store.root)], capsys)
    assert rc == 0 and "unsafe entry evil.hnm" in out and "symbolic link" in out
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--stale", "--yes"], capsys)
    assert rc == 0 and not link.is_symlink() and target.read_bytes() == b"x" * 10


# ---- clear: filters


def test_clear_key_prefix_removes_that_key_and_keeps_foreign_files(store, capsys):
    d = store.root / K_INT4_0
    want = size(entry(store, K_INT4_0, L0)) + 4096
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--key", K_INT4_0[:10], "--yes"], capsys)
    assert rc == 0
    assert f"removed 2 files, freed {want / 1024:.2f} KiB ({want} bytes)" in out
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]  # the user's file, and so its directory, stay
    assert (d / "notes.txt").read_text() == "the user's own file"
    assert entry(store, K_INT4_1, L1).exists() and entry(store, K_INT8, L0).exists()


def test_clear_format_removes_only_that_format_and_empty_key_dirs(store, capsys):
    before = snapshot(store.root)
    want = size(entry(store, K_INT4_0, L0)) + size(entry(store, K_INT4_1, L1))
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--format", "int4", "--yes"], capsys)
    assert rc == 0 and f"removed 2 files, freed {want / 1024:.2f} KiB ({want} bytes)" in out
    assert not entry(store, K_INT4_0, L0).exists() and not (store.root / K_INT4_1).exists()
    after = snapshot(store.root)
    gone = set(before) - set(after)
    assert gone == {f"{K_INT4_0}/{encode_name(L0)}.hnm", K_INT4_1, f"{K_INT4_1}/{encode_name(L1)}.hnm"}
    assert all(after[p] == before[p] for p in after)  # nothing else touched, the temp file included


def test_clear_tier_and_json_output(store, capsys):
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--tier", "avx2", "--yes",
                      "--output", "json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert sorted((f["key"], f["name"]) for f in data["removed"]) == sorted([(K_INT8, L0), (K_LINEAR, Q)])
    assert data["freed_bytes"] == sum(f["size_bytes"] for f in data["removed"]) > 12000
    assert data["key_dirs_removed"] == [K_LINEAR]
    # the unreadable entries of K_INT8 record no tier: they stay (--stale is for them)
    assert sorted(p.name for p in (store.root / K_INT8).iterdir()) == sorted(
        [encode_name(L1) + ".hnm", encode_name(L2) + ".hnm"])


def test_clear_old_layout_removes_entries_of_another_layout_version_only(store, capsys):
    from hi_na_moe.core.native import native_module

    native, why = native_module()
    if native is None:
        pytest.skip(f"the layout version comes from the native extension: {why}")
    now = int(native.PACKED_LAYOUT_VERSION)
    # entries of this build's layout in a key of their own; the fixture's entries record version 3
    assert now != 3
    k_now = entry_key("checkpoint:c0ffee:" + L0, weights="int4", group_size=64, isa="avx512", layout_version=now)
    store.write(k_now, L0, {**experts_meta("int4", "avx512", L0, 64), "layout_version": now}, {"block": bytes(700)})
    d8 = store.root / K_INT8
    want = sum(size(entry(store, k, n)) for k, n in ((K_INT4_0, L0), (K_INT4_1, L1), (K_INT8, L0), (K_BACKUP, L0 + ".original"),
                                                     (K_LINEAR, Q)))
    # cache list points at them (the key of this build's layout is not counted)
    rc, out, _ = run(["cache", "list", "--cache-dir", str(store.root), "--output", "json"], capsys)
    rep = json.loads(out)
    old_bytes = sum(k["size_bytes"] for k in rep["keys"] if k["key"] in (K_INT4_0, K_INT4_1, K_INT8, K_BACKUP, K_LINEAR))
    assert rep["total"]["layout_version"] == now and rep["total"]["old_layout"] == {"keys": 5, "size_bytes": old_bytes}
    rc, out, _ = run(["cache", "list", "--cache-dir", str(store.root)], capsys)
    assert rc == 0 and (f"5 keys ({old_bytes / 1024:.2f} KiB) hold entries of another packed layout than this "
                        f"build's ({now}), never read again: `hi-na-moe cache clear --old-layout` removes them") in out
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--old-layout", "--yes"], capsys)
    assert rc == 0 and f"removed 5 files, freed {want / 1024:.2f} KiB ({want} bytes)" in out
    assert entry(store, k_now, L0).exists()
    # unreadable entries record no layout (--stale is for them); the temp file and foreign files stay
    assert sorted(p.name for p in d8.iterdir()) == sorted([encode_name(L1) + ".hnm", encode_name(L2) + ".hnm"])
    assert (store.root / K_INT4_0 / TMP).exists() and (store.root / K_INT4_0 / "notes.txt").exists()


def test_clear_stale_removes_unreadable_entries_and_leftovers_only(store, capsys):
    d8 = store.root / K_INT8
    want = size(d8 / (encode_name(L1) + ".hnm")) + size(d8 / (encode_name(L2) + ".hnm")) + 4096
    # a lone lock file (its entry removed with PackedStore.remove) is a leftover too
    store.get_or_build(K_BACKUP, "gone", None, lambda: ({}, {"x": b"1"}))[0].close()
    store.remove(K_BACKUP, "gone")
    assert (store.root / K_BACKUP / "gone.hnm.lock").exists()
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--stale", "--yes"], capsys)
    assert rc == 0 and f"removed 4 files, freed {want / 1024:.2f} KiB ({want} bytes)" in out
    assert sorted(p.name for p in d8.iterdir()) == [encode_name(L0) + ".hnm"]
    assert not (store.root / K_INT4_0 / TMP).exists() and entry(store, K_INT4_0, L0).exists()
    assert not (store.root / K_BACKUP / "gone.hnm.lock").exists()
    assert (store.root / K_INT4_0 / "notes.txt").exists()


def test_clear_all_leaves_only_foreign_files(store, capsys):
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--all", "--yes"], capsys)
    assert rc == 0 and "removed 8 files" in out and "4 emptied key directories removed" in out
    left = sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*"))
    assert left == [K_INT4_0, f"{K_INT4_0}/notes.txt", "my-stuff", "my-stuff/keep.hnm"]


def test_dry_run_deletes_nothing_and_says_how_much(store, capsys):
    before = snapshot(store.root)
    total = store_bytes(store)
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--all", "--dry-run"], capsys)
    assert rc == 0
    assert f"dry run: would remove 8 files, {total / 1024:.2f} KiB ({total} bytes); nothing was removed" in out
    assert f"  {K_INT8[:12]}  avx2 int8  3 entries (2 unreadable)" in out
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--format", "int4", "--dry-run",
                      "--output", "json"], capsys)
    data = json.loads(out)
    assert data["dry_run"] is True and data["files"] == 2 and data["freed_bytes"] == 0
    assert data["bytes"] == size(entry(store, K_INT4_0, L0)) + size(entry(store, K_INT4_1, L1))
    assert snapshot(store.root) == before


# ---- clear: confirmation


def test_without_a_terminal_clear_needs_yes(store, monkeypatch, capsys):
    before = snapshot(store.root)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # piped "y": not a person answering
    rc, _, err = run(["cache", "clear", "--cache-dir", str(store.root), "--all"], capsys)
    assert rc == 2 and "stdin is not a terminal" in err and "--yes" in err
    assert snapshot(store.root) == before


def test_terminal_confirmation(store, monkeypatch, capsys):
    before = snapshot(store.root)
    monkeypatch.setattr(sys, "stdin", FakeTTY("n\n"))
    rc, _, err = run(["cache", "clear", "--cache-dir", str(store.root), "--format", "int4"], capsys)
    assert rc == 1 and "remove 2 files" in err and "[y/N]" in err and "nothing was removed" in err
    assert snapshot(store.root) == before
    monkeypatch.setattr(sys, "stdin", FakeTTY("y\n"))
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--format", "int4"], capsys)
    assert rc == 0 and "removed 2 files" in out and not entry(store, K_INT4_0, L0).exists()


# ---- clear: what is in use


def test_entry_whose_build_lock_is_held_is_skipped(store, capsys):
    lock = store._locked(K_INT4_0, L0)  # what get_or_build holds while it builds
    with lock:
        rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--format", "int4", "--yes"], capsys)
        assert rc == 1
        assert (f"skipped {encode_name(L0)}.hnm (key {K_INT4_0[:12]}): its build lock "
                f"({encode_name(L0)}.hnm.lock) is held") in out
        assert "removed 1 file" in out
        assert entry(store, K_INT4_0, L0).exists() and not entry(store, K_INT4_1, L1).exists()
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--format", "int4", "--yes"], capsys)
    assert rc == 0 and not entry(store, K_INT4_0, L0).exists()
    assert not (store.root / K_INT4_0 / (encode_name(L0) + ".hnm.lock")).exists()  # taken along


def test_lock_held_by_another_process_is_skipped(store, capsys):
    lock_path = store.root / K_BACKUP / (encode_name(L0 + ".original") + ".hnm.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()", str(lock_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--key", K_BACKUP, "--yes"], capsys)
        assert rc == 1 and "is held: a process is building this entry now" in out
        assert entry(store, K_BACKUP, L0 + ".original").exists() and lock_path.exists()
    finally:
        holder.communicate("")
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--key", K_BACKUP, "--yes"], capsys)
    assert rc == 0 and not (store.root / K_BACKUP).exists()


def test_temp_file_of_a_running_write_is_kept(store, capsys):
    live = store.root / K_INT8 / f".x.hnm.tmp-{os.getpid()}-12345678"
    live.write_bytes(b"in flight")
    rc, out, _ = run(["cache", "list", "--cache-dir", str(store.root)], capsys)
    assert f"temp file {live.name} (9 B): being written (process {os.getpid()} is running)" in out
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--stale", "--yes"], capsys)
    assert rc == 1 and f"being written by process {os.getpid()}, which is still running" in out
    assert live.exists() and not (store.root / K_INT4_0 / TMP).exists()


def test_delete_skips_a_file_rewritten_since_the_summary_and_refuses_foreign_files(store):
    files = [f for s in store.summary() if s.key == K_INT4_1 for f in s.files]
    store.write(K_INT4_1, L1, experts_meta("int4", "avx512", L1, 64), {"block": bytes(6000)})  # a new build
    res = store.delete(files)
    assert res.removed == [] and res.freed == 0
    assert [why for _, why in res.skipped] == [
        "changed since it was checked (rewritten meanwhile); run the command again"]
    assert entry(store, K_INT4_1, L1).exists()
    foreign = next(f for s in store.summary() if s.key == K_INT4_0 for f in s.files if f.kind == "other")
    with pytest.raises(ValueError, match="notes.txt in key .* is not a store file"):
        store.delete([foreign])


# ---- errors


@pytest.mark.parametrize("argv,message", [
    (["cache", "clear"], "cache clear needs a filter saying what to remove: --key KEY, --source S, --format F, "
                         "--tier T, --old-layout, --stale, or --all"),
    (["cache", "clear", "--all", "--format", "int4"], "--all removes every store file; it cannot be combined"),
    (["cache", "clear", "--key", "0123456789abcdef0"], "--key '0123456789abcdef0' matches no key directory in the "
                                                       "store (7 keys there)"),
    (["cache", "clear", "--key", "xyz"], "--key 'xyz' is not a key: keys are hexadecimal digests"),
    (["cache", "clear", "--key", "abcd", "--yes"], "--key 'abcd' matches 2 keys: abcd000000000000, abcd111111111111"),
])
def test_bad_input_is_one_line_and_exit_2(store, argv, message, capsys):
    store.write("abcd" + "0" * 60, "a", {}, {})
    store.write("abcd" + "1" * 60, "b", {}, {})
    before = snapshot(store.root)
    rc, _, err = run([*argv, "--cache-dir", str(store.root)], capsys)
    assert rc == 2 and f"hi-na-moe: error: {message}" in err
    assert snapshot(store.root) == before


@pytest.mark.parametrize("command", [["list"], ["clear", "--all", "--yes"]])
def test_missing_cache_dir_is_an_error_and_not_created(tmp_path, command, capsys):
    missing = tmp_path / "typo"
    rc, _, err = run(["cache", *command, "--cache-dir", str(missing)], capsys)
    assert rc == 2 and f"--cache-dir {str(missing)!r} does not exist" in err
    assert not missing.exists()


def test_nothing_matching_says_what_the_store_holds(store, capsys):
    rc, out, _ = run(["cache", "clear", "--cache-dir", str(store.root), "--format", "lossless12", "--yes"], capsys)
    assert rc == 0
    assert out.strip() == (f"nothing to clear in {store.root} for --format lossless12 "
                           "(formats in the store: int4, int8, lossless)")


def test_command_runs_as_a_module(store):
    proc = subprocess.run([sys.executable, "-m", "hi_na_moe", "cache", "clear", "--cache-dir", str(store.root),
                           "--stale"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "--yes" in proc.stderr and "Traceback" not in proc.stderr
