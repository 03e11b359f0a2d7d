"""A background thread that builds the next training batches while the device trains.

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
import queue
import threading

import torch

from data.sampler import BatchSampler

Batch = tuple[torch.Tensor, torch.Tensor]


class PrefetchingSampler:
    """`BatchSampler`'s interface (next_batch, state_dict, load_state_dict), read ahead."""

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
