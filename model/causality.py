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
`shrunk_config(model_values)` is an architecture at tiny sizes (train.py's guard checks one).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from model.gpt import ATTENTION_IMPLS, GPT, GPTConfig, eval_mode, unavailable_attention

TRAIN_DROPOUT = 0.1  # the train-mode checks' dropout when the model has none
# A shrunk copy: every option, 4 dimensions per head, a 64-token vocabulary, a 16-token context
# and flash tiles of 4 (so that 8 tested positions cross several tiles and the diagonal).
SHRUNK_HEAD_SIZE = 4
SHRUNK_SIZES = dict(vocab_size=64, block_size=16, flash_block_q=4, flash_block_k=4)
Outputs = dict[str, torch.Tensor]  # each watched output (B, T, ...) by name, in forward order


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

    def failures(self) -> list[str]:
        return ([str(self.leak)] if self.leak else []) + self.problems

    @property
    def passed(self) -> bool:
        return not self.failures()

    def line(self) -> str:
        status = "pass" if self.passed else "FAIL"
        text = f"{self.name:<42} {self.positions:>2} positions, largest {self.measure}"
        text += f" {self.largest:.1e}: {status}"
        return "\n".join([text, *(f"  {p}" for p in self.failures())])


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
        keys = ("positions", "largest", "measure", "passed")
        checks = {c.name: {key: getattr(c, key) for key in keys} for c in self.checks}
        first = self.first_leak
        if first is not None:
            first = {"check": first[0], **dataclasses.asdict(first[1]), "message": str(first[1])}
        return {"causal": self.causal, "checks": checks, "first_leak": first}

    def __str__(self) -> str:
        return "\n".join([*(c.line() for c in self.checks), json.dumps(self.summary())])


class CausalityError(AssertionError):
    """Raised by assert_causal; the message is the localised report of every failed check."""


# ----- running the model with its sublayers watched: the only code that knows their names ---


LanguageModel = Callable[[torch.Tensor], torch.Tensor]  # any ids (B, T) -> logits (B, T, V)


def _run(model: GPT | LanguageModel, idx: torch.Tensor, seed: int, **kwargs: Any) -> Outputs:
    """Every watched output, then the logits (of a function of ids: its logits alone); the RNG
    is reseeded so that dropout draws the same masks on every call."""
    if not isinstance(model, GPT):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return {"logits": model(idx)}
    parts, blocks = ("ln_1", "attn", "ln_2", "mlp"), enumerate(model.transformer.h)
    watched = {model.transformer.drop: "embeddings"}
    watched |= {getattr(block, p): f"layer {i} {p}" for i, block in blocks for p in parts}
    watched |= {model.transformer.ln_f: "ln_f", model.lm_head: "lm_head"}
    outputs: Outputs = {}

    def record(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if module in watched:  # a global hook: every module of every model calls it
            outputs[watched[module]] = out

    with register_module_forward_hook(record), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        logits, _ = model(idx, **kwargs)
    return {**outputs, "logits": logits}


def _first_change(
    base: Outputs, other: Outputs, end: int, tol: float, source: int | None
) -> Leak | None:
    """The first watched output whose positions < end differ by more than tol times its own
    scale (its largest magnitude), at its largest difference, as a leak from `source`. Relative,
    because a norm scales a small difference in its input up to its own output's size: float32
    rounding stays below 1e-6 of each output's scale."""
    for name, b in base.items():
        diff = (other[name][:, :end] - b[:, :end]).abs().flatten(2).amax(dim=(0, 2))  # (end,)
        if diff.max() > tol * b.abs().max():
            return Leak(name, int(diff.argmax()), source, diff.max().item())
    return None


# ----- the three checks -------------------------------------------------------------------


@torch.no_grad()
def perturbation_check(model: GPT | LanguageModel, idx: torch.Tensor, seed: int = 0) -> CheckResult:
    """For each position s > 0, replace the token at s with another one: no watched output at
    positions < s may move (by more than 1e-6 times its scale: the past is computed exactly as
    before, so it does not move at all) and the logits at s must move.
    Works in train mode too (dropout masks are reseeded), and on any function of ids."""
    B, T = idx.shape
    gen = torch.Generator().manual_seed(seed)
    base = _run(model, idx, seed)
    V = base["logits"].size(-1)
    largest, leaks, problems = 0.0, [], []
    for s in range(1, T):
        perturbed = idx.clone()
        shift = torch.randint(1, V, (B,), generator=gen).to(idx.device)
        perturbed[:, s] = (idx[:, s] + shift) % V  # a different token in every row
        out = _run(model, perturbed, seed)
        largest = max(largest, (out["logits"][:, :s] - base["logits"][:, :s]).abs().max().item())
        leaks.append(_first_change(base, out, s, 1e-6, source=s))
        if torch.equal(out["logits"][:, s], base["logits"][:, s]):
            problems.append(f"the logits at t={s} ignore the token at t={s}")
    order = list(base)  # report the earliest output in forward order, then the largest change
    leak = min(filter(None, leaks), key=lambda x: (order.index(x.where), -x.size), default=None)
    return CheckResult("perturbation", "change in the past", T - 1, largest, leak, problems)


def jacobian_check(model: GPT, idx: torch.Tensor, seed: int = 0) -> CheckResult:
    """d logits[:, t] / d embedding[:, s] must be exactly zero for every s > t (and not all
    zero for s <= t). On a violation, the first watched output with a nonzero gradient from a
    later position is the leak."""
    T = idx.size(1)
    leaves: list[torch.Tensor] = []

    def as_leaf(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        leaves.append(out.detach().requires_grad_(True))
        return leaves[-1]  # (B, T, C): what the rest of the model sees

    with torch.enable_grad(), model.transformer.wte.register_forward_hook(as_leaf):
        outputs = _run(model, idx, seed)
    (emb,) = leaves

    def jacobian(output: torch.Tensor) -> torch.Tensor:
        """(T, T): [t, s] = max |d output[:, t] / d emb[:, s]|."""
        rows = [
            torch.autograd.grad(output[:, t].sum(), emb, retain_graph=True)[0] for t in range(T)
        ]
        return torch.stack(rows).abs().amax(dim=(1, 3)).cpu()  # from (T, B, T, C)

    logits = jacobian(outputs["logits"])
    problems = [
        f"the gradient of the logits at t={t} reaches no input <= t"
        for t in range(T)
        if logits[t, : t + 1].max() == 0
    ]
    largest, leak = logits.triu(1).max().item(), None
    if largest > 0:  # localise: the first output with a gradient from the future
        for where, output in outputs.items():
            future = jacobian(output).triu(1)
            if future.max() > 0:
                t, source = divmod(int(future.argmax()), T)
                leak = Leak(where, t, source, future.max().item())
                break
    return CheckResult("jacobian", "gradient from the future", T, largest, leak, problems)


@torch.no_grad()
def kv_cache_check(model: GPT, idx: torch.Tensor) -> CheckResult:
    """Decode idx through the KV cache, a third as a prefill, then a chunk of at least 2 tokens
    over the cache, then one token at a time: every watched output must equal the full
    forward's within 1e-5 times its scale (rounding: < 5e-7; rope positions off after the
    prefill: > 1e-4). Eval mode."""
    B, T = idx.shape
    full = _run(model, idx, seed=0)
    prefill = max(1, T // 3)
    chunk = min(T, prefill + max(2, T // 3))
    bounds = sorted({0, prefill, chunk, *range(chunk + 1, T + 1)})  # each call's [start, end)
    cache = model.new_kv_cache(B, max_len=T)
    parts = [_run(model, idx[:, a:b], 0, cache=cache) for a, b in itertools.pairwise(bounds)]
    cached = {key: torch.cat([p[key] for p in parts], dim=1) for key in full}
    largest = (cached["logits"] - full["logits"]).abs().max().item()
    leak = _first_change(full, cached, T, 1e-5, source=None)
    return CheckResult("kv-cache", "difference from the full forward", T, largest, leak)


# ----- every check, on every implementation -----------------------------------------------


def _variant(model: GPT, **changes: Any) -> GPT:
    """The same model (class and weights) with other config values, e.g. another attention."""
    if all(getattr(model.config, k) == v for k, v in changes.items()):
        return model
    other = type(model)(dataclasses.replace(model.config, **changes))
    other.load_state_dict(model.state_dict())
    return other.to(model.lm_head.weight.device)


def random_tokens(model: GPT, seq_len: int, batch_size: int = 2, seed: int = 0) -> torch.Tensor:
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
    """Every check with each attention implementation that runs on the model's device (the
    model's own first; `attention` narrows them): perturbation and jacobian in eval mode and in
    train mode (dropout `TRAIN_DROPOUT` if the model has none, masks reseeded), and the KV
    cache in eval mode. The model's mode is left as it was."""
    own = model.config.attention
    cannot = unavailable_attention(model.lm_head.weight.device)
    impls = attention or (own, *(a for a in ATTENTION_IMPLS if a != own and a not in cannot))
    idx = random_tokens(model, seq_len, batch_size, seed)
    dropout = model.config.dropout or TRAIN_DROPOUT
    modes = (("eval", {}), (f"train, dropout {dropout:g}", {"dropout": dropout}))
    checks = []
    with eval_mode(model):  # the model's mode is put back after the checks
        for impl, (mode, changes) in itertools.product(impls, modes):
            m = _variant(model, attention=impl, **changes).train(mode != "eval")
            found = [perturbation_check(m, idx, seed), jacobian_check(m, idx, seed)]
            if not m.training:
                found.append(kv_cache_check(m, idx))
            checks += [dataclasses.replace(c, name=f"{impl} {c.name} ({mode})") for c in found]
    return CausalityReport(checks)


def assert_causal(model: GPT | LanguageModel, **kwargs: Any) -> None:
    """Raise CausalityError, with where each leak enters, unless every check passes. One line
    in a test suite: `assert_causal(GPT(config))`; kwargs: those of check_causality. Any other
    function of ids (B, T) -> logits (B, T, V), your own model's forward, gets the perturbation
    check on random ids (kwargs: seq_len, batch_size, seed, vocab_size): no logit at t may move
    when a token after t changes, and the first position that does is named."""
    if not isinstance(model, GPT):
        T, B, seed = kwargs.get("seq_len", 8), kwargs.get("batch_size", 2), kwargs.get("seed", 0)
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, kwargs.get("vocab_size", 64), (B, T), generator=gen)
        report = CausalityReport([perturbation_check(model, idx, seed)])
    else:
        report = check_causality(model, **kwargs)
    if not report.causal:
        raise CausalityError("the model is not causal:\n" + "\n".join(report.failures()))


def shrunk_config(model_values: dict[str, Any], max_layers: int | None = None) -> GPTConfig:
    """The architecture of `model_values` (a model config; vocab_size may be null) at the
    SHRUNK_SIZES, with its head count and (up to max_layers) its layers. zero_init_proj is
    turned off: it changes only the initial values, and zeroed projections would hide a leak."""
    config = GPTConfig.from_dict({**model_values, "vocab_size": SHRUNK_SIZES["vocab_size"]})
    return dataclasses.replace(
        config,
        n_embd=SHRUNK_HEAD_SIZE * config.n_head,
        n_layer=min(config.n_layer, max_layers or config.n_layer),
        zero_init_proj=False,
        **{key: min(getattr(config, key), size) for key, size in SHRUNK_SIZES.items()},
    )
