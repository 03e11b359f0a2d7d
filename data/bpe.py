"""Byte-level BPE trained on a dataset's training split, saved as JSON, encoded by tiktoken.

The vocabulary of ``bpe-<N>`` is the 256 single bytes, then ``N - 257`` merged tokens, then
``<|endoftext|>`` as id ``N - 1``. Training (``train_bpe``) is Hugging Face ``tokenizers``' BPE
trainer (Rust; ~?x faster than the pure-Python trainer it replaced, benchmarks/bench_bpe.py),
as in GPT-2 and nanochat:

1. Split each training document into chunks with ``PATTERN`` (GPT-4's split regex) and count
   the distinct chunks. Merges never cross a chunk boundary, so a word, a number or a run of
   punctuation is merged on its own.
2. Every distinct chunk starts as its UTF-8 bytes (``tokenizers``' byte-level alphabet).
3. Repeatedly merge the most frequent adjacent pair of tokens, counted over the chunks weighted
   by their counts (ties: the pair that comes first in ``tokenizers``' ids, so the result depends
   on nothing but the text).

Encoding is tiktoken's: ``mergeable_ranks`` maps each token's bytes to its id, which is its
merge order, and tiktoken repeatedly merges the adjacent pair whose bytes have the lowest rank;
that reproduces the trained merges (tests check it against ``tokenizers``' own encoding and a
plain-Python application).

The file is JSON (no pickle, nothing executable): the pattern, the special token and the merges
in rank order, each as the hex of its left and right token bytes. It depends only on the
training text, so two trainings on the same text write identical bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

import tiktoken
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from data.errors import DataError

ENDOFTEXT = "<|endoftext|>"
FORMAT = "causalgpt-bpe/1"  # the file layout
# Bump when training would give other merges for the same text (it is in the prepared data's
# fingerprint, so old caches are rebuilt). 2: tokenizers' trainer (other tie-breaks).
TRAINER_VERSION = 2
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
# The same pattern for Oniguruma, tokenizers' regex engine, which reads "{1,3}+" as a repeated
# "{1,3}" (any number of digits) rather than a possessive one; with nothing after it in its
# alternative, the plain "{1,3}" matches the same.
ONIG_PATTERN = PATTERN.replace(r"\p{N}{1,3}+", r"\p{N}{1,3}")
MIN_VOCAB = 257  # the 256 bytes and <|endoftext|>, no merges


def _byte_level_chars() -> dict[str, int]:
    """``tokenizers``' byte-level alphabet (GPT-2's bytes_to_unicode): the character standing
    for each byte; printable bytes stand for themselves, the others for chr(256 + i)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # "!"-"~", "¡"-"¬", "®"-"ÿ"
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(others)})
    return chars


BYTE_OF_CHAR = _byte_level_chars()


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
        head = {
            "format": FORMAT,
            "name": self.name,
            "vocab_size": self.vocab_size,
            "pattern": self.pattern,
            "special_tokens": {ENDOFTEXT: self.eot_token},
        }
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
            if obj["format"] != FORMAT:
                raise bad(f"format {obj['format']!r}, expected {FORMAT!r}")
            if obj["name"] != name:
                raise bad(f"it holds {obj['name']!r}")
            pattern, pairs = obj["pattern"], obj["merges"]
            ids = {bytes([i]): i for i in range(256)}
            merges = []
            for left_hex, right_hex in pairs:
                left, right = bytes.fromhex(left_hex), bytes.fromhex(right_hex)
                if left not in ids or right not in ids or left + right in ids:
                    raise bad(f"merge {len(merges)} ({left_hex} {right_hex}) is not a new merge")
                ids[left + right] = len(ids)
                merges.append((ids[left], ids[right]))
            bpe = cls(name, pattern, tuple(merges))
            if obj["vocab_size"] != bpe.vocab_size or obj["special_tokens"] != {
                ENDOFTEXT: bpe.eot_token
            }:
                raise bad("vocab_size or special_tokens disagree with the merges")
        except (ValueError, KeyError, TypeError) as e:
            if isinstance(e, DataError):
                raise
            raise bad(f"{type(e).__name__}: {e}") from None
        return bpe


@dataclass(frozen=True)
class TrainStats:
    seconds: float  # total, splitting and counting included
    bytes: int  # UTF-8 bytes of training text


def train_hf(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """``tokenizers``' BPE trained on ``texts`` with our pre-tokenization (``PATTERN``, then
    bytes): the 256 bytes and merged tokens, ``vocab_size - 1`` in all (``<|endoftext|>`` is
    ours, added last)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(ONIG_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def token_bytes_of(token: str) -> bytes:
    """The bytes a ``tokenizers`` byte-level token stands for."""
    return bytes(BYTE_OF_CHAR[c] for c in token)


def from_hf(tok: Tokenizer, name: str) -> BPE:
    """The trained ``tokenizers`` model as our merges, in its merge order. A merge whose bytes
    are already a token (another split reached them first) adds no token: tiktoken ranks
    tokens by their bytes, so the first one's rank stands."""
    ids = {bytes([i]): i for i in range(256)}
    merges = []
    for left, right in json.loads(tok.to_str())["model"]["merges"]:
        left_bytes, right_bytes = token_bytes_of(left), token_bytes_of(right)
        if left_bytes + right_bytes not in ids:
            ids[left_bytes + right_bytes] = len(ids)
            merges.append((ids[left_bytes], ids[right_bytes]))
    return BPE(name, PATTERN, tuple(merges))


def train_bpe(texts: Iterable[str], vocab_size: int) -> tuple[BPE, TrainStats]:
    """Train ``bpe-<vocab_size>`` on ``texts`` (the training split's documents)."""
    if vocab_size < MIN_VOCAB:
        raise DataError(f"bpe-{vocab_size}: N must be at least {MIN_VOCAB}")
    start = time.perf_counter()
    nbytes = 0

    def counted() -> Iterator[str]:
        nonlocal nbytes
        for text in texts:
            nbytes += len(text.encode("utf-8"))
            yield text

    bpe = from_hf(train_hf(counted(), vocab_size), f"bpe-{vocab_size}")
    if bpe.vocab_size < vocab_size:
        raise DataError(
            f"bpe-{vocab_size} needs {vocab_size - MIN_VOCAB} merges but the training split "
            f"({nbytes:,} bytes) allows only {len(bpe.merges)}; use a smaller N or more text"
        )
    return bpe, TrainStats(seconds=time.perf_counter() - start, bytes=nbytes)
