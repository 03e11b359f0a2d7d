"""Multi-head causal self-attention, written out as the formula.

    Q = X W_Q,  K = X W_K,  V = X W_V                       (one fused Linear, split in three)
    per head h:  S_h = softmax(mask(Q_h K_h^T / sqrt(d_k)))  (mask: -inf strictly above diagonal)
                 Y_h = S_h V_h
    Y = concat(Y_1, ..., Y_H) W_O                           (d_k = d_model / H)

Options, applied to Q_h and K_h after the split into heads and in this order: `qk_norm: true`
replaces them by RMSNorm(Q_h), RMSNorm(K_h) (one gain of d_k entries each, shared by the
heads), and `pos_embedding: rope` rotates them by their positions (model/rope.py).

`attention: manual` (the default) runs exactly these lines. `attention: sdpa` calls torch's fused
scaled_dot_product_attention with the same mask, as a reference and a speed comparison.
`attention: flash` computes the same thing tile by tile without ever storing S, so its memory
grows linearly with T (model/flash_attention.py). `probs` computes S by the formula, for any
of the three (the attention plots and tests ask for it; the forward pass never does).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import GPTConfig
from model.flash_attention import flash_causal_attention
from model.kv_cache import KVCache
from model.norm import RMSNorm
from model.rope import apply_rope


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, dropout_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention under a mask; returns (output, probabilities S).

    q: (B, nh, Tq, hs); k, v: (B, nh, Tk, hs); allowed: (Tq, Tk) bool, True where query i may
    attend to key j (j <= i for causal attention), or (B, 1, Tq, Tk) for rows of their own
    lengths (model/kv_cache.py's RaggedKVCache). Dropout applies to S before it weighs V.
    """
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, nh, Tq, Tk)
    scores = scores.masked_fill(~allowed, float("-inf"))  # the future gets -inf ...
    probs = F.softmax(scores, dim=-1)  # ... so exp(-inf) = 0: exactly no weight on it
    y = F.dropout(probs, p=dropout_p, training=dropout_p > 0) @ v  # (B, nh, Tq, hs)
    return y, probs


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.impl = config.attention
        self.flash_blocks = (config.flash_block_q, config.flash_block_k)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # W_Q|W_K|W_V
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_O
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_size)
            self.k_norm = RMSNorm(config.head_size)
        self.resid_dropout = nn.Dropout(config.dropout)
        # allowed[i, j] is True when position i may look at position j, i.e. j <= i.
        # A buffer (not recomputed per call) so that tests can swap in a leaky mask as a
        # negative control for the causality checks.
        allowed = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", allowed, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x: (B, T, C). With a cache, x holds only the new positions and the keys and values of
        earlier ones come from the cache. rope: the (cos, sin) tables of x's positions, each
        (T, hs/2), when pos_embedding is rope. Returns Y (B, T, C)."""
        B, T, C = x.shape
        q, k, v = self.heads(x, rope)  # each (B, nh, T, hs)
        allowed = self.causal_mask[:T, :T]  # (T, T)
        fresh = cache is None or (isinstance(cache.length, int) and cache.length == 0)
        if cache is not None:
            allowed = cache.allowed(self.causal_mask, T)  # (T, past + T); ragged: (B, 1, T, L)
            k, v = cache.append(self.layer_idx, k, v)  # (B, nh, past + T, hs)
        dropout_p = self.dropout if self.training else 0.0

        if self.impl == "manual":
            y, _ = causal_attention(q, k, v, allowed, dropout_p)
        elif self.impl == "flash":  # the queries are the last T of the past + T keys
            y = flash_causal_attention(q, k, v, *self.flash_blocks, dropout_p)  # (B, nh, T, hs)
        else:  # sdpa
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if fresh else allowed,
                dropout_p=dropout_p,
                is_causal=fresh,
            )  # (B, nh, T, hs)

        y = y.transpose(1, 2).contiguous().view(B, T, C)  # concatenate heads: (B, T, C)
        return self.resid_dropout(self.c_proj(y))  # W_O

    def heads(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V of x (B, T, C), split into heads: each (B, nh, T, hs)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # each head's vector to RMS 1, times a gain
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # rotated by their positions
        return q, k, v

    def probs(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The attention probabilities S of x (B, T, C) from the formula, whatever `impl` is
        (flash never forms S): (B, nh, T, T)."""
        T = x.size(1)
        q, k, v = self.heads(x, rope)
        _, probs = causal_attention(q, k, v, self.causal_mask[:T, :T])
        return probs
