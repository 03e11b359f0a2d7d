"""Inspection beside the model: S of every layer, and every step of one layer's formula.

Both are pure functions of the model's weights and the input. They run the model's own pieces in
the forward's order (the embedding, each block's norm, `qkv`, `causal_attention`, the blocks)
and leave the model as they found it: no hook registered, no mode switched, nothing stored. A
server can therefore run them on the module another thread decodes with, and neither sees the
other's tensors (a hook on a shared module catches every thread's forwards: docs/serving.md).
For the same reason they do not switch a model to eval mode: one in train mode with dropout is
refused, since its numbers would be random.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch

from model import gpt
from model.gpt import GPT, CausalSelfAttention, Rope


def layer_inputs(
    model: GPT, idx: torch.Tensor
) -> Iterator[tuple[CausalSelfAttention, torch.Tensor, Rope | None]]:
    """Each layer's attention module, its input x (B, T, C) (the block's normed residual stream)
    and the rope tables of idx's positions, computed as the forward computes them."""
    if model.training and model.config.dropout > 0:
        raise ValueError("inspection computes without dropout: call model.eval() first")
    x, rope = model.embed(idx, torch.arange(idx.size(1), device=idx.device))  # (B, T, C)
    for block in model.transformer.h:
        yield block.attn, block.ln_1(x), rope
        x = block(x, None, rope)


def heads(
    attn: CausalSelfAttention, x: torch.Tensor, rope: Rope | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """q, k, v (B, nh, T, hs) of one layer's input x (B, T, C) as the attention's forward makes
    them (q and k after its options), and each step on the way: Q, K, V as made; Q_norm, K_norm
    with qk_norm; Q_rope, K_rope with rope. tests/model/test_formula_steps.py holds them to the
    forward's output."""
    q, k, v = attn.qkv(x)
    steps = dict(Q=q, K=k, V=v)
    if attn.qk_norm:
        q, k = steps["Q_norm"], steps["K_norm"] = attn.q_norm(q), attn.k_norm(k)
    if rope is not None:
        q, k = steps["Q_rope"], steps["K_rope"] = gpt.apply_rope(q, *rope), gpt.apply_rope(k, *rope)
    return q, k, v, steps


def probs(attn: CausalSelfAttention, x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
    """S (B, nh, T, T) of one layer's attention over its input x (B, T, C), from the formula,
    whatever the implementation (flash never forms S)."""
    q, k, v, _ = heads(attn, x, rope)
    allowed = attn.causal_mask[: x.size(1), : x.size(1)]  # (T, T)
    return gpt.causal_attention(q, k, v, allowed, with_probs=True)[1]


@torch.no_grad()
def attention_probs(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The attention probabilities S of every layer and head for idx (B, T), computed with the
    formula from each layer's own input: (n_layer, B, nh, T, T)."""
    return torch.stack([probs(*layer) for layer in layer_inputs(model, idx)])


@torch.no_grad()
def formula_steps(model: GPT, idx: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """Every step of layer `layer`'s attention for idx (1, T) from the layer's input, without
    dropout, whatever implementation the model runs: Y and S from the formula's own function
    (`causal_attention`), the lines before S as it reads them (a test holds softmax(masked) to
    its S). Per head, (nh, T, hs) or (nh, T, T): Q, K, V as made;
    Q_norm, K_norm with qk_norm; Q_rope, K_rope with rope; QK (Q K^T), scaled (/ sqrt(d_k)),
    masked (-inf above the diagonal), S (softmax), Y (S V). For the layer, (T, C): X, the
    normed input; heads, every Y concatenated; out, through W_O; and forward, the attention
    module's own output (its implementation's), which `out` equals."""
    attn, x, rope = next(itertools.islice(layer_inputs(model, idx), layer, None))
    q, k, v, steps = heads(attn, x, rope)
    T = x.size(1)
    allowed = attn.causal_mask[:T, :T]
    y, S = gpt.causal_attention(q, k, v, allowed, with_probs=True)  # the formula's own Y and S
    steps["QK"] = q @ k.transpose(-2, -1)  # and its lines before S, shown
    steps["scaled"] = steps["QK"] / math.sqrt(k.size(-1))
    steps["masked"] = steps["scaled"].masked_fill(~allowed, float("-inf"))
    concat = y.transpose(1, 2).reshape(x.shape)  # the heads side by side: (1, T, C)
    steps.update(S=S, X=x, Y=y, heads=concat, out=attn.c_proj(concat), forward=attn(x, None, rope))
    return {name: step[0] for name, step in steps.items()}  # idx's one row
