"""Checks that a model is causal: the output at position t may use inputs <= t, nothing later.

Three checks, each localising what it finds to the first sublayer whose output is wrong:

- perturbation: change the token at one position s; every watched output at positions < s
  must stay the same (and the logits at s must change: a model blind to its input proves
  nothing).
- jacobian: d output[:, t] / d embedding[:, s] must be exactly zero for every s > t.
- kv-cache: decoding through the KV cache (a prefill, a chunk over the cache, then one token
  at a time) must give the full forward's outputs.

The watched outputs, in forward order, are the embeddings (after dropout), each block's ln_1,
attn, ln_2 and mlp, the final norm ln_f, lm_head and the logits. The first of them to change is
where the future gets in: everything before it is clean, and its input is built from them.

`check_causality(model)` runs every check in eval and train mode (dropout masks reseeded) with
each attention implementation; `assert_causal(model)` raises with the localised report;
`guard_report(model_values)` checks a shrunk copy of an architecture (train.py's guard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from model.config import ATTENTION_IMPLS, GPTConfig
from model.gpt import GPT

TRAIN_DROPOUT = 0.1  # the train-mode checks' dropout when the model has none
# A shrunk copy: every option, 4 dimensions per head, a 64-token vocabulary, a 16-token context
# and flash tiles of 4 (so that 8 tested positions cross several tiles and the diagonal).
SHRUNK_HEAD_SIZE = 4
SHRUNK_SIZES = dict(vocab_size=64, block_size=16, flash_block_q=4, flash_block_k=4)
# The guard also keeps at most 2 layers, as the test suite does: a leak in code that every
# layer runs shows in layer 0, and layer 1 covers one that reaches the logits through a later
# layer; gpt2-xl's 48 layers would cost seconds at every start.
GUARD_LAYERS = 2


@dataclass(frozen=True)
class Leak:
    """Where the future first gets in: `where` (e.g. "layer 3 mlp") changes at position t when
    the input at `source` > t changes. source None: the KV-cached output at t differs from the
    full forward's."""

    where: str
    t: int
    source: int | None
    size: float

    def __str__(self) -> str:
        if self.source is None:
            what = f"cached output at t={self.t} differs from the full forward's"
        else:
            what = f"output at t={self.t} depends on input at t={self.source}"
        return f"leak: {self.where}: {what} (|d|={self.size:.1e})"


@dataclass
class CheckResult:
    """One check: how many positions it tested and the largest change it saw where none is
    allowed (at the logits); `leak` localises a violation, `problems` name anything else."""

    name: str
    measure: str  # what `largest` is, e.g. "change in the past"
    positions: int
    largest: float
    leak: Leak | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.leak is None and not self.problems

    def line(self) -> str:
        status = "pass" if self.passed else "FAIL"
        text = f"{self.name:<42} {self.positions:>2} positions, largest {self.measure}"
        text += f" {self.largest:.1e}: {status}"
        return "\n".join([text, *(f"  {p}" for p in self.failures())])

    def failures(self) -> list[str]:
        return ([str(self.leak)] if self.leak else []) + self.problems


@dataclass
class CausalityReport:
    checks: list[CheckResult]

    @property
    def causal(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def first_leak(self) -> tuple[str, Leak] | None:
        """(check name, leak) of the first check that found one."""
        return next(((c.name, c.leak) for c in self.checks if c.leak), None)

    def failures(self) -> list[str]:
        return [f"{c.name}: {f}" for c in self.checks for f in c.failures()]

    def summary(self) -> dict[str, Any]:
        """The JSON-able result: {"causal", "checks": {name: {...}}, "first_leak"}."""
        first = self.first_leak
        return {
            "causal": self.causal,
            "checks": {
                c.name: {
                    "positions": c.positions,
                    "largest": c.largest,
                    "measure": c.measure,
                    "passed": c.passed,
                }
                for c in self.checks
            },
            "first_leak": None
            if first is None
            else {"check": first[0], **dataclasses.asdict(first[1]), "message": str(first[1])},
        }

    def __str__(self) -> str:
        return "\n".join([*(c.line() for c in self.checks), json.dumps(self.summary())])


class CausalityError(AssertionError):
    """Raised by assert_causal; the message is the localised report of every failed check."""


# ----- the model's internals: the only code that knows its module names -------------------


def _token_embedding(model: GPT) -> nn.Module:
    """The module that turns token ids into vectors: the input the Jacobian is taken against."""
    return model.transformer.wte


def _watched(model: GPT) -> list[tuple[str, nn.Module]]:
    """The sublayers whose outputs are compared, in forward order."""
    sites = [("embeddings", model.transformer.drop)]
    for i, block in enumerate(model.transformer.h):
        for part in ("ln_1", "attn", "ln_2", "mlp"):
            sites.append((f"layer {i} {part}", getattr(block, part)))
    return [*sites, ("ln_f", model.transformer.ln_f), ("lm_head", model.lm_head)]


# ----- running the model with its sublayers watched ---------------------------------------


@contextlib.contextmanager
def _watching(model: GPT) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, every forward records each watched output (B, T, ...) by name."""
    outputs: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            outputs[name] = out

        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in _watched(model)]
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()


def _run(model: GPT, idx: torch.Tensor, seed: int, **kwargs: Any) -> dict[str, torch.Tensor]:
    """Every watched output and the logits, with the RNG reseeded so that dropout draws the same
    masks on every call."""
    with torch.random.fork_rng(devices=[]), _watching(model) as outputs:
        torch.manual_seed(seed)
        logits, _ = model(idx, **kwargs)
    return {**outputs, "logits": logits}


def _first_change(
    base: dict[str, torch.Tensor], other: dict[str, torch.Tensor], end: int, tol: float
) -> tuple[str, float, int] | None:
    """(name, size, position) of the first watched output whose positions < end differ by more
    than tol times its own scale (its largest magnitude), at its largest difference; None if
    none does. Relative, because a norm scales a small difference in its input up to its own
    output's size: float32 rounding stays below 1e-6 of each output's scale."""
    for name, b in base.items():
        diff = (other[name][:, :end] - b[:, :end]).abs().flatten(2).amax(dim=(0, 2))  # (end,)
        if diff.numel() and diff.max() > tol * b.abs().max():
            return name, diff.max().item(), int(diff.argmax())
    return None


# ----- the three checks -------------------------------------------------------------------


@torch.no_grad()
def perturbation_check(
    model: GPT, idx: torch.Tensor, seed: int = 0, rtol: float = 1e-6, name: str = "perturbation"
) -> CheckResult:
    """For each position s > 0, replace the token at s with another one: no watched output at
    positions < s may move (by more than rtol times its scale: the past is computed exactly as
    before, so it does not move at all) and the logits at s must move.
    Works in train mode too (dropout masks are reseeded)."""
    B, T = idx.shape
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    base = _run(model, idx, seed)
    order = list(base)  # the watched outputs in forward order, then the logits
    result = CheckResult(name, "change in the past", max(T - 1, 0), 0.0)
    for s in range(1, T):
        perturbed = idx.clone()
        shift = torch.randint(1, V, (B,), generator=gen).to(idx.device)
        perturbed[:, s] = (idx[:, s] + shift) % V  # a different token in every row
        out = _run(model, perturbed, seed)
        past = (out["logits"][:, :s] - base["logits"][:, :s]).abs().max().item()
        result.largest = max(result.largest, past)
        change = _first_change(base, out, s, rtol)
        if change is not None:  # keep the earliest output in forward order, then the largest
            where, size, t = change
            rank = (order.index(where), -size)
            if result.leak is None or rank < (order.index(result.leak.where), -result.leak.size):
                result.leak = Leak(where, t, s, size)
        if torch.equal(out["logits"][:, s], base["logits"][:, s]):
            result.problems.append(f"the logits at t={s} ignore the token at t={s}")
    return result


def jacobian_check(
    model: GPT, idx: torch.Tensor, seed: int = 0, name: str = "jacobian"
) -> CheckResult:
    """d logits[:, t] / d embedding[:, s] must be exactly zero for every s > t (and not all
    zero for s <= t). On a violation, the first watched output with a nonzero gradient from a
    later position is the leak."""
    T = idx.size(1)
    inputs: list[torch.Tensor] = []

    def as_leaf(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        inputs.append(out.detach().requires_grad_(True))
        return inputs[-1]  # (B, T, C): what the rest of the model sees

    handle = _token_embedding(model).register_forward_hook(as_leaf)
    try:
        with torch.enable_grad():
            outputs = _run(model, idx, seed)
    finally:
        handle.remove()
    (emb,) = inputs

    def grads(output: torch.Tensor, t: int) -> torch.Tensor:
        """max |d output[:, t] / d emb[:, s]| for each s: (T,)."""
        if not output.requires_grad:
            return torch.zeros(T)
        (g,) = torch.autograd.grad(output[:, t].sum(), emb, retain_graph=True, allow_unused=True)
        return torch.zeros(T) if g is None else g.abs().amax(dim=(0, 2)).cpu()

    result = CheckResult(name, "gradient from the future", T, 0.0)
    for t in range(T):
        g = grads(outputs["logits"], t)
        result.largest = max(result.largest, g[t + 1 :].max().item() if t + 1 < T else 0.0)
        if g[: t + 1].max() == 0:
            result.problems.append(f"the gradient of the logits at t={t} reaches no input <= t")
    if result.largest > 0:  # localise: the first output with a gradient from the future
        for where, output in outputs.items():
            worst = max(((grads(output, t)[t + 1 :], t) for t in range(T - 1)), key=_peak)
            if _peak(worst) > 0:
                future, t = worst
                result.leak = Leak(where, t, t + 1 + int(future.argmax()), future.max().item())
                break
    return result


def _peak(pair: tuple[torch.Tensor, int]) -> float:
    return pair[0].max().item()


@torch.no_grad()
def kv_cache_check(
    model: GPT, idx: torch.Tensor, rtol: float = 1e-5, name: str = "kv-cache"
) -> CheckResult:
    """Decode idx through the KV cache, a third as a prefill, then a chunk of at least 2 tokens
    over the cache, then one token at a time: every watched output must equal the full
    forward's within rtol times its scale (rounding: < 5e-7; rope positions off after the
    prefill: > 1e-4). Eval mode."""
    B, T = idx.shape
    full = _run(model, idx, seed=0)
    prefill = max(1, T // 3)
    chunk = min(T, prefill + max(2, T // 3))
    bounds = sorted({0, prefill, chunk, *range(chunk + 1, T + 1)})  # each call's [start, end)
    cache = model.new_kv_cache(B, max_len=T)
    calls = zip(bounds[:-1], bounds[1:], strict=True)
    parts = [_run(model, idx[:, a:b], seed=0, cache=cache) for a, b in calls]
    cached = {key: torch.cat([p[key] for p in parts], dim=1) for key in full}
    largest = (cached["logits"] - full["logits"]).abs().max().item()
    result = CheckResult(name, "difference from the full forward", T, largest)
    change = _first_change(full, cached, T, rtol)
    if change is not None:
        where, size, t = change
        result.leak = Leak(where, t, None, size)
    return result


# ----- every check, on every implementation -----------------------------------------------


def _variant(model: GPT, **changes: Any) -> GPT:
    """The same model (class and weights) with other config values, e.g. another attention."""
    if all(getattr(model.config, k) == v for k, v in changes.items()):
        return model
    other = type(model)(dataclasses.replace(model.config, **changes))
    other.load_state_dict(model.state_dict())
    return other.to(model.lm_head.weight.device)


def random_tokens(model: GPT, seq_len: int = 8, batch_size: int = 2, seed: int = 0) -> torch.Tensor:
    """(batch_size, min(seq_len, block_size)) random token ids on the model's device."""
    T = min(seq_len, model.config.block_size)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (batch_size, T), generator=gen)
    return idx.to(model.lm_head.weight.device)


def check_causality(
    model: GPT,
    seq_len: int = 8,
    batch_size: int = 2,
    seed: int = 0,
    attention: tuple[str, ...] | None = None,
) -> CausalityReport:
    """Every check with each attention implementation (the model's own first; `attention`
    narrows them): perturbation and jacobian in eval mode and in train mode (dropout
    `TRAIN_DROPOUT` if the model has none, masks reseeded), and the KV cache in eval mode.
    The model's mode is left as it was."""
    own = model.config.attention
    impls = attention or (own, *(a for a in ATTENTION_IMPLS if a != own))
    idx = random_tokens(model, seq_len, batch_size, seed)
    was_training = model.training
    checks = []
    try:
        for impl in impls:
            m = _variant(model, attention=impl).eval()
            checks += [
                perturbation_check(m, idx, seed, name=f"{impl} perturbation (eval)"),
                jacobian_check(m, idx, seed, name=f"{impl} jacobian (eval)"),
                kv_cache_check(m, idx, name=f"{impl} kv-cache (eval)"),
            ]
            dropout = model.config.dropout or TRAIN_DROPOUT
            m = _variant(model, attention=impl, dropout=dropout).train()
            mode = f"(train, dropout {dropout:g})"
            checks += [
                perturbation_check(m, idx, seed, name=f"{impl} perturbation {mode}"),
                jacobian_check(m, idx, seed, name=f"{impl} jacobian {mode}"),
            ]
    finally:
        model.train(was_training)
    return CausalityReport(checks)


def assert_causal(model: GPT, **kwargs: Any) -> None:
    """Raise CausalityError, with where each leak enters, unless every check passes. One line
    in a test suite: `assert_causal(GPT(config))`. kwargs: those of check_causality."""
    report = check_causality(model, **kwargs)
    if not report.causal:
        raise CausalityError("the model is not causal:\n" + "\n".join(report.failures()))


def find_leaks(
    model: GPT, batch_size: int = 2, seq_len: int | None = None, seed: int = 0
) -> list[str]:
    """The perturbation and Jacobian checks on the model as it is (its mode and attention);
    one line per failure, [] when no leak was found."""
    idx = random_tokens(model, seq_len or 16, batch_size, seed)
    checks = [perturbation_check(model, idx, seed), jacobian_check(model, idx, seed)]
    return CausalityReport(checks).failures()


# ----- the guard: a shrunk copy of an architecture ----------------------------------------


def shrunk_config(model_values: dict[str, Any], max_layers: int | None = None) -> GPTConfig:
    """The architecture of `model_values` (a model config; vocab_size may be null) at the
    SHRUNK_SIZES, with its head count and (up to max_layers) its layers. zero_init_proj is
    turned off: it changes only the initial values, and zeroed projections would hide a leak."""
    original = GPTConfig.from_dict({**model_values, "vocab_size": 1}).to_dict()  # validated
    values = {**original, "n_embd": SHRUNK_HEAD_SIZE * original["n_head"], "zero_init_proj": False}
    values["n_layer"] = min(original["n_layer"], max_layers or original["n_layer"])
    values["vocab_size"] = SHRUNK_SIZES["vocab_size"]
    for key in ("block_size", "flash_block_q", "flash_block_k"):
        values[key] = min(original[key], SHRUNK_SIZES[key])
    return GPTConfig(**values)


def guard_report(model_values: dict[str, Any], seed: int = 0) -> tuple[CausalityReport, dict]:
    """Check a shrunk copy of the architecture with its own attention implementation, leaving
    torch's RNG as it was. Returns the report and the record kept with checkpoints."""
    config = shrunk_config(model_values, GUARD_LAYERS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    sizes = ", ".join(f"{k}={getattr(config, k)}" for k in ("n_layer", "n_embd", "vocab_size"))
    return _timed_report(model, f"a shrunk copy (same options): {sizes}", seed)


def loaded_model_report(model: GPT, seed: int = 0) -> tuple[CausalityReport, dict]:
    """The guard for loaded weights, whose architecture cannot be shrunk: the model itself,
    with its own attention implementation, on a short sequence."""
    c = model.config
    return _timed_report(model, f"the loaded model: n_layer={c.n_layer}, n_embd={c.n_embd}", seed)


def _timed_report(model: GPT, description: str, seed: int) -> tuple[CausalityReport, dict]:
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        report = check_causality(model, seed=seed, attention=(model.config.attention,))
    record = {
        **report.summary(),
        "model": description,
        "seconds": round(time.perf_counter() - start, 3),
    }
    return report, record
