"""Tokenize a split of documents in parallel and stream the token ids into one flat file."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from data.tokenizer import load_tokenizer, token_dtype

if TYPE_CHECKING:  # `datasets` (pandas, pyarrow) is slow to import: imported where used, so
    # that checking a config or reading a prepared cache never loads it
    from datasets import Dataset, IterableDataset

MAP_BATCH_SIZE = 64
# Below this many documents per process, starting processes costs more than it saves (38 plays
# prepare faster with tokenizer threads in one process: docs/performance.md, Data preparation).
MIN_DOCS_PER_PROC = 1000


def encode_documents(
    batch: dict[str, list], tokenizer: str, tokenizer_dir: Path, num_threads: int
) -> dict[str, list]:
    """``datasets.map`` worker: each non-empty document becomes ``[eot, *tokens]``.

    The leading end-of-text token separates documents and gives every document's first token
    the same context; UTF-8 byte counts of the raw text are kept for bits-per-byte.
    """
    enc = load_tokenizer(tokenizer, tokenizer_dir)
    texts = [t for t in batch["text"] if t]
    ids = enc.encode_ordinary_batch(texts, num_threads=num_threads)
    return {
        "ids": [np.array([enc.eot_token, *x], dtype=np.uint32) for x in ids],
        "nbytes": [len(t.encode("utf-8")) for t in texts],
    }


def write_split(
    docs: Dataset | IterableDataset,
    path: Path,
    tokenizer: str,
    tokenizer_dir: Path,
    num_proc: int,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Write the concatenated tokens of ``docs`` to ``path``, hashing them on the way (no second
    pass over the file); stop after the document that reaches ``max_tokens``. A large finite
    dataset is tokenized by ``num_proc`` processes; small ones and streams use ``num_proc``
    tokenizer threads in this process. A trained tokenizer is read from ``tokenizer_dir``.
    Returns the split's tokens, bytes, documents, seconds and sha256."""
    from datasets import Dataset

    start = time.perf_counter()
    dtype = token_dtype(load_tokenizer(tokenizer, tokenizer_dir).n_vocab)
    big = isinstance(docs, Dataset) and len(docs) >= MIN_DOCS_PER_PROC
    multiprocess = big and num_proc > 1 and len(docs) >= num_proc * MIN_DOCS_PER_PROC
    threads = 1 if multiprocess else num_proc
    if big:  # through datasets.map, for its worker processes and its progress bar (a small
        # split's bar would only add noise to the console's one summary line per split)
        kwargs = {"tokenizer": tokenizer, "tokenizer_dir": tokenizer_dir, "num_threads": threads}
        tokenized = docs.map(
            encode_documents,
            batched=True,
            batch_size=MAP_BATCH_SIZE,
            fn_kwargs=kwargs,
            remove_columns=["text"],
            **({"num_proc": num_proc} if multiprocess else {}),
        )
        batches = tokenized.with_format("numpy").iter(batch_size=MAP_BATCH_SIZE)
    else:  # in this process, with `threads` tokenizer threads
        batches = (
            encode_documents(batch, tokenizer, tokenizer_dir, threads)
            for batch in docs.iter(batch_size=MAP_BATCH_SIZE)
        )
    rows = (row for batch in batches for row in zip(batch["ids"], batch["nbytes"], strict=True))
    tokens = nbytes = documents = 0
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for ids, size in rows:
            chunk = np.asarray(ids, dtype=dtype).tobytes()
            f.write(chunk)
            digest.update(chunk)
            tokens, nbytes, documents = tokens + len(ids), nbytes + int(size), documents + 1
            if max_tokens is not None and tokens >= max_tokens:
                break
    seconds, sha256 = time.perf_counter() - start, digest.hexdigest()
    return dict(tokens=tokens, bytes=nbytes, documents=documents, seconds=seconds, sha256=sha256)
