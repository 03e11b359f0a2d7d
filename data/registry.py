"""Source kinds: how a dataset config's ``source`` key turns into documents."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from datasets import Dataset, IterableDataset

from data import hub, shakespeare, text_files
from data.errors import DataError


@dataclass(frozen=True)
class Source:
    """``fingerprint`` must be cheap and offline (it decides cache hits); ``load`` returns
    ``{"train": ds, "val": ds}`` with one ``text`` column."""

    fingerprint: Callable[[dict[str, Any]], dict[str, Any]]
    load: Callable[[dict[str, Any]], dict[str, Dataset | IterableDataset]]


SOURCES: dict[str, Source] = {
    "shakespeare": Source(shakespeare.fingerprint, shakespeare.load),
    "text": Source(text_files.fingerprint, text_files.load),
    "hub": Source(hub.fingerprint, hub.load),
}


def get_source(cfg: dict[str, Any]) -> Source:
    kind = cfg.get("source", cfg.get("name"))
    if kind not in SOURCES:
        raise DataError(f"unknown data source {kind!r}; known: {', '.join(sorted(SOURCES))}")
    return SOURCES[kind]
