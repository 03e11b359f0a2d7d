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
        """Computed in float32 and returned in x's dtype (shape too). Under bfloat16 autocast
        qk_norm gets bfloat16 q and k and a float32 gain: F.rms_norm on mixed dtypes warns
        and falls back to its slow path, and would return float32."""
        y = F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps)
        return y.type_as(x)


def make_norm(config: GPTConfig) -> nn.Module:
    """The norm of the blocks and the final norm, over n_embd. RMSNorm has no bias, whatever
    `bias` says."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd)
    return nn.LayerNorm(config.n_embd, bias=config.bias)
