"""Hugging Face hub datasets (and local parquet/json/csv files) through ``datasets.load_dataset``.

Every hub dataset is just a config: ``path``, ``subset``, ``text_field``, ``streaming``,
``train_split`` and either ``val_split`` or a seeded ``val_fraction`` hold-out. With
``path: parquet`` (or json, csv) and ``data_files``, the same code reads local files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from data.errors import DataError
from data.holdout import hold_out
from data.text_files import expand_files, file_stats

if TYPE_CHECKING:  # imported where used: see data/encode.py
    import datasets

_CONTENT_KEYS = (
    "path", "subset", "text_field", "train_split", "val_split", "val_fraction", "seed",
    "max_documents", "data_files",
)  # fmt: skip


def identity(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config identifies a hub dataset; local ``data_files`` also contribute size and mtime."""
    data_files = cfg.get("data_files") or []
    patterns = data_files.values() if isinstance(data_files, dict) else [data_files]
    local = [p for v in patterns for p in expand_files(v, "data_files")]
    return {**{k: cfg.get(k) for k in _CONTENT_KEYS}, "local_files": file_stats(local)}


def load_dataset(
    path: str, subset: str | None, split: str, **kwargs: Any
) -> datasets.Dataset | datasets.IterableDataset:
    """`datasets.load_dataset`, with any failure (offline, unknown repo or split, unreadable
    file: many exception types) as one DataError line."""
    import datasets

    try:
        return datasets.load_dataset(path, subset, split=split, **kwargs)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise DataError(
            f"could not load {path!r} (subset={subset}, split={split}): "
            f"{type(e).__name__}: {first_line}; check the name and network access"
        ) from e


def load_split(cfg: dict[str, Any], split: str) -> datasets.Dataset | datasets.IterableDataset:
    """One split with a single ``text`` column, capped at ``max_documents`` if set."""
    import datasets

    ds = load_dataset(
        cfg["path"],
        cfg.get("subset"),
        split,
        streaming=bool(cfg.get("streaming", False)),
        data_files=cfg.get("data_files"),
    )
    field = cfg.get("text_field", "text")
    if ds.column_names is not None and field not in ds.column_names:
        raise DataError(
            f"{cfg['path']!r} has no column {field!r} (columns: {', '.join(ds.column_names)}); "
            "set data.text_field"
        )
    ds = ds.select_columns([field])
    if field != "text":
        ds = ds.rename_column(field, "text")
    if (limit := cfg.get("max_documents")) is not None:
        ds = ds.take(limit if isinstance(ds, datasets.IterableDataset) else min(limit, len(ds)))
    return ds


def load(cfg: dict[str, Any]) -> dict[str, datasets.Dataset | datasets.IterableDataset]:
    """The dataset's own validation split, or a fixed seeded hold-out of the training split."""
    if "path" not in cfg:
        raise DataError(f"dataset {cfg.get('name')!r} uses source=hub but sets no data.path")
    train = load_split(cfg, cfg.get("train_split", "train"))
    if cfg.get("val_split"):
        return {"train": train, "val": load_split(cfg, cfg["val_split"])}
    train, val = hold_out(train, float(cfg.get("val_fraction", 0.005)), int(cfg.get("seed", 0)))
    return {"train": train, "val": val}
