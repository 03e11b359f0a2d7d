"""GPTConfig: the model's shape as a validated dataclass; the YAML presets in configs/model/."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from base.checks import boolean, check, choice, is_number, positive_int
from base.errors import ConfigError

PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"
ATTENTION_IMPLS = ("manual", "sdpa", "flash")
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
    # FlashAttention, memory linear in T (model/flash_attention.py)
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


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_preset(name: str) -> dict[str, Any]:
    """The raw values of configs/model/<name>.yaml (no Hydra needed). `vocab_size: null` in a
    preset means "the tokenizer's vocabulary size", filled in by whoever knows the tokenizer."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; known presets: {preset_names()}")
    return yaml.safe_load(path.read_text())
