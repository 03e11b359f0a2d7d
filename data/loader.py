"""Batches from token files: random training windows (resumable, disjoint per rank), built
ahead on a background thread on GPUs; whole-split evaluation batches; bits per byte.

Without it the main thread gathers every batch from the memmap (page faults on cold storage
included) between steps, and copies it from pageable memory, where `non_blocking=True` is a
synchronous copy. Here a thread builds batches `depth` steps ahead, in page-locked (pinned)
memory when a GPU is present, so the copy to the device overlaps the step before it.

The batches are exactly the sampler's: batch number s is a pure function of (seed, s)
(`BatchSampler.batch_at`), the thread computes them in order, and the position in
`state_dict` counts the batches handed out, not those built ahead, so resuming is unchanged.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections.abc import Iterator

import numpy as np
import torch

from base.errors import DataError

# ----- training and evaluation batches -----------------------------------------------------------

Batch = tuple[torch.Tensor, torch.Tensor]  # (x, y)


def _windows(
    tokens: np.ndarray, starts: np.ndarray, length: int, mask: np.ndarray | None = None
) -> Batch:
    """x = tokens[s : s+length], y = tokens[s+1 : s+length+1] for each start s, as int64; with
    a chat split's `mask`, y is -1 (no loss) wherever the target is not an assistant token."""
    index = starts[:, None] + np.arange(length + 1)
    rows = tokens[index].astype(np.int64)
    y = rows[:, 1:].copy()
    if mask is not None:
        y[mask[index[:, 1:]] == 0] = -1
    return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(y)


class BatchSampler:
    """Random contiguous windows of ``block_size + 1`` tokens, split into inputs and targets.

    Batch ``step`` is a pure function of ``(seed, step)``: every rank draws the same
    ``world_size * batch_size`` distinct window offsets from ``default_rng([seed, step])`` and
    takes its own slice, so ranks never share a window and resuming needs only the step count.

    Conversations are packed the same way (a chat split's ``mask`` leaves only assistant tokens
    as targets): no padding, every window full; docs/chat.md measures what padding would waste.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        mask: np.ndarray | None = None,
    ) -> None:
        self.n_windows = len(tokens) - block_size
        if self.n_windows < world_size * batch_size:
            raise DataError(
                f"the train split has {len(tokens):,} tokens: {max(self.n_windows, 0):,} "
                f"windows of model.block_size + 1 = {block_size + 1}, fewer than the "
                f"{world_size * batch_size} a step draws (train.batch_size per rank); use a "
                "smaller model.block_size or train.batch_size, or more training data"
            )
        self.tokens, self.mask, self.block_size = tokens, mask, block_size
        self.batch_size = batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.step = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): int64 CPU tensors (batch_size, block_size); y[:, t] == x[:, t + 1]."""
        self.step += 1
        return self.batch_at(self.step - 1)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number `step`, without moving the position (for a prefetching reader)."""
        mine = self._offsets(step)[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return _windows(self.tokens, mine, self.block_size, self.mask)

    def targets(self, step: int) -> int:
        """The targets batch `step` holds on all ranks together: every position, or a chat
        split's assistant tokens. Every rank knows it without a collective, as the batch is a
        pure function of the step: the loss of a step is its sum over this count."""
        if self.mask is None:
            return self.world_size * self.batch_size * self.block_size
        index = self._offsets(step)[:, None] + np.arange(1, self.block_size + 1)
        return int(self.mask[index].sum())

    def _offsets(self, step: int) -> np.ndarray:
        """Every rank's window offsets of batch `step`; rank r's are the r-th batch_size."""
        rng = np.random.default_rng([self.seed, step])
        return rng.choice(self.n_windows, size=self.world_size * self.batch_size, replace=False)

    def state_dict(self) -> dict[str, int]:
        """Plain ints: safe for ``torch.load(weights_only=True)`` and JSON."""
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.step = int(state["seed"]), int(state["step"])


def eval_tokens(
    n_tokens: int,
    block_size: int,
    rank: int = 0,
    world_size: int = 1,
    mask: np.ndarray | None = None,
) -> int:
    """The tokens `iter_eval_batches` over a whole split of `n_tokens` gives `rank` to score
    (with a chat split's `mask`, the assistant tokens among them)."""
    n_full, tail = divmod(n_tokens - 1, block_size)
    if mask is None:
        return len(range(rank, n_full, world_size)) * block_size + tail * (
            n_full % world_size == rank
        )
    before = np.concatenate([[0], np.cumsum(mask[1:], dtype=np.int64)])  # targets before i + 1
    starts = np.arange(rank, n_full, world_size) * block_size
    scored = int((before[starts + block_size] - before[starts]).sum())
    return scored + int(before[-1] - before[n_full * block_size]) * (n_full % world_size == rank)


def iter_eval_batches(
    tokens: np.ndarray,
    block_size: int,
    batch_size: int,
    max_windows: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    mask: np.ndarray | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (x, y) over non-overlapping windows that cover the split.

    Window i starts at token i * block_size, so every token after the first is predicted
    exactly once, with between 0 and block_size - 1 tokens of context (the standard
    non-overlapping method; it reads a bit pessimistic next to sliding windows). Full windows
    come in batches of ``batch_size``; the final partial window, if any, is a last (1, L) batch.
    Windows are dealt round-robin to ranks; sum ``loss * y.numel()`` over batches and ranks.
    A chat split's ``mask`` makes every target but assistant tokens -1 (not scored).

    With ``max_windows`` (per rank), only a fixed, evenly spaced subset of full windows is used
    (the same every call), for cheap periodic evals; a split shorter than one window is its own
    subset.
    """
    n_full, tail = divmod(len(tokens) - 1, block_size)
    starts = np.arange(n_full) * block_size
    if max_windows is not None and n_full:
        wanted = min(n_full, max_windows * world_size)
        starts = starts[np.linspace(0, n_full - 1, wanted).round().astype(np.int64)]
        tail = 0
    mine = starts[rank::world_size]
    for i in range(0, len(mine), batch_size):
        yield _windows(tokens, mine[i : i + batch_size], block_size, mask)
    if tail and (n_full % world_size) == rank:
        yield _windows(tokens, np.array([n_full * block_size]), tail, mask)


# ----- prefetching: the next training batches, built while the device trains ---------------------


class PrefetchingSampler:
    """`BatchSampler`'s interface (next_batch, targets, state_dict, load_state_dict), with the
    batches read ahead on a thread."""

    def __init__(self, sampler: BatchSampler, depth: int = 2, pin_memory: bool = False):
        self.sampler, self.depth, self.pin_memory = sampler, depth, pin_memory
        self._thread: threading.Thread | None = None

    def next_batch(self) -> Batch:
        if self._thread is None:  # (re)start the reader at the current position
            self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._read, args=(self.sampler.step,), name="batch-prefetch", daemon=True
            )
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):  # the reader failed: raise it here, where it is used
            raise item
        self.sampler.step += 1
        return item

    def targets(self, step: int) -> int:
        return self.sampler.targets(step)

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()  # the batches handed out, not those read ahead

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.close()
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        """Stop the reader (it restarts from the current position at the next batch)."""
        if self._thread is not None:
            self._stop.set()  # the reader sees it within _put's timeout, even on a full queue
            self._thread.join()
            self._thread = None

    def _read(self, step: int) -> None:
        try:
            while not self._stop.is_set():
                x, y = self.sampler.batch_at(step)
                if self.pin_memory:
                    x, y = x.pin_memory(), y.pin_memory()
                self._put((x, y))
                step += 1
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self._put(e)

    def _put(self, item: Batch | BaseException) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                return self._queue.put(item, timeout=0.1)


# ----- bits per byte: the tokenizer-independent loss the project reports -------------------------


def bits_per_byte(loss_nats_per_token: float, tokens: float, nbytes: float) -> float:
    """Convert a mean loss over ``tokens`` tokens spanning ``nbytes`` UTF-8 bytes.

    Total nats = loss * tokens; dividing by bytes and ln 2 gives bits per byte, which compares
    models with different tokenizers on the same text.
    """
    return loss_nats_per_token * tokens / (nbytes * math.log(2))
