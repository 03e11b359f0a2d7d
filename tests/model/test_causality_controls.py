"""Negative controls: deliberately leaky edits of the model, made here (never in the shipped
code) by patching its classes, so that every model built while the patch holds has the leak,
the guard's and the command's included. Each must be caught by the report, by
`check_causality.py` (exit 1) and by train.py's guard, and localised to the layer and sublayer
that lets the future in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import check_causality
from base.errors import ConfigError
from model import GPT, gpt
from model.causality import check_causality as causality_report
from model.causality import shrunk_config
from model.gpt import Block, CausalSelfAttention
from tests.conftest import load_preset
from trainer.config import RunConfig
from trainer.preflight import causality_guard


def _after_init(monkeypatch: pytest.MonkeyPatch, cls: type, edit: Callable) -> None:
    """Patch cls so that edit(instance) runs at the end of its __init__."""
    init = cls.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        edit(self)

    monkeypatch.setattr(cls, "__init__", patched)


def _mask_in_layer(layer: int, diagonal: int | None) -> Callable:
    """Layer `layer`'s mask: tril(diagonal) (1: one position ahead), or none at all."""

    def edit(attn: CausalSelfAttention) -> None:
        if attn.layer_idx == layer:
            ones = torch.ones_like(attn.causal_mask)
            attn.causal_mask = ones if diagonal is None else ones.tril(diagonal)

    return edit


class NeighbourMLP(nn.Module):
    """An MLP whose output at t also gets its output at t + 1: a "token mixing" MLP."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.inner = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)  # (B, T, C)
        return y + 0.5 * y.roll(-1, dims=1)


class SequenceNorm(nn.Module):
    """A norm over the sequence and the channels together (the norm it replaces gives its
    gain): every position sees every other."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.inner = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(dim=(1, 2), keepdim=True)  # (B, T, C) minus one mean per sequence
        return x / x.std(dim=(1, 2), keepdim=True) * self.inner.weight


def _replace(attr: str, wrapper: type, layer: int | None = None) -> Callable:
    def edit(module: nn.Module) -> None:
        if layer is None or module.attn.layer_idx == layer:
            setattr(module, attr, wrapper(getattr(module, attr)))

    return edit


def _sdpa_without_mask_on_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """sdpa given the cached path's explicit mask runs without any (right for one new token,
    wrong for a chunk); the full forward's is_causal is kept."""
    sdpa = F.scaled_dot_product_attention

    def patched(q, k, v, attn_mask=None, **kwargs):
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", patched)


def _rope_restarting_at_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call over the cache rotates its tokens from position 0, not from the cache's end."""
    tables = gpt.rope_tables
    monkeypatch.setattr(gpt, "rope_tables", lambda pos, *rest: tables(pos - pos.min(), *rest))


FUTURE = ("perturbation (eval)", "jacobian (eval)", "kv-cache (eval)")
TRAIN = ("perturbation (train, dropout 0.1)", "jacobian (train, dropout 0.1)")
KV_CACHE = ("kv-cache (eval)",)


@dataclass
class Control:
    patch: Callable[[pytest.MonkeyPatch], None]
    where: str  # the sublayer the report must name
    options: dict = field(default_factory=dict)  # the model config's values
    catches: tuple[str, ...] = FUTURE + TRAIN  # the checks (of its own attention) that must fail


CONTROLS = {
    "mask off by one": Control(
        lambda mp: _after_init(mp, CausalSelfAttention, _mask_in_layer(1, diagonal=1)),
        "layer 1 attn",
    ),
    "no mask": Control(
        lambda mp: _after_init(mp, CausalSelfAttention, _mask_in_layer(0, diagonal=None)),
        "layer 0 attn",
    ),
    "mask right for the full forward, wrong for the cache": Control(
        _sdpa_without_mask_on_the_cache, "layer 0 attn", {"attention": "sdpa"}, KV_CACHE
    ),
    "MLP mixing neighbouring positions": Control(
        lambda mp: _after_init(mp, Block, _replace("mlp", NeighbourMLP, layer=1)), "layer 1 mlp"
    ),
    "norm across the sequence in a block": Control(
        lambda mp: _after_init(mp, Block, _replace("ln_2", SequenceNorm, layer=0)),
        "layer 0 ln_2",
        {"norm": "rmsnorm"},
    ),
    "final norm across the sequence": Control(
        lambda mp: _after_init(mp, GPT, lambda m: _replace("ln_f", SequenceNorm)(m.transformer)),
        "ln_f",
    ),
    "rope positions restarting after the cache": Control(
        _rope_restarting_at_zero, "layer 0 attn", {"pos_embedding": "rope"}, KV_CACHE
    ),
}


def _model_values(options: dict) -> dict:
    """The `nano` preset as a run config holds it, with the control's options."""
    return {**load_preset("nano"), **options}


@pytest.mark.parametrize("control", CONTROLS)
def test_the_report_catches_and_localises(control, monkeypatch):
    c = CONTROLS[control]
    c.patch(monkeypatch)
    torch.manual_seed(0)
    model = GPT(shrunk_config(_model_values(c.options)))
    attention = model.config.attention
    report = causality_report(model, attention=(attention,))
    failed = {
        check.name.removeprefix(f"{attention} ") for check in report.checks if not check.passed
    }
    assert failed == set(c.catches)
    first_check, leak = report.first_leak
    assert leak.where == c.where, report
    for check in report.checks:
        if check.leak is not None:
            assert check.leak.where == c.where, check.line()  # every check agrees
    if c.catches == KV_CACHE:
        assert str(leak).startswith(f"leak: {c.where}: cached output at t=")
    else:
        assert str(leak).startswith(f"leak: {c.where}: output at t=")
        assert leak.source > leak.t


@pytest.mark.parametrize("control", CONTROLS)
def test_the_command_exits_1_naming_the_leak(control, monkeypatch, capsys):
    c = CONTROLS[control]
    c.patch(monkeypatch)
    cfg = dict(
        checkpoint=None,
        model=_model_values(c.options),
        shrink=True,
        seq_len=8,
        batch_size=2,
        seed=0,
        attention=c.options.get("attention", "manual"),
        device="cpu",
    )
    assert check_causality.run(cfg) == 1
    out = capsys.readouterr().out
    assert f"leak: {c.where}: " in out and out.count(": FAIL") == len(c.catches)
    assert out.startswith(f"NOT causal: {len(c.catches)} of 5 checks failed on the config's model")
    assert '"causal": false' in out.splitlines()[-1]


@pytest.mark.parametrize("control", CONTROLS)
def test_the_guard_stops_training_naming_the_leak(control, monkeypatch):
    c = CONTROLS[control]
    c.patch(monkeypatch)
    cfg = RunConfig.from_dict({"model": _model_values(c.options), "data": {}})
    with pytest.raises(ConfigError) as error:
        causality_guard(cfg, verbose=False)
    message = str(error.value)
    assert f"leak: {c.where}: " in message and "train.check_causality=false" in message
    assert "\n" not in message
