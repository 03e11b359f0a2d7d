"""The GPT: token + position embeddings, n_layer pre-norm blocks, final norm, language-model head.

x = wte[idx] + wpe[0..T)                     # (B, T, C)
for each block:  x = x + Attn(LN(x));  x = x + MLP(LN(x))
logits = LN(x) @ W_head^T                    # (B, T, vocab), W_head = wte unless untied
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import CausalSelfAttention
from model.config import GPTConfig
from model.kv_cache import KVCache


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm residual block: the residual stream x is only ever added to."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, need_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        a, probs = self.attn(self.ln_1(x), cache, need_weights)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, probs


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embeddings
                wpe=nn.Embedding(config.block_size, config.n_embd),  # learned positions
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the projections into the residual stream by 1/sqrt(2 * n_layer), so the
        # stream's variance does not grow with depth (two residual additions per block).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: (B, T) token ids. Returns logits for every position (B, T, vocab) and, given
        targets (B, T) (the next token at each position; -1 is ignored), the mean cross-entropy.
        With a cache, idx holds only the new tokens and positions continue from the cache."""
        return self.forward_embeddings(self.transformer.wte(idx), targets, cache)

    def forward_embeddings(
        self,
        tok_emb: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` from token embeddings (B, T, C): lets the causality tests differentiate the
        logits with respect to the inputs."""
        x, _ = self._trunk(tok_emb, cache, need_weights=False)
        logits = self.lm_head(x)  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1
            )
        return logits, loss

    @torch.no_grad()
    def attention_probs(self, idx: torch.Tensor) -> torch.Tensor:
        """The attention probabilities S of every layer and head for idx (B, T), computed with
        the formula (whatever `attention` is) and without dropout: (n_layer, B, nh, T, T)."""
        was_training = self.training
        self.eval()
        try:
            _, probs = self._trunk(self.transformer.wte(idx), None, need_weights=True)
        finally:
            self.train(was_training)
        return torch.stack(probs)

    def _trunk(
        self, tok_emb: torch.Tensor, cache: KVCache | None, need_weights: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embeddings -> blocks -> final norm. Returns (x (B, T, C), per-layer S if asked)."""
        B, T, C = tok_emb.shape
        start = cache.length if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(
                f"input of {start + T} tokens is longer than block_size={self.config.block_size}; "
                "crop it to the last block_size tokens"
            )
        pos = torch.arange(start, start + T, device=tok_emb.device)  # (T,)
        x = self.transformer.drop(tok_emb + self.transformer.wpe(pos))  # (B, T, C)
        all_probs = []
        for block in self.transformer.h:
            x, probs = block(x, cache, need_weights)
            if probs is not None:
                all_probs.append(probs)
        if cache is not None:
            cache.advance(T)
        return self.transformer.ln_f(x), all_probs

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty KV cache sized for this model, on its device and in its dtype."""
        c = self.config
        w = self.lm_head.weight
        return KVCache(
            c.n_layer, batch_size, c.n_head, max_len or c.block_size, c.head_size, w.device, w.dtype
        )

    def num_params(self, exclude_positions: bool = True) -> int:
        """Parameter count (tied weights once); by default without position embeddings, as
        GPT-2's model sizes are usually quoted."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if exclude_positions else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs (forward + backward) per token: 6 per weight of every matmul, including
        the language-model head, plus 12 * n_layer * T * C for QK^T and SV (PaLM, appendix B)."""
        c = self.config
        T = seq_len or c.block_size
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_weights + 12 * c.n_layer * T * c.n_embd
