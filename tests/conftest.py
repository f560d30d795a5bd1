"""Shared test set-up.

- No test may write to the user's real packed-expert store.
- Every tier's native attention kernel is tested on every CPU. attention.kernel_tiers() is a speed
  table by vendor: on Intel CPUs the generic tier leaves decode attention to PyTorch's SDPA (and
  with it the stack's one call), which would leave the generic kernels and the one call at that tier
  untested there. Tests see AMD's table (a kernel at every tier) unless marked `vendor_tables`:
  those test the tables themselves, and what the CPU's own table makes of a tier.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HINA_CHECK_RAW", "1")  # raw bindings check their ranges (csrc/binding/raw.cpp)


def pytest_configure(config):
    config.addinivalue_line("markers", "vendor_tables: the test sees attention.kernel_tiers() of this CPU's vendor")
    config.addinivalue_line("markers", "ray_cluster: starts a two-node Ray cluster here (tests/test_serve_ray.py)")


@pytest.fixture(autouse=True)
def _private_store(tmp_path_factory, monkeypatch):
    # tests that need a particular store set HINA_MOE_CACHE_DIR again themselves (later wins)
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path_factory.mktemp("hina-store")))


@pytest.fixture(autouse=True)
def _attention_kernel_at_every_tier(request, monkeypatch):
    if request.node.get_closest_marker("vendor_tables"):
        return
    from hi_na_moe.fastpath import attention

    monkeypatch.setattr(attention, "kernel_tiers", lambda: attention.AMD_TIERS)
