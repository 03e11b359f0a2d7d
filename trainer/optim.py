"""The optimizer (AdamW, or Muon for the hidden matrices with AdamW for the rest) and the
learning-rate schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adamw import adamw as functional_adamw

from hardware.device import fast_matmul_dtype
from trainer.config import OptimSettings

# ----- Muon --------------------------------------------------------------------------------------

# Muon (Keller Jordan, 2024) for the transformer's hidden matrices, AdamW for the rest.
#
# Why. A weight matrix W maps vectors to vectors, and what matters about an update to it is how
# much it changes W's outputs: its spectral norm. SGD and Adam updates of a matrix are dominated
# by a few directions (their singular values fall off steeply), so a learning rate small enough
# for the largest direction leaves the others barely trained. Muon replaces the momentum of the
# gradient, M = U S V^T, by its nearest semi-orthogonal matrix U V^T: every direction that the
# gradient moves is moved by the same amount. That has trained GPT-2-sized models in markedly
# fewer steps than AdamW (the modded-nanogpt speedruns, Moonlight).
#
# How. Momentum with Nesterov, then U V^T approximated without an SVD by a quintic Newton-Schulz
# iteration X <- a X + b (X X^T) X + c (X X^T)^2 X on X = M / ||M||_F, 5 steps, in bfloat16 on
# GPUs and on CPUs whose dtype=auto probe picked it (float32 elsewhere: where bfloat16 is emulated
# its matmuls are 7-30x slower than float32's; hardware/device.py),
# (a, b, c) = (3.4445, -4.7750, 2.0315). The coefficients are tuned for speed, not for exact
# convergence: singular values land in roughly [0.68, 1.2] rather than at 1, which trains as well.
# Near-zero ones (below ~1e-3 of ||M||_F) are only multiplied by a^5 ~ 485 and stay small: the
# directions the gradient hardly moves are not blown up.
#
# Scale. Keller Jordan's convention (his `muon` package and modded-nanogpt's first records): the
# orthogonalized update is multiplied by sqrt(max(1, rows / cols)), so a tall matrix (nn.Linear's
# weight is (out, in): the MLP's c_fc, (4C, C), gets x2; c_attn, (3C, C), x1.7) moves its
# per-entry RMS by as much as a square one. Its learning rates are therefore not AdamW's: muon_lr
# ~0.02 against AdamW's ~1e-3. (Moonlight instead scales by 0.2 sqrt(max(rows, cols)) to match
# AdamW's update RMS and reuse AdamW's rate and weight decay; not what this file does.)
#
# What gets which. Muon is for the 2-D matrices inside the blocks (attention and MLP). Embeddings
# and the language-model head (tied or not) are lookups / a classifier rather than maps between
# hidden states and do worse under Muon; biases and norm gains are not matrices. They all get
# AdamW, in this same optimizer, so the training loop, the gradient scaler and checkpoints see a
# single torch.optim.Optimizer whose state_dict resumes both parts exactly.
#
# Distributed. Under DDP the gradients are already all-reduced when `step` runs, so every rank
# would compute the same update: the Newton-Schulz work is dealt round-robin over the ranks and
# each result broadcast (see `_muon_step`). Under FSDP each rank holds a shard of each matrix,
# and the orthogonalization needs the whole matrix: the trainer refuses muon with
# parallel.strategy=fsdp.


def zeropower_via_newtonschulz5(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """An approximately semi-orthogonal matrix U V^T for g = U S V^T, in bfloat16 where its
    matmuls are fast (CUDA; a CPU whose dtype=auto probe picked it), else float32. g is a
    matrix (..., rows, cols) or a stack of them, each orthogonalized alone.

    The Frobenius normalization puts every singular value in (0, 1], where the quintic's
    iteration pushes them towards ~1. Wide or tall: iterate on the wide orientation, whose
    Gram matrix X X^T is the smaller one."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(fast_matmul_dtype(g.device))
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon on the param groups with `use_muon=True`, AdamW on the others (see the module doc).

    Muon groups: lr, momentum, nesterov, ns_steps, weight_decay; their parameters must be 2-D
    and whole (not FSDP shards: the trainer refuses muon under fsdp).
    AdamW groups: lr, betas, eps, weight_decay; torch.optim.AdamW's own arithmetic.
    Every group also keeps `base_lr`, its peak rate, which the schedule scales (set_lr)."""

    def __init__(self, param_groups: Iterable[dict[str, Any]]):
        super().__init__(param_groups, defaults={})

    @torch.no_grad()
    def step(self) -> None:  # no closure: training never re-evaluates the loss in a step
        for group in self.param_groups:
            (self._muon_step if group["use_muon"] else self._adamw_step)(group)

    def _muon_step(self, group: dict[str, Any]) -> None:
        """The matrices of one shape (every block's c_fc, say) are orthogonalized together, one
        batched Newton-Schulz iteration per shape: a few large matmuls instead of many small
        ones (the optimizer's cost is mostly their dispatch at speedrun sizes; docs/speedrun.md).
        Under DDP every rank holds the same gradients, so the shapes are dealt round-robin
        (shape i to rank i mod world_size) and each result broadcast from its owner, as
        modded-nanogpt deals its matrices: every rank still applies the same update."""
        lr, beta = group["lr"], group["momentum"]
        params = [p for p in group["params"] if p.grad is not None]
        sharded = dist.is_initialized() and dist.get_world_size() > 1
        rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
        by_shape: dict[torch.Size, list[nn.Parameter]] = {}
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            # buf = beta * buf + (1 - beta) * grad
            self.state[p]["momentum_buffer"].lerp_(p.grad, 1 - beta)
            by_shape.setdefault(p.shape, []).append(p)
        groups, updates, pending = list(by_shape.values()), [], []
        for i, same in enumerate(groups):
            if i % world == rank:
                # Nesterov: look ahead along the momentum (grad is not modified in place).
                momenta = [self.state[p]["momentum_buffer"] for p in same]
                if group["nesterov"]:
                    momenta = torch._foreach_lerp([p.grad for p in same], momenta, beta)
                stack = zeropower_via_newtonschulz5(torch.stack(momenta), group["ns_steps"])
                stack = stack.contiguous()  # (n, rows, cols)
            else:  # filled by its owner's broadcast
                dtype, device = fast_matmul_dtype(same[0].device), same[0].device
                stack = torch.empty((len(same), *same[0].shape), dtype=dtype, device=device)
            if sharded:
                pending.append(dist.broadcast(stack, src=i % world, async_op=True))
            updates.append(stack)
        for work in pending:
            work.wait()
        for same, stack in zip(groups, updates, strict=True):
            rows, cols = same[0].shape
            scale = math.sqrt(max(1.0, rows / cols))
            torch._foreach_mul_(same, 1 - lr * group["weight_decay"])
            torch._foreach_add_(same, list(stack.to(same[0].dtype).unbind()), alpha=-lr * scale)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        """torch's own AdamW (torch.optim.adamw.adamw, torch.optim.AdamW's arithmetic) with one
        multi-tensor (foreach) kernel per operation over the group, not a Python loop of kernels
        per parameter; the state is torch.optim.AdamW's (step, exp_avg, exp_avg_sq)."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32)  # on the CPU: no sync
                self.state[p]["exp_avg"] = torch.zeros_like(p)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p)
        exp_avgs, exp_avg_sqs, steps = (
            [self.state[p][k] for p in params] for k in ("exp_avg", "exp_avg_sq", "step")
        )
        beta1, beta2 = group["betas"]
        functional_adamw(
            params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, foreach=True,
            amsgrad=False, maximize=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            eps=group["eps"], weight_decay=group["weight_decay"],
        )  # fmt: skip


# ----- the optimizer and the schedule ------------------------------------------------------------

# The optimizer (AdamW, or Muon with AdamW: trainer/optim.py) and the learning-rate schedule.
#
# Every param group stores its peak rate as `base_lr`; the schedule is a shape, `lr_scale`, in
# [min_lr / lr, 1], and `set_lr` sets each group's rate to base_lr * scale, so that AdamW's and
# Muon's rates warm up and decay together.


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
    return [*({**group, "use_muon": False} for group in groups), muon_group(members, settings)]


def muon_group(members: dict[str, list[nn.Parameter]], settings: OptimSettings) -> dict[str, Any]:
    """optim.name=muon: the block matrices' group, with Muon's own rate and settings."""
    return {
        "params": members["muon"],
        "use_muon": True,
        "base_lr": settings.muon_lr,
        "lr": settings.muon_lr,
        "momentum": settings.muon_momentum,
        "nesterov": settings.muon_nesterov,
        "ns_steps": settings.muon_ns_steps,
        "weight_decay": settings.muon_weight_decay,
    }


def build_optimizer(
    model: nn.Module, settings: OptimSettings, device: torch.device
) -> torch.optim.Optimizer:
    """optim.name=adamw: torch's AdamW (fused kernel on CUDA). optim.name=muon: Muon for the
    block matrices and AdamW for the rest, in one optimizer (trainer/optim.py). The AdamW groups
    (`param_groups`: matrices, then biases and gains, then with optim.embed_lr the embeddings)
    come first in both, so that param_groups[0]["lr"] is always AdamW's rate."""
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
    if settings.schedule == "cosine":
        # from warmup's end to the last step (no step limit: the steps make no progress)
        span = (max_steps or math.inf) - 1 - settings.warmup_steps
        by_steps = 1.0 if span <= 0 else (step - settings.warmup_steps) / span
        progress = min(max(by_steps, by_time), 1.0)
        return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)
    progress = wsd_progress(step, settings, max_steps, by_time)
    return 1.0 if progress == 0.0 else floor + (1.0 - progress) * (1.0 - floor)


def wsd_progress(
    step: int, settings: OptimSettings, max_steps: int | None, by_time: float
) -> float:
    """How far the wsd schedule's decay is (0 to 1): the last decay_fraction of the steps, or
    of the time budget, whichever is further."""
    last = (max_steps or math.inf) - 1  # no step limit: the steps make no progress
    fraction = settings.decay_fraction
    decay_steps = round(fraction * max_steps) if max_steps else 0
    decay_start = max(settings.warmup_steps, last + 1 - decay_steps)
    by_steps = 0.0
    if decay_steps > 0 and step >= decay_start:
        by_steps = 1.0 if last <= decay_start else (step - decay_start) / (last - decay_start)
    by_time = max(0.0, (by_time - (1.0 - fraction)) / fraction) if fraction > 0 else 0.0
    return min(max(by_steps, by_time), 1.0)


def warmup_drop(settings: OptimSettings, max_steps: int | None, time_fraction: float) -> str | None:
    """A warning for a warmup that ends `time_fraction` of the way through a time budget: the
    decay goes on from where the clock is (see lr_scale), so a warmup that takes much of the
    budget hands over to a rate far below the peak; None when the drop is less than half."""
    after = lr_scale(settings.warmup_steps, settings, max_steps, time_fraction)
    if not settings.warmup_steps or after >= 0.5:
        return None
    return (
        f"warning: warmup (optim.warmup_steps={settings.warmup_steps}) ends {time_fraction:.0%} "
        f"into train.max_seconds at this speed, where the learning rate falls from "
        f"{settings.lr:g} to {after * settings.lr:.3g} at once; lower optim.warmup_steps or raise "
        "train.max_seconds"
    )


def set_lr(optimizer: torch.optim.Optimizer, scale: float) -> None:
    """Every group's rate to its peak (`base_lr`) times the schedule's `scale`."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * scale
