"""Memory-efficient causal attention (`attention: flash`): the FlashAttention algorithm in PyTorch.

The manual formula materialises S = softmax(QK^T / sqrt(d_k)), a (T, T) matrix per head, and
autograd keeps it for the backward pass: memory grows as T^2. Here queries and keys are taken
in tiles of block_q x block_k and S only ever exists one tile at a time:

- forward: for each query tile, walk the key tiles up to the diagonal (tiles entirely above it
  are never computed), keep a running row max m and row sum l of exp(S - m) and rescale the
  output accumulator whenever m grows (the online softmax). Only O and the per-row
  log-sum-exp LSE = m + log(l) are saved: O(T) memory.
- backward (FlashAttention-2): recompute each tile's P = exp(S - LSE) from the saved LSE, then
  dV += P^T dO, dP = dO V^T, dS = P * (dP - D) with D = rowsum(dO * O), dQ += dS K / sqrt(d_k),
  dK += dS^T Q / sqrt(d_k).

Dropout on P is supported the FlashAttention way: the keep-mask of a tile is regenerated from a
seed (drawn once per call from torch's global RNG) and the tile's position, so the backward
pass sees exactly the forward's masks without storing them.

Tiles are computed in float32 (float64 stays float64) and the results returned in the input
dtype, so bfloat16 inputs lose precision only in the final rounding. Autocast is switched off
inside: under it the tile matmuls would run in bfloat16 and round the scores before the softmax
(FlashAttention kernels likewise keep S, the row max and the log-sum-exp in float32), and the
backward's float32 recomputation of P would then disagree with the forward's LSE.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch


def query_tiles(Tq: int, block_q: int) -> Iterator[tuple[int, int]]:
    """(q0, q1): the query rows [q0, q1) of each tile."""
    for q0 in range(0, Tq, block_q):
        yield q0, min(q0 + block_q, Tq)


def key_tiles(
    q0: int, q1: int, Tk: int, q_offset: int, block_k: int
) -> Iterator[tuple[int, int, bool]]:
    """(k0, k1, straddles) for the key tiles that query rows [q0, q1) may see.

    Query row i sits at absolute position q_offset + i and sees key j iff j <= q_offset + i, so
    keys from q_offset + q1 on are in the future of every row of the tile: those tiles are
    skipped. `straddles` is True when the tile crosses the diagonal and needs a mask.
    """
    k_end = min(Tk, q_offset + q1)
    for k0 in range(0, k_end, block_k):
        k1 = min(k0 + block_k, k_end)
        yield k0, k1, k1 - 1 > q_offset + q0


def _masked(s: torch.Tensor, q0: int, k0: int, q_offset: int) -> torch.Tensor:
    """s with -inf where key k0 + c lies after query q_offset + q0 + r (the future)."""
    rows = torch.arange(q0, q0 + s.size(-2), device=s.device)[:, None] + q_offset  # (bq, 1)
    cols = torch.arange(k0, k0 + s.size(-1), device=s.device)[None, :]  # (1, bk)
    return s.masked_fill(cols > rows, float("-inf"))


def tile_keep_mask(
    seed: int, q0: int, k0: int, Tk: int, shape: torch.Size, p: float, device: torch.device
) -> torch.Tensor:
    """The dropout keep-mask (True = kept) of the tile at (q0, k0): a pure function of its
    arguments, so forward and backward (and tests) regenerate the same mask."""
    gen = torch.Generator(device=device).manual_seed(seed + q0 * Tk + k0)
    return torch.rand(shape, generator=gen, device=device) >= p


class FlashCausalAttention(torch.autograd.Function):
    """Causal attention of q (B, nh, Tq, hs) over k, v (B, nh, Tk, hs), query i at absolute
    position q_offset + i, key j at j. Saves O and LSE (B, nh, Tq) for backward, never S."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_offset: int,
        block_q: int,
        block_k: int,
        dropout_p: float,
        seed: int,
    ) -> torch.Tensor:
        B, nh, Tq, hs = q.shape
        Tk = k.size(2)
        dtype = torch.promote_types(q.dtype, torch.float32)
        scale = 1.0 / math.sqrt(hs)
        o = torch.empty(B, nh, Tq, hs, dtype=dtype, device=q.device)
        lse = torch.empty(B, nh, Tq, dtype=dtype, device=q.device)
        for q0, q1 in query_tiles(Tq, block_q):
            qi = q[:, :, q0:q1].to(dtype)  # (B, nh, bq, hs)
            m = torch.full((B, nh, q1 - q0), float("-inf"), dtype=dtype, device=q.device)
            l = torch.zeros(B, nh, q1 - q0, dtype=dtype, device=q.device)  # noqa: E741
            acc = torch.zeros(B, nh, q1 - q0, hs, dtype=dtype, device=q.device)
            for k0, k1, straddles in key_tiles(q0, q1, Tk, q_offset, block_k):
                s = (qi @ k[:, :, k0:k1].to(dtype).transpose(-2, -1)) * scale  # (B, nh, bq, bk)
                if straddles:
                    s = _masked(s, q0, k0, q_offset)
                # Key tile 0 is always visited and every row sees key 0, so m is finite from
                # the first tile on and exp(-inf - m) = 0 for masked entries, never NaN.
                m_new = torch.maximum(m, s.amax(dim=-1))  # (B, nh, bq)
                p = torch.exp(s - m_new[..., None])  # (B, nh, bq, bk)
                alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
                l = l * alpha + p.sum(dim=-1)  # noqa: E741  (the softmax denominator: undropped)
                if dropout_p > 0:
                    keep = tile_keep_mask(seed, q0, k0, Tk, p.shape, dropout_p, q.device)
                    p = p * keep / (1.0 - dropout_p)
                acc = acc * alpha[..., None] + p @ v[:, :, k0:k1].to(dtype)  # (B, nh, bq, hs)
                m = m_new
            o[:, :, q0:q1] = acc / l[..., None]
            lse[:, :, q0:q1] = m + torch.log(l)
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (q_offset, block_q, block_k, dropout_p, seed)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        q_offset, block_q, block_k, dropout_p, seed = ctx.args
        Tq, hs = q.shape[2:]
        Tk = k.size(2)
        dtype = lse.dtype
        scale = 1.0 / math.sqrt(hs)
        dq, dk, dv = (torch.zeros_like(t, dtype=dtype) for t in (q, k, v))
        # D_i = sum_j P_ij dP_ij = dO_i . O_i, dropout or not: one number per row.
        D = (grad_out.to(dtype) * out.to(dtype)).sum(dim=-1)  # (B, nh, Tq)
        # The forward's autocast is off again here: backward may be called under autocast.
        with torch.autocast(q.device.type, enabled=False):
            for q0, q1 in query_tiles(Tq, block_q):
                qi = q[:, :, q0:q1].to(dtype)  # (B, nh, bq, hs)
                doi = grad_out[:, :, q0:q1].to(dtype)  # (B, nh, bq, hs)
                lse_i = lse[:, :, q0:q1, None]  # (B, nh, bq, 1)
                d_i = D[:, :, q0:q1, None]  # (B, nh, bq, 1)
                for k0, k1, straddles in key_tiles(q0, q1, Tk, q_offset, block_k):
                    kj = k[:, :, k0:k1].to(dtype)  # (B, nh, bk, hs)
                    s = (qi @ kj.transpose(-2, -1)) * scale  # (B, nh, bq, bk)
                    if straddles:
                        s = _masked(s, q0, k0, q_offset)
                    p = torch.exp(s - lse_i)  # the forward's softmax, recomputed
                    dp = doi @ v[:, :, k0:k1].to(dtype).transpose(-2, -1)  # (B, nh, bq, bk)
                    p_used = p  # P as the forward multiplied it into V: after dropout
                    if dropout_p > 0:
                        keep = tile_keep_mask(seed, q0, k0, Tk, p.shape, dropout_p, q.device)
                        z = keep / (1.0 - dropout_p)
                        p_used, dp = p * z, dp * z
                    dv[:, :, k0:k1] += p_used.transpose(-2, -1) @ doi  # (B, nh, bk, hs)
                    ds = p * (dp - d_i)  # softmax backward, (B, nh, bq, bk)
                    dq[:, :, q0:q1] += (ds @ kj) * scale
                    dk[:, :, k0:k1] += (ds.transpose(-2, -1) @ qi) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def flash_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_q: int = 128,
    block_k: int = 128,
    dropout_p: float = 0.0,
    seed: int | None = None,
) -> torch.Tensor:
    """Causal attention of q (B, nh, Tq, hs) over k, v (B, nh, Tk, hs) with Tq <= Tk: the
    queries are the last Tq positions (Tk - Tq of them are earlier, e.g. in a KV cache).
    Returns (B, nh, Tq, hs), equal to `causal_attention`'s output without storing S.

    `seed` fixes the dropout masks; by default one is drawn from torch's global RNG (only when
    dropout_p > 0), so reseeding torch reproduces them, as with F.dropout.
    """
    Tq, Tk = q.size(2), k.size(2)
    if Tq > Tk:
        raise ValueError(f"flash attention needs at least as many keys as queries: {Tq} > {Tk}")
    if dropout_p > 0 and seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    with torch.autocast(q.device.type, enabled=False):  # float32 tiles: see the docstring
        return FlashCausalAttention.apply(q, k, v, Tk - Tq, block_q, block_k, dropout_p, seed or 0)
