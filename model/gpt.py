"""The GPT: token + position embeddings, n_layer pre-norm blocks, final norm, language-model head.

x = wte[idx] + wpe[0..T)                     # (B, T, C)
for each block:  x = x + Attn(Norm(x));  x = x + MLP(Norm(x))
logits = Norm(x) @ W_head^T                  # (B, T, vocab), W_head = wte unless untied

The defaults are GPT-2 (checkpoints/hf.py imports its weights); each option changes one line:

  pos_embedding  learned: + wpe[0..T) as above | rope: no wpe; Attn rotates each head's q and k
                 by their positions (model/rope.py)
  norm           layernorm: LN(x) = (x - mean) / std * g + b | rmsnorm: x / rms(x) * g
  qk_norm        true: Attn RMS-normalises each head's q and k (before rope)
  mlp            gelu:   MLP(x) = GELU(x W_fc) W_proj                 (hidden: mlp_ratio * C)
                 relu2:  MLP(x) = ReLU(x W_fc)^2 W_proj               (hidden: mlp_ratio * C)
                 swiglu: MLP(x) = (SiLU(x W_1) * (x W_3)) W_proj      (hidden: 2/3 of that, to 8s)
  logit_softcap  cap: logits = cap * tanh(logits / cap), so |logits| < cap (loss included)
  tie_embeddings false: W_head is its own matrix
  zero_init_proj true: the projections into the residual stream (W_O, W_proj) start at zero
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import CausalSelfAttention
from model.config import GPTConfig
from model.kv_cache import KVCache, RaggedKVCache
from model.norm import make_norm
from model.rope import RotaryTables


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
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, rope)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        modules = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))  # token embeddings
        if config.pos_embedding == "learned":
            modules["wpe"] = nn.Embedding(config.block_size, config.n_embd)  # learned positions
        self.transformer = nn.ModuleDict(
            dict(
                **modules,
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=make_norm(config),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.rotary = None  # rope: no parameters, the cos/sin tables of every position
        if config.pos_embedding == "rope":
            self.rotary = RotaryTables(config.head_size, config.block_size, config.rope_base)
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
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx: (B, T) token ids. Without targets: (logits (B, T, vocab), None). With targets
        (B, T), the next token at each position (-1 is ignored): (None, mean cross-entropy); the
        logits die inside the call, so no (B, T, vocab) tensor is kept alive through backward.
        With a cache, idx holds only the new tokens and positions continue from the cache."""
        logits = self.logits(self.hidden_states(idx, cache))  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1
        )
        return None, loss

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """The head's input: the final norm of the last block's output, (B, T, C)."""
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        x, rope = self.embed(tok_emb, cache.length if cache is not None else 0)
        for block in self.transformer.h:
            x = block(x, cache, rope)
        if cache is not None:
            cache.advance(x.size(1))
        return self.transformer.ln_f(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (..., vocab) of final hidden states x (..., C)."""
        logits = self.lm_head(x)
        if self.config.logit_softcap is not None:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)  # smoothly squashed into (-cap, cap)
        return logits

    def embed(
        self, tok_emb: torch.Tensor, start: int | torch.Tensor = 0
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The first block's input from token embeddings (B, T, C) at positions start, ...,
        start + T - 1, and rope's (cos, sin) tables of those positions (None for learned).
        start (B, 1): each row from its own position (a RaggedKVCache's rows)."""
        T = tok_emb.size(1)
        last = start if isinstance(start, int) else int(start.max())
        if last + T > self.config.block_size:
            raise ValueError(
                f"input of {last + T} tokens is longer than block_size={self.config.block_size}; "
                "crop it to the last block_size tokens"
            )
        rope = None
        if self.rotary is not None:
            x = tok_emb  # positions enter through q and k, in every layer's attention
            rope = self.rotary(start, T)  # (cos, sin), each (T, hs/2) or (B, 1, T, hs/2)
        else:
            pos = torch.arange(T, device=tok_emb.device) + start  # (T,), or (B, T)
            x = tok_emb + self.transformer.wpe(pos)  # (B, T, C)
        return self.transformer.drop(x), rope

    @torch.no_grad()
    def attention_probs(self, idx: torch.Tensor) -> torch.Tensor:
        """The attention probabilities S of every layer and head for idx (B, T), computed with
        the formula (whatever `attention` is) and without dropout: (n_layer, B, nh, T, T)."""
        with eval_mode(self):
            x, rope = self.embed(self.transformer.wte(idx))
            probs = []
            for block in self.transformer.h:
                probs.append(block.attn.probs(block.ln_1(x), rope))  # (B, nh, T, T)
                x = block(x, rope=rope)
        return torch.stack(probs)

    def new_kv_cache(
        self, batch_size: int, max_len: int | None = None, ragged: bool = False
    ) -> KVCache:
        """An empty KV cache sized for this model, on its device and in its dtype; ragged: a
        RaggedKVCache, whose rows end at lengths of their own."""
        c, w = self.config, self.transformer.wte.weight
        if ragged and c.attention == "flash":  # its tiles take every row to end where k does
            raise ValueError("a ragged KV cache needs attention=manual or sdpa, not flash")
        kind = RaggedKVCache if ragged else KVCache
        shape = (c.n_layer, batch_size, c.n_head, max_len or c.block_size, c.head_size)
        return kind(*shape, device=w.device, dtype=w.dtype)

    def crop_block_size(self, block_size: int) -> None:
        """Shorten the context to `block_size` (at most the current one), as nanoGPT's does for
        fine-tuning pretrained weights on shorter windows: the first block_size rows of the
        position table and of each causal mask are kept; rope recomputes its tables."""
        if not 0 < block_size <= self.config.block_size:
            raise ValueError(
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
        if self.rotary is not None:
            c = self.config
            self.rotary = RotaryTables(c.head_size, block_size, c.rope_base).to(
                self.transformer.wte.weight.device
            )

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
