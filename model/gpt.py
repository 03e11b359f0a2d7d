"""The GPT, top to bottom: multi-head causal self-attention, the MLP, the block, the model.

Multi-head causal self-attention, written out as the formula:

    Q = X W_Q,  K = X W_K,  V = X W_V                       (one fused Linear, split in three)
    per head h:  S_h = softmax(mask(Q_h K_h^T / sqrt(d_k)))  (mask: -inf strictly above diagonal)
                 Y_h = S_h V_h
    Y = concat(Y_1, ..., Y_H) W_O                           (d_k = d_model / H)

and the model around it:

    x = wte[idx] + wpe[0..T)                     # (B, T, C)
    for each block:  x = x + Attn(Norm(x));  x = x + MLP(Norm(x))
    logits = Norm(x) @ W_head^T                  # (B, T, vocab), W_head = wte unless untied

`attention: manual` (the default) runs exactly the formula's lines (`causal_attention`). The
other implementations compute the same Y: `sdpa` calls torch's fused kernel (a reference and a
speed comparison), `flash` walks the formula tile by tile without storing S, memory linear in T
(model/flash_attention.py), `triton` is that algorithm as a GPU kernel (model/triton_attention.py).

The defaults are GPT-2's (checkpoints/hf.py imports its weights); each option changes one line:

  pos_embedding  learned: + wpe[0..T) as above | rope: no wpe; Attn rotates each head's q and k
                 by their positions (`apply_rope`)
  norm           layernorm: LN(x) = (x - mean) / std * g + b | rmsnorm: x / rms(x) * g
  qk_norm        true: Attn RMS-normalises each head's q and k (before rope)
  mlp            gelu:   MLP(x) = GELU(x W_fc) W_proj                 (hidden: mlp_ratio * C)
                 relu2:  MLP(x) = ReLU(x W_fc)^2 W_proj               (hidden: mlp_ratio * C)
                 swiglu: MLP(x) = (SiLU(x W_1) * (x W_3)) W_proj      (hidden: 2/3 of that, to 8s)
  logit_softcap  cap: logits = cap * tanh(logits / cap), so |logits| < cap (loss included)
  tie_embeddings false: W_head is its own matrix
  zero_init_proj true: the projections into the residual stream (W_O, W_proj) start at zero

`GPTConfig`, the shape and options with their validation, closes the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from base.errors import ConfigError, boolean, check, choice, is_number, positive_int

# ----- multi-head causal self-attention: the formula ---------------------------------------------


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    fresh: bool = True,
    dropout_p: float = 0.0,
    with_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention under a mask: Y (B, nh, Tq, hs), and S with `with_probs`
    (model/inspection.py shows it).

    q: (B, nh, Tq, hs); k, v: (B, nh, Tk, hs); allowed: (Tq, Tk) bool, True where query i may
    attend to key j (j <= i for causal attention), or (B, 1, Tq, Tk) for rows of their own
    lengths (inference/batching.py's RaggedKVCache). The mask says it all, so `fresh` (no KV
    cache) changes nothing here. Dropout applies to S before it weighs V.
    """
    qk = q @ k.transpose(-2, -1)  # (B, nh, Tq, Tk): q_i . k_j for every query i and key j
    scaled = qk / math.sqrt(k.size(-1))  # variance ~1 whatever d_k: softmax does not saturate
    masked = scaled.masked_fill(~allowed, float("-inf"))  # the future gets -inf ...
    probs = F.softmax(masked, dim=-1)  # ... so exp(-inf) = 0: exactly no weight on it
    y = F.dropout(probs, p=dropout_p, training=dropout_p > 0) @ v  # (B, nh, Tq, hs)
    return (y, probs) if with_probs else y


# The implementations, one signature, the formula's: q (B, nh, Tq, hs), k and v (B, nh, Tk, hs),
# `allowed` as above, `fresh` when there is no KV cache (Tq = Tk and `allowed` is the plain causal
# mask), the dropout probability; each returns Y (B, nh, Tq, hs). A model picks one at
# construction (flash with its tile sizes bound).


def sdpa(q, k, v, allowed, fresh: bool, dropout_p: float) -> torch.Tensor:
    mask = None if fresh else allowed  # torch's causal kernel, or its masked one over a cache
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=fresh
    )


def flash(q, k, v, allowed, fresh: bool, dropout_p: float, blocks=(128, 128)) -> torch.Tensor:
    from model.flash_attention import flash_causal_attention  # only where it is used

    return flash_causal_attention(q, k, v, *blocks, dropout_p)  # queries: the last Tq keys


def triton(q, k, v, allowed, fresh: bool, dropout_p: float) -> torch.Tensor:
    """The kernel trains and scores; decoding's few new queries over a cache run the formula.
    (On a GPU no check: no work inside a compiled step.)"""
    if not fresh:
        return causal_attention(q, k, v, allowed, fresh, dropout_p)
    if q.device.type != "cuda" and (why := unavailable_attention(q.device).get("triton")):
        raise ConfigError(why)
    from model.triton_attention import triton_causal_attention  # needs the triton package

    return triton_causal_attention(q, k, v, dropout_p)


ATTENTION: dict[str, Callable[..., torch.Tensor]] = dict(
    manual=causal_attention, sdpa=sdpa, flash=flash, triton=triton
)


def unavailable_attention(device: torch.device) -> dict[str, str]:
    """The implementations that cannot run on `device`, each with the one-line reason. Only
    triton has needs: the triton package (Linux), and a CUDA GPU or Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        why = "needs the triton package, which installs on Linux only (pip install triton)"
    elif device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        why = (
            f"runs its kernel on a CUDA GPU, not on {device.type}: use a GPU, or set "
            "TRITON_INTERPRET=1 to run it (slowly) under Triton's interpreter"
        )
    else:
        return {}
    return {"triton": f"model.attention=triton {why}; or use model.attention=sdpa, flash or manual"}


# ----- norms -------------------------------------------------------------------------------------

# The two normalisations a block can use (`norm: layernorm | rmsnorm`), also used for qk_norm:
#
#     LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * g + b     (GPT-2)
#     RMSNorm(x)   = x / sqrt(mean(x^2) + eps) * g                  (no centring, no bias)
#
# both over the last dimension.


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


# ----- rotary position embeddings ----------------------------------------------------------------

# Rotary position embeddings (RoPE, Su et al. 2021), `pos_embedding: rope`.
#
# Instead of adding a learned vector to the token embedding, every query and key of a head is
# rotated by an angle proportional to its position. Split a head's hs dimensions into pairs
# (x_i, x_{i + hs/2}) for i < hs/2 and rotate pair i by the angle p * theta_i at position p:
#
#     theta_i = base^(-2i / hs)                              (base = rope_base, 10000)
#     x_i'        = x_i cos(p theta_i) - x_{i + hs/2} sin(p theta_i)
#     x_{i+hs/2}' = x_i sin(p theta_i) + x_{i + hs/2} cos(p theta_i)
#
# Rotations compose, (R_a q) . (R_b k) = q . (R_{b-a} k), so the score of query m and key n
# depends on their vectors and on n - m only: attention sees relative positions, and nothing is
# learned per absolute position.

Rope = tuple[torch.Tensor, torch.Tensor]  # the (cos, sin) tables at some positions, as below


def rope_tables(pos: torch.Tensor, head_size: int, base: float) -> Rope:
    """cos and sin of p * theta_i at positions pos (T,), each (1, T, hs/2), broadcast over batch
    and heads; at positions of each row's own (B, T), (B, 1, T, hs/2). Always float32, computed
    per forward (a few thousand numbers): a bfloat16 model rotates by the float32 angles it was
    trained with, and no table is stored or saved."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.float32, device=pos.device) / head_size
    angles = pos.float().unsqueeze(-1) * base**-exponents  # (..., T, hs/2)
    return angles.cos().unsqueeze(-3), angles.sin().unsqueeze(-3)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, nh, T, hs) by the angles whose cos and sin are (1, T, hs/2), or (B, 1, T,
    hs/2) (rope_tables'); same shape and dtype as x."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each: the pairs (x_i, x_{i + hs/2})
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, nh, T, hs)
    return rotated.type_as(x)  # float32 tables and bfloat16 x compute in float32


# ----- the KV cache ------------------------------------------------------------------------------

# A key/value cache for generation: each position's keys and values are computed once.
#
# Causal attention makes this exact: position t's keys and values depend only on tokens <= t, so
# appending a token never changes what was cached before it. `KVCache` holds rows that all end at
# one length (a batch of samples of one prompt); the server's cache (inference/batching.py) rows
# of their own lengths, through the same four methods.


class KVCache:
    """Preallocated keys and values, a (B, nh, max_len, hs) tensor of each per layer.

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
        shape = (batch_size, n_head, max_len, head_size)
        # A tensor per layer, not views of one: a compiled decoding step (inference/generate.py)
        # writes each in place, where writing into a view made it copy the whole cache a step
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.length = 0

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) for `layer`; return all keys/values so far (B, nh, L, hs)."""
        end = self.length + k.size(2)
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def positions(self, T: int) -> torch.Tensor:
        """The positions of T new tokens, (T,): they follow the cached ones, within max_len."""
        end, max_len = self.length + T, self.k[0].size(2)
        if end > max_len:
            raise ValueError(
                f"input of {end} tokens is longer than the KV cache's {max_len} (block_size); "
                "crop it to the last block_size tokens"
            )
        return torch.arange(self.length, end, device=self.k[0].device)

    def allowed(self, causal_mask: torch.Tensor, T: int) -> torch.Tensor:
        """Which keys (cached, then new) each of T new queries may see: the causal mask's rows
        at their positions, (T, length + T)."""
        return causal_mask[self.length : self.length + T, : self.length + T]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0


# ----- the attention layer: Q, K, V, the implementation chosen, W_O ----------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # W_Q|W_K|W_V
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_O
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_size)
            self.k_norm = RMSNorm(config.head_size)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.attend = ATTENTION[config.attention]
        if config.attention == "flash":  # its tile sizes, queries x keys
            self.attend = partial(flash, blocks=(config.flash_block_q, config.flash_block_k))
        # allowed[i, j] is True when position i may look at position j, i.e. j <= i.
        # A buffer (not recomputed per call) so that tests can swap in a leaky mask as a
        # negative control for the causality checks.
        allowed = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", allowed, persistent=False)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q = X W_Q, K = X W_K, V = X W_V of x (B, T, C), split into heads: each (B, nh, T,
        hs)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # each (B, T, C)
        return tuple(t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, rope: Rope | None = None
    ) -> torch.Tensor:
        """x: (B, T, C). With a cache, x holds only the new positions and the keys and values of
        earlier ones come from the cache. rope: the (cos, sin) tables of x's positions
        (`rope_tables`), when pos_embedding is rope. Returns Y (B, T, C)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x)  # each (B, nh, T, hs)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # each head's vector to RMS 1, times a gain
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # rotated by their positions
        allowed = self.causal_mask[:T, :T]  # (T, T)
        if cache is not None:
            allowed = cache.allowed(self.causal_mask, T)  # (T, past + T); ragged: (B, 1, T, L)
            k, v = cache.append(self.layer_idx, k, v)  # (B, nh, past + T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = self.attend(q, k, v, allowed, cache is None, dropout_p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # concatenate heads: (B, T, C)
        return self.resid_dropout(self.c_proj(y))  # W_O


# ----- the MLP, the block -----------------------------------------------------------------------


class MLP(nn.Module):
    """gelu and relu2: act(x W_fc) W_proj. swiglu: c_fc holds W_1 and W_3 side by side (one
    matmul, split in two, as c_attn holds W_Q, W_K, W_V) and the activation is SiLU(a) * b."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        hidden = config.mlp_hidden
        fc_out = 2 * hidden if config.mlp == "swiglu" else hidden
        self.c_fc = nn.Linear(config.n_embd, fc_out, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)  # (B, T, hidden), swiglu: (B, T, 2 * hidden)
        if self.kind == "gelu":
            h = F.gelu(h, approximate="tanh")  # GPT-2's GELU
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:  # swiglu
            a, b = h.chunk(2, dim=-1)  # x W_1, x W_3: (B, T, hidden) each
            h = F.silu(a) * b
        return self.dropout(self.c_proj(h))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm residual block: the residual stream x is only ever added to."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, rope: Rope | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, rope)
        x = x + self.mlp(self.ln_2(x))
        return x


# ----- the GPT -----------------------------------------------------------------------------------


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        modules = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))  # token embeddings
        if config.pos_embedding == "learned":
            modules["wpe"] = nn.Embedding(config.block_size, config.n_embd)  # learned positions
        modules["drop"] = nn.Dropout(config.dropout)
        modules["h"] = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        modules["ln_f"] = make_norm(config)
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the projections into the residual stream by 1/sqrt(2 * n_layer), so the
        # stream's variance does not grow with depth (two residual additions per block).
        # zero_init_proj: start them at zero instead, so every block starts as the identity.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                if config.zero_init_proj:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        loss_reduction: str = "mean",
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx: (B, T) token ids. Without targets: (logits (B, T, vocab), None); with `last_only`
        the last position's alone, (B, 1, vocab), for generation (over a 50k vocabulary the head
        is a small model's costliest matmul). With targets (B, T), the next token at each
        position (-1 is ignored): (None, mean cross-entropy, or with loss_reduction="sum" the
        total, for a caller that weighs batches by their targets). Unlike nanoGPT's, no logits
        with a loss: a (B, T, vocab) tensor the caller holds stays alive through backward. With
        a cache, idx holds only the new tokens and positions continue from it."""
        T = idx.size(1)
        if self.config.block_size < T:
            raise ValueError(
                f"input of {T} tokens is longer than block_size={self.config.block_size}; "
                "crop it to the last block_size tokens"
            )
        pos = torch.arange(T, device=idx.device) if cache is None else cache.positions(T)
        x, rope = self.embed(idx, pos)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, cache, rope)
        if cache is not None:
            cache.advance(T)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x[:, [-1]] if last_only else x)  # (B, T or 1, vocab)
        if (cap := self.config.logit_softcap) is not None:
            logits = cap * torch.tanh(logits / cap)  # smoothly squashed into (-cap, cap)
        if targets is None:
            return logits, None
        return None, F.cross_entropy(
            logits.view(-1, logits.size(-1)).float(),
            targets.reshape(-1),
            ignore_index=-1,
            reduction=loss_reduction,
        )

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, Rope | None]:
        """The first block's input x (B, T, C) for tokens idx (B, T) at positions pos (T,), or
        (B, T) for rows of their own, and the rope tables of those positions (rope only). Apart
        from forward because model/inspection.py starts from it too."""
        x, rope = self.transformer.wte(idx), None  # (B, T, C)
        if self.config.pos_embedding == "rope":  # positions enter through every layer's q and k
            rope = rope_tables(pos, self.config.head_size, self.config.rope_base)  # (cos, sin)
        else:
            x = x + self.transformer.wpe(pos)  # (B, T, C)
        return self.transformer.drop(x), rope

    def new_kv_cache(
        self, batch_size: int, max_len: int | None = None, kind: type[KVCache] | None = None
    ) -> KVCache:
        """An empty KV cache (a KVCache, or a `kind` of one) sized for this model, on its device
        and in its dtype."""
        c, w = self.config, self.transformer.wte.weight
        shape = (c.n_layer, batch_size, c.n_head, max_len or c.block_size, c.head_size)
        return (kind or KVCache)(*shape, device=w.device, dtype=w.dtype)

    def crop_block_size(self, block_size: int) -> None:
        """Shorten the context to `block_size` (at most the current one), as nanoGPT's does for
        fine-tuning pretrained weights on shorter windows: the first block_size rows of the
        position table and of each causal mask are kept."""
        if not 0 < block_size <= self.config.block_size:
            raise ConfigError(
                f"model.block_size={block_size} cannot crop a model of block_size "
                f"{self.config.block_size}: use at most {self.config.block_size}"
            )
        self.config = dataclasses.replace(self.config, block_size=block_size)
        if "wpe" in self.transformer:
            wpe = self.transformer.wpe
            wpe.weight = nn.Parameter(wpe.weight[:block_size])  # (block_size, C)
            wpe.num_embeddings = block_size
        for block in self.transformer.h:
            block.attn.causal_mask = block.attn.causal_mask[:block_size, :block_size]

    def add_tokens(self, ids: range, mean_of: int) -> None:
        """Rows for new token ids (a chat template's special tokens): the token embedding and
        the head grow to hold them where they must, and each new row starts as the mean of the
        first `mean_of` rows, an average token that favours no id before fine-tuning."""
        vocab = max(self.config.vocab_size, ids.stop)
        self.config = dataclasses.replace(self.config, vocab_size=vocab)
        tied = self.config.tie_embeddings
        for module in [self.transformer.wte] + ([] if tied else [self.lm_head]):
            old = module.weight.data  # (vocab_size, C)
            new = torch.cat([old, old.new_zeros(vocab - len(old), old.shape[1])])  # (vocab, C)
            new[ids.start : ids.stop] = old[:mean_of].mean(dim=0)
            module.weight = nn.Parameter(new)
        self.transformer.wte.num_embeddings = self.lm_head.out_features = vocab
        if tied:
            self.lm_head.weight = self.transformer.wte.weight

    def stored_state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint of this model stores (checkpoints/store.py): its state, a
        tied head once (as wte: safetensors stores no tensor twice)."""
        state = self.state_dict()
        if self.config.tie_embeddings:
            del state["lm_head.weight"]
        return state

    @staticmethod
    def stored_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor a checkpoint of `config` stores, from a model built on the
        meta device: no memory, whatever the config claims."""
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in GPT(config).stored_state().items()}

    def num_params(self, exclude_positions: bool = True) -> int:
        """Parameter count (tied weights once); by default without position embeddings, as
        GPT-2's model sizes are usually quoted (rope has none to exclude)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_positions and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs (forward + backward) per token: 6 per weight of every matmul, including
        the language-model head, plus 12 * n_layer * T * C for QK^T and SV (PaLM, appendix B).
        swiglu's three matrices are all in c_fc and c_proj; norms, rope, activations and the
        softcap are elementwise and not counted, as in PaLM's formula."""
        c = self.config
        T = seq_len or c.block_size
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_weights + 12 * c.n_layer * T * c.n_embd


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode (no dropout) inside the block, back in its previous mode after it,
    even when the block raises."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


# ----- GPTConfig: the model's shape as a validated dataclass; presets in configs/model/ ---------

ATTENTION_IMPLS = tuple(ATTENTION)
POS_EMBEDDINGS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "relu2", "swiglu")
CHOICES = dict(attention=ATTENTION_IMPLS, pos_embedding=POS_EMBEDDINGS, norm=NORMS, mlp=MLPS)
# Upper bounds on the sizes, far above any model this project trains (GPT-3 has n_embd 12288,
# 96 layers), so that a typo or a hand-edited checkpoint fails here instead of asking the
# allocator for terabytes. block_size also sizes each layer's causal mask (block_size^2 bytes).
MAX_SIZES = dict(vocab_size=1 << 21, block_size=1 << 16, n_layer=1024, n_head=1024)
MAX_SIZES |= dict.fromkeys(("n_embd", "flash_block_q", "flash_block_k"), 1 << 16)
MAX_MLP_RATIO = 64


@dataclass
class GPTConfig:
    """Shape and options of a GPT. Every field is checked on construction so a bad value fails
    here, with its name, instead of deep inside a matmul."""

    vocab_size: int = 50257
    block_size: int = 1024  # the longest context the model attends over
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms, as GPT-2
    # manual: our formula | sdpa: torch's fused kernel (reference) | flash: our tiled
    # FlashAttention, memory linear in T (model/flash_attention.py) | triton: the same
    # algorithm as a Triton GPU kernel (model/triton_attention.py)
    attention: str = "manual"
    tie_embeddings: bool = True  # lm_head shares the token embedding matrix, as GPT-2
    # flash's tiles, queries x keys. 128 x 128 on CPU (benchmarks/bench_attention.py, T=8192):
    # 1.5x faster than 64 x 64 (fewer Python-level tile steps), within noise of 128 x 256
    flash_block_q: int = 128
    flash_block_k: int = 128
    # Architecture options; the defaults are GPT-2's (model/gpt.py's docstring shows each one).
    # learned: a wpe table added to the token embeddings | rope: q and k rotated per head
    pos_embedding: str = "learned"
    rope_base: float = 10000.0  # rope: theta_i = rope_base^(-2i / head_size)
    norm: str = "layernorm"  # the blocks' and the final norm: layernorm | rmsnorm
    qk_norm: bool = False  # RMSNorm of each head's q and k, before RoPE (as modded-nanogpt)
    # gelu: GPT-2's | relu2: ReLU(x)^2 | swiglu: SiLU(x W1) * (x W3), 2/3 as wide (mlp_hidden)
    mlp: str = "gelu"
    mlp_ratio: float = 4  # the MLP's hidden width over n_embd (see mlp_hidden)
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap); null: off
    zero_init_proj: bool = False  # residual output projections start at zero (modded-nanogpt)

    def __post_init__(self) -> None:
        for name, most in MAX_SIZES.items():
            value = positive_int(f"model.{name}", getattr(self, name))
            check(f"model.{name}", value, value <= most, f"at most {most:,}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head}): "
                "each head gets d_k = n_embd / n_head dimensions"
            )
        dropout, ratio, base, cap = self.dropout, self.mlp_ratio, self.rope_base, self.logit_softcap
        check("model.dropout", dropout, is_number(dropout, 0) and dropout < 1, "in [0, 1)")
        for name in ("bias", "tie_embeddings", "qk_norm", "zero_init_proj"):
            boolean(f"model.{name}", getattr(self, name))
        for name, choices in CHOICES.items():
            choice(f"model.{name}", getattr(self, name), choices)
        check("model.rope_base", base, is_number(base) and base > 0, "a positive number")
        ratio_ok = is_number(ratio, 0, MAX_MLP_RATIO) and ratio > 0
        check("model.mlp_ratio", ratio, ratio_ok, f"a positive number at most {MAX_MLP_RATIO}")
        cap_ok = cap is None or (is_number(cap) and cap > 0)
        check("model.logit_softcap", cap, cap_ok, "a positive number or null")
        if self.pos_embedding == "rope" and self.head_size % 2 != 0:
            raise ConfigError(
                f"model.pos_embedding=rope rotates pairs of dimensions: the head size "
                f"n_embd / n_head = {self.head_size} must be even"
            )
        if self.mlp_hidden < 1:
            raise ConfigError(
                f"model.mlp_ratio={ratio} gives the MLP no hidden units at n_embd={self.n_embd}"
            )

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width: mlp_ratio * n_embd (rounded). swiglu has three matrices instead
        of two, so it gets 2/3 of that width, rounded up to a multiple of 8: the same parameter
        count as gelu/relu2 to within 8 * 3 * n_embd (n_embd 768: 2048 instead of 3072)."""
        hidden = round(self.mlp_ratio * self.n_embd)
        if self.mlp == "swiglu":
            return -(-2 * hidden // 24) * 8  # ceil(2/3 * hidden / 8) * 8, in integers
        return hidden

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Build from a mapping (a preset or a Hydra node), naming any key that is not a field."""
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(values) - known):
            raise ConfigError(f"unknown model config key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
