"""hi_na_moe.fastpath.kv_cache: decode appends to a DynamicCache written in place hold what the cache's
own update (torch.cat) holds, bit for bit, past the buffers' room to grow; views handed out are
never overwritten; every other cache, layer or mode goes through the cache's own update; and a
whole model decodes to the same logits both ways (on the layers' two native calls and on the
per-module attention path)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import greedy_decode, olmoe
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import hi_na_moe
from hi_na_moe.fastpath import kv_cache, linear
from hi_na_moe.core.native import native_kernels_available


def _kv(gen, B=2, heads=3, T=1, D=8, dtype=torch.bfloat16):
    return (torch.randn(B, heads, T, D, generator=gen).to(dtype), torch.randn(B, heads, T, D, generator=gen).to(dtype))


def _caches(gen, T=5, dtype=torch.bfloat16, layers=2):
    """Two DynamicCaches holding the same T-position prompt in every layer."""
    a, b = DynamicCache(), DynamicCache()
    for i in range(layers):
        k, v = _kv(gen, T=T, dtype=dtype)
        a.update(k, v, i)
        b.update(k.clone(), v.clone(), i)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_appends_in_place_hold_what_the_caches_own_update_holds(dtype):
    gen = torch.Generator().manual_seed(0)
    ours, ref = _caches(gen, dtype=dtype)
    buffers = set()
    for step in range(300):  # past the first buffers' room (5 + 256 positions)
        for i in range(2):
            k, v = _kv(gen, dtype=dtype)
            got = kv_cache.append(ours, i, k, v)
            want = ref.update(k, v, i)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            layer = ours.layers[i]
            assert got[0] is layer.keys and got[1] is layer.values and type(layer) is DynamicLayer
            buffers.add(layer.keys.untyped_storage().data_ptr())
        assert ours.get_seq_length() == ref.get_seq_length() == 5 + step + 1
    assert len(buffers) == 4  # two layers, each one buffer and one regrowth: written in place between


def _write(slots, gen):
    """What a decode step's native call does to each slot: writes its next position (returned as
    (k, v) [B, heads, 1, D] for the reference cache)."""
    new = []
    for s in slots:
        k, v = _kv(gen, heads=s.k.shape[1], D=s.k.shape[3])
        s.k[:, :, s.base + s.t:s.base + s.t + 1].copy_(k)
        s.v[:, :, s.base + s.t:s.base + s.t + 1].copy_(v)
        new.append((k, v))
    return new


def test_layers_taking_new_buffers_together_share_one_tensor_and_commit_all_at_once(monkeypatch):
    """kv_cache.slots: layers needing new buffers at the same call take one tensor (a group);
    commit_all makes their views with one narrow and one unbind: the same keys and values as the
    cache's own update past the regrowth, a layer cropped alone leaving the group for a buffer of
    its own, and GROUP False or a single layer giving standalone buffers."""
    gen = torch.Generator().manual_seed(4)
    ours, ref = _caches(gen, layers=3)
    storages, commits = set(), []
    commit = kv_cache.commit
    monkeypatch.setattr(kv_cache, "commit", lambda s: commits.append(1) or commit(s))
    for step in range(270):  # past the room (5 + 256 positions): a second group
        slots = kv_cache.slots(ours, [0, 1, 2], 2, 3, 8, torch.bfloat16)
        assert slots is not None and all(s.group is slots[0].group is not None for s in slots)
        assert [s.gi for s in slots] == [0, 1, 2]
        storages.add(slots[0].group.buf.untyped_storage().data_ptr())
        for i, (k, v) in enumerate(_write(slots, gen)):
            ref.update(k, v, i)
        kv_cache.commit_all(slots)
        for a, b in zip(ours.layers, ref.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert len(storages) == 2 and not commits  # (every commit the group's)
    # a layer cropped alone: its next slot a buffer of its own, the others stay in the group
    ours.layers[1].crop(-2)
    ref.layers[1].crop(-2)
    slots = kv_cache.slots(ours, [0, 1, 2], 2, 3, 8, torch.bfloat16)
    assert slots[1].group is None and slots[0].group is slots[2].group is not None
    for i, (k, v) in enumerate(_write(slots, gen)):
        ref.update(k, v, i)
    kv_cache.commit_all(slots)
    assert len(commits) == 1  # (the standalone layer's)
    for a, b in zip(ours.layers, ref.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # GROUP False: standalone buffers; the form asked must be the layers' (else None)
    monkeypatch.setattr(kv_cache, "GROUP", False)
    fresh, _ = _caches(gen, layers=2)
    slots = kv_cache.slots(fresh, [0, 1], 2, 3, 8, torch.bfloat16)
    assert all(s.group is None for s in slots)
    assert kv_cache.slots(_caches(gen, layers=2)[0], [0, 1], 2, 4, 8, torch.bfloat16) is None


def _sliding_caches(gen, window: int, T: int):
    a, b = DynamicCache(), DynamicCache()
    a.layers = [DynamicSlidingWindowLayer(sliding_window=window)]
    b.layers = [DynamicSlidingWindowLayer(sliding_window=window)]
    k, v = _kv(gen, T=T)
    a.update(k, v, 0)
    b.update(k.clone(), v.clone(), 0)
    return a, b


@pytest.mark.parametrize("window,prompt", [(2, 1), (8, 3), (8, 20), (64, 5)])
def test_a_sliding_window_layer_appended_in_place_holds_what_its_own_update_holds(window, prompt):
    """A DynamicSlidingWindowLayer: the same returned states, the same last window - 1 positions
    held, the same count and mask sizes, bit for bit, past the window and past the buffers' room;
    the views handed out are never overwritten."""
    gen = torch.Generator().manual_seed(window + prompt)
    ours, ref = _sliding_caches(gen, window, prompt)
    held, buffers = [], set()
    for step in range(300):  # past the first buffers' room (at most 63 + 256 positions)
        k, v = _kv(gen)
        got = kv_cache.append(ours, 0, k, v)
        want = ref.update(k, v, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        layer, lr = ours.layers[0], ref.layers[0]
        assert type(layer) is DynamicSlidingWindowLayer
        assert torch.equal(layer.keys, lr.keys) and torch.equal(layer.values, lr.values)
        assert layer.keys.shape[2] == min(prompt + step + 1, window - 1)
        assert layer.cumulative_length == lr.cumulative_length == prompt + step + 1
        assert ours.get_seq_length() == ref.get_seq_length() and layer.get_mask_sizes(1) == lr.get_mask_sizes(1)
        buffers.add(layer.keys.untyped_storage().data_ptr())
        if step % 37 == 0:
            held.append((got[0], got[0].clone(), got[1], got[1].clone()))
        # the stack's one call reads the view's start: layout() follows base as it moves on
        s = kv_cache.slot(ours, 0, 2, 3, 8, torch.bfloat16)
        assert s.layout() == (layer.keys.data_ptr(), layer.values.data_ptr(), *s.k.stride()[:3], s.v.stride(0),
                              s.v.stride(2))
    assert 2 <= len(buffers) <= 3  # written in place between the buffers' renewals
    for keys, k0, values, v0 in held:
        assert torch.equal(keys, k0) and torch.equal(values, v0)
    # recording its past from here on (assisted decoding): the layer's own update, as the reference's
    ours.layers[0].activate_past_recording()
    ref.layers[0].activate_past_recording()
    for _ in range(3):
        k, v = _kv(gen)
        got, want = kv_cache.append(ours, 0, k, v), ref.update(k, v, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(ours.layers[0].keys, ref.layers[0].keys)


def test_views_handed_out_are_never_overwritten():
    gen = torch.Generator().manual_seed(1)
    ours, ref = _caches(gen, layers=1)
    held = []
    for step in range(6):
        k, v = _kv(gen)
        keys, values = kv_cache.append(ours, 0, k, v)
        ref.update(k, v, 0)
        held.append((keys, keys.clone(), values, values.clone()))
        if step == 2:  # a crop hands the layer shorter views: the next append copies to new buffers
            ours.crop(-2)
            ref.crop(-2)
    for keys, k0, values, v0 in held:
        assert torch.equal(keys, k0) and torch.equal(values, v0)
    assert torch.equal(ours.layers[0].keys, ref.layers[0].keys)
    assert torch.equal(ours.layers[0].values, ref.layers[0].values)


def _count_updates(monkeypatch):
    calls = []
    orig = DynamicLayer.update
    monkeypatch.setattr(DynamicLayer, "update", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    return calls


def test_other_caches_layers_and_modes_go_through_the_caches_own_update(monkeypatch):
    gen = torch.Generator().manual_seed(2)

    class MyCache(DynamicCache):
        pass

    def appended_by_update(cache):
        k, v = _kv(gen)
        before = cache.layers[0].keys if cache.layers and cache.layers[0].is_initialized else None
        keys, _ = kv_cache.append(cache, 0, k, v)
        # the cache's own update concatenates into a new contiguous tensor
        return keys.is_contiguous() and (before is None or keys.untyped_storage().data_ptr() != before.untyped_storage().data_ptr())

    sub = MyCache()
    sub.update(*_kv(gen, T=4), 0)
    assert appended_by_update(sub)
    inst = DynamicCache()
    inst.update(*_kv(gen, T=4), 0)
    inst.update = lambda *a, _u=inst.update, **k: _u(*a, **k)  # replaced on the object
    assert appended_by_update(inst)
    for window, record in ((1, False), (64, True)):  # a window of 1 keeps every position; a recording layer too
        sliding = DynamicCache()
        sliding.layers = [DynamicSlidingWindowLayer(sliding_window=window)]
        if record:
            sliding.layers[0].activate_past_recording()
        sliding.update(*_kv(gen, T=4), 0)
        assert appended_by_update(sliding)
    empty = DynamicCache()  # no prompt yet: the first update initialises the layer
    assert appended_by_update(empty)
    shape = DynamicCache()
    shape.update(*_kv(gen, T=4), 0)
    assert kv_cache.slot(shape, 0, 2, 5, 8, torch.bfloat16) is None  # another head count than the cached one
    assert kv_cache.slot(shape, 0, 2, 3, 8, torch.float32) is None  # another dtype
    assert kv_cache.slot(shape, 1, 2, 3, 8, torch.bfloat16) is None  # no such layer
    assert kv_cache.slot(shape, 0, 2, 3, 8, torch.bfloat16) is not None
    monkeypatch.setattr(kv_cache, "IN_PLACE", False)
    off = DynamicCache()
    off.update(*_kv(gen, T=4), 0)
    assert appended_by_update(off) and appended_by_update(off)
    monkeypatch.setattr(kv_cache, "IN_PLACE", True)
    calls = _count_updates(monkeypatch)  # DynamicLayer.update replaced on the class
    patched = DynamicCache()
    patched.update(*_kv(gen, T=4), 0)
    calls.clear()
    kv_cache.append(patched, 0, *_kv(gen))
    assert calls == [1]


def test_buffers_made_in_inference_mode_are_replaced_outside_it():
    gen = torch.Generator().manual_seed(3)
    ours, ref = _caches(gen, layers=1)
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with mode():
            for _ in range(3):
                k, v = _kv(gen)
                kv_cache.append(ours, 0, k, v)
                ref.update(k, v, 0)
    assert torch.equal(ours.layers[0].keys, ref.layers[0].keys)
    assert torch.equal(ours.layers[0].values, ref.layers[0].values)


def _count_commits(monkeypatch, sink: list) -> None:
    """Appends one item to `sink` per layer position committed in place: by commit, or by
    commit_all for a group's members (the others it hands to commit)."""
    commit, commit_all = kv_cache.commit, kv_cache.commit_all
    monkeypatch.setattr(kv_cache, "commit", lambda s: sink.append(1) or commit(s))

    def counted_all(slots):
        sink.extend(1 for s in slots if s.group is not None)
        return commit_all(slots)

    monkeypatch.setattr(kv_cache, "commit_all", counted_all)


@pytest.mark.skipif(not native_kernels_available(), reason="the decode paths run on the native kernels")
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("path", ["one-native-call", "two-native-calls", "per-module-attention"])
def test_a_model_decodes_to_the_same_logits_with_and_without_in_place_appends(path, rows, monkeypatch):
    from hi_na_moe.fastpath import layers, stack

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)  # the tiny projections packed: the layers' two native calls
    # the stack's one native call (decode_layers writes at the slots' positions itself), or its loop
    monkeypatch.setattr(stack, "ONE_CALL", path == "one-native-call")
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    hi_na_moe.enable_for_model(model, scope="all")
    hooks = []
    try:
        if path == "per-module-attention":  # a hook on the attention: the layers step aside to calling it
            hooks = [layer.self_attn.register_forward_hook(lambda *a: None) for layer in model.model.layers]
        appends, direct = [], []
        slot_of = layers._slot_of
        _count_commits(monkeypatch, appends)
        # the layers' first native call writes k and v at the slot's next position; append() copies them
        monkeypatch.setattr(layers, "_slot_of", lambda s: direct.append(1) or slot_of(s))
        ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3]][:rows])
        got, c_got = greedy_decode(model, ids, 264)  # past the buffers' room (7 + 256)
        assert len(appends) == 264 * 2
        assert len(direct) == (264 * 2 if path == "two-native-calls" else 0)
        monkeypatch.setattr(kv_cache, "IN_PLACE", False)
        want, c_want = greedy_decode(model, ids, 264)
        assert len(appends) == 264 * 2
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        for lg, lw in zip(c_got.layers, c_want.layers):
            assert torch.equal(lg.keys, lw.keys) and torch.equal(lg.values, lw.values)
            assert not lg.keys.is_contiguous() and lw.keys.is_contiguous()
    finally:
        for h in hooks:
            h.remove()
        hi_na_moe.disable_for_model(model)


@pytest.mark.skipif(not native_kernels_available(), reason="the decode paths run on the native kernels")
def test_beam_search_reorders_a_grown_cache_as_the_caches_own_update_does(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    kw = dict(max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        commits = []
        _count_commits(monkeypatch, commits)
        with torch.inference_mode():
            got = model.generate(ids, **kw)
        assert commits  # the beams' decode steps appended in place
        monkeypatch.setattr(kv_cache, "IN_PLACE", False)
        with torch.inference_mode():
            want = model.generate(ids, **kw)
    finally:
        hi_na_moe.disable_for_model(model)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(g, w) for g, w in zip(got.scores, want.scores))


def _static(B=2, heads=2, D=8, cap=6, dtype=torch.bfloat16):
    from transformers import StaticCache

    from tiny_models import olmoe as _olmoe_model

    cfg = _olmoe_model(layers=1, kv_heads=heads, hidden=heads * D * 2, heads=heads * 2).config
    cache = StaticCache(config=cfg, max_cache_len=cap)
    k0 = torch.randn(B, heads, 3, D).to(dtype)
    cache.update(k0, k0 + 1, 0)
    return cache


def test_a_static_caches_slot_is_its_buffers_and_the_next_position_as_its_update_writes():
    cache = _static()
    own = _static()
    s = kv_cache.static_slot(cache, 0, 2, 2, 8, torch.bfloat16)
    assert s is not None and s.t == 3 and s.k is cache.layers[0].keys and s.v is cache.layers[0].values
    k, v = torch.randn(2, 2, 1, 8).to(torch.bfloat16), torch.randn(2, 2, 1, 8).to(torch.bfloat16)
    s.k[:, :, s.t:s.t + 1].copy_(k)  # what the native call writes at position t
    s.v[:, :, s.t:s.t + 1].copy_(v)
    kv_cache.static_commit(s)
    own.update(k, v, 0)
    a, b = cache.layers[0], own.layers[0]
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert int(a.cumulative_length) == int(b.cumulative_length) == 4 == cache.get_seq_length()
    # other shapes, a full buffer, a layer's own update replaced, a subclass: the update runs
    assert kv_cache.static_slot(cache, 0, 1, 2, 8, torch.bfloat16) is None
    assert kv_cache.static_slot(cache, 0, 2, 2, 8, torch.float32) is None
    assert kv_cache.static_slot(cache, 1, 2, 2, 8, torch.bfloat16) is None
    a.cumulative_length.fill_(6)
    assert kv_cache.static_slot(cache, 0, 2, 2, 8, torch.bfloat16) is None
    a.cumulative_length.fill_(4)
    a.update = lambda *args, **kw: None
    assert kv_cache.static_slot(cache, 0, 2, 2, 8, torch.bfloat16) is None
    del a.update
    assert kv_cache.static_slot(cache, 0, 2, 2, 8, torch.bfloat16) is not None
    from transformers import StaticCache

    class Mine(StaticCache):
        pass

    cache.__class__ = Mine
    assert kv_cache.static_slot(cache, 0, 2, 2, 8, torch.bfloat16) is None


def test_a_static_cache_made_in_inference_mode_is_not_written_outside_it():
    with torch.inference_mode():
        cache = _static()
    assert kv_cache.static_slot(cache, 0, 2, 2, 8, torch.bfloat16) is None
    with torch.inference_mode():
        assert kv_cache.static_slot(cache, 0, 2, 2, 8, torch.bfloat16) is not None


def test_a_cache_dropped_after_in_place_appends_is_freed():
    """A cache its owner dropped goes, with its layers and the buffers their appends took: the
    slot kept for a layer must not keep the layer alive (it did until 2026-12-07, one cache's
    buffers for good per generate call, which ran a server out of memory)."""
    import gc
    import weakref

    gen = torch.Generator().manual_seed(3)
    refs = []
    for _ in range(3):
        cache, _ = _caches(gen)
        for i in range(2):
            kv_cache.append(cache, i, *_kv(gen))
        assert kv_cache._SLOTS.get(cache.layers[0]) is not None  # (the appends went in place)
        refs.append(weakref.ref(cache.layers[0]))
        del cache
    gc.collect()
    assert all(r() is None for r in refs)
