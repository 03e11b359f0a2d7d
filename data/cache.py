"""Prepared-data cache: fingerprinted directories, atomic writes, and the validity check.

A directory is complete only when ``meta.json`` exists, names the expected fingerprint, every
token file has exactly the size it records, and a trained tokenizer file (``tokenizer.json``)
has the size and sha256 it records. ``meta.json`` is written last, and every file goes through
a temporary name and an atomic rename, so an interrupted preparation never leaves something
that passes this check.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1  # bump when the token file layout changes, to invalidate old caches
META = "meta.json"
HASH_CHUNK = 1 << 20  # bytes per read when hashing; 1 MiB measured fastest (0.25-8 MiB tried)


def fingerprint(tokenizer: str, source: dict[str, Any]) -> str:
    """sha256 over everything that determines the token files."""
    blob = json.dumps(
        {"format": FORMAT_VERSION, "tokenizer": tokenizer, "source": source}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def sha256_file(path: Path) -> str:
    """The file's sha256, streamed in ``HASH_CHUNK`` reads (never the whole file in memory)."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """How meta.json records a small side file (a trained tokenizer): name, size and sha256."""
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def read_valid_meta(directory: Path, expected_fingerprint: str) -> dict[str, Any] | None:
    """The directory's meta if it is a complete preparation of ``expected_fingerprint``."""
    try:
        meta = json.loads((directory / META).read_text())
        if meta["fingerprint"] != expected_fingerprint:
            return None
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split, stats in meta["splits"].items():
            if (directory / f"{split}.bin").stat().st_size != stats["tokens"] * itemsize:
                return None
        if (entry := meta.get("tokenizer_file")) is not None:
            file = directory / Path(entry["name"]).name
            if file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; rename it to ``path`` only if the block succeeds.

    The temporary name includes the pid so concurrent preparations (e.g. several ranks) never
    write the same file.
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    with atomic_path(directory / META) as tmp, open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
