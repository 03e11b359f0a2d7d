"""The ``text`` dataset: the user's own local UTF-8 text files or globs, one document per file."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

from datasets import Dataset

from data.errors import DataError
from data.holdout import hold_out


def _as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def expand_files(patterns: str | list[str] | None, key: str) -> list[Path]:
    """Resolve paths and globs to existing, non-empty files (sorted, so order is stable)."""
    files: list[Path] = []
    for pattern in _as_list(patterns):
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


def identity(cfg: dict[str, Any]) -> dict[str, Any]:
    """Path, size and mtime of every file: cheap to compute, and changes when a file is edited."""
    stats = {
        split: [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
        for split, files in _file_lists(cfg).items()
    }
    keys = ("val_fraction", "seed", "encoding_errors")
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


def _documents(files: list[Path], key: str, errors: str) -> Dataset:
    fix = (
        "convert it to UTF-8 or set data.encoding_errors=replace to substitute U+FFFD for bad bytes"
    )
    return Dataset.from_dict({"text": [read_utf8(p, key, errors, fix) for p in files]})


def load(cfg: dict[str, Any]) -> dict[str, Dataset]:
    """``val_files`` when given, else a seeded ``val_fraction`` of whole files."""
    files = _file_lists(cfg)
    errors = cfg.get("encoding_errors", "strict")
    train = _documents(files["train"], "data.train_files", errors)
    if files["val"]:
        return {"train": train, "val": _documents(files["val"], "data.val_files", errors)}
    train, val = hold_out(train, float(cfg.get("val_fraction", 0.1)), int(cfg.get("seed", 0)))
    return {"train": train, "val": val}
