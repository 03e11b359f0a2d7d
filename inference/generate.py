"""Autoregressive generation: logit filters, sampling parameters, the next-token rule, a KV-cached
stream of tokens, and the text they make (incremental UTF-8, stop strings).

Which tokens each new token sees (the same with and without the cache, so `use_cache` changes
the speed, never the tokens): the window starts at the first token and grows one token a step;
when the next token would make it longer than block_size, it restarts at the last
block_size // 2 tokens. So every token is predicted from between half a window and a full one,
at positions 0, 1, ... of that window:
    logits = model(seq[:, start:])[0][:, -1]
and the next token is drawn from those logits by `next_token`. (nanoGPT slides the window by
one token every step, `seq[:, -block_size:]`: a full window each time, but with learned
positions every token then moves, every cached key goes stale, and each step costs a whole
forward over block_size tokens.)
"""

from __future__ import annotations

import codecs
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tiktoken
import torch
import torch.nn.functional as F
from torch import nn

from base.errors import ConfigError, check, defaults_from, is_int, is_number, yaml_config
from hardware.device import ThreadChoice, decoder_for, is_sharded
from model import GPT
from model.gpt import KVCache

# ----- logit filters -----------------------------------------------------------------------------

# Logit filters for sampling, applied by `next_token` in this order:
# repetition penalty -> temperature -> top-k -> top-p -> min-p.
#
# Each takes float logits (B, V) and returns new logits in which removed tokens are -inf, so the
# filters compose and the final softmax renormalises over the tokens that survive. A setting is
# one number for every row, or each row's own, (B, 1): a server's batch samples in one pass.


def apply_repetition_penalty(
    logits: torch.Tensor, context: torch.Tensor, penalty: float | torch.Tensor
) -> torch.Tensor:
    """CTRL's penalty (Keskar et al., 2019): every token that occurs in `context` (B, T) gets
    less likely. Positive logits are divided by `penalty`, negative ones multiplied by it
    (dividing a negative logit would raise it). penalty < 1 favours repetition instead."""
    seen = logits.gather(-1, context)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, context, seen)


def top_k_filter(logits: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Keep exactly the k highest logits of each row; of those tied with the k-th, the ones at
    the lowest indices. Not topk's order among ties, which changes with the batch's shape: a
    server's row keeps what the same row keeps alone (ties are common in bfloat16 logits)."""
    rows, vocab = logits.shape
    most = min(int(k if isinstance(k, int) else k.max()), vocab)
    k = torch.full((rows, 1), most) if isinstance(k, int) else k.clamp(1, most)  # (B, 1)
    k = k.to(logits.device)  # each row's own (one clamped from 0: top_k off, its result unused)
    values, keep = logits.topk(min(most + 1, vocab), dim=-1)  # (B, most + 1): one past the k-th
    kth = values.gather(-1, k - 1)
    if bool(((values.gather(-1, k % values.size(-1)) == kth) & (k < vocab)).any()):  # tied past
        above, tied = logits > kth, logits == kth
        tied &= tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)
        return logits.masked_fill(~(above | tied), float("-inf"))
    first_k = torch.arange(most, device=logits.device) < k  # (B, most)
    kept = values[:, :most].masked_fill(~first_k, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, keep[:, :most], kept)


def top_p_filter(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al., 2020): keep the smallest set of most likely tokens
    whose probabilities add up to at least p. The most likely token always survives."""
    sorted_probs, order = F.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # of strictly more likely tokens
    remove_sorted = mass_before >= p
    remove_sorted[..., 0] = False  # even where p rounds to 0 in float32
    remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """min-p (Nguyen et al., 2024): keep tokens at least p times as likely as the most likely
    one, so the cut adapts to how confident the model is."""
    probs = F.softmax(logits, dim=-1)
    threshold = p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


# ----- sampling and the token stream -------------------------------------------------------------


@defaults_from(yaml_config("sample.yaml"), frozen=True)
class SamplingParams:
    """How to turn logits into a token; checked on construction so that a bad value fails
    before a model is loaded, with the name of the field. None disables a filter. The defaults
    are sample.py's (configs/sample.yaml)."""

    temperature: float  # 0: greedy (argmax)
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float  # 1: off

    def __post_init__(self) -> None:
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        check("temperature", t, is_number(t, 0), ">= 0 (0 means greedy)")
        check("top_k", k, k is None or is_int(k, 1), "an integer >= 1 or null")
        check("top_p", p, p is None or (is_number(p, 0, 1) and p > 0), "in (0, 1] or null")
        check("min_p", m, m is None or is_number(m, 0, 1), "in [0, 1] or null")
        penalty = self.repetition_penalty
        check("repetition_penalty", penalty, is_number(penalty) and penalty > 0, "> 0 (1 is off)")


def next_token(
    logits: torch.Tensor,
    context: torch.Tensor | list[torch.Tensor],
    params: SamplingParams | list[SamplingParams],
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> torch.Tensor:
    """The next token (B,) from last-position logits (B, V), given the tokens so far (B, T)
    (for the repetition penalty). Randomness comes only from `generator`, for reproducibility.
    A server's batch gives each row its own: contexts (1, T_r), params and generators in lists,
    sampled in one pass, each row's token the one it would draw alone.
    Always a token the logits allow: where the settings leave no distribution (a temperature
    or penalty so near 0 that the logits overflow and every probability is NaN), the greedy one,
    their limit."""
    rows, device = logits.size(0), logits.device
    each = params if isinstance(params, list) else [params]

    def column(values: list) -> Any:  # one number for every row, or each row's own (B, 1)
        return values[0] if len(set(values)) == 1 else torch.tensor(values, device=device)[:, None]

    logits = logits.float()
    if any(p.repetition_penalty != 1.0 for p in each):
        if isinstance(context, list):  # each row padded with its own first token: seen already
            longest = max(c.size(1) for c in context)
            context = torch.cat(
                [F.pad(c, (0, longest - c.size(1)), value=int(c[0, 0])) for c in context]
            )
        penalty = column([p.repetition_penalty for p in each])
        logits = apply_repetition_penalty(logits, context, penalty)
    greedy = logits.argmax(dim=-1)
    if all(p.temperature == 0 for p in each):
        return greedy
    logits = logits / column([p.temperature or 1.0 for p in each])  # 0: greedy (below)
    for keep, name in {top_k_filter: "top_k", top_p_filter: "top_p", min_p_filter: "min_p"}.items():
        on = [getattr(p, name) is not None for p in each]  # in this order; None: off
        if any(on):
            filtered = keep(logits, column([getattr(p, name) or 0 for p in each]))
            logits = filtered if all(on) else torch.where(column(on), filtered, logits)
    # Inverse-CDF sampling: one uniform u per row, and the first token whose cumulative
    # probability exceeds u * total is token i with probability p_i, the distribution of
    # torch.multinomial(probs, 1). One random number instead of one per vocabulary entry: over
    # 50k entries, a fraction of multinomial's time (docs/performance.md, Sampling). The sum is
    # in float64 so that no entry's share is rounded.
    cdf = F.softmax(logits, dim=-1).cumsum(dim=-1, dtype=torch.float64)  # (B, V)
    total = cdf[:, -1:]  # (B, 1)
    if isinstance(generator, list):  # each row's uniform from its own generator
        u = torch.cat([torch.rand(1, 1, generator=g, dtype=torch.float64) for g in generator])
    else:
        u = torch.rand(rows, 1, generator=generator, dtype=torch.float64)
    # u * total may round up to the total, past every entry: keep u below it, where the first
    # entry above u is still one that adds probability
    u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # c[i-1] <= u < c[i]: p_i > 0
    sampled = (total > 0) & column([p.temperature > 0 for p in each])  # NaN > 0 is False
    return torch.where(sampled.squeeze(-1), drawn, greedy)


def window_start(length: int, start: int | None, block_size: int) -> int:
    """Where the window over a sequence of `length` tokens starts (see the top of this module): a
    new window (start None) at the last block_size tokens; one that would outgrow block_size
    restarts at the last block_size // 2 (at least one); else it stays at `start`."""
    if start is None:
        return max(0, length - block_size)
    if length - start > block_size:
        return length - max(1, block_size // 2)
    return start


class StepKVCache:
    """A KVCache as a compiled decoding step sees it: one new token a forward, at the position
    `at` (a tensor, set before each step), over the keys and values of all max_len positions,
    those after `at` masked as the future is (stale or zero, they get exactly no weight). Fixed
    shapes and no Python number that changes from step to step, so that torch.compile captures
    the step once, not once per position. It writes into `cache`'s tensors (where the eager
    forwards of a prompt or a refill wrote), and `cache` keeps the count: `advance` is its job."""

    def __init__(self, cache: KVCache):
        self.k, self.v = cache.k, cache.v  # (B, nh, max_len, hs) per layer: the same tensors
        self.at = torch.zeros(1, dtype=torch.long, device=cache.k[0].device)

    def positions(self, T: int) -> torch.Tensor:
        return self.at  # (1,): T is 1

    def allowed(self, causal_mask: torch.Tensor, T: int) -> torch.Tensor:
        return causal_mask[self.at]  # (1, max_len): the causal mask's row at `at`

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[layer].index_copy_(2, self.at, k)  # (B, nh, 1, hs) into (B, nh, max_len, hs)
        self.v[layer].index_copy_(2, self.at, v)
        return self.k[layer], self.v[layer]

    def advance(self, n: int) -> None:
        pass  # the cache it writes into counts


def _one_token(decoder: nn.Module, token: torch.Tensor, cache: StepKVCache) -> torch.Tensor:
    return decoder(token, cache=cache, last_only=True)[0][:, -1]  # (B, V)


@functools.cache
def compiled_step() -> Callable[..., torch.Tensor]:
    """`_one_token` compiled: one graph for a model's every decoding step (and batch size), made
    at its first call, from torch's on-disk caches where an earlier process compiled the same
    step. A function, so that only a compiled decoding imports dynamo (1.3 s)."""
    return torch.compile(_one_token, fullgraph=True, dynamic=False)


# compile=auto compiles for this many new tokens or more. On a 2-core AMD EPYC (Zen 4), 30M
# shape, a compiled step saves ~1 ms a token (float32, 8 and 4 bits) and compiling takes 1-4 s
# from torch's on-disk cache, 10-25 s cold: a warm compile pays after ~1,000-4,000 tokens (on the
# 124M shape it does not pay: docs/performance.md, Compiled decoding).
COMPILE_PAYS_AFTER = 4096


def decoding_plan(compile: Any, model: GPT, max_new_tokens: int) -> tuple[bool, str]:
    """(whether the one-token steps run through `compiled_step`, a line saying which and why),
    for sample.py's `compile`: true, false, or auto (compile where it pays, above). Where the
    step cannot compile, true is refused and auto decodes eagerly."""
    why_not = None
    if model.config.attention == "flash":  # its tiles take the queries to be the last keys
        why_not = "attention=flash decodes eagerly (use attention=manual or sdpa to compile)"
    elif is_sharded(model):
        why_not = "a model FSDP shards decodes eagerly"
    if why_not and compile is True:
        raise ConfigError(f"compile=true: {why_not}")
    if compile == "auto" and not why_not and max_new_tokens < COMPILE_PAYS_AFTER:
        why_not = f"compile=auto: {max_new_tokens} new tokens, under the {COMPILE_PAYS_AFTER:,} "
        why_not += "a compile pays for"
    if why_not or compile is False:
        return False, f"decoding: eager ({why_not or 'compile=false'})"
    return True, "decoding: compiled (the first token waits for torch.compile: 1-25 s)"


class TokenContext:
    """The sequence so far and the logits of its next token, from the window defined at the top
    of this module: `model(seq[:, start:])[0][:, -1]`, with `start` moved to the last
    block_size // 2 tokens whenever the window would outgrow block_size.

    With the cache, each window's first tokens are processed once (the prompt, or the refill of
    half a window), then only the newest token per step: a refill every block_size // 2 tokens
    keeps the cost per token flat however long the generation. Without it, every step runs the
    whole window (the reference the cached path must equal). Either way the language-model head
    runs at the last position only.
    """

    def __init__(
        self,
        model: GPT,
        idx: torch.Tensor,
        use_cache: bool = True,
        vocab_size: int | None = None,
        compiled: bool = False,
        quantize: str | None = None,
    ):
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(
                f"idx must be (batch, tokens) with at least one token, got {tuple(idx.shape)}; "
                "start an empty prompt from the end-of-text token"
            )
        self.block_size = model.config.block_size
        self.seq = idx
        self.start = window_start(idx.size(1), None, self.block_size)
        self.cache = model.new_kv_cache(idx.size(0)) if use_cache else None
        # Rows of the logits past the tokenizer's vocabulary are padding (see `logits`)
        self.padding = None
        if vocab_size is not None and vocab_size < model.config.vocab_size:
            self.padding = torch.arange(model.config.vocab_size, device=idx.device) >= vocab_size
        # On a CPU, a token's matrix-vector products stream the weights faster from the layout
        # of hardware/device.py, in a copy of the model's Linear layers; `quantize`: the copy's
        # weights in 8 or 4 bits
        self.decoder = decoder_for(model, quantize)
        # `compiled`: each one-token step over the cache through `compiled_step`
        self.step_cache = StepKVCache(self.cache) if compiled and self.cache is not None else None
        # inference_mode: no_grad, and no view or version tracking (~10% less per token); but
        # FSDP's hooks need version counters, so its sharded models decode under no_grad
        self.grad_free = torch.no_grad if is_sharded(model) else torch.inference_mode

    def logits(self) -> torch.Tensor:
        """Logits (B, V) for the token after `seq`; call once per `append`."""
        start = window_start(self.seq.size(1), self.start, self.block_size)
        if start != self.start:  # the window was full: it restarts
            self.start = start
            if self.cache is not None:
                self.cache.reset()
        with self.grad_free():
            cached = 0 if self.cache is None else self.cache.length
            new = self.seq[:, self.start + cached :]  # with a cache: the window's start, then 1
            if self.step_cache is not None and new.size(1) == 1:
                self.step_cache.at.fill_(cached)
                token = new.clone(memory_format=torch.contiguous_format)  # strides (1, 1) always
                logits = compiled_step()(self.decoder, token, self.step_cache)  # (B, V)
                self.cache.advance(1)
            else:
                logits = self.decoder(new, cache=self.cache, last_only=True)[0][:, -1]  # (B, V)
            if self.padding is not None:
                # A vocabulary padded for aligned matmuls (50304 rows for GPT-2's 50257 tokens):
                # the padding decodes to nothing, so it can never be drawn, greedy or sampled.
                logits = logits.masked_fill(self.padding, float("-inf"))
        return logits

    def append(self, token: torch.Tensor) -> None:
        """Extend every row by its token (B,)."""
        self.seq = torch.cat([self.seq, token[:, None]], dim=1)


def stream_tokens(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    eot_token: int | None = None,
    vocab_size: int | None = None,
    compiled: bool = False,
    quantize: str | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), one step at a time, so callers can print text
    as it comes or stop early (stop strings) by leaving the loop.

    idx (B, T) is the prompt, one row per sample: the batch is generated together. A row that
    produced `eot_token` keeps producing it, and the stream ends once every row has. The model
    should be in eval mode (dropout would make the samples noisier, not wrong). `vocab_size`:
    the tokenizer's, when the model's vocabulary is padded past it (never drawn). The tokens are
    inference tensors: clone one to change it in place. Each step runs on the CPU thread count
    `ThreadChoice` picks (hardware/device.py), and gives torch its count back before yielding.
    `compiled`: the one-token steps through `compiled_step` (the same tokens; see
    `decoding_plan`); `quantize` (int8, int4): from the model's Linear weights in 8 or 4 bits
    (hardware/device.py's QUANTIZED: not the same tokens, close ones).
    """
    params = params or SamplingParams()
    context = TokenContext(model, idx, use_cache, vocab_size, compiled, quantize)
    finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    # no trials for a compiled step: a graph holds its thread count (another is a recompile)
    threads = ThreadChoice(trials=context.decoder is not model and context.step_cache is None)
    for step in range(max_new_tokens):
        with context.grad_free(), threads.step(step):
            token = next_token(context.logits(), context.seq, params, generator)
            if eot_token is not None:
                token = token.masked_fill(finished, eot_token)
                finished |= token == eot_token
            context.append(token)
        yield token
        if finished.all():
            return


def generate(model: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`stream_tokens` (same arguments) collected: the prompt followed by the new tokens,
    (B, T + n)."""
    steps = stream_tokens(model, idx, *args, **kwargs)
    return torch.cat([idx, *(token[:, None] for token in steps)], dim=1)


# ----- from tokens to text -----------------------------------------------------------------------

# From tokens to text as they arrive: incremental UTF-8 decoding and stop strings.
#
# A BPE token can end in the middle of a UTF-8 character (an emoji is often two or three
# byte-level tokens), so text is shown only once its characters are complete. Text that could be
# the beginning of a stop string is held back until it is clear whether the stop string follows.

_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|(.))", re.DOTALL)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def decode_escapes(text: str) -> str:
    r"""`\n`, `\t`, `\r`, `\\` and `\uXXXX` as the characters they name: the shell and Hydra
    pass `'stop=["\n\n"]'` on as backslash, n. Any other backslash stays as written."""
    # group 1: the hex digits of \\uXXXX; group 2: the character after any other backslash
    return _ESCAPE.sub(lambda m: chr(int(m[1], 16)) if m[1] else _ESCAPES.get(m[2], m[0]), text)


class TextStream:
    """One sample's text, token by token. `push` returns the text that became safe to show;
    the sample ends at the first stop string (which is not shown) or at `finish`."""

    def __init__(self, tokenizer: tiktoken.Encoding, stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ConfigError("stop strings must be non-empty")
        self._token_bytes = tokenizer.decode_single_token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._held = ""  # decoded, not yet shown: it may be the start of a stop string
        self.text = ""  # everything shown so far
        self.done = False

    def push(self, token: int) -> str:
        """Add one token; return the new text that is now complete (possibly "")."""
        if self.done:
            return ""
        return self._release(self._utf8.decode(self._token_bytes(token)))

    def finish(self) -> str:
        """End the sample (end-of-text or token budget); return whatever was held back, with
        an unfinished character shown as U+FFFD."""
        if self.done:
            return ""
        shown = self._release(self._utf8.decode(b"", final=True))
        rest, self._held, self.done = self._held, "", True
        self.text += rest
        return shown + rest

    def _release(self, new: str) -> str:
        buf = self._held + new
        if hits := [i for i in (buf.find(s) for s in self._stop) if i >= 0]:
            self._held, self.done, shown = "", True, buf[: min(hits)]
        else:
            held = max((_overlap(buf, s) for s in self._stop), default=0)
            self._held, shown = buf[len(buf) - held :], buf[: len(buf) - held]
        self.text += shown
        return shown


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    longest_first = range(min(len(text), len(stop) - 1), 0, -1)
    return next((n for n in longest_first if text.endswith(stop[:n])), 0)
