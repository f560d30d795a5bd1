"""Cache replacement policies (hi_na_moe.core.cache_policy) against hand-computed traces, naive
implementations written here, and an exhaustive search for the offline optimum."""

from __future__ import annotations

import functools
import itertools
import random

import numpy as np
import pytest

from hi_na_moe.core import cache_policy as cp


def random_trace(seed: int, layers: int = 3, tokens: int = 60, experts: int = 6, k: int = 2, skew: float = 0.6):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(experts, skew), size=layers)
    arr = np.stack([np.stack([rng.choice(experts, k, replace=False, p=probs[l]) for _ in range(tokens)])
                    for l in range(layers)])
    return cp.make_trace(arr)


def naive_lru(steps, capacity):
    """LRU written as plainly as possible: a list of (last use, key), every decision a scan."""
    cache: dict = {}  # key -> tick of last use
    tick = hits = misses = 0
    for step in steps:
        step = list(dict.fromkeys(step))
        missing = [k for k in step if k not in cache]
        hits += len(step) - len(missing)
        misses += len(missing)
        while missing and len(cache) + len(missing) > capacity:
            victim = min((t, k) for k, t in cache.items() if k not in step)[1]
            del cache[victim]
            missing = [k for k in step if k not in cache]
        for k in step:
            tick += 1
            cache[k] = tick
    return hits, misses


def optimum(steps, capacity):
    """The most hits any demand-loading cache can get: every choice of victims tried."""
    steps = [frozenset(s) for s in steps]

    @functools.lru_cache(maxsize=None)
    def best(i, cache):
        if i == len(steps):
            return 0
        s = steps[i]
        hits = len(s & cache)
        need = len(cache) + len(s - cache) - capacity
        if need <= 0:
            return hits + best(i + 1, cache | s)
        options = [c for c in cache if c not in s]
        return hits + max(best(i + 1, (cache - frozenset(out)) | s) for out in itertools.combinations(options, need))

    return best(0, frozenset())


def test_lru_on_a_hand_computed_trace():
    # steps {0,1} {2} {0} {1,3} {2,0}, 3 slots: misses 0,1,2; hit 0; hit 1, miss 3 evicts 2 (1 is
    # in the step); hit 0, miss 2 evicts 1 (the oldest not in the step)
    trace = cp.make_trace([[[0, 1], [2], [0], [1, 3], [2, 0]]])
    lru = cp.LRU(3)
    evicted = [lru.step(s).evicted for s in trace.steps]
    assert (lru.hits, lru.misses) == (3, 5)
    assert evicted == [[], [], [], [(0, 2)], [(0, 1)]]
    assert lru.resident() == {(0, 0), (0, 2), (0, 3)}
    assert naive_lru(trace.steps, 3) == (3, 5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("capacity", [2, 3, 5, 8, 13])
def test_lru_matches_a_naive_lru_and_the_stack_distances(seed, capacity):
    trace = random_trace(seed)
    got = cp.simulate(trace, capacity, "lru")
    assert (got.hits, got.misses) == naive_lru(trace.steps, capacity)
    by_size = cp.lru_hits_by_size(trace)
    assert by_size[capacity] == got.hits


def test_lfu_on_a_hand_computed_trace():
    # 2 slots: 0 m, 0 h, 1 m, 2 m evicts 1 (count 1 < 2), 1 m evicts 2 (1 < 2; 1 now counts 2),
    # 2 m evicts 0 (counts tie at 2, 0 used longer ago), 0 m evicts 1 (tie, 1 used before 2)
    lfu = cp.LFU(2)
    evicted = [lfu.step([k]).evicted for k in [0, 0, 1, 2, 1, 2, 0]]
    assert (lfu.hits, lfu.misses) == (1, 6)
    assert [e for step in evicted for e in step] == [1, 2, 0, 1]
    assert lfu.count(1) == 2 and lfu.count(2) == 2 and lfu.count(0) == 3
    # LRU on the same keys keeps 1 and 2 resident at the end: 3 hits
    lru = cp.LRU(2)
    for k in [0, 0, 1, 2, 1, 2, 0]:
        lru.step([k])
    assert (lru.hits, lru.misses) == (3, 4)


def test_lru2_evicts_a_key_used_once_before_older_twice_used_ones():
    # 2 slots: 0 0 1 1 -> both used twice; 2 evicts 0 (its second-last use is the oldest); 0 then
    # evicts 2 (used once: infinitely old for LRU-2) where LRU would evict 1; so 1 hits
    seq = [0, 0, 1, 1, 2, 0, 1]
    k2, lru = cp.LRUK(2, k=2), cp.LRU(2)
    ev2 = [k2.step([k]).evicted for k in seq]
    ev1 = [lru.step([k]).evicted for k in seq]
    assert [e for s in ev2 for e in s] == [0, 2]
    assert [e for s in ev1 for e in s] == [0, 1, 2]
    assert (k2.hits, lru.hits) == (3, 2)
    assert k2.name == "lru-2"


def test_freq_decay_with_a_tiny_half_life_is_lru_and_counts_decay():
    for seed in range(4):
        trace = random_trace(seed, tokens=80)
        for c in (2, 4, 7):
            assert cp.simulate(trace, c, "freq-decay", half_life=1e-6).hits == cp.simulate(trace, c, "lru").hits
    fd = cp.FreqDecay(4, half_life=10.0)
    fd.step(["a"], time=0)
    fd.step(["a"], time=10)
    # 2^(-20/10) + 2^(-10/10) at time 20
    assert fd.decayed_count("a", 20) == pytest.approx(0.25 + 0.5)
    assert fd.decayed_count("b", 20) == 0.0


def test_freq_decay_prefers_recent_frequency():
    # 2 slots; "a" used 3 times long ago, "b" twice recently; "c" must evict one of them.
    # LFU evicts b (fewer uses); with a half-life of 2 tokens a's uses have faded: a goes
    seq = [("a", 0), ("a", 1), ("a", 2), ("b", 20), ("b", 21), ("c", 22)]
    lfu, fd = cp.LFU(2), cp.FreqDecay(2, half_life=2.0)
    for k, t in seq:
        lfu.step([k], t)
        fd.step([k], t)
    assert lfu.resident() == {"a", "c"}
    assert fd.resident() == {"b", "c"}


@pytest.mark.parametrize("seed", range(8))
def test_belady_is_the_optimum_of_an_exhaustive_search(seed):
    rng = random.Random(seed)
    keys = list(range(5))
    steps = [tuple(rng.sample(keys, rng.choice([1, 2]))) for _ in range(12)]
    for capacity in (2, 3):
        b = cp.Belady(capacity, steps)
        for s in steps:
            b.step(s)
        assert b.hits == optimum(steps, capacity)


@pytest.mark.parametrize("seed", range(10))
def test_belady_is_at_least_every_online_policy(seed):
    trace = random_trace(seed, layers=2 + seed % 3, tokens=120, experts=5 + seed % 4, k=1 + seed % 3)
    lo = cp.min_capacity(trace)
    for capacity in sorted({lo, lo + 1, lo + 3, lo + 7}):
        best = cp.simulate(trace, capacity, "belady").hits
        for name in cp.ONLINE:
            assert cp.simulate(trace, capacity, name).hits <= best, (name, capacity)
        for name in cp.ONLINE:  # per layer too
            per = cp.simulate(trace, capacity * trace.num_layers, name, per_layer=True).hits
            assert per <= cp.simulate(trace, capacity * trace.num_layers, "belady", per_layer=True).hits


def test_a_step_keeps_its_hits_resident():
    # 3 slots hold 0 1 2 (0 the oldest); step {0, 3}: the victim is 1, never 0 which the step uses
    for name in ("lru", "lfu", "lru-2", "freq-decay"):
        p = cp.make_policy(name, 3)
        for k in (0, 1, 2):
            p.step([k])
        r = p.step([0, 3])
        assert r.hits == [0] and r.misses == [3] and r.evicted == [1], name
        assert 0 in p and 3 in p and len(p) == 3


def test_per_layer_split_replays_each_layer_with_its_share():
    trace = random_trace(3, layers=3, tokens=50)
    got = cp.simulate(trace, 10, "lfu", per_layer=True)
    assert got.layer_capacity == [4, 3, 3] == cp.split_capacity(10, 3)
    want = sum(cp.simulate(trace.layer(l), c, "lfu").hits for l, c in enumerate(got.layer_capacity))
    assert got.hits == want and got.accesses == trace.accesses


def test_hit_rate_curve_matches_simulate_and_skips_sizes_below_a_step():
    trace = random_trace(5)
    curve = cp.hit_rate_curve(trace, [1, 2, 4, 9], ["lru", "lfu", "belady"])
    assert curve["lru"][0] is None and curve["belady"][0] is None  # a step uses 2 experts
    for name, row in curve.items():
        for c, r in zip([2, 4, 9], row[1:]):
            assert r.hits == cp.simulate(trace, c, name).hits and r.capacity == c
    assert curve["belady"][2].hit_rate >= curve["lfu"][2].hit_rate


def test_reuse_distances_on_a_hand_computed_trace():
    # one layer, steps {0,1} {2} {0} {1,3} {2,0}; accesses in order 0 1 2 0 1 3 2 0
    trace = cp.make_trace([[[0, 1], [2], [0], [1, 3], [2, 0]]])
    r = cp.reuse_distances(trace)
    # 0 at step 2: since its use at step 0, 1 and 2 were used -> 2; 1 at step 3: 2 and 0 -> 2;
    # 2 at step 4: 0, 1, 3 -> 3; 0 at step 4: 1 and 3 (the step's own 2 does not count) -> 2
    assert r.stack.tolist() == [-1, -1, -1, 2, 2, -1, 3, 2]
    assert r.interval.tolist() == [-1, -1, -1, 2, 3, -1, 3, 2]
    s, i = r.of((0, 0))
    assert s.tolist() == [2, 2] and i.tolist() == [2, 2]
    assert cp.summarize(np.array([1, 2, 3, 10]))["median"] == 2.5


def test_reuse_distances_match_a_naive_count():
    trace = random_trace(11, layers=2, tokens=40)
    r = cp.reuse_distances(trace)
    flat = [(k, si) for si, s in enumerate(trace.steps) for k in s]
    for pos, (k, si) in enumerate(flat):
        prev = max((p for p in range(pos) if flat[p][0] == k), default=None)
        if prev is None:
            assert r.stack[pos] == -1
            continue
        between = {flat[p][0] for p in range(prev + 1, pos) if flat[p][1] < si}
        assert r.stack[pos] == len(between)
        assert r.interval[pos] == trace.times[si] - trace.times[flat[prev][1]]


def test_make_trace_interleaves_layers_and_skips_negative_slots():
    trace = cp.make_trace(np.array([[[0, 1], [1, -1]], [[2, 2], [0, 3]]]))
    assert trace.steps == [((0, 0), (0, 1)), ((1, 2),), ((0, 1),), ((1, 0), (1, 3))]
    assert trace.times == [0, 0, 1, 1] and trace.layers == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="layers, tokens, k"):
        cp.make_trace(np.zeros((2, 3)))


def test_bad_arguments_are_clear_errors():
    trace = random_trace(0)
    with pytest.raises(ValueError, match="2 experts but the cache has 1 slots"):
        cp.simulate(trace, 1, "lru")
    with pytest.raises(ValueError, match="unknown cache policy 'mru'"):
        cp.simulate(trace, 4, "mru")
    with pytest.raises(ValueError, match="capacity must be an integer >= 1"):
        cp.LRU(0)
    with pytest.raises(ValueError, match="half_life"):
        cp.FreqDecay(2, half_life=0)
    b = cp.Belady(2, [[1], [2]])
    with pytest.raises(ValueError, match="another sequence"):
        b.step([2])


def test_stale_heap_entries_stay_bounded():
    # one hot key used at every step would otherwise leave one stale entry a use
    p = cp.LFU(4)
    for t in range(5000):
        p.step([t % 3], t)
    assert len(p._heap) <= p._limit
    assert p.hits == 5000 - 3


@pytest.mark.parametrize("name", ["lfu", "lru-2", "freq-decay"])
def test_dropping_stale_entries_in_a_step_of_new_keys(name):
    # every step two keys never seen before, stale entries dropped at every use (a limit of 3): so
    # also while the step's second key is not yet recorded
    p, plain = cp.make_policy(name, 4), cp.make_policy(name, 4)
    p._limit = 3
    for t in range(50):
        for step in ([t % 2], [100 + 2 * t, 101 + 2 * t]):  # a hot key (stale entries), two new ones
            assert p.step(step, t) == plain.step(step, t)
    assert len(p) == 4 and {198, 199} <= p.resident() == plain.resident()
