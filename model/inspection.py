"""Inspection beside the model: S of every layer, and every step of one layer's formula.

Both are pure functions of the model's weights and the input. They run the model's own pieces in
the forward's order (the embedding, each block's norm, `heads`, `causal_attention`, the blocks)
and leave the model as they found it: no hook registered, no mode switched, nothing stored. A
server can therefore run them on the module another thread decodes with, and neither sees the
other's tensors (a hook on a shared module catches every thread's forwards: docs/serving.md).
For the same reason they do not switch a model to eval mode: one in train mode with dropout is
refused, since its numbers would be random.
"""

from __future__ import annotations

import itertools
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


def probs(attn: CausalSelfAttention, x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
    """S (B, nh, T, T) of one layer's attention over its input x (B, T, C), from the formula,
    whatever the implementation (flash never forms S)."""
    T = x.size(1)
    return gpt.causal_attention(*attn.heads(x, rope), attn.causal_mask[:T, :T])[1]


@torch.no_grad()
def attention_probs(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The attention probabilities S of every layer and head for idx (B, T), computed with the
    formula from each layer's own input: (n_layer, B, nh, T, T)."""
    return torch.stack([probs(*layer) for layer in layer_inputs(model, idx)])


@torch.no_grad()
def formula_steps(model: GPT, idx: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """Every step of layer `layer`'s attention for idx (1, T), computed by the formula's own
    lines (`heads`, `causal_attention`) from the layer's input, without dropout, whatever
    implementation the model runs. Per head, (nh, T, hs) or (nh, T, T): Q, K, V as made;
    Q_norm, K_norm with qk_norm; Q_rope, K_rope with rope; QK (Q K^T), scaled (/ sqrt(d_k)),
    masked (-inf above the diagonal), S (softmax), Y (S V). For the layer, (T, C): X, the
    normed input; heads, every Y concatenated; out, through W_O; and forward, the attention
    module's own output (its implementation's), which `out` equals."""
    attn, x, rope = next(itertools.islice(layer_inputs(model, idx), layer, None))
    T, steps = x.size(1), {}
    q, k, v = attn.heads(x, rope, steps)
    y, _ = gpt.causal_attention(q, k, v, attn.causal_mask[:T, :T], 0, steps)
    heads = y.transpose(1, 2).reshape(x.shape)  # concatenated: (1, T, C)
    steps.update(X=x, Y=y, heads=heads, out=attn.c_proj(heads), forward=attn(x, None, rope))
    return {name: step[0] for name, step in steps.items()}  # idx's one row
