"""Where blocks loaded from the packed-expert store live (config key memory, hi_na_moe.core.memory):
a copy of its own or the store's file mapping. A copy is the same block: the same outputs bit for
bit, validated as a view is, independent of the buffer it was copied from; "auto" copies only with
headroom left; the report says which blocks are where."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny, greedy_decode, olmoe

import hi_na_moe
from hi_na_moe.fastpath import linear
from hi_na_moe.core import memory
from hi_na_moe.core.native import native_kernels_available, native_module

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="blocks from the store need the native library")


def _packed(weights="int4"):
    native = native_module()[0]
    g = torch.Generator().manual_seed(3)
    E, H, I = 4, 128, 64
    gate, up = (torch.randn(E, I, H, generator=g).bfloat16() for _ in range(2))
    down = torch.randn(E, H, I, generator=g).bfloat16()
    return native.PackedExperts(gate, up, down, weights=weights)


def _written(src):
    """The block's bytes in a 64-byte aligned buffer of their own, as the store's mapping holds them."""
    import numpy as np

    data = torch.from_dlpack(src.data).numpy()
    raw = np.empty(data.nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    buf = raw[off:off + data.nbytes]
    buf[:] = data
    return buf


def _run(pe, x, idx, w):
    out = torch.empty_like(x)
    pe.forward(x, idx, w, out)
    return out


@pytest.mark.parametrize("weights", ["lossless", "int8", "int4"])
def test_a_copy_is_the_block_bit_for_bit_and_owns_its_bytes(weights):
    native = native_module()[0]
    src = _packed(weights)
    buf = _written(src)
    view = native.PackedExperts.view(src.header, buf)
    copy = native.PackedExperts.copy(src.header, buf)
    assert copy.nbytes == view.nbytes == src.nbytes and copy.header == src.header
    g = torch.Generator().manual_seed(4)
    for T in (1, 5):
        x = torch.randn(T, 128, generator=g).bfloat16()
        idx = torch.randint(4, (T, 2), generator=g)
        w = torch.rand(T, 2, generator=g)
        assert torch.equal(_run(copy, x, idx, w), _run(view, x, idx, w))
    want = _run(copy, x, idx, w)
    buf[:] = 0  # the source changes: the copy does not (the view would)
    assert torch.equal(_run(copy, x, idx, w), want)
    with pytest.raises(ValueError, match="cannot be packed into"):
        copy.pack_experts(0, None, torch.zeros(4, 64, 128).bfloat16(), torch.zeros(4, 128, 64).bfloat16())


def test_a_copy_is_validated_as_a_view_is():
    native = native_module()[0]
    src = _packed()
    buf = _written(src)
    for make in (native.PackedExperts.view, native.PackedExperts.copy):
        with pytest.raises(ValueError, match="bytes; its header says"):
            make(src.header, buf[:-64])
        bad = bytearray(src.header)
        bad[0] ^= 0xFF
        with pytest.raises(ValueError, match="magic"):
            make(bytes(bad), buf)


def test_auto_copies_only_while_headroom_is_left(monkeypatch):
    gib = 1 << 30
    assert memory.copies("copy", 100 * gib) and not memory.copies("map", 1)
    monkeypatch.setattr(memory, "available_bytes", lambda: (8 * gib, 16 * gib))
    assert memory.copies("auto", 6 * gib)  # 2 GiB left >= max(1 GiB, 10 % of 16)
    assert not memory.copies("auto", 7 * gib)  # 1 GiB left < 1.6 GiB
    monkeypatch.setattr(memory, "available_bytes", lambda: (300 * gib, 400 * gib))
    assert not memory.copies("auto", 270 * gib)  # 30 GiB left < 40 GiB (10 % of the total)
    monkeypatch.setattr(memory, "available_bytes", lambda: None)  # unknown: the mapping
    assert not memory.copies("auto", 1)
    assert "cannot be read" in memory.describe("auto")
    monkeypatch.setattr(memory, "available_bytes", lambda: (8 * gib, 16 * gib))
    assert memory.describe("auto") == ("memory='auto': copied while 1.60 GiB stay free, now up to 6.40 GiB of "
                                       "blocks; the rest read through the store's file mapping")
    assert "every block copied" in memory.describe("copy") and "mapping" in memory.describe("map")
    assert hi_na_moe.capabilities(hi_na_moe.load_config(memory="map"))["store_blocks"] == memory.describe("map")


def test_the_memory_this_process_may_take_reads_meminfo_and_a_cgroup_limit(tmp_path):
    mem = memory._meminfo()
    assert mem is not None and 0 < mem[0] <= mem[1]
    group = tmp_path / "fs" / "app.slice" / "job"
    group.mkdir(parents=True)
    self_cgroup = tmp_path / "cgroup"
    self_cgroup.write_text("0::/app.slice/job\n")
    (group / "memory.max").write_text("4294967296\n")
    (group / "memory.current").write_text("3221225472\n")
    (group / "memory.stat").write_text("anon 2147483648\nfile 1073741824\ninactive_file 536870912\n")
    # 4 GiB limit - 3 GiB used + 0.5 GiB of inactive file pages
    assert memory._cgroup_room(tmp_path / "fs", self_cgroup) == (int(1.5 * (1 << 30)), 4 << 30)
    (group / "memory.max").write_text("max\n")
    assert memory._cgroup_room(tmp_path / "fs", self_cgroup) is None
    self_cgroup.write_text("1:memory:/old\n")  # cgroup v1 only: not read
    assert memory._cgroup_room(tmp_path / "fs", self_cgroup) is None


def test_a_model_from_the_store_decodes_the_same_copied_or_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    ids = torch.tensor([[3, 4, 5, 6]])
    runs = {}
    for mode in ("map", "copy", "map", "auto"):  # the first map builds the store, the rest reuse it
        model = build_tiny("olmoe", torch.bfloat16).model.eval()
        rep = hi_na_moe.enable_for_model(model, weights="int4", scope="all", dense_lossless="",
                                         cache_dir=str(tmp_path), memory=mode)
        try:
            held = {b.memory for b in rep.blocks} | {d.memory for d in rep.dense}
            want = {"map": {"mapped"}, "copy": {"copied"}}.get(mode)
            if want is not None:
                assert held == want, (mode, held)
            else:
                assert held <= {"copied", "mapped"} and held
            n = len(rep.blocks) + len(rep.dense)
            copied = sum(r.memory == "copied" for r in [*rep.blocks, *rep.dense])
            assert (f"from the packed-expert store (memory={mode!r}): {copied} copied into memory" in str(rep)
                    and f"{n - copied} read through its file mapping" in str(rep))
            logits, cache = greedy_decode(model, ids, 4)
            runs.setdefault(mode, []).append((logits, cache))
        finally:
            hi_na_moe.disable_for_model(model)
    base_logits, base_cache = runs["map"][0]
    for mode, got in runs.items():
        for logits, cache in got:
            assert all(torch.equal(a, b) for a, b in zip(logits, base_logits)), mode
            for a, b in zip(cache.layers, base_cache.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), mode


def test_the_memory_key_names_its_choices():
    with pytest.raises(hi_na_moe.ConfigError, match=r"config key 'memory'.*'auto', 'copy', 'map'"):
        hi_na_moe.load_config(memory="resident")


def _pages_present(t: torch.Tensor) -> tuple[int, int]:
    """(present, all) of the 4 KiB pages under `t`'s bytes, from /proc/self/pagemap (bit 63: page
    present; readable without privileges)."""
    import struct

    a, n = t.data_ptr() // 4096, (t.data_ptr() + t.nbytes - 1) // 4096 + 1
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(a * 8)
        raw = f.read((n - a) * 8)
    return sum(e >> 63 for e in struct.unpack(f"{n - a}Q", raw)), n - a


def _file_backed(t: torch.Tensor) -> bool:
    p = t.data_ptr()
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= p < hi:
            return len(parts) > 5 and parts[5].startswith("/")
    return False


def test_enable_reads_in_an_embedding_left_in_the_checkpoint_mapping(tmp_path):
    """A table transformers left in the checkpoint's file mapping, whose pages a decode step
    would otherwise read from disk a new token at a time, is read in at enable: every page of it
    mapped afterwards, and the report says so; the outputs are not touched."""
    import os

    from transformers import OlmoeForCausalLM

    if not os.path.exists("/proc/self/pagemap"):
        pytest.skip("needs /proc/self/pagemap")
    src = olmoe(layers=1)
    src.resize_token_embeddings(8192, mean_resizing=False)  # 8192 x 256 bf16: 4 MiB, 1024 pages
    src.save_pretrained(tmp_path)
    model = OlmoeForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    w = model.model.embed_tokens.weight
    if not _file_backed(w):
        pytest.skip("this transformers copies loaded tensors: no file mapping to read in")
    before, pages = _pages_present(w)
    if before == pages:
        pytest.skip("loading already mapped every page of the table")
    ids = torch.randint(3, 8192, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(ids).logits
    rep = hi_na_moe.enable_for_model(model, cache=False)
    assert rep.embeddings_read == ["model.embed_tokens"] and rep.embeddings_read_bytes == w.nbytes
    assert _pages_present(w) == (pages, pages)
    assert "embedding tables read in at enable" in str(rep) and ": 1 (4 MiB, " in str(rep)
    assert rep.to_dict()["embeddings_read"] == ["model.embed_tokens"]
    hi_na_moe.disable_for_model(model)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, ref)


def test_read_in_leaves_small_and_non_cpu_tables(monkeypatch):
    small = torch.nn.Embedding(16, 8)
    meta = torch.nn.Embedding(100000, 64, device="meta")
    model = torch.nn.ModuleDict({"small": small, "meta": meta})
    assert memory.read_in_embeddings(model)[:2] == ([], 0)
    monkeypatch.setattr(memory, "READ_IN_MIN", 0)
    assert memory.read_in_embeddings(model)[:2] == (["small"], small.weight.nbytes)
