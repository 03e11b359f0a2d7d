"""Shared fixtures: one Shakespeare preparation per session, always in a temporary cache."""

from __future__ import annotations

import os

# Tests never touch the network: set before `datasets` is first imported (it reads them once).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from data import PreparedData, prepare  # noqa: E402


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    cache = tmp_path_factory.mktemp("cache")
    return prepare({"name": "shakespeare", "cache_dir": str(cache)}, verbose=False)
