"""Prepare a dataset once: tokenize, write memory-mapped token files and ``meta.json``; reuse.

Training calls :func:`prepare` itself; ``python -m data.prepare`` runs it alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from data.cache import atomic_path, fingerprint, read_valid_meta, write_meta
from data.config import cache_root, resolve_config
from data.errors import DataError
from data.registry import get_source
from data.tokenize import write_split
from data.tokenizer import get_tokenizer, token_dtype

SPLITS = ("train", "val")


@dataclass
class PreparedData:
    """A complete, validated preparation: token files plus their ``meta.json``."""

    dir: Path
    meta: dict[str, Any]
    tokenizer_name: str
    vocab_size: int

    def tokens(self, split: str) -> np.memmap:
        """The split's tokens as a read-only 1-D memmap (nothing is loaded into memory)."""
        if split not in self.meta["splits"]:
            raise DataError(f"unknown split {split!r}; known: {', '.join(self.meta['splits'])}")
        n = self.meta["splits"][split]["tokens"]
        return np.memmap(self.dir / f"{split}.bin", dtype=self.meta["dtype"], mode="r", shape=(n,))

    def bytes_per_token(self, split: str) -> float:
        """UTF-8 bytes per token, to convert a loss in nats/token into bits per byte."""
        stats = self.meta["splits"][split]
        return stats["bytes"] / stats["tokens"]


def _build(cfg: dict[str, Any], out: Path, fp: str, source_fp: dict, verbose: bool) -> dict:
    tokenizer = cfg.get("tokenizer", "gpt2")
    enc = get_tokenizer(tokenizer)  # fail on a bad tokenizer before loading any data
    docs = get_source(cfg).load(cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # invalidate before replacing any token file
    limits = {"train": cfg.get("max_train_tokens")}
    num_proc = int(cfg.get("num_proc", 1))
    splits = {}
    for split in SPLITS:
        with atomic_path(out / f"{split}.bin") as tmp:
            stats = write_split(docs[split], tmp, tokenizer, num_proc, limits.get(split))
            if stats.tokens == 0:
                raise DataError(
                    f"the {split} split of {cfg['name']!r} has no text (0 documents); "
                    "check the files, text_field or val_fraction"
                )
        splits[split] = {
            "tokens": stats.tokens,
            "bytes": stats.bytes,
            "documents": stats.documents,
            "seconds": round(stats.seconds, 3),
        }
        if verbose:
            print(
                f"{cfg['name']}/{split}: {stats.documents:,} documents, {stats.tokens:,} tokens, "
                f"{stats.bytes / 1e6:.2f} MB in {stats.seconds:.2f}s "
                f"({stats.bytes / 1e6 / stats.seconds:.2f} MB/s, "
                f"{stats.tokens / stats.seconds:,.0f} tokens/s)"
            )
    meta = {
        "dataset": cfg["name"],
        "source": cfg.get("source", cfg["name"]),
        "tokenizer": tokenizer,
        "vocab_size": enc.n_vocab,
        "eot_token": enc.eot_token,
        "dtype": token_dtype(enc.n_vocab).name,
        "fingerprint": fp,
        "splits": splits,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sources": source_fp,
    }
    write_meta(out, meta)
    return meta


def prepare(cfg: Mapping[str, Any] | DictConfig, *, verbose: bool = True) -> PreparedData:
    """Return the prepared dataset named by ``cfg``, building it unless a valid cache exists.

    The cache directory ``<cache_dir>/<name>/<tokenizer>-<fingerprint[:12]>`` changes whenever
    the sources or the tokenizer do, so stale data is never reused.
    """
    cfg = resolve_config(cfg)
    tokenizer = cfg.get("tokenizer", "gpt2")
    source_fp = get_source(cfg).fingerprint(cfg)
    fp = fingerprint(tokenizer, source_fp)
    out = cache_root(cfg) / cfg["name"] / f"{tokenizer}-{fp[:12]}"
    meta = read_valid_meta(out, fp)
    if meta is None:
        meta = _build(cfg, out, fp, source_fp, verbose)
    elif verbose:
        print(f"{cfg['name']}: reusing prepared data in {out}")
    return PreparedData(out, meta, meta["tokenizer"], meta["vocab_size"])
