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
    """``identity`` says what the documents are made of, cheaply and offline (the prepared-data
    fingerprint is computed from it, so it decides cache hits); ``load`` returns
    ``{"train": ds, "val": ds}`` with one ``text`` column."""

    identity: Callable[[dict[str, Any]], dict[str, Any]]
    load: Callable[[dict[str, Any]], dict[str, Dataset | IterableDataset]]


SOURCES: dict[str, Source] = {
    "shakespeare": Source(shakespeare.identity, shakespeare.load),
    "text": Source(text_files.identity, text_files.load),
    "hub": Source(hub.identity, hub.load),
}


def get_source(cfg: dict[str, Any]) -> Source:
    kind = cfg.get("source", cfg.get("name"))
    if kind not in SOURCES:
        raise DataError(f"unknown data source {kind!r}; known: {', '.join(sorted(SOURCES))}")
    return SOURCES[kind]
