"""Source kinds: how a dataset config's ``source`` key turns into documents.

A source is a module with ``identity(cfg) -> dict``, which says what the documents are made
of, cheaply and offline (the prepared-data fingerprint is computed from it, so it decides cache
hits), and ``load(cfg) -> {"train": ds, "val": ds}`` (``datasets.Dataset`` or
``IterableDataset`` with one ``text`` column).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from data import hub, shakespeare, text_files
from data.errors import DataError

SOURCES: dict[str, ModuleType] = {"shakespeare": shakespeare, "text": text_files, "hub": hub}


def get_source(cfg: dict[str, Any]) -> ModuleType:
    kind = cfg.get("source", cfg.get("name"))
    if kind not in SOURCES:
        raise DataError(f"unknown data source {kind!r}; known: {', '.join(sorted(SOURCES))}")
    return SOURCES[kind]
