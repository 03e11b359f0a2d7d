"""Shared fixtures: one Shakespeare preparation per session, always in a temporary cache."""

from __future__ import annotations

import pytest

from data import PreparedData, prepare


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    cache = tmp_path_factory.mktemp("cache")
    return prepare({"name": "shakespeare", "cache_dir": str(cache)}, verbose=False)
