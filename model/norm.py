"""The two normalisations a block can use (`norm: layernorm | rmsnorm`), also used for qk_norm.

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * g + b     (GPT-2)
    RMSNorm(x)   = x / sqrt(mean(x^2) + eps) * g                  (no centring, no bias)

both over the last dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import GPTConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # the gain g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)  # same shape as x


def make_norm(config: GPTConfig) -> nn.Module:
    """The norm of the blocks and the final norm, over n_embd. RMSNorm has no bias, whatever
    `bias` says."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd)
    return nn.LayerNorm(config.n_embd, bias=config.bias)
