"""Checks that a model is causal: the output at position t may use inputs <= t, nothing later.

The checks, each localising what it finds to the first sublayer whose output is wrong:

- perturbation: change the token at one position s; every watched output at positions < s
  must stay the same (and the logits at s must change: a model blind to its input proves
  nothing).
- jacobian: d output[:, t] / d embedding[:, s] must be exactly zero for every s > t.
- kv-cache: decoding through the KV cache (a prefill, a chunk over the cache, then one token
  at a time) must give the full forward's outputs.

and on a transformers causal LM, through its own interfaces (attention mask, position ids,
cache, window):

- attention-span: each layer's attention output depends on exactly the keys its mask allows,
  d attn_out[t] / d attn_in[s] != 0 iff t - window < s <= t (window: the config's sliding
  window on the layers that have one, else none): nothing later, nothing out of the window,
  every key inside it reachable.
- padding: prompts of different lengths in one batch, padded left and right with the attention
  mask, get the outputs each gets alone; left-padded, the same greedy continuation (generate).
- packing: documents packed in one row with restarting position ids get what each gets alone.

The watched outputs, in forward order, are the embeddings, each block's sublayers (ours: ln_1,
attn, ln_2 and mlp; a transformers layer's children, in the order they run), the final norm,
lm_head and the logits. The first of them to change is where the future gets in: everything
before it is clean, and its input is built from them.

`check_causality(model)` runs every check on our GPT in eval and train mode (dropout masks
reseeded) with each attention implementation, and on a transformers model (`audit_transformers`)
the checks above in eval mode with its own attention, and on any function of ids to logits
(`audit_function`) perturbation, and kv-cache and padding through the hooks it declares;
`assert_causal(model)` raises with the localised report;
`shrunk_config(model_values)` is an architecture at tiny sizes (train.py's guard checks one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from base.errors import ConfigError
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
    the input at `source` > t changes. source None: the output at t differs from what it should
    equal (`versus`: a KV-cached output from the full forward's, a padded row from itself)."""

    where: str
    t: int
    source: int | None
    size: float
    versus: str = "cached output at t={t} differs from the full forward's"  # source None

    def __str__(self) -> str:
        if self.source is None:
            what = self.versus.format(t=self.t)
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
Audited = GPT | nn.Module | LanguageModel  # ours, a transformers causal LM, or a function


def is_transformers(model: Audited) -> bool:
    """A transformers model (PreTrainedModel's interface), told apart without importing it."""
    return hasattr(model, "get_decoder") and hasattr(model, "config")


def _layers(model: nn.Module) -> nn.ModuleList | None:
    """A transformers model's decoder layers: its decoder's list of num_hidden_layers modules
    (None: it has none)."""
    n = model.config.num_hidden_layers
    found = (m for m in model.get_decoder().modules() if isinstance(m, nn.ModuleList))
    return next((m for m in found if len(m) == n), None)


def _watched(model: Audited) -> dict[nn.Module, str]:
    """The watched modules and their names: ours by name; a transformers model's embedding, each
    layer's children (recorded in the order they run), head; none in a function of ids."""
    if isinstance(model, GPT):
        parts, blocks = ("ln_1", "attn", "ln_2", "mlp"), enumerate(model.transformer.h)
        watched = {model.transformer.drop: "embeddings"}
        watched |= {getattr(block, p): f"layer {i} {p}" for i, block in blocks for p in parts}
        return watched | {model.transformer.ln_f: "ln_f", model.lm_head: "lm_head"}
    if not is_transformers(model):
        return {}
    watched = {model.get_input_embeddings(): "embeddings"}
    for i, layer in enumerate(_layers(model)):
        watched |= {child: f"layer {i} {name}" for name, child in layer.named_children()}
    return watched | {model.get_output_embeddings(): "lm_head"}


def _logits(model: Audited, idx: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The logits (B, T, V) of ids idx (B, T); kwargs: the model's own (a cache, a mask)."""
    if isinstance(model, GPT):
        return model(idx, **kwargs)[0]
    if is_transformers(model):
        return model(input_ids=idx, **kwargs).logits
    return model(idx, **kwargs)  # a function: its own hooks' keywords (cache, attention_mask)


def _run(model: Audited, idx: torch.Tensor, seed: int, **kwargs: Any) -> Outputs:
    """Every watched output in the order they ran, then the logits; the RNG is reseeded so that
    dropout draws the same masks on every call."""
    watched, outputs = _watched(model), {}

    def record(module: nn.Module, args: Any, out: Any) -> None:
        if module not in watched:  # a global hook: every module of every model calls it
            return
        out = out[0] if isinstance(out, tuple) else out  # attn: (y, S)
        if out.shape[:2] == idx.shape:  # (B, T, ...): not OPT's fc1 on flattened rows
            outputs[watched[module]] = out

    # no hook where nothing is watched: a compiled function would recompile for each new one
    hook = register_module_forward_hook(record) if watched else contextlib.nullcontext()
    with hook, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        logits = _logits(model, idx, **kwargs)
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


# ----- the checks on any model -------------------------------------------------------------------


@torch.no_grad()
def perturbation_check(model: Audited, idx: torch.Tensor, seed: int = 0) -> CheckResult:
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


def jacobian_check(model: GPT | nn.Module, idx: torch.Tensor, seed: int = 0) -> CheckResult:
    """d logits[:, t] / d embedding[:, s] must be exactly zero for every s > t (and not all
    zero for s <= t). On a violation, the first watched output with a nonzero gradient from a
    later position is the leak."""
    T = idx.size(1)
    leaves: list[torch.Tensor] = []

    def as_leaf(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        leaves.append(out.detach().requires_grad_(True))
        return leaves[-1]  # (B, T, C): what the rest of the model sees

    embedding = model.transformer.wte if isinstance(model, GPT) else model.get_input_embeddings()
    with torch.enable_grad(), embedding.register_forward_hook(as_leaf):
        outputs = _run(model, idx, seed)
    (emb,) = leaves

    def jacobian(output: torch.Tensor) -> torch.Tensor:
        """(T, T): [t, s] = max |d output[:, t] / d emb[:, s]|; zero for an output upstream of
        emb (a transformers embedding's own, recorded before it is made the leaf)."""
        grad = functools.partial(torch.autograd.grad, retain_graph=True, allow_unused=True)
        rows = [grad(output[:, t].sum(), emb)[0] for t in range(T)]
        if rows[0] is None:
            return torch.zeros(T, T)
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
def kv_cache_check(model: Audited, idx: torch.Tensor, cache: Any = None) -> CheckResult:
    """Decode idx through the model's KV cache (ours, a transformers DynamicCache, which keeps
    a sliding window's last keys only, or a function's `cache`, given empty), a third as a
    prefill, then a chunk of at least 2 tokens over the cache, then one token at a time: every
    watched output must equal the full forward's within 1e-5 times its scale (rounding: < 5e-7;
    rope positions off after the prefill: > 1e-4). Eval mode."""
    B, T = idx.shape
    full = _run(model, idx, seed=0)
    prefill = max(1, T // 3)
    chunk = min(T, prefill + max(2, T // 3))
    bounds = sorted({0, prefill, chunk, *range(chunk + 1, T + 1)})  # each call's [start, end)
    cache = _empty_cache(model, B, T) if cache is None else {"cache": cache}
    parts = [_run(model, idx[:, a:b], 0, **cache) for a, b in itertools.pairwise(bounds)]
    cached = {key: torch.cat([p[key] for p in parts], dim=1) for key in full}
    largest = (cached["logits"] - full["logits"]).abs().max().item()
    leak = _first_change(full, cached, T, 1e-5, source=None)
    return CheckResult("kv-cache", "difference from the full forward", T, largest, leak)


def _empty_cache(model: GPT | nn.Module, batch_size: int, max_len: int) -> dict[str, Any]:
    """The forward's keyword arguments that decode through a new, empty cache of the model's own
    kind (transformers 5 names it `cache`, 4 `past_key_values`)."""
    if isinstance(model, GPT):
        return {"cache": model.new_kv_cache(batch_size, max_len=max_len)}
    from transformers import DynamicCache

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: DynamicCache(config=model.config), "use_cache": True}


# ----- the checks through a transformers model's own interfaces ----------------------------


def _windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: the full causal span), from the config: layer_types
    where it has them (Gemma, Qwen2), else sliding_window on every layer (Mistral, Phi-3)."""
    window, n = getattr(config, "sliding_window", None), config.num_hidden_layers
    kinds = getattr(config, "layer_types", None) or n * ["sliding_attention" if window else ""]
    if unknown := sorted(set(kinds) - {"full_attention", "sliding_attention", ""}):
        raise ConfigError(
            f"layer_types {unknown} are not checked: the audit knows full_attention "
            "and sliding_attention layers"
        )
    return [window if kind == "sliding_attention" else None for kind in kinds]


def attention_span_check(model: nn.Module, idx: torch.Tensor) -> CheckResult:
    """Each layer's attention output at t depends on its input at exactly the positions s its
    window allows, t - window < s <= t: d attn_out[:, t] / d attn_in[:, s] is zero outside
    (a leak: later, or older than the window) and nonzero inside (a key the mask hides wrongly).
    Each layer's attention input is made a leaf, so a layer is judged on its own mask alone."""
    T = idx.size(1)
    attentions = [
        next(c for n, c in layer.named_children() if "att" in n) for layer in _layers(model)
    ]
    inputs, outputs = {}, {}

    def as_leaf(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = (args[0] if args else kwargs["hidden_states"]).detach().requires_grad_(True)
        inputs[module] = x  # (B, T, C)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    def keep(module: nn.Module, args: tuple, out: Any) -> None:
        outputs[module] = out[0] if isinstance(out, tuple) else out  # (B, T, C)

    with contextlib.ExitStack() as hooks, torch.enable_grad():
        for attn in attentions:
            hooks.enter_context(attn.register_forward_pre_hook(as_leaf, with_kwargs=True))
            hooks.enter_context(attn.register_forward_hook(keep))
        _logits(model, idx)
    largest, leak, problems = 0.0, None, []
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i, (attn, window) in enumerate(zip(attentions, _windows(model.config), strict=True)):
        out, x = outputs[attn], inputs[attn]
        w = torch.randn(out.shape[-1], generator=torch.Generator().manual_seed(i)).to(out)
        # a random direction, not the sum: a sum after a LayerNorm (BERT's) has no gradient
        rows = [
            torch.autograd.grad((out[:, t] @ w).sum(), x, retain_graph=True)[0] for t in range(T)
        ]
        grads = torch.stack(rows).abs().amax(dim=(1, 3)).cpu()  # (T, T): [t, s] from (T, B, T, C)
        allowed = causal if window is None else causal & ~causal.tril(-window)
        span = "causal" if window is None else f"window {window}"
        outside = grads.masked_fill(allowed, 0)
        largest = max(largest, outside.max().item())
        if leak is None and outside.max() > 0:
            t, s = divmod(int(outside.argmax()), T)
            leak = Leak(f"layer {i} attention ({span})", t, s, outside.max().item())
        if (hidden := allowed & (grads == 0)).any():
            t, s = divmod(int(hidden.float().argmax()), T)
            problems.append(f"layer {i} attention ({span}): output at t={t} ignores input at t={s}")
    return CheckResult("attention-span", "gradient outside the span", T, largest, leak, problems)


@torch.no_grad()
def padding_check(model: nn.Module, idx: torch.Tensor, new_tokens: int = 3) -> CheckResult:
    """Every other row cut to half its length, the batch padded left and then right, with the
    attention mask (and for transformers, left, the position ids generate gives: the mask's
    cumulative sum; a function derives its own): each row's outputs at its tokens must equal
    its own alone within 1e-5 of their scale, and for transformers, left-padded, generate's
    greedy continuation of `new_tokens` must be the row's alone."""
    B, T = idx.shape
    hf = is_transformers(model)
    lengths = [T - (b % 2) * (T // 2) for b in range(B)]
    alone = [_run(model, idx[b : b + 1, :n], 0) for b, n in enumerate(lengths)]
    largest, leak, problems = 0.0, None, []
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    greedy |= dict(pad_token_id=0)
    for side in ("left", "right"):
        ids, mask = torch.zeros_like(idx), torch.zeros_like(idx)  # pad id 0: masked anyway
        cols = [slice(T - n, T) if side == "left" else slice(0, n) for n in lengths]
        for b, (n, c) in enumerate(zip(lengths, cols, strict=True)):
            ids[b, c], mask[b, c] = idx[b, :n], 1
        positions = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        batched = _run(model, ids, 0, attention_mask=mask, **positions if hf else {})
        for b, (n, c) in enumerate(zip(lengths, cols, strict=True)):
            row = {name: out[b : b + 1, c] for name, out in batched.items()}
            largest = max(largest, (row["logits"] - alone[b]["logits"]).abs().max().item())
            found = _first_change(alone[b], row, n, 1e-5, source=None)
            if leak is None and found is not None:
                versus = f"{side}-padded row {b}'s output at t={{t}} differs from the row alone"
                leak = dataclasses.replace(found, versus=versus)
        if side == "left" and hf:
            batch = model.generate(ids, attention_mask=mask, **greedy)[:, T:]
            for b, n in enumerate(lengths):
                ones = mask.new_ones(1, n)  # 0 is a token here, not padding
                own = model.generate(idx[b : b + 1, :n], attention_mask=ones, **greedy)[0, n:]
                if not torch.equal(batch[b], own):
                    problems.append(
                        f"left-padded row {b}'s greedy continuation "
                        f"{batch[b].tolist()} is not its own {own.tolist()}"
                    )
    return CheckResult(
        "padding", "difference from the row alone", sum(lengths), largest, leak, problems
    )


@torch.no_grad()
def packing_check(model: nn.Module, idx: torch.Tensor) -> CheckResult:
    """Two documents packed in one row, the position ids restarting at the second (no attention
    mask: transformers reads the documents from the position ids): each document's outputs
    must equal its own alone within 1e-5 of their scale."""
    T = idx.size(1)
    docs = [idx[0, : T // 2], idx[-1, : T - T // 2]]
    row, position_ids = torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])
    position_ids = position_ids[None].to(idx.device)  # (1, T); with a cache no packing is read
    packed = _run(model, row, 0, position_ids=position_ids, use_cache=False)
    largest, leak = 0.0, None
    for i, (doc, start) in enumerate(zip(docs, (0, T // 2), strict=True)):
        alone = _run(model, doc[None], 0)
        part = {name: out[:, start : start + len(doc)] for name, out in packed.items()}
        largest = max(largest, (part["logits"] - alone["logits"]).abs().max().item())
        found = _first_change(alone, part, len(doc), 1e-5, source=None)
        if leak is None and found is not None:
            versus = f"packed document {i}'s output at t={{t}} differs from the document alone"
            leak = dataclasses.replace(found, versus=versus)
    return CheckResult("packing", "difference from the document alone", T, largest, leak)


def undrivable(model: nn.Module) -> str | None:
    """Why the checks cannot run on a transformers model (None: they can): not a causal LM, an
    attention not causal by design, a cache that is not keys and values, no layers found."""
    if not model.can_generate() or getattr(model.config, "is_encoder_decoder", False):
        return "it is not a causal language model (an encoder or an encoder-decoder)"
    if model._is_stateful or not model._supports_default_dynamic_cache():
        return "it keeps a recurrent state, not a cache of keys and values (the audit's)"
    if names := [n for n, m in model.named_modules() if getattr(m, "is_causal", True) is False]:
        return f"its attention is not causal by design ({names[0]}.is_causal=False): an encoder"
    if _layers(model) is None:
        return f"its decoder has no list of num_hidden_layers={model.config.num_hidden_layers}"
    return None


def audit_transformers(
    model: nn.Module, seq_len: int = 8, batch_size: int = 2, seed: int = 0
) -> CausalityReport:
    """Every check on a transformers causal LM, with its own attention implementation, in eval
    mode (put back after): perturbation, jacobian, kv-cache, attention-span, padding, packing.
    A model the checks cannot drive is refused in one line (`undrivable`)."""
    if reason := undrivable(model):
        raise ConfigError(f"{type(model).__name__} cannot be audited: {reason}")
    idx = random_tokens(model, seq_len, batch_size, seed)
    impl = model.config._attn_implementation
    with eval_mode(model):
        found = [
            perturbation_check(model, idx, seed),
            jacobian_check(model, idx, seed),
            kv_cache_check(model, idx),
            attention_span_check(model, idx),
            padding_check(model, idx),
            packing_check(model, idx),
        ]
    return CausalityReport([dataclasses.replace(c, name=f"{impl} {c.name}") for c in found])


# ----- every check, on every implementation -----------------------------------------------


def _variant(model: GPT, **changes: Any) -> GPT:
    """The same model (class and weights) with other config values, e.g. another attention."""
    if all(getattr(model.config, k) == v for k, v in changes.items()):
        return model
    other = type(model)(dataclasses.replace(model.config, **changes))
    other.load_state_dict(model.state_dict())
    return other.to(model.lm_head.weight.device)


def random_tokens(
    model: GPT | nn.Module, seq_len: int, batch_size: int = 2, seed: int = 0
) -> torch.Tensor:
    """(batch_size, min(seq_len, the model's context)) random token ids on the model's device."""
    c = model.config
    T = min(seq_len, c.block_size if isinstance(model, GPT) else c.max_position_embeddings)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, c.vocab_size, (batch_size, T), generator=gen)
    return idx.to(next(model.parameters()).device)


def check_causality(
    model: GPT | nn.Module,
    seq_len: int = 8,
    batch_size: int = 2,
    seed: int = 0,
    attention: tuple[str, ...] | None = None,
) -> CausalityReport:
    """Every check with each attention implementation that runs on the model's device (the
    model's own first; `attention` narrows them): perturbation and jacobian in eval mode and in
    train mode (dropout `TRAIN_DROPOUT` if the model has none, masks reseeded), and the KV
    cache in eval mode. The model's mode is left as it was. A transformers model gets
    `audit_transformers` (`attention`: its own only)."""
    if is_transformers(model):
        return audit_transformers(model, seq_len, batch_size, seed)
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


def audit_function(
    fn: LanguageModel,
    seq_len: int = 8,
    batch_size: int = 2,
    seed: int = 0,
    vocab_size: int = 64,
    new_cache: Callable[[int, int], Any] | None = None,
    attention_mask: bool = False,
) -> CausalityReport:
    """The checks a function of ids (B, T) -> logits (B, T, V) takes (your own model's forward),
    on random ids, in eval mode if it is a module: perturbation; kv-cache when `new_cache(
    batch_size, max_len)` makes an empty cache of yours that `fn(ids, cache=cache)` decodes
    through, each call continuing from what it holds; padding with `attention_mask=True`:
    `fn(ids, attention_mask=mask)`, mask (B, T) 1 at a token, 0 at a pad (positions are yours
    to derive from it)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    mode = eval_mode(fn) if isinstance(fn, nn.Module) else contextlib.nullcontext()
    with mode:
        found = [perturbation_check(fn, idx, seed)]
        if new_cache is not None:
            found.append(kv_cache_check(fn, idx, cache=new_cache(batch_size, seq_len)))
        if attention_mask:
            found.append(padding_check(fn, idx))
    return CausalityReport(found)


def assert_causal(model: Audited, **kwargs: Any) -> None:
    """Raise CausalityError, with where each leak enters, unless every check passes. One line
    in a test suite: `assert_causal(GPT(config))`, or a transformers causal LM (kwargs: those
    of check_causality), or any function of ids to logits (kwargs: audit_function's hooks)."""
    audit = check_causality if isinstance(model, GPT) or is_transformers(model) else audit_function
    report = audit(model, **kwargs)
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
