"""Prepare a dataset once: tokenize, write memory-mapped token files and ``meta.json``; reuse.

Training calls :func:`prepare` itself; ``python -m data.prepare`` runs it alone.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken
from omegaconf import DictConfig

from base.files import atomic_path, sha256_file, write_atomic
from data.bpe import train_bpe
from data.cache import META, InvalidCache, fingerprint, verify_prepared
from data.config import cache_root, resolve_config
from data.encode import MAP_BATCH_SIZE, write_split
from data.errors import DataError
from data.registry import get_source
from data.tokenizer import (
    TOKENIZER_FILE,
    cache_key,
    get_tokenizer,
    load_tokenizer,
    parse_tokenizer,
    token_dtype,
)


@dataclass
class PreparedData:
    """A complete, validated preparation: token files plus their ``meta.json``."""

    dir: Path
    meta: dict[str, Any]
    tokenizer_name: str
    vocab_size: int

    def tokens(self, split: str) -> np.memmap:
        """The split's tokens as a read-only 1-D memmap (nothing is loaded into memory)."""
        n = self.meta["splits"][split]["tokens"]
        return np.memmap(self.dir / f"{split}.bin", dtype=self.meta["dtype"], mode="r", shape=(n,))

    @property
    def tokenizer_file(self) -> Path | None:
        """A trained tokenizer's file (``bpe-<N>``), which checkpoints copy; None otherwise."""
        entry = self.meta.get("tokenizer_file")
        return self.dir / Path(entry["name"]).name if entry else None

    def tokenizer(self) -> tiktoken.Encoding:
        """The tokenizer the token files were written with."""
        return load_tokenizer(self.tokenizer_name, self.dir)

    def bytes_per_token(self, split: str) -> float:
        """UTF-8 bytes per token, to convert a loss in nats/token into bits per byte."""
        return self.meta["splits"][split]["bytes"] / self.meta["splits"][split]["tokens"]


def _build(cfg: dict[str, Any], out: Path, fp: str, source_fp: dict, verbose: bool) -> dict:
    tokenizer = cfg["tokenizer"]
    if (vocab_size := parse_tokenizer(tokenizer)) is None:
        get_tokenizer(tokenizer)  # fail on a bad tokenizer (download) before loading any data
    docs = get_source(cfg).load(cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / META).unlink(missing_ok=True)  # invalidate before replacing any token file
    trained: dict[str, Any] = {}
    if vocab_size:  # trained on the train split alone
        texts = (t for b in docs["train"].iter(batch_size=MAP_BATCH_SIZE) for t in b["text"])
        bpe, stats = train_bpe(texts, vocab_size)
        path = out / TOKENIZER_FILE
        write_atomic(path, bpe.to_json())
        if verbose:
            print(
                f"{cfg['name']}: trained {bpe.name} on the train split ({stats.bytes / 1e6:.2f} "
                f"MB, {stats.unique_chunks:,} distinct chunks of {stats.chunks:,}) in "
                f"{stats.seconds:.2f}s"
            )
        file = {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
        trained = {
            "tokenizer_file": file,
            "tokenizer_training": {**asdict(stats), "seconds": round(stats.seconds, 3)},
        }
    enc = load_tokenizer(tokenizer, out)
    splits = {}
    for split in ("train", "val"):
        with atomic_path(out / f"{split}.bin") as tmp:
            max_tokens = cfg.get("max_train_tokens") if split == "train" else None
            stats = write_split(
                docs[split], tmp, tokenizer, out, int(cfg.get("num_proc", 1)), max_tokens
            )
            if stats["tokens"] == 0:
                raise DataError(
                    f"the {split} split of {cfg['name']!r} has no text (0 documents); "
                    "check the files, text_field or val_fraction"
                )
        if verbose:
            mb, seconds = stats["bytes"] / 1e6, stats["seconds"]
            print(
                f"{cfg['name']}/{split}: {stats['documents']:,} documents, "
                f"{stats['tokens']:,} tokens, {mb:.2f} MB in {seconds:.2f}s "
                f"({mb / seconds:.2f} MB/s, {stats['tokens'] / seconds:,.0f} tokens/s)"
            )
        splits[split] = {**stats, "seconds": round(stats["seconds"], 3)}
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
        **trained,
    }
    write_atomic(out / META, json.dumps(meta, indent=2))
    return meta


def prepare_data(cfg: Mapping[str, Any] | DictConfig, *, verbose: bool = True) -> PreparedData:
    """Return the prepared dataset named by ``cfg``, building it unless a valid cache exists.

    A cache directory is reused only after :func:`data.cache.verify_prepared` (sizes and sha256
    of every file); one that fails is named in one line on stderr and rebuilt, never used.

    The cache directory ``<cache_dir>/<name>/<tokenizer>-<fingerprint[:12]>`` changes whenever
    the sources or the tokenizer do, so stale data is never reused. A trained tokenizer
    (``bpe-<N>``) is trained on the train split and saved there as ``tokenizer.json``; since
    the fingerprint covers the sources, changed training text means a new directory and a new
    tokenizer.
    """
    cfg = resolve_config(cfg)
    tokenizer = cfg.setdefault("tokenizer", "gpt2")
    source_fp = get_source(cfg).identity(cfg)
    fp = fingerprint(cache_key(tokenizer), source_fp)
    name, start = cfg["name"], time.perf_counter()
    out = cache_root(cfg) / name / f"{tokenizer}-{fp[:12]}"
    announce = (lambda line: print(f"{name}: {line}", flush=True)) if verbose else None
    try:
        meta = verify_prepared(out, fp, announce)
        if verbose:
            seconds = time.perf_counter() - start
            print(f"{name}: reusing prepared data in {out} (verified in {seconds:.2f}s)")
    except (FileNotFoundError, InvalidCache) as e:  # FileNotFoundError: never (fully) prepared
        if isinstance(e, InvalidCache):  # said even when not verbose: the rebuild takes time
            print(f"{name}: {e}; rebuilding the prepared data from its sources", file=sys.stderr)
        meta = _build(cfg, out, fp, source_fp, verbose)
    return PreparedData(out, meta, meta["tokenizer"], meta["vocab_size"])
