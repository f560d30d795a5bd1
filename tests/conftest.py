"""Shared test set-up: no test may write to the user's real packed-expert store."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_store(tmp_path_factory, monkeypatch):
    # tests that need a particular store set HINA_MOE_CACHE_DIR again themselves (later wins)
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path_factory.mktemp("hina-store")))
