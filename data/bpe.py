"""Byte-level BPE trained on a dataset's training split, saved as JSON, encoded by tiktoken.

The vocabulary of ``bpe-<N>`` is the 256 single bytes, then ``N - 257`` merged tokens, then
``<|endoftext|>`` as id ``N - 1``. Training (``train_bpe``), as in GPT-2 and nanochat:

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

import heapq
import json
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import regex
import tiktoken

from data.errors import DataError

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
        except (ValueError, KeyError, TypeError) as e:
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
