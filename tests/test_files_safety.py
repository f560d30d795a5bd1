"""Privilege and files (README, "Guarantees"): nothing in a model directory is ever unpickled;
the packed-expert store is private to its user (0600 files, 0700 directories, whatever the
umask, in the user's cache directory) and never reads or writes through a link planted in it.

tests/test_store.py already covers: a symlink at an entry or lock path (refused, target
untouched), a symlinked key directory for write/open, 0600/0700 under umask 0 and 0o277 at the
store level, entries writable by others or owned by someone else, a FIFO. This file adds what
those leave out.
"""

from __future__ import annotations

import ast
import json
import os
import stat
from pathlib import Path

import pytest
import torch

import hi_na_moe
from hi_na_moe.tools.commands import common as cli_common
from hi_na_moe.core import checkpoint as checkpoint_mod, store as store_mod
from hi_na_moe.core.store import PackedStore, StoreError, UnsafeEntry, entry_key
from tiny_models import build_tiny

SRC = Path(hi_na_moe.__file__).parent
KEY = entry_key("f" * 64, format="bf16")
NAME = "model.layers.0.mlp.experts"


# ---------------------------------------------------------------------------------------------
# Pickles


def _loader_calls(tree: ast.AST) -> list[str]:
    """Calls and imports in a module that can unpickle: torch.load, pickle/dill/joblib/shelve/
    marshal, numpy.load (allow_pickle)."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad += [n for n in names if n.split(".")[0] in ("pickle", "_pickle", "dill", "joblib", "shelve", "marshal", "cloudpickle")]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("load", "loads"):
            base = node.func.value
            if isinstance(base, ast.Name) and base.id in ("torch", "np", "numpy", "pickle"):
                bad.append(f"{base.id}.{node.func.attr}")
    return bad


def test_the_package_never_calls_an_unpickler():
    found = {p.name: _loader_calls(ast.parse(p.read_text(encoding="utf-8"))) for p in SRC.glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}
    assert _loader_calls(ast.parse("import torch\ntorch.load('x')")) == ["torch.load"]  # the scan finds them


class _Payload:
    """Unpickling this creates `marker` (what a malicious checkpoint would do, harmlessly)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def unpickling(monkeypatch):
    """Every torch.load call (transformers' only unpickler for checkpoints), recorded."""
    calls = []
    real = torch.load

    def spy(f, *args, **kwargs):
        calls.append(os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f))
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    tiny = build_tiny("olmoe")
    tiny.model.save_pretrained(d / "single")
    tiny.model.save_pretrained(d / "sharded", max_shard_size="100KB")
    return d, tiny


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _plant(path: Path, marker: Path) -> None:
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, path)


def _beside(d, marker):  # transformers prefers model.safetensors: the pickle is just there
    _plant(d / "pytorch_model.bin", marker)


def _renamed(d, marker):  # no model.safetensors: without use_safetensors=True, the .bin is read
    (d / "model.safetensors").rename(d / "weights.safetensors")
    _plant(d / "pytorch_model.bin", marker)


def _named_by_config(d, marker):  # config.json may name the weights file; the flag is ignored then
    cfg = json.loads((d / "config.json").read_text())
    cfg["transformers_weights"] = "adapter_model.bin"
    (d / "config.json").write_text(json.dumps(cfg))
    _plant(d / "adapter_model.bin", marker)


def _shard_in_index(name):
    def plant(d, marker):  # a safetensors index pointing one tensor at a pickle
        index = d / "model.safetensors.index.json"
        doc = json.loads(index.read_text())
        first = sorted(doc["weight_map"])[0]
        doc["weight_map"][first] = name
        index.write_text(json.dumps(doc))
        _plant(d / name, marker)

    return plant


PLANTS = {"beside": ("single", _beside), "renamed": ("single", _renamed),
          "named_by_config": ("single", _named_by_config),
          # transformers reads every shard with load_state_dict (torch.load for a .bin) when the
          # first one is not safetensors, else every shard with safe_open
          "shard_in_index_first": ("sharded", _shard_in_index("000-shard.bin")),
          "shard_in_index_last": ("sharded", _shard_in_index("zzz-shard.bin"))}


def _hi_na_moe_load(d):
    return hi_na_moe.from_pretrained(d, weights="int8")


def _cli_load(d):
    return cli_common._load(d, None)[0]


@pytest.mark.parametrize("load", [_hi_na_moe_load, _cli_load], ids=["from_pretrained", "cli"])
@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_pickle_is_never_unpickled(checkpoint, tmp_path, unpickling, plant, load, monkeypatch):
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path / "store"))
    base, tiny = checkpoint
    which, do = PLANTS[plant]
    d = _copy(base / which, tmp_path / "model")
    marker = tmp_path / "UNPICKLED"
    do(d, marker)
    try:
        model = load(d)
    except Exception as exc:  # noqa: BLE001
        # refused, with a message saying why (transformers' own for a missing safetensors file)
        assert isinstance(exc, (checkpoint_mod.PickleRefused, cli_common.UserError, OSError)), exc
        assert "safetensors" in str(exc), exc
        assert plant != "beside"
    else:
        assert plant == "beside"
        ids = torch.tensor([[3, 9, 27, 81]])
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, tiny.model(ids).logits, rtol=2e-2, atol=2e-2)
        if hi_na_moe.is_enabled(model):
            hi_na_moe.disable_for_model(model)
    assert unpickling == [] and not marker.exists()


def test_the_guard_is_what_refuses(checkpoint, tmp_path, monkeypatch):
    # without hi_na_moe's guard, transformers would torch.load the file named by config.json
    # even with use_safetensors=True: the case above is not refused by accident
    from transformers import AutoModelForCausalLM

    calls = []
    real = torch.load

    def spy(f, *args, **kwargs):
        calls.append(os.fspath(f))
        raise RuntimeError("stop here")

    d = _copy(checkpoint[0] / "single", tmp_path / "model")
    _named_by_config(d, tmp_path / "UNPICKLED")
    monkeypatch.setattr(torch, "load", spy)
    with pytest.raises(RuntimeError, match="stop here"):
        AutoModelForCausalLM.from_pretrained(d, use_safetensors=True)
    assert calls == [str(d / "adapter_model.bin")]
    monkeypatch.setattr(torch, "load", real)
    with checkpoint_mod.safetensors_only(), pytest.raises(checkpoint_mod.PickleRefused, match="adapter_model.bin"):
        AutoModelForCausalLM.from_pretrained(d, use_safetensors=True)
    import transformers.modeling_utils as mu

    assert mu.load_state_dict is checkpoint_mod._GUARD["original"] or checkpoint_mod._GUARD["original"] is None
    assert "hi_na_moe" not in (mu.load_state_dict.__module__ or "")  # restored after the load


def test_use_safetensors_false_is_refused(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path / "store"))
    with pytest.raises(ValueError, match="safetensors checkpoints only"):
        hi_na_moe.from_pretrained(checkpoint[0] / "single", weights="int8", use_safetensors=False)


def test_disable_never_unpickles_either(checkpoint, tmp_path, unpickling, monkeypatch):
    # disable of a from_pretrained model reads the original experts back from the checkpoint:
    # a pickle planted there meanwhile is refused too, and the model stays enabled (retryable)
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path / "store"))
    d = _copy(checkpoint[0] / "single", tmp_path / "model")
    model = hi_na_moe.from_pretrained(d, weights="int8")
    saved = (d / "config.json").read_text()
    marker = tmp_path / "UNPICKLED"
    _named_by_config(d, marker)
    with pytest.raises(RuntimeError, match="could not be restored .*adapter_model.bin.*not safetensors"):
        hi_na_moe.disable_for_model(model)
    assert hi_na_moe.is_enabled(model) and unpickling == [] and not marker.exists()
    (d / "config.json").write_text(saved)
    hi_na_moe.disable_for_model(model)
    assert unpickling == []


# ---------------------------------------------------------------------------------------------
# Permissions: private files in the user's cache directory


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_enable_writes_private_files_into_the_users_cache_dir(tmp_path, monkeypatch, umask):
    # a fresh user: not even ~/.cache exists; XDG_CACHE_HOME points into it
    monkeypatch.delenv("HINA_MOE_CACHE_DIR", raising=False)
    monkeypatch.delenv("HINA_MOE_CACHE_DIR", raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    tiny = build_tiny("olmoe")
    old = os.umask(umask)
    try:
        report = hi_na_moe.enable_for_model(tiny.model, weights="int8")
        hi_na_moe.disable_for_model(tiny.model)
    finally:
        os.umask(old)
    assert {b.cache for b in report.accelerated} == {"built"}
    root = home / ".cache" / "hi_na_moe"
    modes = _modes(home)
    assert modes[".cache"] == 0o700 and modes[".cache/hi_na_moe"] == 0o700  # parents made too
    files = {p: m for p, m in modes.items() if (home / p).is_file()}
    dirs = {p: m for p, m in modes.items() if (home / p).is_dir()}
    assert any(p.endswith(".hnm") for p in files) and any(p.endswith(".lock") for p in files)
    assert set(files.values()) == {0o600}, files
    assert set(dirs.values()) == {0o700}, dirs
    assert all((home / p).resolve().is_relative_to(root) for p in files)


# ---------------------------------------------------------------------------------------------
# Links planted in the store


@pytest.fixture
def store(tmp_path):
    return PackedStore(tmp_path / "cache")


def _precious(tmp_path, content=b"precious"):
    p = tmp_path / "precious"
    p.write_bytes(content)
    p.chmod(0o600)
    return p


def _build():
    return {"format": "bf16"}, {"data": b"x" * 5000}


def test_a_symlink_at_the_temp_path_is_never_written_through(store, tmp_path, monkeypatch):
    target = _precious(tmp_path)
    dangling = tmp_path / "not-there"
    monkeypatch.setattr(store_mod.secrets, "token_hex", lambda n: "deadbeef")
    final = store.path_for(KEY, NAME)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-deadbeef"
    for link_to in (target, dangling):
        os.makedirs(final.parent, mode=0o700, exist_ok=True)
        os.symlink(link_to, tmp)
        with pytest.raises(StoreError, match="File exists"):
            store.write(KEY, NAME, {}, {"data": b"x" * 5000})
        assert not final.exists() and not dangling.exists()
        assert target.read_bytes() == b"precious" and stat.S_IMODE(target.stat().st_mode) == 0o600
        assert not os.path.lexists(tmp)  # the planted link is cleaned up, its target is not


def test_a_hard_link_at_the_entry_path_is_replaced_not_written_through(store, tmp_path):
    # a hard link to one of the user's files passes the owner/mode checks, fails as an entry,
    # and is rebuilt by replacing the name: the linked file keeps its bytes
    target = _precious(tmp_path)
    path = store.path_for(KEY, NAME)
    os.makedirs(path.parent, mode=0o700)
    os.link(target, path)
    entry, built, reason = store.get_or_build(KEY, NAME, {"format": "bf16"}, _build)
    entry.close()
    assert built and "not a hi_na_moe store file" in reason
    assert target.read_bytes() == b"precious" and os.stat(target).st_nlink == 1


def test_a_symlinked_key_directory_is_refused_everywhere(store, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    theirs = elsewhere / (store_mod.encode_name(NAME) + ".hnm")
    theirs.write_bytes(b"not the store's")
    lock = elsewhere / (store_mod.encode_name(NAME) + ".hnm.lock")
    lock.write_bytes(b"")
    store.root.mkdir(mode=0o700)
    os.symlink(elsewhere, store.root / KEY)
    with pytest.raises(UnsafeEntry, match="symbolic link"):
        store.get_or_build(KEY, NAME, {"format": "bf16"}, _build)
    # housekeeping does not follow it either: nothing listed, counted or removed through it
    assert store.entries() == [] and store.size_bytes() == 0
    store.clear()
    store.clear(KEY)
    assert sorted(os.listdir(elsewhere)) == sorted([theirs.name, lock.name])
    assert theirs.read_bytes() == b"not the store's"


def test_the_store_directory_must_be_private(store, tmp_path, monkeypatch):
    store.write(KEY, NAME, {}, {"data": b"x"})
    store.root.chmod(0o770)
    with pytest.raises(UnsafeEntry, match=r"store directory writable by group or others \(mode 0770\)"):
        store.open(KEY, NAME)
    with pytest.raises(UnsafeEntry, match="writable by group or others"):
        store.write(KEY, "other", {}, {"data": b"x"})
    store.root.chmod(0o700)
    store.open(KEY, NAME).close()
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 12345)
    with pytest.raises(UnsafeEntry, match="store directory owned by uid"):
        store.open(KEY, NAME)


def test_a_store_directory_symlinked_by_its_user_is_fine(tmp_path):
    # the user's own choice (e.g. the cache on another disk): followed, and still checked
    real = tmp_path / "disk" / "hina"
    real.parent.mkdir()
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "cache")
    store = PackedStore(tmp_path / "cache")
    store.write(KEY, NAME, {}, {"data": b"x"})
    store.open(KEY, NAME).close()
    assert (real / KEY).is_dir()
