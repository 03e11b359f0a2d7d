"""The ``text`` dataset: the user's own local UTF-8 text files or globs, one document per file.

Without ``val_files``, validation is the last ``val_fraction`` of the text, as in nanoGPT's
``input.txt``: the files are read in order (sorted within each glob) and cut once, at the line
boundary nearest to that fraction of the characters. The cut is made on text, before any
tokenizer sees it, so every tokenizer gets the same split; one file is enough.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data.errors import DataError
from data.holdout import check_fraction

if TYPE_CHECKING:  # imported where used: see data/encode.py
    from datasets import Dataset


def expand_files(patterns: str | list[str] | None, key: str) -> list[Path]:
    """Resolve paths and globs to existing, non-empty files (sorted, so order is stable)."""
    files: list[Path] = []
    for pattern in [patterns] if isinstance(patterns, str) else patterns or []:
        pattern = str(Path(pattern).expanduser())
        is_glob = glob.has_magic(pattern)
        matches = sorted(glob.glob(pattern, recursive=True)) if is_glob else [pattern]
        if not matches:
            raise DataError(f"data.{key}: {pattern!r} matches no files")
        for match in map(Path, matches):
            if not match.is_file():
                raise DataError(f"data.{key}: {str(match)!r} does not exist or is not a file")
            if match.stat().st_size == 0:
                raise DataError(f"data.{key}: {str(match)!r} is empty; remove it from the list")
            files.append(match.resolve())
    return files


def _file_lists(cfg: dict[str, Any]) -> dict[str, list[Path]]:
    train = expand_files(cfg.get("train_files"), "train_files")
    if not train:
        raise DataError("the text dataset needs data.train_files=[path/or/glob, ...]")
    return {"train": train, "val": expand_files(cfg.get("val_files"), "val_files")}


def file_stats(paths: list[Path]) -> list[list]:
    """Path, size and mtime of every file: cheap to compute, and changes when a file is edited."""
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def identity(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every file's path, size and mtime, and how the split is cut."""
    stats = {split: file_stats(files) for split, files in _file_lists(cfg).items()}
    keys = ("val_fraction", "encoding_errors")
    return {"files": stats, **{k: cfg.get(k) for k in keys}}


def read_utf8(
    path: Path, key: str, errors: str = "strict", fix: str = "convert it to UTF-8, e.g. with iconv"
) -> str:
    """The text of the UTF-8 file `path`, given as `key`; a missing file or one that is not
    UTF-8 is a DataError naming both, and `fix` says what to do."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{key} {path.resolve()} does not exist") from None
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise DataError(
            f"{key} {path} is not UTF-8 text (byte {e.start} is not valid UTF-8); {fix}"
        ) from None


def tail_split(texts: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """(train, val) documents: val is the last ``fraction`` of the concatenated characters, cut
    at the nearest line boundary (a file's start or end counts as one). The file the cut falls
    in becomes two documents, its head in train and its tail in val."""
    total = sum(map(len, texts))
    cut = total - round(total * check_fraction(fraction))  # where val would start, exactly
    i, start = 0, 0  # the text the cut falls in, and where it starts
    while cut > start + len(texts[i]):
        start += len(texts[i])
        i += 1
    text, local = texts[i], cut - start
    before = text.rfind("\n", 0, local) + 1  # the line start at or before it (0: none)
    newline = text.find("\n", local)
    after = len(text) if newline < 0 else newline + 1  # the next line start (or the end)
    at = before if local - before <= after - local else after
    train = [t for t in [*texts[:i], text[:at]] if t]
    val = [t for t in [text[at:], *texts[i + 1 :]] if t]
    if not train or not val:
        raise DataError(
            f"cannot hold out the last {fraction:g} of a {total:,}-character text at a line "
            "boundary (one side would be empty); change data.val_fraction, add line breaks or "
            "more text, or pass data.val_files"
        )
    return train, val


def load(cfg: dict[str, Any]) -> dict[str, Dataset]:
    """``val_files`` when given, else the last ``val_fraction`` of the text (see above)."""
    from datasets import Dataset

    files, errors = _file_lists(cfg), cfg.get("encoding_errors", "strict")
    fix = "convert it to UTF-8, or set data.encoding_errors=replace to read bad bytes as U+FFFD"
    train, val = ([read_utf8(p, f"data.{s}_files", errors, fix) for p in files[s]] for s in files)
    if not val:
        train, val = tail_split(train, float(cfg.get("val_fraction", 0.1)))
    return {"train": Dataset.from_dict({"text": train}), "val": Dataset.from_dict({"text": val})}
