"""Decode-step appends to transformers' DynamicCache written in place.

`DynamicLayer.update` grows a layer's keys and values with `torch.cat`, so every decode step
copies the layer's whole cache: a read and a write of 2 x B x kv_heads x T x head_dim values.
At 4096 tokens of context that copy costs more than the attention that reads the cache once
(benchmarks/RESULTS.md, "Decode at 512-4096 tokens of context"). On hi_na_moe's decode paths
(hi_na_moe.fastpath.attention, hi_na_moe.fastpath.layers) a layer's keys and values instead become views of
buffers with room to grow: the new position is written in place and the layer's `keys` and
`values` are set to views one position longer.

What the cache holds is what `DynamicLayer.update` would hold, bit for bit, and the layer stays
the DynamicLayer it was; only the strides of its tensors differ (views of longer buffers). The
room to grow is max(256, T / 8) positions beyond the T cached when the buffers are (re)made.

A DynamicSlidingWindowLayer (a sliding-window layer of DynamicCache(config=...): GPT-OSS,
Mixtral with a window, ...) keeps only the last window - 1 positions, and its update returns
those and the new one. In place, its keys and values are views of the buffers that start later
by one position a step once the window is full: the new position is written after the view, the
update's return is the view one position longer, and the layer then holds its last window - 1
positions (its cumulative_length one further, as its update counts). The buffers' room is
used up after max(256, T / 8) steps and the next append copies the window into new ones.

When it applies: a cache whose type is DynamicCache exactly, not offloading, whose layer
`layer_idx` is a DynamicLayer or DynamicSlidingWindowLayer exactly (the latter with a window of at
least 2 and not recording its past) and already holds at least one position (the prompt), with
keys and values of the expected [B, kv_heads, T, head_dim] shape and dtype on the CPU, and with
`Cache.update` and `DynamicLayer.update` the functions transformers ships (not replaced on the
classes or the objects). Anything else goes through the cache's own `update`.

Nothing already handed out is overwritten: a position is written in place only while the
layer's keys and values are the very views this module set last (their length is then the
buffers' high-water mark, so every earlier view ends before it). After anything else replaced
them (`crop`, a beam reorder, the cache's own `update`, `reset`) the next append copies them
into new buffers.

`kv_cache.IN_PLACE = False` sends every append through the cache's own update again (for A/B
benchmarks, or for code that needs the cache's tensors contiguous).

A StaticCache needs no room to grow: its layers hold buffers of max_cache_len positions and their
update writes the next one (`cumulative_length`) with index_copy_. `static_slot` hands the
stack's one native call (hi_na_moe.fastpath.stack) those buffers and that position, and `static_commit`
then advances `cumulative_length` as the update does, so the layer holds what its update would
have written, bit for bit. The same conditions as above apply, with StaticCache and StaticLayer
(exactly those classes, their `update` the shipped functions).
"""
from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticCache,
    StaticLayer,
)

__all__ = ["Slot", "slot", "slots", "commit", "commit_all", "append", "StaticSlot", "static_slot", "static_commit"]


class Slot:
    """A layer's buffers k [B, heads, cap, D] and v [B, heads, cap, Dv] (Dv = D but for latent
    attention's caches, hi_na_moe.fastpath.mla), the views of their t positions from base the
    layer holds (kview, vview), and t: the next append writes position base + t. base stays 0 but
    for a sliding-window layer (window: its window, else 0), whose view moves on once full."""

    __slots__ = ("_layer", "k", "v", "kview", "vview", "t", "cap", "form", "base", "window", "group", "gi", "_layout")

    def __init__(self, layer, k: torch.Tensor, v: torch.Tensor, t: int, window: int = 0):
        # the layer weakly: _SLOTS maps the layer to this Slot, and a strong reference back would
        # keep every cache's layers, and their buffers, alive for good (a leak a cache a generate
        # call, 2026-12-07)
        self._layer = weakref.ref(layer)
        self.k, self.v, self.t, self.cap = k, v, t, k.shape[2]
        self.form = (k.shape[0], k.shape[1], k.shape[3], v.shape[3], k.dtype)
        self.kview = self.vview = None
        self.base, self.window = 0, window
        self.group, self.gi = None, -1  # (slots(): the _Group holding k and v, and its member index)
        self._layout = None  # (base, layout()) last computed

    @property
    def layer(self):
        return self._layer()

    def layout(self) -> tuple[int, int, int, int, int, int, int]:
        """(address of k at position base, of v at position base, k's batch, head and position
        element strides, v's batch and position strides): what the native calls read the cache by
        besides the positions; made again only when base moves (the buffers never change)."""
        lay = self._layout
        if lay is None or lay[0] != self.base:
            lay = self._layout = (self.base, _layout(self.k, self.v, self.base))
        return lay[1]


def _layout(k: torch.Tensor, v: torch.Tensor, base: int) -> tuple[int, int, int, int, int, int, int]:
    st, sv = k.stride(), v.stride()
    # (the views' addresses: position base of row 0, head 0)
    return k[:, :, base:].data_ptr(), v[:, :, base:].data_ptr(), st[0], st[1], st[2], sv[0], sv[2]


IN_PLACE = True
_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DynamicLayer -> Slot
_SHIPPED: tuple | None = None


def _shipped() -> tuple:
    global _SHIPPED
    if _SHIPPED is None:
        _SHIPPED = (DynamicCache, Cache.update, {DynamicLayer: DynamicLayer.update,
                                                 DynamicSlidingWindowLayer: DynamicSlidingWindowLayer.update})
    return _SHIPPED


def _shipped_layer(cache, layer_idx: int, shipped: tuple):
    """Layer `layer_idx` of `cache` when the cache and the layer are exactly the classes of
    `shipped` (cache class, its update, {layer class: its update} as transformers ships them), not
    offloading, the layer initialised and neither update replaced on the class or the object;
    else None."""
    cc, cache_update, layer_updates = shipped
    if (not IN_PLACE or type(cache) is not cc or cc.update is not cache_update or cache.offloading
            or "update" in cache.__dict__):
        return None
    layers = cache.layers
    if not 0 <= layer_idx < len(layers):
        return None
    layer = layers[layer_idx]
    lc = type(layer)
    if (layer_updates.get(lc) is None or lc.update is not layer_updates[lc] or not layer.is_initialized
            or "update" in layer.__dict__):
        return None
    return layer


def slot(cache, layer_idx: int, B: int, heads: int, D: int, dtype: torch.dtype, Dv: int | None = None) -> Slot | None:
    """Where to write the next position of layer `layer_idx` of `cache` in place (then call
    commit), or None: the cache's own update must run (module docstring). Values are Dv wide
    (default D)."""
    Dv = D if Dv is None else Dv
    layer = _shipped_layer(cache, layer_idx, _shipped())
    if layer is None:
        return None
    s = _held(layer, (B, heads, D, Dv, dtype))
    if s is not None:
        return s or None
    fresh = _fresh(layer, B, heads, D, Dv, dtype)
    if fresh is None:
        return None
    return _install_alone(layer, B, heads, D, Dv, dtype, *fresh)


def _held(layer, form: tuple):
    """The layer's Slot when the next position can go into its buffers; False when its own
    update must run (a sliding-window layer recording its past); None when it needs new buffers."""
    s = _SLOTS.get(layer)
    if s is None:
        return None
    if s.window and layer.record_past:
        return False  # recording its past since (assisted decoding): its own update keeps every position
    if (layer.keys is s.kview and layer.values is s.vview and s.base + s.t < s.cap and s.form == form
            and (not s.k.is_inference() or torch.is_inference_mode_enabled())):
        return s
    return None


def _fresh(layer, B: int, heads: int, D: int, Dv: int, dtype: torch.dtype) -> tuple[int, int] | None:
    """(T, window) of a layer whose keys and values new buffers can take (the expected shape and
    dtype on the CPU, a window as its update keeps it), else None."""
    keys, values = layer.keys, layer.values
    if (type(keys) is not torch.Tensor or type(values) is not torch.Tensor or keys.dim() != 4
            or keys.shape[0] != B or keys.shape[1] != heads or keys.shape[3] != D or keys.shape[2] == 0
            or values.shape != (B, heads, keys.shape[2], Dv) or keys.dtype is not dtype or values.dtype is not dtype
            or not keys.is_cpu or not values.is_cpu or keys.requires_grad or values.requires_grad):
        return None
    T, window = keys.shape[2], 0
    if getattr(type(layer), "is_sliding", False):  # a DynamicSlidingWindowLayer (_shipped_layer let it through)
        window, n = layer.sliding_window, layer.cumulative_length
        # a window of 1 keeps every position (its update's slice [-0:]); a recording layer keeps
        # them all until crop
        if (type(window) is not int or window < 2 or layer.record_past or type(n) is not int
                or T != min(n, window - 1)):
            return None
    return T, window


def _capacity(T: int) -> int:
    return T + max(256, T // 8)


def _install_alone(layer, B: int, heads: int, D: int, Dv: int, dtype: torch.dtype, T: int, window: int) -> Slot:
    """_install into buffers of the layer's own."""
    cap = _capacity(T)
    return _install(layer, torch.empty(B, heads, cap, D, dtype=dtype), torch.empty(B, heads, cap, Dv, dtype=dtype),
                    T, window)


def _install(layer, k: torch.Tensor, v: torch.Tensor, T: int, window: int) -> Slot:
    """The layer's T positions copied into new buffers k and v, and the layer holding views of them."""
    k[:, :, :T].copy_(layer.keys)
    v[:, :, :T].copy_(layer.values)
    s = Slot(layer, k, v, T, window)
    # the layer holds views of the new buffers from here on: were the caller to fail before
    # commit, the layer still holds its T positions
    s.kview, s.vview = k[:, :, :T], v[:, :, :T]
    layer.keys, layer.values = s.kview, s.vview
    _SLOTS[layer] = s
    return s


# slots(): layers taking new buffers at the same call share one tensor (commit_all)
GROUP = True


class _Group:
    """The buffers of several layers' Slots as one tensor buf [2 n, B, heads, cap, D]: member i's
    keys buf[2 i], its values buf[2 i + 1]."""

    __slots__ = ("buf",)

    def __init__(self, buf: torch.Tensor):
        self.buf = buf


def slots(cache, layer_ids: list[int], B: int, heads: int, D: int, dtype: torch.dtype) -> list[Slot] | None:
    """slot() of each layer of `layer_ids` (values D wide too), or None when one of them would be
    None (layers before it may then hold views of new buffers: the same positions). The layers
    that need new buffers at this call, without a window and holding as many positions, take
    them as one group (GROUP; _Group): commit_all then makes all their next views with one
    narrow and one unbind instead of two narrows a layer (each ~2 us warm, several times that
    on the caches a decode step's weight stream leaves)."""
    shipped = _shipped()
    form = (B, heads, D, D, dtype)
    out: list = []
    new = []  # (index in out, layer, T, window)
    for idx in layer_ids:
        layer = _shipped_layer(cache, idx, shipped)
        if layer is None:
            return None
        s = _held(layer, form)
        if s is False:
            return None
        if s is None:
            fresh = _fresh(layer, B, heads, D, D, dtype)
            if fresh is None:
                return None
            new.append((len(out), layer, *fresh))
        out.append(s)
    grouped = [x for x in new if not x[3]] if GROUP else []
    if len(grouped) > 1 and len({x[2] for x in grouped}) == 1:
        cap = _capacity(grouped[0][2])
        g = _Group(torch.empty(2 * len(grouped), B, heads, cap, D, dtype=dtype))
        for j, (i, layer, T, _) in enumerate(grouped):
            s = out[i] = _install(layer, g.buf[2 * j], g.buf[2 * j + 1], T, 0)
            s.group, s.gi = g, j
    for i, layer, T, window in new:
        if out[i] is None:
            out[i] = _install_alone(layer, B, heads, D, D, dtype, T, window)
    return out


def commit_all(slots: list[Slot]) -> None:
    """commit() of every slot, without its return; the members of one group (slots()) holding as
    many positions all at once, with one narrow and one unbind."""
    groups: dict[int, list[Slot]] = {}
    for s in slots:
        if s.group is None:
            commit(s)
        else:
            groups.setdefault(id(s.group), []).append(s)
    for members in groups.values():
        t = members[0].t + 1
        if len(members) == 1 or any(m.t + 1 != t for m in members):
            for m in members:
                commit(m)
            continue
        views = members[0].group.buf.narrow(3, 0, t).unbind(0)  # (members: no window, base 0)
        for m in members:
            m.kview, m.vview = views[2 * m.gi], views[2 * m.gi + 1]
            m.t = t
            m.layer.keys, m.layer.values = m.kview, m.vview


class StaticSlot:
    """A StaticCache layer's buffers k and v [B, heads, max_cache_len, D] (its own keys and values)
    and t, the position its update would write next."""

    __slots__ = ("layer", "k", "v", "t")

    def __init__(self, layer, k: torch.Tensor, v: torch.Tensor, t: int):
        self.layer, self.k, self.v, self.t = layer, k, v, t

    def layout(self) -> tuple[int, int, int, int, int, int, int]:  # (Slot.layout's; a StaticSlot lives one step)
        return _layout(self.k, self.v, 0)


_SHIPPED_STATIC: tuple | None = None


def static_slot(cache, layer_idx: int, B: int, heads: int, D: int, dtype: torch.dtype,
                Dv: int | None = None) -> StaticSlot | None:
    """Where a StaticCache's layer `layer_idx` takes the next position in place (then call
    static_commit), or None: the cache's own update must run (module docstring). Values Dv wide
    (latent attention's rope keys, hi_na_moe.fastpath.mla; their buffer then has its own strides), default D
    (the same strides as the keys')."""
    global _SHIPPED_STATIC
    if _SHIPPED_STATIC is None:
        _SHIPPED_STATIC = (StaticCache, Cache.update, {StaticLayer: StaticLayer.update})
    layer = _shipped_layer(cache, layer_idx, _SHIPPED_STATIC)
    if layer is None:
        return None
    k, v, n = layer.keys, layer.values, layer.cumulative_length
    if (type(k) is not torch.Tensor or type(v) is not torch.Tensor or k.dim() != 4
            or k.shape != (B, heads, layer.max_cache_len, D)
            or (v.shape != k.shape or k.stride() != v.stride() if Dv is None
                else v.shape != (B, heads, layer.max_cache_len, Dv) or v.stride(3) != 1)
            or k.stride(3) != 1 or k.dtype is not dtype or v.dtype is not dtype or not k.is_cpu or not v.is_cpu
            or k.requires_grad or v.requires_grad or type(n) is not torch.Tensor or n.dim() != 0 or not n.is_cpu
            or n.dtype is not torch.int64):
        return None
    if (k.is_inference() or v.is_inference()) and not torch.is_inference_mode_enabled():
        return None  # the update's index_copy_ would refuse: let it say so
    t = int(n)
    if not 0 <= t < k.shape[2]:
        return None
    return StaticSlot(layer, k, v, t)


def static_commit(s: StaticSlot) -> None:
    """After position s.t of the layer's buffers was written: its cumulative_length one further, as
    its update advances it."""
    s.layer.cumulative_length.add_(1)


def commit(s: Slot) -> tuple[torch.Tensor, torch.Tensor]:
    """After position s.base + s.t of s.k and s.v was written: the layer's keys and values one
    position longer (a sliding-window layer: its last window - 1 of them), and what the cache's
    update returns (the positions held before and the new one)."""
    t = s.t + 1
    full = s.k.narrow(2, s.base, t), s.v.narrow(2, s.base, t)  # [:, :, base:base + t] with less Python
    layer = s.layer
    if s.window:
        layer.cumulative_length += 1
        keep = s.window - 1
        if t > keep:
            s.base += t - keep
            t = keep
            s.kview, s.vview = s.k.narrow(2, s.base, t), s.v.narrow(2, s.base, t)
        else:
            s.kview, s.vview = full
    else:
        s.kview, s.vview = full
    s.t = t
    layer.keys, layer.values = s.kview, s.vview
    return full


def append(cache, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cache.update(k, v, layer_idx) for one new position (k [B, heads, 1, D], v [B, heads, 1, Dv]),
    in place when slot() allows it."""
    B, heads, n, D = k.shape
    s = (slot(cache, layer_idx, B, heads, D, k.dtype, v.shape[3])
         if n == 1 and v.dim() == 4 and v.shape[:3] == k.shape[:3] and v.dtype is k.dtype else None)
    if s is None:
        return cache.update(k, v, layer_idx)
    at = s.base + s.t
    s.k[:, :, at:at + 1].copy_(k)
    s.v[:, :, at:at + 1].copy_(v)
    return commit(s)
