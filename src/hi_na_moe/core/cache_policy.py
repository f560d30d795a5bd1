"""Replacement policies for a cache of expert slots, and their replay on a routing trace.

A model larger than memory keeps some of its experts resident in a fixed number of slots and
loads the others when a token routes to them. Which expert to drop when a slot is needed is a
cache replacement policy; this module has the candidates, each as a class with one interface
(`CachePolicy`), and replays a recorded routing trace against them to give hit rates.

The access model. A trace is, per MoE layer, a sequence of steps (one per token), each the set
of expert ids the token routes to in that layer; a cache key is `(layer, expert)`. The steps
are replayed in the order a forward pass runs them: token 0 through layers 0..L-1, then token 1,
and so on. A step's experts are all used together, so all of them must be resident while the
step runs: a step's hits are never evicted to make room for its misses, and a cache must have
at least as many slots as the largest step (a smaller one is an error, and `hit_rate_curve`
gives None there). A miss loads the expert into a slot (evicting a victim when all are full);
nothing bypasses the cache. The cache is global (one pool of slots for every layer's experts)
or, with `per_layer=True`, split evenly between the layers (each layer replayed on its own).

The policies:
- `LRU`: evict the least recently used expert.
- `LFU`: evict the least frequently used one, counting every use since the start (counts are
  kept while an expert is out of the cache: "perfect" LFU); ties go to the least recent.
- `LRUK` (K=2 by default, "lru-2"): evict the expert whose K-th most recent use is oldest; one
  used fewer than K times counts as infinitely old (first out), ties by least recent use.
- `FreqDecay`: evict the lowest exponentially decayed use count (each use weighs
  2^(-age / half_life), age in tokens), ties by least recent use.
- `Belady`: MIN, the offline optimum: evict the expert whose next use is farthest in the future
  (or never). It needs the whole trace in advance and is the bound the online ones are judged by.

Victims are chosen from heaps with lazy deletion (O(log n) a step, not a scan of the slots).
`reuse_distances` gives, for every access, the LRU stack distance (how many other experts were
used since this expert's previous use) and the interval in tokens; `lru_hits_by_size` turns the
stack distances into LRU's hit count at every cache size in one pass.
"""

from __future__ import annotations

import heapq
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Collection, Hashable, Iterable, Sequence

import numpy as np

Key = Hashable  # (layer, expert) in traces made here
INF = math.inf


# ---------------------------------------------------------------------------------------------
# Traces
# ---------------------------------------------------------------------------------------------

@dataclass
class Trace:
    """Steps in replay order: `steps[i]` is the tuple of keys (layer, expert) used together at
    step i, `times[i]` its token index and `layers[i]` its layer."""

    steps: list[tuple[Key, ...]]
    times: list[int]
    layers: list[int]
    num_layers: int

    @property
    def accesses(self) -> int:
        return sum(len(s) for s in self.steps)

    @property
    def max_step(self) -> int:
        return max((len(s) for s in self.steps), default=0)

    def keys(self) -> set:
        return {k for s in self.steps for k in s}

    def layer(self, layer: int) -> "Trace":
        """The steps of one layer alone (for a cache of that layer's own)."""
        idx = [i for i, l in enumerate(self.layers) if l == layer]
        return Trace([self.steps[i] for i in idx], [self.times[i] for i in idx], [layer] * len(idx), 1)


def make_trace(per_layer) -> Trace:
    """A Trace from per-layer steps: `per_layer[layer][t]` is an iterable of the expert ids token
    t routes to in that layer (negative ids, i.e. slots that route nowhere, are skipped; a
    repeated id counts once). A numpy array or torch tensor of shape [layers, tokens, k] works
    too. Layers may have different numbers of tokens; step (t, layer) is replayed after every
    step of tokens < t, layers in order within a token."""
    if hasattr(per_layer, "detach"):  # a torch tensor
        per_layer = per_layer.detach().cpu().numpy()
    if isinstance(per_layer, np.ndarray):
        if per_layer.ndim != 3:
            raise ValueError(f"trace array must be [layers, tokens, k], got shape {per_layer.shape}")
        per_layer = [[[int(e) for e in row] for row in layer] for layer in per_layer.tolist()]
    layers = [l.tolist() if hasattr(l, "tolist") else list(l) for l in per_layer]
    steps, times, lay = [], [], []
    n_tok = max((len(l) for l in layers), default=0)
    for t in range(n_tok):
        for li, l in enumerate(layers):
            if t < len(l):
                ids = []
                for e in l[t]:
                    e = int(e)
                    if e >= 0 and e not in ids:
                        ids.append(e)
                steps.append(tuple((li, e) for e in ids))
                times.append(t)
                lay.append(li)
    return Trace(steps, times, lay, len(layers))


# ---------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------

@dataclass
class StepResult:
    hits: list
    misses: list  # loaded into the cache by this step
    evicted: list


class CachePolicy:
    """A cache of `capacity` slots under one replacement policy.

    `step(keys, time)` runs one step: every key of `keys` is resident at its end, hits are
    counted before anything moves, victims are chosen among the keys *not* in the step, then the
    step's keys are used in their order. A subclass says what a use records (`_use`; `_insert`
    for a key that has just been loaded, by default a use too), what an eviction does (`_evict`)
    and which resident key goes next (`victim`). `time` is the step's token index (FreqDecay
    ages by it; the others only need the order of uses); by default the step count."""

    name = "base"

    def __init__(self, capacity: int):
        if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self.capacity = int(capacity)
        self._resident: set = set()
        self._clock = 0  # one tick per use: orders uses, ties included
        self._steps = 0
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def resident(self) -> set:
        return set(self._resident)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def access(self, key: Key, time: float | None = None) -> bool:
        """One key alone as a step; True on a hit."""
        return bool(self.step((key,), time).hits)

    def step(self, keys: Iterable[Key], time: float | None = None) -> StepResult:
        keys = tuple(dict.fromkeys(keys))
        if len(keys) > self.capacity:
            raise ValueError(f"a step uses {len(keys)} experts but the cache has {self.capacity} slots: "
                             "every expert of a step must be resident at once")
        hits = [k for k in keys if k in self._resident]
        misses = [k for k in keys if k not in self._resident]
        evicted = self._step(keys, self._steps if time is None else time)
        return StepResult(hits, misses, evicted)

    def _step(self, keys: tuple, now: float) -> list:
        """step() for distinct keys no more than the slots (the replay's fast path): the evicted keys."""
        resident = self._resident
        missing = [k for k in keys if k not in resident]
        evicted = []
        if missing:
            over = len(resident) + len(missing) - self.capacity
            for _ in range(over):
                v = self.victim(keys)
                resident.discard(v)
                self._evict(v)
                evicted.append(v)
            # victims were chosen before this step's uses are recorded: a use changes only the used
            # key's standing, and no key of the step can be a victim
            self.misses += len(missing)
            self.hits += len(keys) - len(missing)
            use, insert = self._use, self._insert
            for k in keys:
                self._clock += 1
                if k in missing:
                    resident.add(k)
                    insert(k, now)
                else:
                    use(k, now)
        else:
            self.hits += len(keys)
            use = self._use
            for k in keys:
                self._clock += 1
                use(k, now)
        self._steps += 1
        return evicted

    def remove(self, key: Key) -> None:
        """Drop a resident key (the owner evicted it for a reason of its own)."""
        if key in self._resident:
            self._resident.discard(key)
            self._evict(key)

    # -- what a subclass defines
    def _use(self, key: Key, now: float) -> None:
        """A use of a resident key."""

    def _insert(self, key: Key, now: float) -> None:
        """The key has just been loaded (and is used)."""
        self._use(key, now)

    def _evict(self, key: Key) -> None:
        """The key has left the cache."""

    def victim(self, protected: Collection[Key] = ()) -> Key:
        """The resident key the policy would evict next, never one of `protected`."""
        raise NotImplementedError


class _HeapPolicy(CachePolicy):
    """Victim = the resident key of the smallest priority; a key's priority changes only when it
    is used, so each use pushes a fresh entry and stale ones are dropped when they surface."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._heap: list = []  # (priority, sequence number, key): equal priorities never compare keys
        self._seq = 0
        self._prio: dict = {}  # key -> its current priority (the very object in its live entry)
        self._limit = 8 * self.capacity + 64  # heap entries before the stale ones are dropped

    def _push(self, key: Key, p: tuple) -> None:
        self._prio[key] = p
        self._seq += 1
        heapq.heappush(self._heap, (p, self._seq, key))
        if len(self._heap) > self._limit:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries (their number is bounded by _limit)."""
        prio = self._prio
        self._heap = [(prio[k], self._seq + i, k) for i, k in enumerate(self._resident, 1) if k in prio]
        self._seq += len(self._heap)
        heapq.heapify(self._heap)

    def victim(self, protected: Collection[Key] = ()) -> Key:
        heap, prio, resident = self._heap, self._prio, self._resident
        aside = []
        try:
            while heap:
                p, _, k = heap[0]
                if prio.get(k) is not p or k not in resident:
                    heapq.heappop(heap)  # stale
                elif k in protected:
                    aside.append(heapq.heappop(heap))
                else:
                    return k
            raise ValueError("no key can be evicted: every resident key is protected")
        finally:
            for e in aside:
                heapq.heappush(heap, e)


class LRU(CachePolicy):
    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict = OrderedDict()  # oldest first

    def _use(self, key, now):
        self._order.move_to_end(key)

    def _insert(self, key, now):
        self._order[key] = None

    def _evict(self, key):
        self._order.pop(key, None)

    def victim(self, protected=()):
        for k in self._order:  # at most len(protected) keys skipped
            if k not in protected:
                return k
        raise ValueError("no key can be evicted: every resident key is protected")


class LFU(_HeapPolicy):
    name = "lfu"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._count: dict = {}

    def _use(self, key, now):
        c = self._count[key] = self._count.get(key, 0) + 1
        p = self._prio[key] = (c, self._clock)
        self._seq += 1
        heapq.heappush(self._heap, (p, self._seq, key))
        if len(self._heap) > self._limit:
            self._compact()

    _insert = _use

    def count(self, key: Key) -> int:
        return self._count.get(key, 0)


class LRUK(_HeapPolicy):
    name = "lru-2"

    def __init__(self, capacity: int, k: int = 2):
        super().__init__(capacity)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"LRU-K needs an integer k >= 1, got {k!r}")
        self.k = k
        self.name = f"lru-{k}"
        self._hist: dict = {}  # key -> its last k use ticks, oldest first

    def _use(self, key, now):
        h = self._hist.get(key)
        if h is None:
            h = self._hist[key] = []
        h.append(self._clock)
        if len(h) > self.k:
            del h[0]
        self._push(key, (h[0] if len(h) == self.k else -1, h[-1]))

    _insert = _use


class FreqDecay(_HeapPolicy):
    """Each use adds 2^(t / half_life) to a key's score (t: the step's time, in tokens when
    replayed from a trace); ordering scores so is ordering the decayed counts
    sum 2^(-(now - t) / half_life) at any common `now`. Kept as log2 of the sum: no overflow."""

    name = "freq-decay"

    def __init__(self, capacity: int, half_life: float = 32.0):
        super().__init__(capacity)
        if not (isinstance(half_life, (int, float)) and half_life > 0):
            raise ValueError(f"half_life must be a number > 0, got {half_life!r}")
        self.half_life = float(half_life)
        self._score: dict = {}

    def _use(self, key, now):
        x = now / self.half_life
        s = self._score.get(key)
        if s is not None:
            x = s + math.log2(1.0 + 2.0 ** (x - s)) if s >= x else x + math.log2(1.0 + 2.0 ** (s - x))
        self._score[key] = x
        self._push(key, (x, self._clock))

    _insert = _use

    def decayed_count(self, key: Key, now: float) -> float:
        """The key's uses weighed by 2^(-age / half_life) at time `now`."""
        s = self._score.get(key)
        return 0.0 if s is None else 2.0 ** (s - now / self.half_life)


class Belady(_HeapPolicy):
    """MIN: evict the key used next farthest in the future. Built with the whole sequence of
    steps it will be given (`future`), which `step` must then follow in order."""

    name = "belady"

    def __init__(self, capacity: int, future: Sequence[Iterable[Key]]):
        super().__init__(capacity)
        self._future = [tuple(dict.fromkeys(s)) for s in future]
        self._next_use: list[dict] = [{}] * len(self._future)
        last: dict = {}
        for i in range(len(self._future) - 1, -1, -1):
            self._next_use[i] = {k: last.get(k, INF) for k in self._future[i]}
            for k in self._future[i]:
                last[k] = i

    def step(self, keys, time=None):
        i = self._steps
        if i >= len(self._future) or set(keys) != set(self._future[i]):
            raise ValueError(f"Belady was built for another sequence: step {i} is not the one given at construction")
        return super().step(keys, time)

    def next_use(self, key: Key) -> float:
        """The step index of the key's next use after the steps run so far (inf: never)."""
        for i in range(self._steps, len(self._future)):
            if key in self._next_use[i]:
                return i
        return INF

    def _use(self, key, now):
        self._push(key, (-self._next_use[self._steps][key],))  # the farthest next use is the smallest

    _insert = _use


POLICIES: dict[str, Callable[..., CachePolicy]] = {
    "lru": LRU, "lfu": LFU, "lru-2": LRUK, "freq-decay": FreqDecay, "belady": Belady,
}
ONLINE = ("lru", "lfu", "lru-2", "freq-decay")


def make_policy(name: str, capacity: int, trace: Trace | None = None, **options) -> CachePolicy:
    """A policy by name (POLICIES); Belady needs the trace it will replay."""
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; known: {', '.join(POLICIES)}")
    if name == "belady":
        if trace is None:
            raise ValueError("the belady policy needs the trace (it reads the future)")
        return Belady(capacity, trace.steps)
    return POLICIES[name](capacity, **options)


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------

@dataclass
class SimResult:
    policy: str
    capacity: int  # slots in all (per_layer: their sum)
    hits: int
    misses: int
    per_layer: bool = False
    layer_capacity: list[int] | None = None  # per_layer: each layer's slots

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def to_dict(self) -> dict:
        return {"policy": self.policy, "capacity": self.capacity, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hit_rate, "per_layer": self.per_layer, "layer_capacity": self.layer_capacity}


def _replay(trace: Trace, policy: CachePolicy) -> tuple[int, int]:
    if trace.max_step > policy.capacity:
        raise ValueError(f"a step of the trace uses {trace.max_step} experts but the cache has {policy.capacity} "
                         "slots: every expert of a step must be resident at once")
    step = policy._step  # the trace's steps are distinct keys already
    for keys, t in zip(trace.steps, trace.times):
        step(keys, t)
    return policy.hits, policy.misses


def split_capacity(capacity: int, layers: int) -> list[int]:
    """`capacity` slots split evenly between `layers` layers (the first layers take the remainder)."""
    base, extra = divmod(capacity, layers)
    return [base + (i < extra) for i in range(layers)]


def simulate(trace: Trace, capacity: int, policy: str = "lru", per_layer: bool = False, **options) -> SimResult:
    """Replay `trace` against a cache of `capacity` slots (with per_layer: split evenly between
    the layers, each replayed on its own) under the named policy."""
    if per_layer:
        caps = split_capacity(capacity, trace.num_layers)
        hits = misses = 0
        for layer, cap in enumerate(caps):
            sub = trace.layer(layer)
            if not sub.steps:
                continue
            h, m = _replay(sub, make_policy(policy, cap, sub, **options))
            hits, misses = hits + h, misses + m
        return SimResult(policy, capacity, hits, misses, True, caps)
    h, m = _replay(trace, make_policy(policy, capacity, trace, **options))
    return SimResult(policy, capacity, h, m)


def min_capacity(trace: Trace, per_layer: bool = False) -> int:
    """The fewest slots that can run the trace: its largest step (per_layer: on every layer)."""
    if per_layer:
        return trace.num_layers * trace.max_step
    return trace.max_step


def hit_rate_curve(trace: Trace, sizes: Iterable[int], policies: Iterable[str] = tuple(POLICIES),
                   per_layer: bool = False, options: dict | None = None,
                   progress: Callable[[str, int], None] | None = None) -> dict[str, list[SimResult | None]]:
    """Per policy, the SimResult at every size (None where the cache cannot hold a step).
    `options`: per policy name, keyword arguments for its class (e.g. {"freq-decay":
    {"half_life": 64}}). LRU without per_layer comes from the stack distances in one pass
    (the same counts as replaying LRU; tests/test_cache_policy.py checks it)."""
    sizes = list(sizes)
    options = options or {}
    lo = min_capacity(trace, per_layer)
    out: dict[str, list[SimResult | None]] = {}
    for name in policies:
        if name not in POLICIES:
            raise ValueError(f"unknown cache policy {name!r}; known: {', '.join(POLICIES)}")
        if name == "lru" and not per_layer and not options.get(name):
            by_size = lru_hits_by_size(trace)
            n = trace.accesses
            out[name] = [SimResult("lru", c, int(by_size[min(c, len(by_size) - 1)]), n - int(by_size[min(c, len(by_size) - 1)]))
                         if c >= lo else None for c in sizes]
            if progress:
                for c in sizes:
                    progress(name, c)
            continue
        row = []
        for c in sizes:
            row.append(simulate(trace, c, name, per_layer, **options.get(name, {})) if c >= lo else None)
            if progress:
                progress(name, c)
        out[name] = row
    return out


# ---------------------------------------------------------------------------------------------
# Replay on the native tier
# ---------------------------------------------------------------------------------------------

def replay_hits(trace: Trace, policy: CachePolicy, times: Sequence[float] | None = None) -> list[tuple[bool, ...]]:
    """Per step of `trace`, per key in the step's order: whether it was a hit, replaying the steps
    through `policy` at `times` (by default the trace's token indices)."""
    times = trace.times if times is None else times
    if len(times) != len(trace.steps):
        raise ValueError(f"replay_hits: {len(times)} times for {len(trace.steps)} steps")
    out = []
    for keys, t in zip(trace.steps, times):
        hit = set(policy.step(keys, t).hits)
        out.append(tuple(k in hit for k in keys))
    return out


def tier_clock(trace: Trace, half_life_tokens: float) -> tuple[list[int], float]:
    """The native tier's freq-decay clock for `trace`: its steps' times counted in acquires (1, 2,
    ...: the tier ticks once an acquire, i.e. once a layer a token) and the half-life in those
    units (core/tier.py gives the tier half_life_tokens x layers). Replaying the simulator at these
    times gives the tier's decisions exactly; at the token times, a use in a later layer of the same
    token is no more recent than one in the first (tests/test_tier_policy_replay.py measures what
    that changes)."""
    return list(range(1, len(trace.steps) + 1)), half_life_tokens * max(1, trace.num_layers)


def replay_on_tier(native, trace: Trace, capacity: int, policy: str, half_life_tokens: float, workdir,
                   num_experts: int | None = None) -> list[tuple[bool, ...]]:
    """Replay `trace` on the native ExpertTier's slot pool (`native`: hi_na_moe._native) with
    `capacity` slots: one layer of `num_experts` tiny experts (64-byte panels, random bytes, their
    CRCs recorded) a trace layer, in one file written under `workdir`; prediction off, one I/O
    thread; each step is one acquire..release of its experts in the step's order (ExpertTier.warm
    of one layer). Returns, like replay_hits, per step and key whether the expert was resident
    before the step."""
    E = num_experts if num_experts is not None else 1 + max((k[1] for k in trace.keys()), default=0)
    if trace.max_step > capacity:
        raise ValueError(f"a step of the trace uses {trace.max_step} experts but the tier has {capacity} slots")
    L, gu = max(1, trace.num_layers), 64
    data = np.random.default_rng(0).integers(0, 256, size=L * E * 2 * gu, dtype=np.uint8)
    path = os.path.join(os.fspath(workdir), f"tier-replay-{L}x{E}.bin")
    data.tofile(path)
    tier = native.ExpertTier(int(native.tier_slot_bytes(gu, gu)), int(capacity), io_threads=1, direct_io=False,
                             policy=policy, half_life=tier_clock(trace, half_life_tokens)[1], prediction_window=0)
    for layer in range(L):
        base = layer * E * 2 * gu
        crc = [int(native.crc32c(data[base + i * gu:base + (i + 1) * gu])) for i in range(2 * E)]
        tier.add_layer(path, E, base, gu, base + E * gu, gu, crc[:E], crc[E:])
    out = []
    for keys, layer in zip(trace.steps, trace.layers):
        ids = [e for _, e in keys]
        resident = set(tier.resident(layer))
        out.append(tuple(e in resident for e in ids))
        tier.warm([layer] * len(ids), ids)
    return out


# ---------------------------------------------------------------------------------------------
# Reuse distance
# ---------------------------------------------------------------------------------------------

@dataclass
class Reuse:
    """Per access of the trace, in replay order (steps' keys in their order): its key, the LRU
    stack distance (distinct other keys used since the key's previous use, counted up to the end
    of the previous step; -1 at a first use) and the interval in tokens since that use (-1)."""

    keys: list
    stack: np.ndarray
    interval: np.ndarray
    key_index: dict = field(default_factory=dict)  # key -> positions in keys/stack/interval

    def of(self, key: Key) -> tuple[np.ndarray, np.ndarray]:
        """The key's reuses: (stack distances, intervals), first use left out."""
        pos = np.asarray(self.key_index.get(key, []), dtype=np.int64)
        s, i = self.stack[pos], self.interval[pos]
        keep = s >= 0
        return s[keep], i[keep]


def reuse_distances(trace: Trace) -> Reuse:
    """Stack distances and intervals of every access (see Reuse).

    With step sets: a key is resident in an LRU cache of C slots (C at least the largest step) at
    the start of a step exactly when fewer than C other keys were used after its previous use up
    to the end of the previous step (LRU keeps the C most recent keys, and a step's keys are used
    after every earlier key, in the step's order). So LRU's hits at C are the accesses of stack
    distance < C; `lru_hits_by_size` counts them."""
    ids: dict = {}
    keys: list = []
    kid, start, when = [], [], []
    for st, t in zip(trace.steps, trace.times):
        first = len(keys)
        for k in st:
            i = ids.get(k)
            if i is None:
                i = ids[k] = len(ids)
            keys.append(k)
            kid.append(i)
            start.append(first)
            when.append(t)
    n = len(keys)
    kid_a = np.asarray(kid, dtype=np.int64)
    start_a = np.asarray(start, dtype=np.int64)
    when_a = np.asarray(when, dtype=np.int64)
    pos = np.arange(n, dtype=np.int64)
    order = np.lexsort((pos, kid_a))  # by key, then position
    prev = np.full(n, -1, dtype=np.int64)
    same = kid_a[order][1:] == kid_a[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    seen = prev >= 0
    p, r = prev[seen], start_a[seen]
    # key y was used in (p, r) iff its first use after p comes before r; one vectorised pass per
    # key (n x keys work, in numpy)
    d = np.zeros(p.size, dtype=np.int64)
    for y in range(len(ids)):
        occ = order[kid_a[order] == y]
        j = np.searchsorted(occ, p, side="right")
        nxt = np.append(occ, n)[j]
        d += nxt < r
    stack = np.full(n, -1, dtype=np.int64)
    interval = np.full(n, -1, dtype=np.int64)
    stack[seen] = d
    interval[seen] = when_a[seen] - when_a[p]
    key_index: dict = {k: [] for k in ids}
    for i, k in enumerate(keys):
        key_index[k].append(i)
    return Reuse(keys, stack, interval, key_index)


def lru_hits_by_size(trace: Trace, reuse: Reuse | None = None) -> np.ndarray:
    """hits[c] = LRU's hits with a global cache of c slots, for c = 0 .. (distinct keys); valid
    for c >= the largest step (a smaller cache cannot run the trace)."""
    r = reuse_distances(trace) if reuse is None else reuse
    n_keys = len(r.key_index)
    d = r.stack[r.stack >= 0]
    hist = np.bincount(d, minlength=n_keys + 1)
    # a reuse of stack distance d hits when d < c
    return np.concatenate([[0], np.cumsum(hist)])[: n_keys + 2]


def summarize(values: np.ndarray) -> dict:
    """count, mean, median, p90, max of a 1-D array (None when empty)."""
    v = np.asarray(values)
    if v.size == 0:
        return {"count": 0, "mean": None, "median": None, "p90": None, "max": None}
    return {"count": int(v.size), "mean": float(v.mean()), "median": float(np.median(v)),
            "p90": float(np.percentile(v, 90)), "max": int(v.max())}
