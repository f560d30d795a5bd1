"""The read-bandwidth probes the benchmarks state achieved GB/s against (no timing asserted:
only that they read, return a rate and refuse what they cannot measure)."""
from __future__ import annotations

import math

import pytest

from hi_na_moe.core.native import native_module

_native, _why = native_module()
pytestmark = pytest.mark.skipif(_native is None, reason=f"native core not built: {_why}")


def test_measure_read_bandwidth_reports_its_passes():
    r = _native.measure_read_bandwidth(8 << 20, 2, 3)
    assert r["bytes"] == 8 << 20 and r["threads"] == 2 and r["passes"] == 3
    assert 0 < r["median_gbs"] <= r["best_gbs"] and math.isfinite(r["best_gbs"])


def test_probe_reads_round_robin_and_refuses_bad_sizes():
    probe = _native.BandwidthProbe(12 << 20, 2)
    assert probe.size == 12 << 20
    rates = [probe.read(4 << 20) for _ in range(5)]  # wraps around the buffer
    assert all(r > 0 and math.isfinite(r) for r in rates)
    with pytest.raises(ValueError, match="a third of the buffer"):
        probe.read(5 << 20)
    with pytest.raises(ValueError, match=">= 1 MiB"):
        probe.read(1 << 10)
    with pytest.raises(ValueError, match="bytes >= 3 MiB"):
        _native.BandwidthProbe(1 << 20, 1)
