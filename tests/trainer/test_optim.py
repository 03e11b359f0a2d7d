"""The learning-rate schedules (by steps and by time), AdamW's and Muon's parameter groups."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hardware.distributed import load_optimizer_state
from model import GPT
from tests.conftest import compose_run, make_trainer, tiny_config
from trainer.config import ConfigError, OptimSettings
from trainer.loop import Budget, Trainer
from trainer.optim import (
    Muon,
    build_optimizer,
    is_block_matrix,
    lr_scale,
    param_groups,
    set_lr,
    warmup_drop,
    zeropower_via_newtonschulz5,
)


def schedule(max_steps: int, **kw) -> list[float]:
    """Every step's rate at a peak of 1.0, where the schedule's scale is the rate itself (so too
    in the tests below that set lr=1.0)."""
    settings = OptimSettings(**{"lr": 1.0, "min_lr": 0.1, **kw})
    return [lr_scale(s, settings, max_steps) for s in range(max_steps)]


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


@pytest.mark.parametrize("name", ["adamw", "muon"])
@pytest.mark.parametrize("tie", [True, False])
def test_embed_lr_gives_the_embedding_tables_their_own_rate_and_nothing_else(name, tie):
    model = GPT(tiny_config(tie_embeddings=tie))
    settings = OptimSettings(name=name, lr=1e-3, embed_lr=0.05, warmup_steps=0)
    optimizer = build_optimizer(model, settings, torch.device("cpu"))
    table = model.transformer.wte.weight
    (embed,) = [g for g in optimizer.param_groups if g["base_lr"] == 0.05]
    positions = [model.transformer.wpe.weight] if "wpe" in model.transformer else []
    assert [id(p) for p in embed["params"]] == [id(p) for p in [table, *positions]]
    assert embed["weight_decay"] == settings.weight_decay and embed.get("use_muon") in (None, False)
    others = [p for g in optimizer.param_groups if g is not embed for p in g["params"]]
    assert all(p is not table for p in others)
    assert (model.lm_head.weight is table) == tie  # tied: the head trains at embed_lr too
    grouped = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(grouped) == len(set(grouped)) == len(list(model.parameters()))
    assert optimizer.param_groups[0]["lr"] == 1e-3  # group 0 is still AdamW's rate (the log's)
    set_lr(optimizer, lr_scale(10**6, settings, 100))  # past the end: at its own floor
    assert embed["lr"] == pytest.approx(0.05 * settings.min_lr / settings.lr)


def test_embed_lr_null_keeps_the_groups_of_checkpoints_saved_before_it():
    model = GPT(tiny_config())
    plain = build_optimizer(model, OptimSettings(name="muon"), torch.device("cpu"))
    assert len(plain.param_groups) == 3  # AdamW decay, AdamW no decay, Muon: as before embed_lr
    assert all(g["base_lr"] != 0.05 for g in plain.param_groups)


@pytest.mark.parametrize("value", ["0", "-1", "fast"])
def test_a_bad_embed_lr_names_its_key(value):
    with pytest.raises(ConfigError, match=r"^optim.embed_lr "):
        compose_run([], f"optim.embed_lr={value}")


# ----- the time budget ------------------------------------------------------------------------


def test_time_budget_ends_the_cosine_even_when_max_steps_is_far_away():
    settings = OptimSettings(lr=1.0, min_lr=0.1, warmup_steps=10)
    far = 1_000_000  # a 300-second speedrun with max_steps set high
    assert lr_scale(500, settings, far, time_fraction=0.0) == pytest.approx(1.0, abs=1e-4)
    assert lr_scale(500, settings, far, time_fraction=0.5) == pytest.approx(0.55, abs=1e-4)
    assert lr_scale(500, settings, far, time_fraction=1.0) == pytest.approx(0.1)
    lrs = [lr_scale(500, settings, far, time_fraction=t / 100) for t in range(101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


@pytest.mark.parametrize("kind, half_way", [("cosine", 0.5), ("wsd", 0.9)])
def test_without_a_step_limit_the_time_budget_alone_is_the_horizon(kind, half_way):
    """max_steps None (train.max_seconds alone): however many steps, only the clock decays."""
    settings = OptimSettings(lr=1.0, min_lr=0.1, warmup_steps=10, schedule=kind)
    assert lr_scale(10**9, settings, None, time_fraction=0.0) == 1.0
    assert lr_scale(500, settings, None, time_fraction=half_way) == pytest.approx(0.55)
    assert lr_scale(500, settings, None, time_fraction=1.0) == pytest.approx(0.1)


def test_the_further_along_of_steps_and_time_sets_the_progress():
    settings = OptimSettings(lr=1.0, min_lr=0.1, warmup_steps=0)
    assert lr_scale(99, settings, 100, time_fraction=0.1) == pytest.approx(0.1)  # steps are done
    assert lr_scale(0, settings, 100, time_fraction=1.0) == pytest.approx(0.1)  # time is up
    time_up = lr_scale(0, settings, 100, 1.0)
    assert lr_scale(0, settings, 100, time_fraction=7.0) == time_up  # clamped
    assert lr_scale(50, settings, 101, time_fraction=-1.0) == lr_scale(50, settings, 101)


def test_warmup_is_counted_in_steps_even_when_time_is_up():
    settings = OptimSettings(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_scale(4, settings, 1000, time_fraction=1.0) == pytest.approx(0.5)


def test_wsd_decays_over_the_last_fraction_of_the_time_budget():
    settings = OptimSettings(lr=1.0, min_lr=0.1, warmup_steps=0, schedule="wsd")
    far = 1_000_000
    assert lr_scale(10, settings, far, time_fraction=0.79) == 1.0  # still stable
    assert lr_scale(10, settings, far, time_fraction=0.9) == pytest.approx(0.55)  # half-way down
    assert lr_scale(10, settings, far, time_fraction=1.0) == pytest.approx(0.1)


@pytest.mark.parametrize("time_fraction", [0.0, 0.5, 1.0])
def test_wsd_decay_fraction_edges(time_fraction):
    never = OptimSettings(lr=1.0, min_lr=0.1, warmup_steps=2, schedule="wsd", decay_fraction=0.0)
    assert [lr_scale(s, never, 10, time_fraction) for s in range(2, 10)] == [1.0] * 8
    whole = OptimSettings(lr=1.0, min_lr=0.1, warmup_steps=2, schedule="wsd", decay_fraction=1.0)
    lrs = [lr_scale(s, whole, 10, time_fraction) for s in range(2, 10)]  # decays right after warmup
    assert lrs[-1] == pytest.approx(0.1)
    if time_fraction == 0.0:
        assert lrs[0] == 1.0
        assert [a - b for a, b in zip(lrs, lrs[1:], strict=False)] == pytest.approx([0.9 / 7] * 7)


def test_constant_schedule_ignores_the_clock():
    settings = OptimSettings(lr=1.0, min_lr=0.1, warmup_steps=0, schedule="constant")
    assert lr_scale(5, settings, 100, time_fraction=1.0) == 1.0


@pytest.mark.parametrize("time_fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
@pytest.mark.parametrize("decay_fraction", [0.0, 0.2, 1.0])
@pytest.mark.parametrize(
    "max_steps, warmup, min_lr",
    [(1, 0, 0.1), (1, 5, 0.1), (5, 5, 0.1), (3, 10, 0.1), (10, 0, 1.0), (2, 1, 0.0)],
)
def test_edges_with_a_clock_give_finite_rates_within_bounds(
    kind, decay_fraction, time_fraction, max_steps, warmup, min_lr
):
    settings = OptimSettings(
        lr=1.0,
        min_lr=min_lr,
        warmup_steps=warmup,
        schedule=kind,
        decay_fraction=decay_fraction,
    )
    for step in range(max_steps):
        scale = lr_scale(step, settings, max_steps, time_fraction)
        assert math.isfinite(scale)
        assert min(min_lr, 1 / max(warmup, 1)) - 1e-12 <= scale <= 1.0


def test_every_group_follows_the_schedule_from_its_own_peak_rate():
    settings = OptimSettings(name="muon", lr=1e-3, min_lr=1e-4, muon_lr=0.02, warmup_steps=0)
    optimizer = build_optimizer(GPT(tiny_config()), settings, torch.device("cpu"))
    scale = lr_scale(30, settings, 100)
    set_lr(optimizer, scale)
    adamw_decay, adamw_no_decay, muon = optimizer.param_groups
    assert adamw_decay["lr"] == adamw_no_decay["lr"] == settings.lr * scale
    assert muon["lr"] == pytest.approx(0.02 * scale)
    set_lr(optimizer, lr_scale(99, settings, 100))  # the end: each at its floor
    assert muon["lr"] == pytest.approx(0.02 * 1e-4 / 1e-3)


# ----- Muon ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [(32, 128), (128, 32), (48, 16), (16, 48), (40, 300), (300, 40), (96, 64), (1, 8)]
)
def test_newton_schulz_singular_values_are_near_one(shape):
    """Random Gaussian matrices, wide and tall (a random square one may have a near-zero
    singular value, which Newton-Schulz leaves small: see the next test)."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x = zeropower_via_newtonschulz5(g, steps=5)
    assert x.shape == g.shape and x.dtype == torch.float32  # bfloat16 on CUDA only
    s = torch.linalg.svdvals(x.float())
    assert s.min() >= 0.5 and s.max() <= 1.5, s  # Muon's band (~[0.68, 1.2] in exact arithmetic)


def test_newton_schulz_approximates_the_orthogonal_polar_factor():
    """For a square matrix with singular values in [0.1, 1], the output is close to
    U V^T (the same rotation, every singular value near one) and its scale does not matter."""
    gen = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(128, 128, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(128, 128, generator=gen))
    s = torch.linspace(0.1, 1.0, 128)
    g = u @ torch.diag(s) @ v.T
    x = zeropower_via_newtonschulz5(g).float()
    singular = torch.linalg.svdvals(x)
    assert singular.min() >= 0.5 and singular.max() <= 1.5
    polar = u @ v.T
    assert (x - polar).norm() / polar.norm() < 0.3
    torch.testing.assert_close(zeropower_via_newtonschulz5(1e3 * g).float(), x, atol=0.02, rtol=0)


@pytest.mark.parametrize("shape", [(24, 64), (64, 24)])
def test_newton_schulz_orthogonalizes_each_matrix_of_a_stack_alone(shape):
    """Muon stacks the matrices of one shape: each comes out as it would alone, whatever the
    others' scale (one normalization for the whole stack would leave the small one near 0)."""
    gen = torch.Generator().manual_seed(2)
    stack = torch.randn((3, *shape), generator=gen) * torch.tensor([1.0, 1e3, 1e-3])[:, None, None]
    together = zeropower_via_newtonschulz5(stack).float()
    for g, x in zip(stack, together, strict=True):
        torch.testing.assert_close(x, zeropower_via_newtonschulz5(g).float(), atol=2e-2, rtol=0)
        singular = torch.linalg.svdvals(x)
        assert singular.min() >= 0.5 and singular.max() <= 1.5


def test_muon_trains_the_block_matrices_and_adamw_everything_else_each_once():
    for tie in (True, False):
        model = GPT(tiny_config(tie_embeddings=tie))
        optimizer = build_optimizer(model, OptimSettings(name="muon"), torch.device("cpu"))
        assert isinstance(optimizer, Muon)
        decay, no_decay, muon = optimizer.param_groups
        assert [g["use_muon"] for g in optimizer.param_groups] == [False, False, True]
        name_of = {id(p): n for n, p in model.named_parameters()}
        grouped = [id(p) for g in optimizer.param_groups for p in g["params"]]
        assert len(grouped) == len(set(grouped)) == len(name_of)  # each once, a tied head once
        muon_names = {name_of[id(p)] for p in muon["params"]}
        expected = {
            n
            for n, p in model.named_parameters()
            if n.startswith("transformer.h.") and p.dim() == 2
        }
        assert muon_names == expected and len(expected) == 4 * model.config.n_layer
        adamw_matrices = {name_of[id(p)] for p in decay["params"]}
        head = set() if tie else {"lm_head.weight"}
        assert adamw_matrices == {"transformer.wte.weight", "transformer.wpe.weight"} | head
        assert all(p.dim() == 1 for p in no_decay["params"])  # biases and norm gains


def test_muon_adamw_part_is_torch_adamw():
    """The embeddings, head, biases and gains get exactly AdamW's update."""
    torch.manual_seed(0)
    model = GPT(tiny_config())
    reference = GPT(tiny_config())
    reference.load_state_dict(model.state_dict())
    settings = OptimSettings(name="muon", lr=1e-2, weight_decay=0.1)
    ours = build_optimizer(model, settings, torch.device("cpu"))
    theirs = torch.optim.AdamW(
        [g for g in param_groups(reference, settings) if not g["use_muon"]], foreach=False
    )
    for _ in range(3):
        x = torch.randint(0, 101, (2, 16))
        for m, opt in ((model, ours), (reference, theirs)):
            m(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
            if m is reference:  # keep the matrices that Muon trains the same in both
                reference.load_state_dict({**reference.state_dict(), **block_matrices(model)})
    for name, p in reference.named_parameters():
        if not name.startswith("transformer.h.") or p.dim() < 2:
            torch.testing.assert_close(dict(model.named_parameters())[name], p, rtol=0, atol=1e-6)


def block_matrices(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if is_block_matrix(n, p)}


@pytest.mark.parametrize("shape, scale", [((64, 16), 2.0), ((16, 64), 1.0), ((32, 32), 1.0)])
def test_muon_step_is_the_scaled_orthogonalized_momentum(shape, scale):
    """First step from zero momentum: W -= muon_lr * sqrt(max(1, rows/cols)) * NS(u), where
    Nesterov's u = beta * m + (1 - beta) * g with m = (1 - beta) * g is (1 - beta^2) * g.
    (NS(g) itself differs from NS(u) by ~4%: bfloat16 rounds g and u differently.)"""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape, generator=gen))
    before = w.detach().clone()
    group = {"use_muon": True, "lr": 0.02, "base_lr": 0.02, "momentum": 0.95, "nesterov": True}
    optimizer = Muon([{**group, "params": [w], "ns_steps": 5, "weight_decay": 0.0}])
    w.grad = torch.randn(shape, generator=gen)
    optimizer.step()
    expected = 0.02 * scale * zeropower_via_newtonschulz5((1 - 0.95**2) * w.grad).float()
    delta = before - w.detach()
    assert (delta - expected).norm() / expected.norm() < 1e-3


def test_muon_state_dict_resumes_bit_exactly():
    torch.manual_seed(0)
    settings = OptimSettings(name="muon", lr=1e-2, muon_weight_decay=0.01)
    batches = [torch.randint(0, 101, (2, 16)) for _ in range(4)]

    def train(model, optimizer, xs):
        for x in xs:
            model(x, x)[1].backward()
            optimizer.step()
            optimizer.zero_grad()

    straight = GPT(tiny_config())
    start = {k: v.clone() for k, v in straight.state_dict().items()}
    train(straight, build_optimizer(straight, settings, torch.device("cpu")), batches)

    first = GPT(tiny_config())
    first.load_state_dict(start)
    optimizer = build_optimizer(first, settings, torch.device("cpu"))
    train(first, optimizer, batches[:2])
    saved_model = {k: v.clone() for k, v in first.state_dict().items()}
    saved_optimizer = copy.deepcopy(optimizer.state_dict())

    resumed = GPT(tiny_config())
    resumed.load_state_dict(saved_model)
    optimizer = build_optimizer(resumed, settings, torch.device("cpu"))
    load_optimizer_state(resumed, optimizer, saved_optimizer)
    train(resumed, optimizer, batches[2:])
    for name, tensor in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


def test_a_resume_keeps_the_state_but_takes_the_configs_hyperparameters():
    model = GPT(tiny_config())
    old = build_optimizer(model, OptimSettings(name="muon", muon_lr=0.02), torch.device("cpu"))
    model(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
    old.step()
    new = build_optimizer(
        model, OptimSettings(name="muon", muon_lr=0.01, weight_decay=0.0), torch.device("cpu")
    )
    load_optimizer_state(model, new, old.state_dict())
    assert new.param_groups[2]["base_lr"] == 0.01 and new.param_groups[0]["weight_decay"] == 0.0
    for p in model.parameters():
        for key, value in old.state[p].items():
            assert torch.equal(new.state[p][key], value)


def test_an_adamw_checkpoint_does_not_resume_under_muon():
    model = GPT(tiny_config())
    adamw = build_optimizer(model, OptimSettings(), torch.device("cpu"))
    muon = build_optimizer(model, OptimSettings(name="muon"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="optim.name the checkpoint was trained with"):
        load_optimizer_state(model, muon, adamw.state_dict())


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.name=sgd", "optim.name"),
        ("optim.muon_lr=0", "optim.muon_lr"),
        ("optim.muon_lr=abc", "optim.muon_lr"),
        ("optim.muon_lr=nan", "optim.muon_lr"),
        ("optim.muon_momentum=1.0", "optim.muon_momentum"),
        ("optim.muon_momentum=-0.1", "optim.muon_momentum"),
        ("optim.muon_nesterov=maybe", "optim.muon_nesterov"),
        ("optim.muon_ns_steps=0", "optim.muon_ns_steps"),
        ("optim.muon_ns_steps=2.5", "optim.muon_ns_steps"),
        ("optim.muon_weight_decay=-1", "optim.muon_weight_decay"),
    ],
)
def test_bad_muon_keys_name_their_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key} "):
        compose_run([], "optim=muon", override)


def test_the_muon_config_is_valid_and_names_muon():
    settings, _ = compose_run([], "optim=muon")
    assert settings.optim.name == "muon" and settings.optim.muon_lr == 0.02


def test_muon_under_fsdp_is_refused_at_startup(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun; refused before joining a group
    settings, resolved = compose_run([], "optim=muon", "parallel.strategy=fsdp")
    with pytest.raises(ConfigError, match="^optim.name=muon is not supported with .*fsdp"):
        Trainer(settings, "unused", resolved)


def test_a_warmup_that_took_most_of_the_time_budget_is_warned_of():
    """The cosine goes on from where the clock is: a warmup that took 90% of train.max_seconds
    hands over at a tenth of the peak, which a user would not expect without a word."""
    settings = OptimSettings(lr=6e-4, min_lr=6e-5, warmup_steps=100)
    assert warmup_drop(settings, None, 0.1) is None  # 0.98 of the peak: no cliff
    warning = warmup_drop(settings, None, 0.9)
    assert "optim.warmup_steps=100" in warning and "ends 90% into train.max_seconds" in warning
    assert "falls from 0.0006 to 7.32e-05" in warning  # 6e-5 + 0.5 (1 + cos 0.9 pi) 5.4e-4
    assert warmup_drop(OptimSettings(schedule="constant", warmup_steps=100), None, 0.9) is None


class LateClock(Budget):
    """A time budget 90% spent from the first step on, never over: the clock, injected."""

    def time_fraction(self, elapsed: float) -> float:
        return 0.9

    def spent(self, elapsed: float) -> bool:
        return False


def test_the_loop_warns_at_its_first_log_before_warmup_ends(tmp_path, corpus, capsys):
    """From the measured step time, once, while the warmup still runs (it ends at step 5)."""
    trainer = make_trainer(tmp_path, corpus, "train.max_seconds=1000", "optim.warmup_steps=5")
    trainer.budget = LateClock(trainer.cfg.train.max_steps, 1000)
    trainer.run()
    lines = capsys.readouterr().out.splitlines()
    warned = [i for i, line in enumerate(lines) if line.startswith("warning: warmup")]
    first_log = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert warned == [first_log - 1] and int(lines[first_log].split()[1]) < 5


def test_no_warmup_warning_when_the_budget_leaves_it_room(tmp_path, corpus, capsys):
    """The negative control: the same run with the clock at 10% of the budget is quiet."""
    trainer = make_trainer(tmp_path, corpus, "train.max_seconds=1000", "optim.warmup_steps=5")
    trainer.budget = type("EarlyClock", (LateClock,), {"time_fraction": lambda self, e: 0.1})(
        trainer.cfg.train.max_steps, 1000
    )
    trainer.run()
    assert "warning: warmup" not in capsys.readouterr().out
