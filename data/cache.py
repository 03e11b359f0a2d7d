"""Prepared-data cache: fingerprinted directories, atomic writes, and the validity check.

A directory is complete only when ``meta.json`` exists, names the expected fingerprint, and
every file it records is intact: each token file ``<split>.bin`` has exactly the size and the
sha256 recorded under ``splits.<split>``, and a trained tokenizer file (``tokenizer.json``) the
size and sha256 under ``tokenizer_file``. ``meta.json`` is written last, and every file goes
through a temporary name and an atomic rename (``base.files.atomic_path``), so an interrupted
preparation never leaves something that passes this check; a file damaged afterwards
(truncated, overwritten, a flipped bit) fails it with a message naming the file.
:func:`verify_prepared` is that check, the only one: ``prepare_data()`` runs it whenever it
reuses a directory, and every reader of token files (training, resuming, ``evaluate.py``, each
torchrun rank) gets them from ``prepare_data()``.

Cost. A token file's sha256 is computed while it is written (no extra pass). Verifying checks
all sizes first (free: a truncated file fails without reading anything), then hashes every byte
in one streaming pass (base.files.sha256_file): milliseconds for Shakespeare, tens of seconds
for a 10B-token FineWeb (docs/performance.md, Data preparation). Under torchrun rank 0 verifies
(or rebuilds) first and the other ranks then verify concurrently, so startup waits about twice
that. From ``ANNOUNCE_BYTES`` (1 GB) on, ``prepare_data()`` prints a line before hashing, so the
wait is explained.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from base.files import sha256_file

# Bump when the token file layout or what meta.json must record changes, to invalidate old
# caches. 2: meta.json records each token file's sha256.
FORMAT_VERSION = 2
META = "meta.json"
ANNOUNCE_BYTES = 1_000_000_000  # verifying more than this (over ~1 s) is announced


class InvalidCache(Exception):
    """A prepared directory that must not be used; the one-line message names the file."""


def fingerprint(tokenizer: str, source: dict[str, Any]) -> str:
    """sha256 over everything that determines the token files."""
    blob = json.dumps(
        {"format": FORMAT_VERSION, "tokenizer": tokenizer, "source": source}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def verify_prepared(
    directory: Path, expected_fingerprint: str, announce: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The directory's meta if it is a complete, intact preparation of ``expected_fingerprint``.

    Raises ``FileNotFoundError`` when there is no ``meta.json`` (never prepared here, or
    interrupted before the end) and :class:`InvalidCache` naming the file that fails otherwise.
    ``announce`` gets one line before hashing ``ANNOUNCE_BYTES`` or more.
    """
    path = directory / META
    text = path.read_text()  # FileNotFoundError: never prepared here, or interrupted
    try:
        meta = json.loads(text)
        if meta["fingerprint"] != expected_fingerprint:
            raise InvalidCache(f"{path} is for another fingerprint ({meta['fingerprint']})")
        # (path, size, sha256) of every file meta.json vouches for: token files, tokenizer file
        itemsize = np.dtype(meta["dtype"]).itemsize
        files = [
            (directory / f"{split}.bin", stats["tokens"] * itemsize, str(stats["sha256"]))
            for split, stats in meta["splits"].items()
        ]
        if (entry := meta.get("tokenizer_file")) is not None:
            files.append(
                (directory / Path(entry["name"]).name, entry["bytes"], str(entry["sha256"]))
            )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidCache(f"{path} is unreadable or incomplete ({type(e).__name__}: {e})") from e
    try:
        for file, size, _ in files:
            if (actual := file.stat().st_size) != size:
                raise InvalidCache(
                    f"{file} has {actual:,} bytes but {META} records {size:,} "
                    "(truncated or overwritten)"
                )
        total = sum(size for _, size, _ in files)
        if announce is not None and total >= ANNOUNCE_BYTES:
            announce(
                f"verifying the sha256 of {total / 1e9:.1f} GB of prepared data in {directory} "
                "(every byte is read and hashed, at about 0.7-2 GB/s)"
            )
        for file, _, expected in files:
            if (actual := sha256_file(file)) != expected:
                raise InvalidCache(
                    f"{file} fails its sha256 check (it is corrupt: {actual[:12]}..., "
                    f"{META} records {expected[:12]}...)"
                )
    except OSError as e:  # a recorded file that is missing or unreadable
        raise InvalidCache(f"{e.filename} cannot be read ({e.strerror})") from e
    return meta
