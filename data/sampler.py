"""Training batches (random windows, resumable, per-rank disjoint) and whole-split eval batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from data.errors import DataError


def _check_length(tokens: np.ndarray, block_size: int) -> None:
    """block_size itself is checked by GPTConfig, which every run's model goes through."""
    if len(tokens) < block_size + 1:
        raise DataError(
            f"split has {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}; "
            "use a smaller block_size or more data"
        )


def _windows(
    tokens: np.ndarray, starts: np.ndarray, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x = tokens[s : s+length], y = tokens[s+1 : s+length+1] for each start s, as int64."""
    rows = tokens[starts[:, None] + np.arange(length + 1)].astype(np.int64)
    return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())


class BatchSampler:
    """Random contiguous windows of ``block_size + 1`` tokens, split into inputs and targets.

    Batch ``step`` is a pure function of ``(seed, step)``: every rank draws the same
    ``world_size * batch_size`` distinct window offsets from ``default_rng([seed, step])`` and
    takes its own slice, so ranks never share a window and resuming needs only the step count.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        _check_length(tokens, block_size)
        self.n_windows = len(tokens) - block_size
        if self.n_windows < world_size * batch_size:
            raise DataError(
                f"split has {self.n_windows} distinct windows of {block_size + 1} tokens, fewer "
                f"than world_size * batch_size = {world_size * batch_size}; use less of either"
            )
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.step = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): int64 CPU tensors (batch_size, block_size); y[:, t] == x[:, t + 1]."""
        self.step += 1
        return self.batch_at(self.step - 1)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number `step`, without moving the position (for a prefetching reader)."""
        rng = np.random.default_rng([self.seed, step])
        offsets = rng.choice(self.n_windows, size=self.world_size * self.batch_size, replace=False)
        mine = offsets[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return _windows(self.tokens, mine, self.block_size)

    def state_dict(self) -> dict[str, int]:
        """Plain ints: safe for ``torch.load(weights_only=True)`` and JSON."""
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.step = int(state["seed"]), int(state["step"])


def iter_eval_batches(
    tokens: np.ndarray,
    block_size: int,
    batch_size: int,
    max_windows: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (x, y) over non-overlapping windows that cover the split.

    Window i starts at token i * block_size, so every token after the first is predicted
    exactly once, with between 0 and block_size - 1 tokens of context (the standard
    non-overlapping method; it reads a bit pessimistic next to sliding windows). Full windows
    come in batches of ``batch_size``; the final partial window, if any, is a last (1, L) batch.
    Windows are dealt round-robin to ranks; sum ``loss * y.numel()`` over batches and ranks.

    With ``max_windows`` (per rank), only a fixed, evenly spaced subset of full windows is used
    (the same every call), for cheap periodic evals.
    """
    _check_length(tokens, block_size)
    n_full = (len(tokens) - 1) // block_size
    starts = np.arange(n_full) * block_size
    tail = len(tokens) - 1 - n_full * block_size
    if max_windows is not None:
        wanted = min(n_full, max_windows * world_size)
        starts = starts[np.linspace(0, n_full - 1, wanted).round().astype(np.int64)]
        tail = 0
    mine = starts[rank::world_size]
    for i in range(0, len(mine), batch_size):
        yield _windows(tokens, mine[i : i + batch_size], block_size)
    if tail and (n_full % world_size) == rank:
        yield _windows(tokens, np.array([n_full * block_size]), tail)
