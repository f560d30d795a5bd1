"""The native memory tier's eviction policies against the simulator they were chosen with
(core/cache_policy.py): the recorded routing of both trained models (benchmarks/results/
expert-cache/trace-*.npz) replayed through the tier's slot pool and through the simulator must hit
and miss on the same accesses, for every policy, at two pool sizes and two freq-decay half-lives.

The tier's freq-decay ages by acquires (one a layer a token), the simulator by the time it is given:
replayed at the tier's clock (cache_policy.tier_clock) the two must agree access by access. Before
b351109 they did not: the tier forgot an expert's uses when it evicted it (LFU, LRU-2 and
freq-decay then saw a returning expert as new) and broke ties by slot index. The token clock's own
effect is measured here too, and is small (benchmarks/log/memory-tier.md, 2026-12-07)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hi_na_moe.core import cache_policy as cp
from hi_na_moe.core.native import native_module

TRACES = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "expert-cache"
TOKENS = 300  # of the recorded 8192: 1200 steps, a few hundred evictions at the larger pool
HALF_LIVES = (32.0, 4.0)  # tokens: the study's (and core/tier.py's) and a short one


def _native():
    native, why = native_module()
    if native is None:
        pytest.skip(f"native core not built: {why}")
    return native


def _trace(name: str) -> tuple[cp.Trace, int]:
    z = np.load(TRACES / f"trace-{name}-8192.npz")
    return cp.make_trace(z["top_k_index"].astype(np.int64)[:, :TOKENS]), int(z["num_experts"])


def _first_difference(trace: cp.Trace, a, b) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next(j for j in range(len(x)) if x[j] != y[j])
            layer, e = trace.steps[i][j]
            return (f"first at token {trace.times[i]}, layer {layer}, expert {e}: tier "
                    f"{'hit' if x[j] else 'miss'}, simulator {'hit' if y[j] else 'miss'}")
    return "none"


def _compare(trace, tier_hits, sim_hits, what):
    flat_t, flat_s = np.concatenate(tier_hits), np.concatenate(sim_hits)
    assert flat_t.size == flat_s.size == trace.accesses
    differ = int((flat_t != flat_s).sum())
    assert differ == 0, (f"{what}: {differ} of {flat_t.size} accesses differ (tier {flat_t.mean():.4f} hit rate, "
                         f"simulator {flat_s.mean():.4f}); {_first_difference(trace, tier_hits, sim_hits)}")
    return flat_t.mean()


@pytest.mark.parametrize("name,fractions", [("hina-moe-e64", (0.1, 0.3)), ("hina-tiny-moe", (0.25, 0.5))])
def test_tier_and_simulator_hit_the_same_accesses(name, fractions, tmp_path):
    native = _native()
    trace, E = _trace(name)
    for f in fractions:
        cap = max(trace.max_step, round(f * trace.num_layers * E))
        for policy in cp.ONLINE:
            for hl in HALF_LIVES if policy == "freq-decay" else HALF_LIVES[:1]:
                tier = cp.replay_on_tier(native, trace, cap, policy, hl, tmp_path, E)
                times, hl_acquires = cp.tier_clock(trace, hl)
                opts = {"half_life": hl_acquires} if policy == "freq-decay" else {}
                sim = cp.replay_hits(trace, cp.make_policy(policy, cap, **opts), times)
                rate = _compare(trace, tier, sim, f"{name}, {cap} slots, {policy}"
                                + (f" half-life {hl:g} tokens" if policy == "freq-decay" else ""))
                assert 0 < rate < 1  # evictions happened, so the policy decided something


def test_the_comparison_sees_a_different_policy(tmp_path):
    # the check above is not vacuous: a tier and a simulator that differ in one parameter (the
    # half-life) or in the policy disagree on many accesses
    native = _native()
    trace, E = _trace("hina-moe-e64")
    cap = round(0.3 * trace.num_layers * E)
    tier = cp.replay_on_tier(native, trace, cap, "freq-decay", 32.0, tmp_path, E)
    times, _ = cp.tier_clock(trace, 32.0)
    for other in (cp.FreqDecay(cap, half_life=4.0 * trace.num_layers), cp.LFU(cap)):
        with pytest.raises(AssertionError, match="accesses differ"):
            _compare(trace, tier, cp.replay_hits(trace, other, times), "perturbed")


def test_the_token_clock_changes_little(tmp_path):
    # The simulator's study aged uses by tokens, the tier by acquires: a later layer's use of the
    # same token counts as slightly more recent. That flips some near-ties and moves the hit
    # rate by well under a point on this trace (the totals on the whole traces:
    # benchmarks/log/memory-tier.md, 2026-12-07).
    native = _native()
    trace, E = _trace("hina-moe-e64")
    cap = round(0.3 * trace.num_layers * E)
    tier = np.concatenate(cp.replay_on_tier(native, trace, cap, "freq-decay", 32.0, tmp_path, E))
    tokens = np.concatenate(cp.replay_hits(trace, cp.FreqDecay(cap, half_life=32.0)))
    assert abs(tier.mean() - tokens.mean()) < 0.005
