"""Batched decoding: the requests a server holds decode together, one forward a step for all.

Each request is a `Job` with its own prompt, sampling settings, torch.Generator and stop strings.
A worker thread keeps up to `max_batch` of them in the rows of one RaggedKVCache (below), each
row at its own length. A step: jobs that finished or were cancelled
leave (the last row moves into the freed one), waiting jobs join, every job whose window is new
or full gets it (re)filled alone in its row, all but its newest token; then one forward over
all rows, a token each, and each row's next token from `next_token` with that job's settings.

The rows are shared fairly between clients (a job's `client`: its peer address or API key).
Waiting jobs join round-robin, the client holding the fewest rows first; where no row is free,
a client above its fair share (max_batch over the clients with jobs) gives a row back to one
below it: that job waits at the head of the queue and, when it rejoins, refills the window it
was on, so its tokens are the ones it would have drawn without the pause. And a client holding
at most max_batch jobs still finds a place when others filled the queue: max_batch places past
it are kept for such clients.

The tokens are generate.py's, for the same settings and seed: each job follows TokenContext's
window (the prompt's last block_size tokens, restarted at the last block_size // 2 when full),
its logits are the same sums in another batch shape (within 1e-5 in float32), and its draws come
from its own generator, as sample.py's single sample's do.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hardware.device import decoder_for
from inference.generate import SamplingParams, TextStream, next_token, window_start
from model import GPT
from model.gpt import KVCache


class RaggedKVCache(KVCache):
    """A KVCache whose rows end at lengths of their own: one request per row, each at its own
    position, decoded together in one forward. A forward runs on the rows `rows` selects (a
    slice, so the keys are a view, never a copy); `positions` are each selected row's own, so
    every row's tokens get their own positions, and `allowed` is the causal mask's rows at
    those positions: keys past a row's end (another request's longer history, or stale values)
    are masked as the future is. `length` is the longest selected row's, where the model checks
    its window. For manual and sdpa attention (flash takes the queries to be the last keys of
    every row: the Batcher refuses it)."""

    def __init__(self, n_layer: int, batch_size: int, *shape: int, **place: Any):
        """KVCache's arguments; every row starts empty."""
        self.lengths = torch.zeros(batch_size, 1, dtype=torch.long, device=place.get("device"))
        self.rows = slice(0, batch_size)  # before KVCache's `self.length = 0` sets them
        super().__init__(n_layer, batch_size, *shape, **place)

    @property
    def length(self) -> int:
        return int(self.lengths[self.rows].max())

    @length.setter
    def length(self, value: int) -> None:
        self.lengths[self.rows] = value

    def advance(self, n: int) -> None:
        self.lengths[self.rows] += n

    def positions(self, T: int) -> torch.Tensor:
        """(rows, T): each selected row's next T positions."""
        return self.lengths[self.rows] + torch.arange(T, device=self.lengths.device)

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (rows, nh, T, hs) at each row's own end; return the selected rows' keys and
        values up to the longest row's new end (rows, nh, L, hs)."""
        positions = self.positions(k.size(2))
        index = torch.arange(k.size(0), device=k.device)[:, None]  # (rows, 1)
        keys, values = self.k[layer][self.rows], self.v[layer][self.rows]  # views
        keys[index, :, positions] = k.transpose(1, 2)  # (rows, T, nh, hs)
        values[index, :, positions] = v.transpose(1, 2)
        end = int(positions.max()) + 1
        return keys[:, :, :end], values[:, :, :end]

    def allowed(self, causal_mask: torch.Tensor, T: int) -> torch.Tensor:
        """(rows, 1, T, L): row r's queries see its keys up to their own positions, no further."""
        positions = self.positions(T)
        return causal_mask[positions, : int(positions.max()) + 1][:, None]

    def move(self, src: int, dst: int) -> None:
        """Row src's keys, values and length into row dst (a finished request's row reused)."""
        n = int(self.lengths[src])
        for layer in (*self.k, *self.v):
            layer[dst, :, :n] = layer[src, :, :n]
        self.lengths[dst] = n


@dataclass(eq=False)
class Job:
    """One completion. `emit(job, text, token, finish_reason, logits)` is called from the worker
    thread after each token, with the text that became safe to show, finish_reason "stop" (the
    end-of-text token or a stop string) or "length" (max_tokens) on the last one, and the logits
    (V,) the token was drawn from; or once with finish_reason "error" (token -1, logits None)
    when decoding failed. Set
    `cancelled` from any thread: the job leaves at the next step, without another emit."""

    ids: list[int]  # the prompt's tokens, at least one
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator
    text: TextStream
    emit: Callable[[Job, str, int, str | None, torch.Tensor | None], None]
    end: int | None = None  # a token that ends it besides <|endoftext|>: a chat reply's <|im_end|>
    client: str = ""  # who sent it: rows are shared fairly between clients
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)  # generated so far
    seq: torch.Tensor | None = None  # prompt + generated (1, T), while it decodes
    start: int | None = None  # where its window starts (generate.window_start); None: not yet
    refill: bool = False  # its row was given to another client: its window is filled again


class Batcher:
    """Decodes Jobs in batches on a worker thread; `submit` refuses jobs past its capacity."""

    def __init__(
        self,
        model: GPT,
        eot: int,
        vocab_size: int,
        max_batch: int,
        max_waiting: int,
        quantize: str | None = None,
    ):
        """quantize (int8, int4): decode from the Linear weights in 8 or 4 bits, as sample.py's
        quantize= does (hardware/device.py's decoding_copy)."""
        self.eot, self.max_batch, self.max_waiting = eot, max_batch, max_waiting
        self.block_size = model.config.block_size
        self.decoder = decoder_for(model, quantize)
        if model.config.attention == "flash":  # its tiles take every row to end where k does
            raise ValueError("batched decoding needs attention=manual or sdpa, not flash")
        self.cache = model.new_kv_cache(max_batch, kind=RaggedKVCache)
        w = model.lm_head.weight
        self.padding = torch.arange(model.config.vocab_size, device=w.device) >= vocab_size
        self.active: list[Job] = []  # row i of the cache holds active[i]
        self.waiting: list[Job] = []
        self.wake = threading.Condition()

    def start(self) -> None:
        """Run the decoding loop on a daemon thread (it lives as long as the process)."""
        threading.Thread(target=self._loop, name="batcher", daemon=True).start()

    def submit(self, jobs: list[Job]) -> bool:
        """Queue all of `jobs` (one client's), or none when they would pass max_batch +
        max_waiting, unless the client holds at most max_batch jobs with them (see the top)."""
        with self.wake:
            held, room = self.active + self.waiting, self.max_batch + self.max_waiting
            mine = len(jobs) + sum(job.client == jobs[0].client for job in held)
            reserved = self.max_batch if mine <= self.max_batch else 0  # places past the queue
            if len(held) + len(jobs) > room + reserved:
                return False
            self.waiting += jobs
            self.wake.notify()
        return True

    def counts(self) -> dict[str, int]:
        """Jobs decoding and waiting now."""
        with self.wake:
            return {"active": len(self.active), "waiting": len(self.waiting)}

    def _loop(self) -> None:
        while True:
            with self.wake:
                self.wake.wait_for(lambda: self.active or self.waiting)
            try:
                self.step()
            except Exception:  # the shared forward failed: every job ends
                with self.wake:
                    failed, self.active, self.waiting = self.active + self.waiting, [], []
                _fail(failed)

    @torch.inference_mode()
    def step(self) -> torch.Tensor | None:
        """One decoding step of every active job; returns the logits the tokens were drawn from
        (rows, V), before sampling filters, or None when no job was left to decode."""
        with self.wake:  # leave, then join: the batch's rows change only here
            for i in reversed(range(len(self.active))):
                if self.active[i].cancelled or self.active[i].text.done:
                    self._leave(i)
            self.waiting = [job for job in self.waiting if not job.cancelled]
            self._share_rows()
            jobs = list(self.active)
        if not jobs:
            return None
        for row, job in enumerate(jobs):
            self._fill(row, job)
        self.cache.rows = slice(0, len(jobs))
        newest = torch.cat([job.seq[:, -1:] for job in jobs])  # (rows, 1)
        logits = self.decoder(newest, cache=self.cache, last_only=True)[0][:, -1]  # (rows, V)
        logits = logits.masked_fill(self.padding, float("-inf"))
        tokens = self._draw(logits, jobs)
        for row, (job, token) in enumerate(zip(jobs, tokens.tolist(), strict=True)):
            if token < 0:  # its draw failed alone: it ended
                continue
            try:
                job.seq = torch.cat([job.seq, tokens[row, None, None]], dim=1)
                self._emit(job, token, logits[row])
            except Exception:  # this job's own failure (its text, its callback) ends it alone
                _fail([job])
        return logits

    def _leave(self, i: int) -> Job:
        """Row i's job leaves the batch; the last row moves into its place."""
        job = self.active[i]
        self.cache.move(len(self.active) - 1, i)
        self.active[i] = self.active[-1]
        self.active.pop()
        return job

    def _share_rows(self) -> None:
        """Waiting jobs join, round-robin between clients, a row given back by a client above its
        fair share where none is free (see the top)."""
        while self.waiting:
            held = Counter(job.client for job in self.active)
            joining = min(self.waiting, key=lambda job: held[job.client])  # the first of those
            if len(self.active) == self.max_batch:
                clients = {job.client for job in self.active + self.waiting}
                share = max(1, self.max_batch // len(clients))
                richest = max(reversed(self.active), key=lambda job: held[job.client])
                if held[joining.client] >= share or held[richest.client] <= share:
                    return
                paused = self._leave(self.active.index(richest))
                paused.refill = True
                self.waiting.insert(0, paused)
            self.waiting.remove(joining)
            self.active.append(joining)

    def _draw(self, logits: torch.Tensor, jobs: list[Job]) -> torch.Tensor:
        """Each row's next token (rows,), all in one pass, each with its own job's settings;
        where that raises, row by row (the same tokens: a row's draw is the one it makes alone),
        and a row that fails alone ends with its own error (token -1): no row fails another."""
        try:
            contexts, params = [job.seq for job in jobs], [job.params for job in jobs]
            return next_token(logits, contexts, params, [job.generator for job in jobs])
        except Exception:
            tokens = torch.full((len(jobs),), -1, device=logits.device)
            for row, job in enumerate(jobs):
                try:
                    tokens[row] = next_token(logits[row, None], job.seq, job.params, job.generator)
                except Exception:
                    _fail([job])
            return tokens

    def _fill(self, row: int, job: Job) -> None:
        """Put the job's window but its newest token in its row, when the window is new (the
        prompt's last block_size tokens) or full (its last block_size // 2): generate.py's."""
        if job.seq is None:
            job.seq = torch.tensor([job.ids], device=self.padding.device)
        start = window_start(job.seq.size(1), job.start, self.block_size)  # job.start None: new
        if start == job.start and not job.refill:
            return
        job.start, job.refill = start, False
        self.cache.rows = slice(row, row + 1)
        self.cache.length = 0
        if job.seq.size(1) - 1 > job.start:
            self.decoder(job.seq[:, job.start : -1], cache=self.cache, last_only=True)

    def _emit(self, job: Job, token: int, logits: torch.Tensor) -> None:
        """Pass the token on; the job's text is done (it leaves) when the token ends it."""
        job.tokens.append(token)
        if token in (self.eot, job.end):
            text, reason = job.text.finish(), "stop"
        else:
            text = job.text.push(token)
            reason = "stop" if job.text.done else None
            if reason is None and len(job.tokens) == job.max_tokens:
                text, reason = text + job.text.finish(), "length"
        job.emit(job, text, token, reason, logits)


def _fail(jobs: list[Job]) -> None:
    """A bug ended these jobs: its traceback shown, each cancelled and told "error"."""
    traceback.print_exc()
    for job in jobs:
        job.cancelled = True
        job.emit(job, "", -1, "error", None)
