"""Memory before it is spent: the peak of one training step, estimated from the config alone.

A model or batch too large for the machine otherwise runs until the operating system kills it
(no message; on a shared machine it can take other processes with it). `check_memory` runs
before the model is allocated and refuses such a run in one line naming the cheapest fixes.

The estimate (bytes, per process; float32 parameters, as the trainer keeps them):

    weights       4 * P                  (+ 2 * P of bf16/fp16 copies that autocast caches)
    gradients     4 * P
    optimizer     AdamW: 8 * P (two moments); Muon: 4 per block-matrix weight (its momentum)
                  + 8 per other parameter (AdamW)
    activations   what autograd keeps for backward, per layer, in elements of B x T x C:
                  the two norms' inputs (the float32 residual stream) 2, their outputs 2,
                  q|k|v 3, the heads' output 1 (+1: flash and sdpa keep their output too),
                  the MLP's hidden activations 2 * hidden / C (swiglu: 4 * hidden / C);
                  manual attention adds the probabilities S, B x nh x T x T per layer (float32,
                  + a copy in the autocast dtype), and transiently two more while one layer
                  runs backward; the final norm's input and output: 2 B x T x C
    logits        3 x B x T x vocab float32: the log-probabilities kept for the loss's backward,
                  their gradient and the logits' gradient, all alive at the start of backward

Activations count 4 bytes per element in float32 and the autocast dtype's size under autocast
(norm inputs stay float32). Under torchrun, FSDP divides weights, gradients and optimizer state
by the world size. Not counted: the runtime's own memory (lazily imported modules, thread pools,
matmul scratch: 70-150 MB on a CPU). benchmarks/bench_memory.py compares the estimate with
measured peaks (README, Performance).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from base.errors import ConfigError
from hardware.device import Precision
from model import GPT, GPTConfig
from trainer.config import RunConfig
from trainer.console import format_bytes
from trainer.optim import is_block_matrix

FLOAT32 = 4


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return sum(vars(self).values())

    def summary(self) -> str:
        parts = ", ".join(f"{name} {format_bytes(size)}" for name, size in vars(self).items())
        return f"{format_bytes(self.total)} ({parts})"


def estimate_memory(
    config: GPTConfig, batch_size: int, optimizer: str, dtype: torch.dtype, shards: int = 1
) -> MemoryEstimate:
    """The estimated peak of one training step of micro-batches of `batch_size` windows of
    config.block_size tokens under autocast `dtype` (float32: none); see the module docstring.
    `shards`: the world size under FSDP (weights, gradients, optimizer state split), else 1."""
    with torch.device("meta"):  # the parameters' shapes, allocating nothing
        model = GPT(config)
    params = model.num_params(exclude_positions=False)
    named = model.named_parameters()
    muon = sum(p.numel() for n, p in named if optimizer == "muon" and is_block_matrix(n, p))
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    act = dtype.itemsize  # bytes per activation element kept for backward
    low = 0 if dtype == torch.float32 else act  # bytes per element of autocast's copies

    B, T, C = batch_size, config.block_size, config.n_embd
    mlp = (4 if config.mlp == "swiglu" else 2) * config.mlp_hidden / C
    heads_out = 1 if config.attention == "manual" else 2
    per_layer = B * T * C * (2 * FLOAT32 + (2 + 3 + heads_out + mlp) * act)
    activations = config.n_layer * per_layer + 2 * B * T * C * FLOAT32
    if config.attention == "manual":
        scores = B * config.n_head * T * T
        activations += config.n_layer * scores * (FLOAT32 + low) + 2 * scores * FLOAT32
    return MemoryEstimate(
        weights=(FLOAT32 * params) // shards + low * matmul,
        gradients=FLOAT32 * params // shards,
        optimizer=(FLOAT32 * muon + 2 * FLOAT32 * (params - muon)) // shards,
        activations=int(activations),
        logits=3 * B * T * config.vocab_size * FLOAT32,
    )


def available_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes this process may use, where the figure comes from); None where unknown (MPS, or
    a system without /proc/meminfo). CPU ranks on one node share its memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {torch.cuda.get_device_name(device)}"
    if device.type != "cpu":
        return None, f"unknown for {device.type}"
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None, "unknown (no /proc/meminfo)"
    kib = int(re.search(r"MemAvailable:\s+(\d+)", meminfo)[1])  # in every Linux since 3.14
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    share = f", shared by {ranks} ranks" if ranks > 1 else ""
    return kib * 1024 // ranks, f"MemAvailable on this CPU{share}"


def check_memory(
    config: GPTConfig, cfg: RunConfig, precision: Precision, shards: int = 1
) -> tuple[MemoryEstimate, str]:
    """The estimate and a line to print beside what the device has; raises ConfigError naming
    the cheapest fixes if it does not fit (unless train.skip_memory_check)."""
    train, dtype = cfg.train, precision.dtype
    estimate = estimate_memory(config, train.batch_size, cfg.optim.name, dtype, shards)
    budget, source = available_memory(precision.device)
    have = f"{format_bytes(budget)} {source}" if budget is not None else f"available: {source}"
    line = f"memory: estimated peak {estimate.summary()}; {have}"
    if budget is None or estimate.total <= budget or train.skip_memory_check:
        return estimate, line
    one = estimate_memory(config, 1, cfg.optim.name, dtype, shards)  # memory is linear in B
    per_window = one.activations + one.logits
    state = one.total - per_window  # weights, gradients, optimizer: whatever the batch
    if state > budget:
        how = f"the weights, gradients and optimizer state alone take {format_bytes(state)}: "
        how += "choose a smaller model, "
    else:
        smaller = (budget - state) // per_window
        fixes = []
        if smaller >= 1:
            accum = train.grad_accum_steps * -(-train.batch_size // smaller)
            fixes.append(f"train.batch_size={smaller} train.grad_accum_steps={accum}")
        if config.attention == "manual":
            fixes.append("model.attention=flash")
        if dtype == torch.float32 and precision.device.type == "cuda":
            fixes.append("dtype=bfloat16")
        how = f"try {' or '.join(fixes)}, " if fixes else ""
    raise ConfigError(
        f"this run needs about {format_bytes(estimate.total)} per training step "
        f"(estimated: {estimate.summary()}), more than the {format_bytes(budget)} {source}; "
        f"{how}or set train.skip_memory_check=true to run anyway"
    )
