"""Validation loss and bits per byte over non-overlapping windows of a token split."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from data import iter_eval_batches
from model import GPT
from trainer.device import Precision


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy, nats per predicted token
    bpb: float  # bits per UTF-8 byte: loss / ln 2 / (bytes per token of the split)
    tokens: int  # tokens predicted
    bytes: float  # UTF-8 bytes those tokens span (tokens * the split's bytes per token)
    stderr: float  # standard error of `loss` across batches: differences below ~2x are noise

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/loss": self.loss,
            f"{prefix}/bpb": self.bpb,
            f"{prefix}/loss_stderr": self.stderr,
        }


@torch.no_grad()
def evaluate(
    model: GPT,
    tokens: np.ndarray,
    bytes_per_token: float,
    batch_size: int,
    precision: Precision,
    max_batches: int | None = None,
) -> EvalResult:
    """Loss over `tokens` in windows of block_size (see `data.iter_eval_batches`): the whole split,
    or with max_batches the same evenly spaced subset on every call, so successive periodic
    evaluations are comparable."""
    was_training = model.training
    model.eval()
    block_size = model.config.block_size
    total_nats, total_tokens, batch_losses = 0.0, 0, []
    for x, y in iter_eval_batches(tokens, block_size, batch_size, max_batches):
        x, y = x.to(precision.device), y.to(precision.device)
        with precision.autocast():
            _, loss = model(x, y)
        batch_losses.append(loss.item())
        total_nats += batch_losses[-1] * y.numel()
        total_tokens += y.numel()
    model.train(was_training)
    mean = total_nats / total_tokens
    spread = float(np.std(batch_losses, ddof=1)) if len(batch_losses) > 1 else float("nan")
    return EvalResult(
        loss=mean,
        bpb=mean / math.log(2) / bytes_per_token,
        tokens=total_tokens,
        bytes=total_tokens * bytes_per_token,
        stderr=spread / math.sqrt(len(batch_losses)),
    )
