"""Tokenize a split of documents in parallel and stream the token ids into one flat file."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from datasets import Dataset, IterableDataset

from data.tokenizer import load_tokenizer, token_dtype

MAP_BATCH_SIZE = 64
# Below this many documents per process, starting processes costs more than it saves (measured on
# shakespeare: 38 plays prepare 2x faster with tokenizer threads in one process).
MIN_DOCS_PER_PROC = 1000


@contextlib.contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """datasets' own progress bar, only for splits big enough to need one: a small split's
    bar would only add noise to the console's one summary line per split."""
    was_enabled = not datasets.are_progress_bars_disabled()
    if not show:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


@dataclass(frozen=True)
class SplitStats:
    tokens: int
    bytes: int
    documents: int
    seconds: float
    sha256: str  # of the file's bytes, hashed as they were written


def encode_documents(
    batch: dict[str, list], tokenizer: str, num_threads: int, tokenizer_dir: str | None = None
) -> dict[str, list]:
    """``datasets.map`` worker: each non-empty document becomes ``[eot, *tokens]``.

    The leading end-of-text token separates documents and gives every document's first token
    the same context; UTF-8 byte counts of the raw text are kept for bits-per-byte.
    """
    enc = load_tokenizer(tokenizer, tokenizer_dir)
    texts = [t for t in batch["text"] if t]
    ids = enc.encode_ordinary_batch(texts, num_threads=num_threads)
    eot = np.array([enc.eot_token], dtype=np.uint32)
    return {
        "ids": [np.concatenate([eot, np.asarray(x, dtype=np.uint32)]) for x in ids],
        "nbytes": [len(t.encode("utf-8")) for t in texts],
    }


def _rows(tokenized: Dataset | IterableDataset) -> Iterator[tuple[np.ndarray, int]]:
    for batch in tokenized.iter(batch_size=MAP_BATCH_SIZE):
        yield from zip(batch["ids"], batch["nbytes"], strict=True)


def write_split(
    docs: Dataset | IterableDataset,
    path: Path,
    tokenizer: str,
    num_proc: int,
    max_tokens: int | None = None,
    tokenizer_dir: str | None = None,
) -> SplitStats:
    """Write the concatenated tokens of ``docs`` to ``path``, hashing them on the way (no second
    pass over the file); stop after the document that reaches ``max_tokens``. A large finite
    dataset is tokenized by ``num_proc`` processes; small ones and streams use ``num_proc``
    tokenizer threads in this process. A trained tokenizer is read from ``tokenizer_dir``."""
    start = time.perf_counter()
    dtype = token_dtype(load_tokenizer(tokenizer, tokenizer_dir).n_vocab)
    num_proc = max(1, num_proc)
    kwargs: dict[str, Any] = {"batched": True, "batch_size": MAP_BATCH_SIZE}
    threads = num_proc
    if isinstance(docs, Dataset) and num_proc > 1 and len(docs) >= num_proc * MIN_DOCS_PER_PROC:
        kwargs["num_proc"], threads = num_proc, 1
    with _progress_bars(isinstance(docs, Dataset) and len(docs) >= MIN_DOCS_PER_PROC):
        tokenized = docs.map(
            encode_documents,
            fn_kwargs={
                "tokenizer": tokenizer,
                "num_threads": threads,
                "tokenizer_dir": tokenizer_dir,
            },
            remove_columns=["text"],
            **kwargs,
        ).with_format("numpy")
    tokens = nbytes = documents = 0
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for ids, size in _rows(tokenized):
            chunk = np.asarray(ids, dtype=dtype).tobytes()
            f.write(chunk)
            digest.update(chunk)
            tokens, nbytes, documents = tokens + len(ids), nbytes + int(size), documents + 1
            if max_tokens is not None and tokens >= max_tokens:
                break
    seconds = time.perf_counter() - start
    return SplitStats(tokens, nbytes, documents, seconds, digest.hexdigest())
