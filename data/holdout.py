"""Fixed, seeded hold-out of whole documents for sources without their own validation split."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from data.errors import DataError

if TYPE_CHECKING:  # imported where used: see data/encode.py
    from datasets import Dataset, IterableDataset


def check_fraction(fraction: float) -> float:
    if not 0 < fraction < 1:
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {fraction}")
    return fraction


def hold_out(
    ds: Dataset | IterableDataset, fraction: float, seed: int
) -> tuple[Dataset | IterableDataset, Dataset | IterableDataset]:
    """Split documents into (train, val); the same seed always holds out the same documents.

    A finite dataset gets datasets' exact seeded split (at least one validation document; it
    refuses a split that would leave either side empty); a stream has no length, so each
    document is assigned by a seeded hash of its position.
    """
    from datasets import Dataset

    check_fraction(fraction)
    if isinstance(ds, Dataset):
        parts = ds.train_test_split(test_size=fraction, seed=seed)
        return parts["train"], parts["test"]

    def in_val(_: dict, index: int) -> bool:
        digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") < fraction * 2**64

    train = ds.filter(lambda row, i: not in_val(row, i), with_indices=True)
    return train, ds.filter(in_val, with_indices=True)
