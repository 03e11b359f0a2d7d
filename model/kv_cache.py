"""A key/value cache for generation: each position's keys and values are computed once.

Causal attention makes this exact: position t's keys and values depend only on tokens <= t, so
appending a token never changes what was cached before it.
"""

from __future__ import annotations

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

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0
