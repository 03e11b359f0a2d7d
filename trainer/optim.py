"""The optimizer and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import OptimSettings


def build_optimizer(
    model: nn.Module, settings: OptimSettings, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW with two groups: weight decay on matrices and embeddings (dim >= 2), none on biases
    and norm gains, which only shift or scale and gain nothing from being pulled to zero.
    Fused kernel on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        fused=device.type == "cuda",
    )


def lr_at(step: int, settings: OptimSettings, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of `max_steps`.

    Linear warmup to `lr` over `warmup_steps` steps, then:
      cosine:   half a cosine from lr down to min_lr at the last step
      wsd:      warmup-stable-decay: lr until the last `decay_fraction` of steps, then linear to
                min_lr
      constant: lr
    Every edge is defined: warmup_steps >= max_steps (warmup never ends), max_steps = 1,
    min_lr = lr (flat).
    """
    lr, min_lr = settings.lr, settings.min_lr
    if step < settings.warmup_steps:
        return lr * (step + 1) / settings.warmup_steps
    if settings.schedule == "constant":
        return lr
    last = max_steps - 1
    if settings.schedule == "cosine":
        span = last - settings.warmup_steps
        progress = 1.0 if span <= 0 else (step - settings.warmup_steps) / span
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))) * (lr - min_lr)
    # wsd
    decay_steps = round(settings.decay_fraction * max_steps)
    decay_start = max(settings.warmup_steps, max_steps - decay_steps)
    if step < decay_start or decay_steps == 0:
        return lr
    progress = 1.0 if last <= decay_start else (step - decay_start) / (last - decay_start)
    return lr + min(progress, 1.0) * (min_lr - lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
