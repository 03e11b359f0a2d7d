"""The optimizer (AdamW, or Muon with AdamW: trainer/muon.py) and the learning-rate schedule.

Every param group stores its peak rate as `base_lr`; the schedule is a shape, `lr_scale`, in
[min_lr / lr, 1], and `set_lr` sets each group's rate to base_lr * scale, so that AdamW's and
Muon's rates warm up and decay together.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from trainer.config import OptimSettings
from trainer.muon import Muon


def is_block_matrix(name: str, p: nn.Parameter) -> bool:
    """A 2-D weight inside a transformer block (attention or MLP): what Muon trains."""
    return name.startswith("transformer.h.") and p.dim() == 2


def param_groups(model: nn.Module, settings: OptimSettings) -> list[dict[str, Any]]:
    """AdamW's two groups, weight decay on matrices and embeddings (dim >= 2) and none on biases
    and norm gains (they only shift or scale and gain nothing from being pulled to zero); with
    optim.embed_lr the embedding tables leave them for a group of their own at that rate (a
    one-hot input row gets a gradient only where its token occurs, so it can take a larger
    step than the dense matrices); under muon the block matrices leave them for a last, Muon
    group. Each parameter is in exactly one group (named_parameters lists a tied head once, as
    the embedding)."""
    muon = settings.name == "muon"
    own_rate = settings.embed_lr is not None

    def group_of(name: str, p: nn.Parameter) -> str:
        if muon and is_block_matrix(name, p):
            return "muon"
        if own_rate and name in ("transformer.wte.weight", "transformer.wpe.weight"):
            return "embed"
        return "decay" if p.dim() >= 2 else "no_decay"

    members: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], "embed": [], "muon": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            members[group_of(name, p)].append(p)

    def adamw(kind: str, lr: float, weight_decay: float) -> dict[str, Any]:
        rates = {"base_lr": lr, "lr": lr, "betas": settings.betas, "eps": settings.eps}
        return {**rates, "params": members[kind], "weight_decay": weight_decay}

    decay = settings.weight_decay
    groups = [adamw("decay", settings.lr, decay), adamw("no_decay", settings.lr, 0.0)]
    if own_rate:  # optim.embed_lr: a third AdamW group, so that null keeps the groups as they were
        groups.append(adamw("embed", settings.embed_lr, decay))
    if not muon:
        return groups
    for group in groups:
        group["use_muon"] = False
    groups.append(
        {
            "params": members["muon"],
            "use_muon": True,
            "base_lr": settings.muon_lr,
            "lr": settings.muon_lr,
            "momentum": settings.muon_momentum,
            "nesterov": settings.muon_nesterov,
            "ns_steps": settings.muon_ns_steps,
            "weight_decay": settings.muon_weight_decay,
        }
    )
    return groups


def build_optimizer(
    model: nn.Module, settings: OptimSettings, device: torch.device
) -> torch.optim.Optimizer:
    """optim.name=adamw: torch's AdamW (fused kernel on CUDA). optim.name=muon: Muon for the
    block matrices and AdamW for the rest, in one optimizer (trainer/muon.py). The AdamW groups
    (group 0: matrices and embeddings, group 1: biases and gains) come first in both, so that
    param_groups[0]["lr"] is always AdamW's rate."""
    groups = param_groups(model, settings)
    if settings.name == "muon":
        return Muon(groups)
    return torch.optim.AdamW(groups, fused=device.type == "cuda")  # each group sets its rates


def lr_scale(
    step: int, settings: OptimSettings, max_steps: int | None, time_fraction: float = 0.0
) -> float:
    """The learning rate of optimizer step `step` (0-based) of `max_steps` (None: no step limit,
    the time budget alone is the horizon), as a multiple of the peak rate: from min_lr / lr to 1.
    A pure function of its arguments.

    Linear warmup to 1 over `warmup_steps` steps, then:
      cosine:   half a cosine from 1 down to min_lr / lr at the end of the run
      wsd:      warmup-stable-decay: 1 until the last `decay_fraction` of the run, then linear to
                min_lr / lr
      constant: 1
    The end of the run is the last step, or, with a time budget (train.max_seconds), the moment
    it is spent, whichever comes first: `time_fraction` is elapsed / max_seconds (0 without a
    budget), and the decay's progress is the larger of the step-based and the time-based one.
    So a run with max_steps set high still decays fully by its deadline. Warmup is counted in
    steps only; a cosine then goes on from where the clock already is (a warmup that took 10% of
    the budget hands over at 0.5 (1 + cos(0.1 pi)) = 0.98 of the way from floor to peak).
    A time-based schedule is not bit-reproducible on resume (the elapsed time at each step
    differs from run to run); the step-based one is.

    Every edge is defined: warmup_steps >= max_steps (warmup never ends), max_steps = 1 (the
    one step is the last: min_lr, after any warmup), min_lr = lr (flat), decay_fraction 0
    (wsd never decays, not even by time) or 1 (wsd decays from the end of warmup).
    """
    floor = settings.min_lr / settings.lr
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    if settings.schedule == "constant":
        return 1.0
    by_time = min(max(time_fraction, 0.0), 1.0)
    last = (max_steps or math.inf) - 1  # no step limit: the steps make no progress
    if settings.schedule == "cosine":
        span = last - settings.warmup_steps
        by_steps = 1.0 if span <= 0 else (step - settings.warmup_steps) / span
        progress = min(max(by_steps, by_time), 1.0)
        return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)
    # wsd: the decay is the last decay_fraction of the steps, or of the time budget
    fraction = settings.decay_fraction
    decay_steps = round(fraction * max_steps) if max_steps else 0
    decay_start = max(settings.warmup_steps, last + 1 - decay_steps)
    by_steps = 0.0
    if decay_steps > 0 and step >= decay_start:
        by_steps = 1.0 if last <= decay_start else (step - decay_start) / (last - decay_start)
    by_time = max(0.0, (by_time - (1.0 - fraction)) / fraction) if fraction > 0 else 0.0
    progress = min(max(by_steps, by_time), 1.0)
    return 1.0 if progress == 0.0 else floor + (1.0 - progress) * (1.0 - floor)


def set_lr(optimizer: torch.optim.Optimizer, scale: float) -> None:
    """Every group's rate to its peak (`base_lr`) times the schedule's `scale`."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * scale
