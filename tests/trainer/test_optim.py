"""The learning-rate schedules and AdamW's parameter groups."""

from __future__ import annotations

import math

import pytest
import torch

from model import GPT
from tests.conftest import tiny_config
from trainer.config import ConfigError, OptimSettings
from trainer.optim import build_optimizer, lr_at


def schedule(max_steps: int, **kw) -> list[float]:
    settings = OptimSettings(**{"lr": 1.0, "min_lr": 0.1, **kw})
    return [lr_at(s, settings, max_steps) for s in range(max_steps)]


def test_warmup_is_linear_then_cosine_reaches_min_lr_at_the_last_step():
    lrs = schedule(111, warmup_steps=10)  # cosine over steps 10..110
    assert lrs[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.5 * 0.9)  # half-way through the cosine
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))  # never rises again


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction():
    lrs = schedule(100, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    assert lrs[10:80] == [1.0] * 70
    assert lrs[-1] == pytest.approx(0.1)
    steps = [lrs[i] - lrs[i + 1] for i in range(80, 99)]
    assert steps == pytest.approx([steps[0]] * len(steps))  # linear


def test_constant_schedule():
    assert schedule(20, warmup_steps=5, schedule="constant")[5:] == [1.0] * 15


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
@pytest.mark.parametrize(
    "max_steps, warmup, min_lr",
    [(1, 0, 0.1), (1, 5, 0.1), (5, 5, 0.1), (3, 10, 0.1), (10, 0, 1.0), (2, 1, 0.0)],
)
def test_edge_values_give_finite_rates_within_bounds(kind, max_steps, warmup, min_lr):
    lrs = schedule(max_steps, warmup_steps=warmup, min_lr=min_lr, schedule=kind)
    assert len(lrs) == max_steps
    assert all(math.isfinite(lr) and 0.0 <= lr <= 1.0 for lr in lrs)


def test_min_lr_equal_to_lr_is_flat():
    assert schedule(20, warmup_steps=0, min_lr=1.0) == [1.0] * 20


def test_min_lr_above_lr_is_refused():
    with pytest.raises(ConfigError, match="optim.min_lr"):
        OptimSettings(lr=1e-3, min_lr=1e-2)


def test_decay_applies_to_matrices_only_and_each_parameter_once():
    model = GPT(tiny_config())
    optimizer = build_optimizer(model, OptimSettings(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])  # biases and LayerNorm gains
    grouped = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(grouped) == len(set(grouped)) == len(list(model.parameters()))  # tied head once
