"""What is checked before a run spends anything: the causality guard, the memory estimate, and the
run directory's lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from base.errors import ConfigError, UserError
from hardware.device import Precision
from model import GPT, GPTConfig
from model.causality import check_causality, shrunk_config
from model.gpt import unavailable_attention
from trainer.config import RunConfig
from trainer.optim import is_block_matrix
from trainer.reporting import format_bytes

# ----- the causality guard -----------------------------------------------------------------------

# The causality guard: before the model is built, `train.py` checks a shrunk copy of the
# configured architecture (same options and code path, tiny sizes: well under a second) with
# model/causality.py, and refuses to train a model that can see the future. Loaded weights
# (train.init_from) cannot be shrunk: the loaded model itself is checked, on a short sequence.
#
# A leak stops the run with one `error:` line and exit code 2, as every other problem found
# before training starts. `train.check_causality=false` turns the guard off.

# The shrunk copy keeps at most 2 layers, as the test suite does: a leak in code that every
# layer runs shows in layer 0, and layer 1 covers one that reaches the logits through a later
# layer; gpt2-xl's 48 layers would cost seconds at every start.
GUARD_LAYERS = 2


def causality_guard(
    cfg: RunConfig,
    verbose: bool = True,
    model: GPT | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """The guard's record, kept in every checkpoint's metadata under "causality"; raises
    ConfigError naming where the leak enters, or why the attention cannot run on `device` (the
    run's). model: a loaded model to check as it is, with its own attention implementation.
    A shrunk copy is checked on the CPU (exact float32) unless its attention runs only on the
    run's device (triton's kernel)."""
    attention = model.config.attention if model else cfg.model.get("attention", "manual")
    if why := unavailable_attention(torch.device(device)).get(attention):
        raise ConfigError(why)
    if not cfg.train.check_causality:
        return {"checked": False, "reason": "train.check_causality=false"}
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # the run's random stream stays as it was
        if model is None:
            torch.manual_seed(0)
            model = GPT(shrunk_config(cfg.model, GUARD_LAYERS))
            if attention in unavailable_attention(torch.device("cpu")):
                model.to(device)
            what, label = "a shrunk copy of this model", "a shrunk copy (same options)"
        else:
            what = label = "the loaded model"
        report = check_causality(model, attention=(model.config.attention,))
    if not report.causal:
        raise ConfigError(
            f"the causality guard found a leak in {what}: "
            f"{report.failures()[0]}. For the full report run `python check_causality.py` "
            "with the same model overrides; to train anyway set train.check_causality=false"
        )
    seconds = round(time.perf_counter() - start, 3)
    if verbose:
        print(f"causality guard: passed ({len(report.checks)} checks in {seconds} s)")
    c = model.config
    sizes = f"n_layer={c.n_layer}, n_embd={c.n_embd}, vocab_size={c.vocab_size}"
    return {"checked": True, **report.summary(), "model": f"{label}: {sizes}", "seconds": seconds}


# ----- the memory estimate -----------------------------------------------------------------------

# Memory before it is spent: the peak of one training step, estimated from the config alone.
#
# A model or batch too large for the machine otherwise runs until the operating system kills it
# (no message; on a shared machine it can take other processes with it). `check_memory` runs
# before the model is allocated and refuses such a run in one line naming the cheapest fixes.
#
# The estimate (bytes, per process; float32 parameters, as the trainer keeps them):
#
#     weights       4 * P                  (+ 2 * P of bf16/fp16 copies that autocast caches)
#     gradients     4 * P
#     optimizer     AdamW: 8 * P (two moments); Muon: 4 per block-matrix weight (its momentum)
#                   + 8 per other parameter (AdamW)
#     activations   what autograd keeps for backward, per layer, in elements of B x T x C:
#                   the two norms' inputs (the float32 residual stream) 2, their outputs 2,
#                   q|k|v 3, the heads' output 1 (+1: flash and sdpa keep their output too),
#                   the MLP's hidden activations 2 * hidden / C (swiglu: 4 * hidden / C);
#                   manual attention adds the probabilities S, B x nh x T x T per layer (float32,
#                   + a copy in the autocast dtype), and transiently two more while one layer
#                   runs backward; the final norm's input and output: 2 B x T x C
#     logits        3 x B x T x vocab float32: the log-probabilities kept for the loss's backward,
#                   their gradient and the logits' gradient, all alive at the start of backward
#
# Activations count 4 bytes per element in float32 and the autocast dtype's size under autocast
# (norm inputs stay float32). A step compiled for a CUDA GPU keeps less (`compiled`): inductor
# recomputes the pointwise ops in backward instead of saving their outputs (the norms' outputs,
# the MLP's activation, manual's autocast copy of S), and its fused cross-entropy keeps the
# logits in the autocast dtype plus their gradient, 2 x B x T x vocab, not three float32
# tensors. GPT-2 124M, batch 16 x 1,024, bfloat16, on an H100 (docs/performance.md): sdpa
# 8.91 GiB estimated for 8.45 measured, manual 19.1 for 17.5 (the eager formula: 16.7, 31.5).
# Under torchrun, FSDP divides weights, gradients and optimizer state by the world size. Not
# counted: the runtime's own memory (lazily imported modules, thread pools, matmul scratch:
# 70-150 MB on a CPU). benchmarks/bench_memory.py compares the estimate with measured peaks
# (README, Performance); benchmarks/bench_gpu.py on a GPU.

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
    config: GPTConfig,
    batch_size: int,
    optimizer: str,
    dtype: torch.dtype,
    shards: int = 1,
    compiled: bool = False,
) -> MemoryEstimate:
    """The estimated peak of one training step of micro-batches of `batch_size` windows of
    config.block_size tokens under autocast `dtype` (float32: none); see the comment above.
    `shards`: the world size under FSDP (weights, gradients, optimizer state split), else 1.
    `compiled`: the step is torch.compile'd for a CUDA GPU."""
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
    norm_outs, kept = (0, mlp / 2) if compiled else (2, mlp)  # compiled: recomputed, not kept
    per_layer = B * T * C * (2 * FLOAT32 + (norm_outs + 3 + heads_out + kept) * act)
    activations = config.n_layer * per_layer + 2 * B * T * C * FLOAT32
    if config.attention == "manual":
        scores = B * config.n_head * T * T
        s_copy = 0 if compiled else low
        activations += config.n_layer * scores * (FLOAT32 + s_copy) + 2 * scores * FLOAT32
    return MemoryEstimate(
        weights=(FLOAT32 * params) // shards + low * matmul,
        gradients=FLOAT32 * params // shards,
        optimizer=(FLOAT32 * muon + 2 * FLOAT32 * (params - muon)) // shards,
        activations=int(activations),
        logits=B * T * config.vocab_size * (2 * act if compiled else 3 * FLOAT32),
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
    compiled = cfg.compile and precision.device.type == "cuda"
    estimate = estimate_memory(config, train.batch_size, cfg.optim.name, dtype, shards, compiled)
    budget, source = available_memory(precision.device)
    have = f"{format_bytes(budget)} {source}" if budget is not None else f"available: {source}"
    if budget is None or estimate.total <= budget or train.skip_memory_check:
        return estimate, f"memory: estimated peak {estimate.summary()}; {have}"
    one = estimate_memory(config, 1, cfg.optim.name, dtype, shards, compiled)  # linear in B
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


# ----- the run lock ------------------------------------------------------------------------------

# One owner per run directory: an flock on `<run_dir>/.run.lock`, held by the training process.
#
# Two trainings writing the same `checkpoints/` race (one deletes the directory the other is
# renaming into). The holder writes `{"pid", "host", "started"}` into the file for the error that
# refuses another. The kernel drops the lock with the last descriptor of the open file, so with
# its process however that ends: after kill -9 nothing is stale to judge. flock is advisory and
# per open file description, which a child sharing it would keep locked after we die: so ours
# closes on exec (os.open's default) and in forked children. NFS may not enforce it across hosts.

LOCK_FILE = ".run.lock"


class RunDirLocked(UserError):
    """The run directory belongs to a running process (the message names its pid and host)."""


_held: list[int] = []  # this process's lock descriptors, open until it exits


def _in_forked_child() -> None:  # close the child's copies of our locks' descriptors
    for fd in _held:
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_in_forked_child)


def acquire_run_lock(run_dir: str | Path) -> dict:
    """Take `run_dir`'s lock for this process until it exits and return the owner record it
    wrote; raise RunDirLocked naming the owner if another process (or an earlier
    acquire_run_lock in this one) holds it. The file is never unlinked: a newcomer could then
    lock a new file of that name while a process that had opened this one locks it."""
    path = Path(run_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            owner = json.loads(os.pread(fd, 4096, 0))
        except ValueError:  # not written yet (the owner locked it an instant ago)
            owner = {}
        os.close(fd)
        raise RunDirLocked(
            f"the run directory {path.parent} is in use by pid {owner.get('pid', '?')} on host "
            f"{owner.get('host', '?')} (since {owner.get('started', '?')}); wait for it to "
            f"end, or choose another hydra.run.dir"
        ) from None
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%FT%T%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    _held.append(fd)
    return owner
