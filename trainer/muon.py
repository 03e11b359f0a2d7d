"""Muon (Keller Jordan, 2024) for the transformer's hidden matrices, AdamW for the rest.

Why. A weight matrix W maps vectors to vectors, and what matters about an update to it is how
much it changes W's outputs: its spectral norm. SGD and Adam updates of a matrix are dominated
by a few directions (their singular values fall off steeply), so a learning rate small enough
for the largest direction leaves the others barely trained. Muon replaces the momentum of the
gradient, M = U S V^T, by its nearest semi-orthogonal matrix U V^T: every direction that the
gradient moves is moved by the same amount. That has trained GPT-2-sized models in markedly
fewer steps than AdamW (the modded-nanogpt speedruns, Moonlight).

How. Momentum with Nesterov, then U V^T approximated without an SVD by a quintic Newton-Schulz
iteration X <- a X + b (X X^T) X + c (X X^T)^2 X on X = M / ||M||_F, 5 steps, in bfloat16 on
GPUs and on CPUs whose dtype=auto probe picked it (float32 elsewhere: where bfloat16 is emulated
its matmuls are 7-30x slower than float32's; hardware/device.py),
(a, b, c) = (3.4445, -4.7750, 2.0315). The coefficients are tuned for speed, not for exact
convergence: singular values land in roughly [0.68, 1.2] rather than at 1, which trains as well.
Near-zero ones (below ~1e-3 of ||M||_F) are only multiplied by a^5 ~ 485 and stay small: the
directions the gradient hardly moves are not blown up.

Scale. Keller Jordan's convention (his `muon` package and modded-nanogpt's first records): the
orthogonalized update is multiplied by sqrt(max(1, rows / cols)), so a tall matrix (nn.Linear's
weight is (out, in): the MLP's c_fc, (4C, C), gets x2; c_attn, (3C, C), x1.7) moves its
per-entry RMS by as much as a square one. Its learning rates are therefore not AdamW's: muon_lr
~0.02 against AdamW's ~1e-3. (Moonlight instead scales by 0.2 sqrt(max(rows, cols)) to match
AdamW's update RMS and reuse AdamW's rate and weight decay; not what this file does.)

What gets which. Muon is for the 2-D matrices inside the blocks (attention and MLP). Embeddings
and the language-model head (tied or not) are lookups / a classifier rather than maps between
hidden states and do worse under Muon; biases and norm gains are not matrices. They all get
AdamW, in this same optimizer, so the training loop, the gradient scaler and checkpoints see a
single torch.optim.Optimizer whose state_dict resumes both parts exactly.

Distributed. Under DDP the gradients are already all-reduced when `step` runs, so every rank
would compute the same update: the Newton-Schulz work is dealt round-robin over the ranks and
each result broadcast (see `_muon_step`). Under FSDP each rank holds a shard of each matrix, and the
orthogonalization needs the whole matrix: the trainer refuses muon with parallel.strategy=fsdp.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from hardware.device import fast_matmul_dtype


def zeropower_via_newtonschulz5(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """An approximately semi-orthogonal matrix U V^T for g = U S V^T (2-D), in bfloat16 where
    its matmuls are fast (CUDA; a CPU whose dtype=auto probe picked it), else float32.

    The Frobenius normalization puts every singular value in (0, 1], where the quintic's
    iteration pushes them towards ~1. Wide or tall: iterate on the wide orientation, whose
    Gram matrix X X^T is the smaller one."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(fast_matmul_dtype(g.device))
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon on the param groups with `use_muon=True`, AdamW on the others (see the module doc).

    Muon groups: lr, momentum, nesterov, ns_steps, weight_decay; their parameters must be 2-D
    and whole (not FSDP shards: the trainer refuses muon under fsdp).
    AdamW groups: lr, betas, eps, weight_decay; the same arithmetic as torch.optim.AdamW.
    Every group also keeps `base_lr`, its peak rate, which the schedule scales (set_lr)."""

    def __init__(self, param_groups: Iterable[dict[str, Any]]):
        super().__init__(param_groups, defaults={})

    @torch.no_grad()
    def step(self) -> None:  # no closure: training never re-evaluates the loss in a step
        for group in self.param_groups:
            (self._muon_step if group["use_muon"] else self._adamw_step)(group)

    def _muon_step(self, group: dict[str, Any]) -> None:
        """Under DDP every rank holds the same gradients, so the Newton-Schulz work is dealt
        round-robin (matrix i to rank i mod world_size) and each result broadcast from its
        owner, as modded-nanogpt does: each rank orthogonalizes 1/world_size of the matrices,
        and every rank still applies the same update."""
        lr, beta = group["lr"], group["momentum"]
        params = [p for p in group["params"] if p.grad is not None]
        sharded = dist.is_initialized() and dist.get_world_size() > 1
        rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
        updates, pending = [], []
        for i, p in enumerate(params):
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - beta)  # buf = beta * buf + (1 - beta) * grad
            # Nesterov: look ahead along the momentum (grad is not modified in place).
            update = p.grad.lerp(buf, beta) if group["nesterov"] else buf
            if i % world == rank:
                update = zeropower_via_newtonschulz5(update, group["ns_steps"]).contiguous()
            else:  # filled by its owner's broadcast
                update = torch.empty_like(update, dtype=fast_matmul_dtype(update.device))
            if sharded:
                pending.append(dist.broadcast(update, src=i % world, async_op=True))
            updates.append(update)
        for work in pending:
            work.wait()
        for p, update in zip(params, updates, strict=True):
            scale = math.sqrt(max(1.0, p.size(0) / p.size(1)))
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update.to(p.dtype), alpha=-lr * scale)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's arithmetic with one multi-tensor (foreach) kernel per operation
        over the group, not a Python loop of kernels per parameter; parameters are bucketed by
        their step count, which only differs if some missed a gradient."""
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        buckets: dict[int, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)  # on the CPU: no sync
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            buckets.setdefault(int(state["step"].item()), []).append(p)
        for step, params in buckets.items():
            grads = [p.grad for p in params]
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, math.sqrt(1 - beta2**step))  # bias corrections
            torch._foreach_add_(denom, eps)
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / (1 - beta1**step))
