"""A key/value cache for generation: each position's keys and values are computed once.

Causal attention makes this exact: position t's keys and values depend only on tokens <= t, so
appending a token never changes what was cached before it. `KVCache` holds rows that all end at
one length (a batch of samples of one prompt); `RaggedKVCache` rows of their own lengths (a
server's requests decoding together).
"""

from __future__ import annotations

from typing import Any

import torch


class KVCache:
    """Preallocated keys and values for every layer, shape (n_layer, B, nh, max_len, hs).

    During one forward pass every layer appends its new keys/values at [length, length + T);
    the model then calls `advance(T)` once, so all layers agree on where the sequence ends.
    """

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_head: int,
        max_len: int,
        head_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        shape = (n_layer, batch_size, n_head, max_len, head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) for `layer`; return all keys/values so far (B, nh, L, hs).
        Past max_len the copy fails on its shapes (the model refuses that input first)."""
        end = self.length + k.size(2)
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def allowed(self, causal_mask: torch.Tensor, T: int) -> torch.Tensor:
        """Which keys (cached, then new) each of T new queries may see: the causal mask's rows
        at their positions, (T, length + T)."""
        return causal_mask[self.length : self.length + T, : self.length + T]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0


class RaggedKVCache(KVCache):
    """A KVCache whose rows end at lengths of their own: one request per row, each at its own
    position, decoded together in one forward (inference/batching.py). A forward runs on the
    rows `rows` selects (a slice, so the keys are a view, never a copy); `length` is each
    selected row's (rows, 1), so every row's tokens get their own positions, and `allowed` is
    the causal mask's rows at those positions: keys past a row's end (another request's longer
    history, or stale values) are masked as the future is. For manual and sdpa attention (flash
    takes the queries to be the last keys of every row: GPT.new_kv_cache refuses it)."""

    def __init__(self, n_layer: int, batch_size: int, *shape: int, **place: Any):
        """KVCache's arguments; every row starts empty."""
        self.lengths = torch.zeros(batch_size, 1, dtype=torch.long)
        self.rows = slice(0, batch_size)  # before KVCache's `self.length = 0` sets them
        super().__init__(n_layer, batch_size, *shape, **place)
        self.lengths = self.lengths.to(self.k.device)

    @property
    def length(self) -> torch.Tensor:
        return self.lengths[self.rows]  # (rows, 1)

    @length.setter
    def length(self, value: int | torch.Tensor) -> None:
        self.lengths[self.rows] = value

    def _positions(self, T: int) -> torch.Tensor:
        return self.length + torch.arange(T, device=self.lengths.device)  # (rows, T)

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (rows, nh, T, hs) at each row's own end; return the selected rows' keys and
        values up to the longest row's new end (rows, nh, L, hs)."""
        positions = self._positions(k.size(2))
        index = torch.arange(self.k.size(1), device=k.device)[self.rows, None]  # (rows, 1)
        self.k[layer, index, :, positions] = k.transpose(1, 2)  # (rows, T, nh, hs)
        self.v[layer, index, :, positions] = v.transpose(1, 2)
        end = int(positions.max()) + 1
        return self.k[layer, self.rows, :, :end], self.v[layer, self.rows, :, :end]

    def allowed(self, causal_mask: torch.Tensor, T: int) -> torch.Tensor:
        """(rows, 1, T, L): row r's queries see its keys up to their own positions, no further."""
        positions = self._positions(T)
        return causal_mask[positions, : int(positions.max()) + 1][:, None]

    def move(self, src: int, dst: int) -> None:
        """Row src's keys, values and length into row dst (a finished request's row reused)."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n
