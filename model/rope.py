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
        theta = base ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
        angles = torch.outer(torch.arange(block_size, dtype=torch.float32), theta)  # (T, hs/2)
        # Not persistent: derived from the config, so checkpoints do not store them.
        self.register_buffer("cos", angles.cos(), persistent=False)  # (block_size, hs/2)
        self.register_buffer("sin", angles.sin(), persistent=False)  # (block_size, hs/2)

    def forward(self, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions start .. start + T - 1, each (T, hs/2)."""
        return self.cos[start : start + T], self.sin[start : start + T]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, nh, T, hs) by the angles whose cos and sin are (T, hs/2); same shape and
    dtype as x."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each: the pairs (x_i, x_{i + hs/2})
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, nh, T, hs)
    return rotated.type_as(x)  # float32 tables and bfloat16 x compute in float32
