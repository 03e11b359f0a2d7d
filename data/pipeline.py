"""Prepare a dataset once: tokenize, write memory-mapped token files and ``meta.json``; reuse.

Training calls :func:`prepare_data` itself; ``python -m data.prepare`` runs it alone. A
dataset's defaults and names are ``configs/data/<name>.yaml``'s alone. The prepared data live in
fingerprinted directories, written atomically, checked whenever reused: a directory is complete
only when ``meta.json`` exists, names the expected fingerprint, and every file it records is
intact: each token file ``<split>.bin`` (and a chat split's assistant mask ``<split>.mask.bin``)
has exactly the size and the sha256 recorded under ``splits.<split>``, and a trained tokenizer
file (``tokenizer.json``) the size and sha256 under ``tokenizer_file``. ``meta.json`` is written
last, and every file goes through a temporary name and an atomic rename
(``base.files.atomic_path``), so an interrupted preparation never leaves something that passes
this check; a file damaged afterwards (truncated, overwritten, a flipped bit) fails it with a
message naming the file.
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
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tiktoken
from omegaconf import DictConfig, OmegaConf

from base.errors import CONFIG_DIR, DataError
from base.files import atomic_path, sha256_file, verify_files, writable_error, write_atomic
from data.chat import TEMPLATE, chat_tokenizer, problem, render, text_of
from data.sources import get_source, progress_bars
from data.tokenizer import (
    TOKENIZER_FILE,
    cache_key,
    get_tokenizer,
    load_tokenizer,
    parse_tokenizer,
    token_dtype,
    tokenizer_fingerprint,
    train_bpe,
)

if TYPE_CHECKING:  # imported where used: see data/sources.py
    from datasets import Dataset, IterableDataset

# ----- dataset configs ---------------------------------------------------------------------------

DATA_CONFIG_DIR = CONFIG_DIR / "data"


def known_datasets() -> tuple[str, ...]:
    """Names with a config under ``configs/data/``: adding a yaml there adds a dataset."""
    return tuple(sorted(p.stem for p in DATA_CONFIG_DIR.glob("*.yaml")))


def resolve_config(cfg: Mapping[str, Any] | DictConfig) -> dict[str, Any]:
    """Overlay ``cfg`` on the defaults of its named dataset, so ``{"name": "shakespeare"}``
    means the same as the Hydra-composed ``data=shakespeare``."""
    user = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    if not (name := user.get("name")):
        raise DataError(f"data config has no 'name'; known datasets: {', '.join(known_datasets())}")
    if (path := DATA_CONFIG_DIR / f"{name}.yaml").is_file():
        return {**OmegaConf.to_container(OmegaConf.load(path), resolve=True), **user}
    if "source" in user:  # a dataset defined entirely by the caller's own config
        return user
    raise DataError(f"unknown dataset {name!r}; known: {', '.join(known_datasets())}")


def cache_root(cfg: Mapping[str, Any]) -> Path:
    """Where prepared data lives; never relative to cwd, so scripts work from any directory."""
    configured = cfg.get("cache_dir") or os.environ.get("CAUSALGPT_CACHE")
    root = Path(configured) if configured else Path.home() / ".cache" / "causalgpt"
    return root.expanduser().resolve()


# ----- the cache: fingerprints and the one validity check ----------------------------------------

# Bump when the token file layout or what meta.json must record changes, to invalidate old
# caches. 2: meta.json records each token file's sha256.
FORMAT_VERSION = 2
META = "meta.json"
ANNOUNCE_BYTES = 1_000_000_000  # verifying more than this (over ~1 s) is announced


class InvalidCache(Exception):
    """A prepared directory that must not be used; the one-line message names the file."""


def fingerprint(tokenizer: str, source: dict[str, Any]) -> str:
    """sha256 over everything that determines the token files."""
    fields = {"format": FORMAT_VERSION, "tokenizer": tokenizer, "source": source}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


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
        files += [  # a chat split's assistant mask: a byte per token
            (directory / f"{split}.mask.bin", stats["tokens"], str(stats["mask_sha256"]))
            for split, stats in meta["splits"].items()
            if "mask_sha256" in stats
        ]
        if (entry := meta.get("tokenizer_file")) is not None:
            files.append(
                (directory / Path(entry["name"]).name, entry["bytes"], str(entry["sha256"]))
            )
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # meta.json's fields, mistyped
        raise InvalidCache(f"{path} is unreadable or incomplete ({type(e).__name__}: {e})") from e
    if announce is not None and (total := sum(size for _, size, _ in files)) >= ANNOUNCE_BYTES:
        announce(
            f"verifying the sha256 of {total / 1e9:.1f} GB of prepared data in {directory} "
            "(every byte is read and hashed, at about 0.7-2 GB/s)"
        )
    verify_files(files, META, InvalidCache)
    return meta


# ----- tokenizing a split into its token file ----------------------------------------------------

MAP_BATCH_SIZE = 64
# Below this many documents per process, starting processes costs more than it saves (38 plays
# prepare faster with tokenizer threads in one process: docs/performance.md, Data preparation).
MIN_DOCS_PER_PROC = 1000


def data_tokenizer(tokenizer: str, tokenizer_dir: Path, chat: bool) -> tiktoken.Encoding:
    """The token files' tokenizer: ``tokenizer``, with the chat template's tokens for chat data."""
    enc = load_tokenizer(tokenizer, tokenizer_dir)
    return chat_tokenizer(enc) if chat else enc


def encode_documents(
    batch: dict[str, list], tokenizer: str, tokenizer_dir: Path, num_threads: int
) -> dict[str, list]:
    """``datasets.map`` worker: each non-empty document becomes ``[eot, *tokens]``.

    The leading end-of-text token separates documents and gives every document's first token
    the same context; UTF-8 byte counts of the raw text are kept for bits-per-byte. A chat
    batch goes to `encode_conversations`.
    """
    if "messages" in batch:
        return encode_conversations(batch, data_tokenizer(tokenizer, tokenizer_dir, chat=True))
    enc = data_tokenizer(tokenizer, tokenizer_dir, chat=False)
    texts = [t for t in batch["text"] if t]
    ids = enc.encode_ordinary_batch(texts, num_threads=num_threads)
    return {
        "ids": [np.array([enc.eot_token, *x], dtype=np.uint32) for x in ids],
        "nbytes": [len(t.encode("utf-8")) for t in texts],
    }


def encode_conversations(batch: dict[str, list], enc: tiktoken.Encoding) -> dict[str, list]:
    """A chat batch (a ``messages`` column): each conversation in the chat template
    (data/chat.py), with its assistant mask and the bytes of its assistant turns (what the
    masked tokens spell); one that cannot be trained on has no tokens, and why in ``skipped``."""
    why = [problem(messages) or "" for messages in batch["messages"]]
    rows = [
        ([], []) if bad else render(messages, enc, generation_prompt=False)
        for messages, bad in zip(batch["messages"], why, strict=True)
    ]
    return {
        "ids": [np.array(ids, dtype=np.uint32) for ids, _ in rows],
        "mask": [np.array(mask, dtype=np.uint8) for _, mask in rows],
        "nbytes": [
            0
            if bad
            else sum(len(text_of(m["content"]).encode()) for m in c if m["role"] == "assistant")
            for c, bad in zip(batch["messages"], why, strict=True)
        ],
        "skipped": why,
    }


def encoded_batches(
    docs: Dataset | IterableDataset, tokenizer: str, tokenizer_dir: Path, num_proc: int
) -> Iterator[dict[str, Any]]:
    """``docs`` encoded (`encode_documents`), a batch at a time: a large finite dataset by
    ``num_proc`` processes; small ones and streams by ``num_proc`` tokenizer threads in this
    process."""
    from datasets import Dataset

    big = isinstance(docs, Dataset) and len(docs) >= MIN_DOCS_PER_PROC
    multiprocess = big and num_proc > 1 and len(docs) >= num_proc * MIN_DOCS_PER_PROC
    threads = 1 if multiprocess else num_proc
    if not big:  # in this process, with `threads` tokenizer threads
        for batch in docs.iter(batch_size=MAP_BATCH_SIZE):
            yield encode_documents(batch, tokenizer, tokenizer_dir, threads)
        return
    # through datasets.map, for its worker processes and its progress bar (a small split's bar
    # would only add noise to the console's one summary line per split), on a terminal: in a
    # log, the bar is one long line of carriage returns
    kwargs = {"tokenizer": tokenizer, "tokenizer_dir": tokenizer_dir, "num_threads": threads}
    with progress_bars(sys.stderr.isatty()):
        tokenized = docs.map(
            encode_documents,
            batched=True,
            batch_size=MAP_BATCH_SIZE,
            fn_kwargs=kwargs,
            remove_columns=docs.column_names,
            **({"num_proc": num_proc} if multiprocess else {}),
        )
    yield from tokenized.with_format("numpy").iter(batch_size=MAP_BATCH_SIZE)


def write_split(
    docs: Dataset | IterableDataset,
    path: Path,
    tokenizer: str,
    tokenizer_dir: Path,
    num_proc: int,
    max_tokens: int | None = None,
    mask_path: Path | None = None,
) -> dict[str, Any]:
    """Write the concatenated tokens of ``docs`` (`encoded_batches`) to ``path``, hashing them on
    the way (no second pass over the file); stop after the document that reaches ``max_tokens``.
    A trained tokenizer is read from ``tokenizer_dir``. A chat split (``docs`` of conversations)
    also writes ``mask_path`` (one byte per token: 1 on assistant tokens) and counts the
    conversations it skips, by reason. Returns the split's tokens, bytes, documents, seconds and
    sha256 (and mask_sha256, skipped)."""
    start = time.perf_counter()
    chat = mask_path is not None
    dtype = token_dtype(data_tokenizer(tokenizer, tokenizer_dir, chat).n_vocab)
    batches = encoded_batches(docs, tokenizer, tokenizer_dir, num_proc)
    tokens = nbytes = documents = 0
    digest, mask_digest, skipped = hashlib.sha256(), hashlib.sha256(), Counter()
    rows = ((batch, i) for batch in batches for i in range(len(batch["ids"])))
    with open(path, "wb") as f, open(mask_path, "wb") if chat else nullcontext() as masks:
        for batch, i in rows:
            if chat and (why := batch["skipped"][i]):
                skipped[str(why)] += 1
                continue
            ids = batch["ids"][i]
            chunk = np.asarray(ids, dtype=dtype).tobytes()
            f.write(chunk)
            digest.update(chunk)
            if chat:
                chunk = np.asarray(batch["mask"][i], dtype=np.uint8).tobytes()
                masks.write(chunk)
                mask_digest.update(chunk)
            size = batch["nbytes"][i]
            tokens, nbytes, documents = tokens + len(ids), nbytes + int(size), documents + 1
            if max_tokens is not None and tokens >= max_tokens:
                break
    seconds, sha256 = time.perf_counter() - start, digest.hexdigest()
    stats = dict(tokens=tokens, bytes=nbytes, documents=documents, seconds=seconds, sha256=sha256)
    if chat:
        stats |= {"mask_sha256": mask_digest.hexdigest(), "skipped": dict(skipped)}
    return stats


# ----- preparing, or reusing, a dataset ----------------------------------------------------------


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

    @property
    def chat_template(self) -> str | None:
        """The chat template of a conversation dataset (data/chat.py); None for text."""
        return self.meta.get("chat_template")

    def tokenizer(self) -> tiktoken.Encoding:
        """The tokenizer the token files were written with."""
        return data_tokenizer(self.tokenizer_name, self.dir, self.chat_template is not None)

    def mask(self, split: str) -> np.memmap | None:
        """A chat split's assistant mask (1 where a token is a target), beside its tokens."""
        if self.chat_template is None:
            return None
        n = self.meta["splits"][split]["tokens"]
        return np.memmap(self.dir / f"{split}.mask.bin", dtype=np.uint8, mode="r", shape=(n,))


def tokenizer_key(cfg: dict[str, Any]) -> str:
    """What the fingerprint records of data.tokenizer: with data.tokenizer_dir, the sha256 of the
    trained tokenizer copied from there (changed text there means new token files)."""
    tokenizer, given = cfg["tokenizer"], cfg.get("tokenizer_dir")
    if given is None:
        return cache_key(tokenizer)
    if parse_tokenizer(tokenizer) is None:
        raise DataError(
            f"data.tokenizer_dir={given} names where a trained tokenizer (bpe-<N>) is read "
            f"from; data.tokenizer={tokenizer} is built in: drop data.tokenizer_dir"
        )
    if not (Path(given) / TOKENIZER_FILE).is_file():
        raise DataError(
            f"data.tokenizer_dir={given} holds no {TOKENIZER_FILE}: give the checkpoint (or "
            f"prepared data directory) of a model trained with data.tokenizer={tokenizer}"
        )
    return f"{cache_key(tokenizer)}:{tokenizer_fingerprint(tokenizer, given)}"


def _build(cfg: dict[str, Any], out: Path, fp: str, source_fp: dict, verbose: bool) -> dict:
    tokenizer, chat = cfg["tokenizer"], cfg.get("chat")
    if chat not in (None, TEMPLATE):
        raise DataError(f"data.chat={chat!r} is not a chat template; the one there is: {TEMPLATE}")
    if (vocab_size := parse_tokenizer(tokenizer)) is None:
        get_tokenizer(tokenizer)  # fail on a bad tokenizer (download) before loading any data
    docs = get_source(cfg).load(cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / META).unlink(missing_ok=True)  # invalidate before replacing any token file
    trained = {}
    if vocab_size:
        trained = _copy_tokenizer(cfg, out, verbose) or _train_tokenizer(
            cfg, docs["train"], out, vocab_size, verbose
        )
    enc = data_tokenizer(tokenizer, out, bool(chat))
    splits = {}
    for split in ("train", "val"):
        masks = atomic_path(out / f"{split}.mask.bin") if chat else nullcontext()
        with atomic_path(out / f"{split}.bin") as tmp, masks as mask_tmp:
            max_tokens = cfg.get("max_train_tokens") if split == "train" else None
            stats = write_split(
                docs[split], tmp, tokenizer, out, int(cfg.get("num_proc", 1)), max_tokens, mask_tmp
            )
            if stats["tokens"] == 0:
                what, key = "text", "text_field"
                if chat:
                    what, key = "conversations that can be trained on", "messages_field"
                skipped = f"; {_skipped(stats)}" if stats.get("skipped") else ""
                raise DataError(
                    f"the {split} split of {cfg['name']!r} has no {what} (0 documents{skipped}); "
                    f"check the files, {key} or val_fraction"
                )
        if verbose and stats.get("skipped"):
            print(f"{cfg['name']}/{split}: {_skipped(stats)}")
        if verbose:
            mb, seconds = stats["bytes"] / 1e6, stats["seconds"]
            print(
                f"{cfg['name']}/{split}: {stats['documents']:,} document"
                f"{'s' * (stats['documents'] != 1)}, "
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
        **({"chat_template": chat} if chat else {}),
    }
    write_atomic(out / META, json.dumps(meta, indent=2))
    return meta


def _train_tokenizer(
    cfg: dict[str, Any], train: Dataset, out: Path, vocab_size: int, verbose: bool
) -> dict[str, Any]:
    """Train data.tokenizer=bpe-<N> on the train split alone, into out/tokenizer.json; returns
    what meta.json records of it."""
    batches = train.iter(batch_size=MAP_BATCH_SIZE)
    texts = (
        (text_of(m["content"]) for b in batches for c in b["messages"] for m in c if not problem(c))
        if cfg.get("chat")
        else (t for b in batches for t in b["text"])
    )
    bpe, stats = train_bpe(texts, vocab_size)
    write_atomic(out / TOKENIZER_FILE, bpe.to_json())
    if verbose:
        print(
            f"{cfg['name']}: trained {bpe.name} on the train split ({stats.bytes / 1e6:.2f} "
            f"MB, {stats.unique_chunks:,} distinct chunks of {stats.chunks:,}) in "
            f"{stats.seconds:.2f}s"
        )
    training = {**asdict(stats), "seconds": round(stats.seconds, 3)}
    return {"tokenizer_file": _file_entry(out), "tokenizer_training": training}


def _copy_tokenizer(cfg: dict[str, Any], out: Path, verbose: bool) -> dict[str, Any]:
    """data.tokenizer_dir's trained tokenizer (a checkpoint's: a model's own), copied into out/
    instead of training one; what meta.json records of it ({} without data.tokenizer_dir)."""
    if (given := cfg.get("tokenizer_dir")) is None:
        return {}
    source = Path(given) / TOKENIZER_FILE
    load_tokenizer(cfg["tokenizer"], given)  # a valid file of that name, or a DataError
    write_atomic(out / TOKENIZER_FILE, source.read_bytes())
    if verbose:
        print(f"{cfg['name']}: {cfg['tokenizer']} from {source} (data.tokenizer_dir), not trained")
    return {"tokenizer_file": _file_entry(out), "tokenizer_source": str(source)}


def _file_entry(out: Path) -> dict[str, Any]:
    path = out / TOKENIZER_FILE
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _skipped(stats: dict[str, Any]) -> str:
    """How many conversations a split skipped, and why (called when it skipped some)."""
    reasons = stats["skipped"]
    n = sum(reasons.values())
    why = ", ".join(f"{count:,} with {reason}" for reason, count in sorted(reasons.items()))
    return f"{n:,} conversation{'s' * (n != 1)} skipped: {why}"


def prepare_data(cfg: Mapping[str, Any] | DictConfig, *, verbose: bool = True) -> PreparedData:
    """Return the prepared dataset named by ``cfg``, building it unless a valid cache exists.

    A cache directory is reused only after :func:`verify_prepared` (sizes and sha256
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
    if cfg.get("chat"):  # text data keeps the fingerprint it always had
        source_fp |= {key: cfg.get(key) for key in ("chat", "messages_field", "seed")}
    fp = fingerprint(tokenizer_key(cfg), source_fp)
    name, start = cfg["name"], time.perf_counter()
    out = cache_root(cfg) / name / f"{tokenizer}-{fp[:12]}"
    announce = (lambda line: print(f"{name}: {line}", flush=True)) if verbose else None
    try:
        meta = verify_prepared(out, fp, announce)
        if verbose:
            seconds = time.perf_counter() - start
            print(f"{name}: reusing prepared data in {out} (verified in {seconds:.2f}s)")
    except (OSError, InvalidCache) as e:  # OSError: never (fully) prepared, or unreadable
        if isinstance(e, InvalidCache):  # said even when not verbose: the rebuild takes time
            print(f"{name}: {e}; rebuilding the prepared data from its sources", file=sys.stderr)
        made = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
        try:
            if (reason := writable_error(out.parent)) is not None:
                raise DataError(
                    f"cannot write the prepared data to {out.parent}: {reason}; set "
                    "data.cache_dir (or $CAUSALGPT_CACHE) to a writable directory"
                ) from None
            meta = _build(cfg, out, fp, source_fp, verbose)
        except BaseException:  # a failed first preparation leaves no empty folder behind
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)
            raise
    return PreparedData(out, meta, meta["tokenizer"], meta["vocab_size"])
