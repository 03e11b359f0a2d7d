"""Rotary position embeddings (RoPE, Su et al. 2021), `pos_embedding: rope`.

Instead of adding a learned vector to the token embedding, every query and key of a head is
rotated by an angle proportional to its position. Split a head's hs dimensions into pairs
(x_i, x_{i + hs/2}) for i < hs/2 and rotate pair i by the angle p * theta_i at position p:

    theta_i = base^(-2i / hs)                              (base = rope_base, 10000)
    x_i'        = x_i cos(p theta_i) - x_{i + hs/2} sin(p theta_i)
    x_{i+hs/2}' = x_i sin(p theta_i) + x_{i + hs/2} cos(p theta_i)

Rotations compose, (R_a q) . (R_b k) = q . (R_{b-a} k), so the score of query m and key n
depends on their vectors and on n - m only: attention sees relative positions, and nothing is
learned per absolute position.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryTables(nn.Module):
    """cos and sin of p * theta_i for every position p < block_size, computed once."""

    def __init__(self, head_size: int, block_size: int, base: float):
        super().__init__()
        self.head_size, self.block_size, self.base = head_size, block_size, base
        cos, sin = self._tables(None)  # None: torch's default device (meta under `with meta`)
        # Not persistent: derived from the config, so checkpoints do not store them.
        self.register_buffer("cos", cos, persistent=False)  # (block_size, hs/2)
        self.register_buffer("sin", sin, persistent=False)  # (block_size, hs/2)

    def _tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        hs = self.head_size
        theta = self.base ** (-torch.arange(0, hs, 2, dtype=torch.float32, device=device) / hs)
        positions = torch.arange(self.block_size, dtype=torch.float32, device=device)
        angles = torch.outer(positions, theta)  # (block_size, hs/2)
        return angles.cos(), angles.sin()

    def _apply(self, fn, recurse: bool = True):
        """`model.to(torch.bfloat16)` (sample.py's dtype) casts every floating buffer: these
        tables are then recomputed in float32 on the new device, so that a bfloat16 model
        rotates by the same angles as the float32 one it was trained as, and apply_rope
        rounds only its result."""
        super()._apply(fn, recurse)
        self.cos, self.sin = self._tables(self.cos.device)
        return self

    def forward(self, start: int | torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions start .. start + T - 1, each (T, hs/2); for a start per
        row (B, 1), each row's own, (B, 1, T, hs/2) (broadcast over the heads)."""
        if isinstance(start, int):
            return self.cos[start : start + T], self.sin[start : start + T]
        positions = start + torch.arange(T, device=start.device)  # (B, T)
        return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, nh, T, hs) by the angles whose cos and sin are (T, hs/2); same shape and
    dtype as x."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each: the pairs (x_i, x_{i + hs/2})
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, nh, T, hs)
    return rotated.type_as(x)  # float32 tables and bfloat16 x compute in float32
