"""Autoregressive generation: sampling parameters, the next-token rule, and a KV-cached stream.

The reference semantics, with or without the cache, are nanoGPT's: at every step
    logits = model(idx[:, -block_size:])[0][:, -1]
and the next token is drawn from those logits by `next_token`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.filters import apply_repetition_penalty, min_p_filter, top_k_filter, top_p_filter
from model import GPT


def _check(name: str, value: object, kind: type, ok: Callable[[float], bool], rule: str) -> None:
    """Raise a one-line ValueError naming the field unless value is a `kind` satisfying ok."""
    kinds = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) or not isinstance(value, kinds) or not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a token; checked on construction so that a bad value fails
    before a model is loaded, with the name of the field. None disables a filter."""

    temperature: float = 1.0  # 0: greedy (argmax)
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0  # 1: off

    def __post_init__(self) -> None:
        _check("temperature", self.temperature, float, lambda x: x >= 0, ">= 0 (0 means greedy)")
        if self.top_k is not None:
            _check("top_k", self.top_k, int, lambda x: x >= 1, "an integer >= 1 or null")
        if self.top_p is not None:
            _check("top_p", self.top_p, float, lambda x: 0 < x <= 1, "in (0, 1] or null")
        if self.min_p is not None:
            _check("min_p", self.min_p, float, lambda x: 0 <= x <= 1, "in [0, 1] or null")
        _check(
            "repetition_penalty", self.repetition_penalty, float, lambda x: x > 0, "> 0 (1 is off)"
        )


def next_token(
    logits: torch.Tensor,
    context: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token (B,) from last-position logits (B, V), given the tokens so far (B, T)
    (for the repetition penalty). Randomness comes only from `generator`, for reproducibility."""
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, context, params.repetition_penalty)
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p is not None:
        logits = min_p_filter(logits, params.min_p)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


class TokenContext:
    """The sequence so far and its next-token logits, equal to the reference
    `model(seq[:, -block_size:])[0][:, -1]` at every step.

    With the cache, while the sequence fits in block_size the prompt is processed once and then
    only the newest token per step. Positions are learned absolute embeddings, so once the
    sequence outgrows block_size the window slides and every token changes position: the cached
    keys and values no longer apply. From then on each step recomputes the last block_size
    tokens in full, which is correct but no faster than running without a cache.
    """

    def __init__(
        self,
        model: GPT,
        idx: torch.Tensor,
        use_cache: bool = True,
        vocab_size: int | None = None,
    ):
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(
                f"idx must be (batch, tokens) with at least one token, got {tuple(idx.shape)}; "
                "start an empty prompt from the end-of-text token"
            )
        self.model = model
        self.block_size = model.config.block_size
        self.seq = idx
        self.cache = model.new_kv_cache(idx.size(0)) if use_cache else None
        self.vocab_size = vocab_size  # the tokenizer's: rows past it are padding (see `logits`)

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        """Logits (B, V) for the token after `seq`; call once per `append`."""
        if self.seq.size(1) > self.block_size:
            self.cache = None  # the window slides: positions shift, cached keys are stale
        if self.cache is None:
            logits = self.model(self.seq[:, -self.block_size :])[0][:, -1]
        else:
            new = self.seq[:, self.cache.length :]  # the whole prompt first, then one token
            logits = self.model(new, cache=self.cache)[0][:, -1]
        if self.vocab_size is not None and self.vocab_size < logits.size(-1):
            # A vocabulary padded for aligned matmuls (50304 rows for GPT-2's 50257 tokens):
            # the padding decodes to nothing, so it can never be drawn, greedy or sampled.
            logits = logits.masked_fill(
                torch.arange(logits.size(-1), device=logits.device) >= self.vocab_size,
                float("-inf"),
            )
        return logits

    def append(self, token: torch.Tensor) -> None:
        """Extend every row by its token (B,)."""
        self.seq = torch.cat([self.seq, token[:, None]], dim=1)


@torch.no_grad()
def stream_tokens(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    eot_token: int | None = None,
    vocab_size: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), one step at a time, so callers can print text
    as it comes or stop early (stop strings) by leaving the loop.

    idx (B, T) is the prompt, one row per sample: the batch is generated together. A row that
    produced `eot_token` keeps producing it, and the stream ends once every row has. The model
    should be in eval mode (dropout would make the samples noisier, not wrong). `vocab_size`:
    the tokenizer's, when the model's vocabulary is padded past it (never drawn).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    params = params or SamplingParams()
    context = TokenContext(model, idx, use_cache, vocab_size)
    finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        token = next_token(context.logits(), context.seq, params, generator)
        if eot_token is not None:
            token = token.masked_fill(finished, eot_token)
            finished |= token == eot_token
        context.append(token)
        yield token
        if finished.all():
            return


def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    eot_token: int | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """`stream_tokens` collected: the prompt followed by the new tokens, (B, T + n)."""
    steps = stream_tokens(
        model, idx, max_new_tokens, params, generator, use_cache, eot_token, vocab_size
    )
    return torch.cat([idx, *(token[:, None] for token in steps)], dim=1)
