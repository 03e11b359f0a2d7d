"""The model's matrices laid out for decoding on a CPU: every matrix-vector product on every core.

Decoding one token at batch 1 multiplies one vector by every weight matrix, so its speed is how
fast the weights stream from memory. MKL, torch's CPU BLAS, runs such a product on one core, and
from nn.Linear's (out, in) layout at a fraction of the bandwidth an (in, out) copy reaches.
Cut that copy into one block of rows per core and `torch.bmm` runs the blocks side by side,
each core reading its own part of the matrix against its slice of the input vector; the partial
sums then add up to the product (faster than a block of columns per core: the sums stay in
each core's registers). The figures per CPU are in docs/performance.md (Sampling);
benchmarks/bench_sample.py prints them on any machine. `decoding_copy` gives
generation a copy of the model whose Linear layers are `SplitLinear`s: the same values in that
layout, the model's code unchanged.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from hardware.device import fastest, probed_dtype, resolve_precision


class SplitLinear(nn.Module):
    """nn.Linear's y = x W^T + b, with W^T (in, out) copied into `parts` blocks of consecutive
    rows: blocks (parts, in / parts, out), the last block padded with zero rows. Each block
    multiplies its slice of x's entries (one torch.bmm for all, a block per core), and the
    blocks' partial sums add up to y. Inference only: the blocks are a detached copy, taken when
    the copy is made."""

    def __init__(self, linear: nn.Linear, parts: int):
        super().__init__()
        weight = linear.weight.detach()  # (out, in)
        self.out_features, self.in_features = weight.shape
        height = -(-self.in_features // parts)  # input rows per block, rounded up
        padded = weight.new_zeros(parts * height, self.out_features)  # (parts * height, out)
        padded[: self.in_features] = weight.t()
        self.register_buffer("blocks", padded.view(parts, height, -1), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)  # (out,) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        parts, height, out = self.blocks.shape
        lead = x.shape[:-1]
        x = F.pad(x, (0, parts * height - self.in_features))  # zero entries for the zero rows
        slices = x.reshape(-1, parts, height).transpose(0, 1)  # (parts, n, height)
        y = torch.bmm(slices, self.blocks).sum(0).view(*lead, out)  # (..., out)
        return y if self.bias is None else y + self.bias


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP shards the model's weights (DTensors, gathered by its forward's hooks). No
    weight is a DTensor before torch.distributed.tensor is imported: sampling never imports it."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in model.parameters())


def decodes_from_a_copy(model: nn.Module) -> bool:
    """Whether generation decodes from `decoding_copy(model)`: for float32 weights on a CPU, held
    whole by this process. GPUs read nn.Linear's layout at full speed (no memory is spent on a
    copy)."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not is_sharded(model)


def decoding_copy(model: nn.Module, parts: int | None = None) -> nn.Module:
    """A copy of `model` whose nn.Linear layers are SplitLinear (`parts` blocks each; default:
    torch's CPU thread count). Everything else is shared with `model`, not copied: the extra
    memory is one copy of the Linear weights, the head's included. Take a new copy after the
    weights change."""
    parts = parts or torch.get_num_threads()
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    decoder = copy.deepcopy(model, memo=shared)
    for module in list(decoder.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                setattr(module, name, SplitLinear(child, parts))
    return decoder


@contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """torch's CPU threads set to `n` inside the block, and back to what they were after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# From a decoding copy, generation times its first decoding steps on torch's threads and on one,
# alternately, THREAD_TRIALS steps each (it stops early once torch's threads have taken twice one
# thread's time), then decodes on the faster count. torch splits each product's blocks
# statically over the threads, so a core busy with other work holds every token (figures:
# docs/performance.md, Sampling). Real steps, not a probe of its own: a short probe on a machine
# whose cores are both busy often meets a moment when they are free. The blocks fix the order of
# the sums, so the tokens are the same on either count.
THREAD_TRIALS = 16


class ThreadChoice:
    """The CPU thread count each decoding step runs on: alternately torch's and one for the trial
    steps (none when `trials` is false), then the one whose trial steps were faster."""

    def __init__(self, trials: bool):
        self.many = torch.get_num_threads()
        self.seconds = {self.many: 0.0, 1: 0.0}  # the trial steps' time on each thread count
        self.trials = 2 * THREAD_TRIALS if trials else 0

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run decoding step `step` (0: the prompt's) inside the block on its thread count, and
        give torch its count back after."""
        if step % 8 == 1 and self.seconds[self.many] > 2 * self.seconds[1]:  # every 4 trials each
            self.trials = 0  # a busy core: torch's threads already take twice one thread's time
        trial = 0 < step <= self.trials
        threads = (self.many, 1)[step % 2] if trial else min(self.seconds, key=self.seconds.get)
        start = time.perf_counter()
        with cpu_threads(threads):
            yield
        if trial:
            self.seconds[threads] += time.perf_counter() - start


def bf16_decoding_speedup(shape: tuple[int, int] = (768, 32768), repeats: int = 3) -> float:
    """float32 time / bfloat16 time of one matrix-vector product as generation runs each: float32
    from SplitLinear's blocks (one per thread), bfloat16 from nn.Linear; best of `repeats`. The
    default matrix, (in, out), is 100 MB in float32, larger than any CPU's caches, so that it
    streams from memory as a token's weights do."""
    generator = torch.Generator().manual_seed(0)  # leaves the global RNG untouched
    linear = nn.utils.skip_init(nn.Linear, *shape, bias=False)  # filled from `generator`
    x = torch.randn(1, shape[0], generator=generator)
    with torch.inference_mode():
        linear.weight.normal_(generator=generator)
        split, x16 = SplitLinear(linear, torch.get_num_threads()), x.bfloat16()
        linear16 = linear.to(torch.bfloat16)
        return fastest(lambda: split(x), repeats) / fastest(lambda: linear16(x16), repeats)


@cache
def cpu_decoding_dtype() -> tuple[torch.dtype, str]:
    """(the weights' dtype for generation with dtype=auto on this CPU, a line saying why). A
    decoded token is memory-bound matrix-vector products, not the compute-bound matmuls of
    training that `cpu_auto_dtype` measures: bfloat16 halves the bytes, but pays only where its
    kernel streams them as fast (a CPU with native bf16 matmuls may still decode slower in bf16:
    docs/performance.md, Sampling), so decoding has a probe of its own, measured once."""
    return probed_dtype("decoding", bf16_decoding_speedup)


def decoding_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype of the weights generation runs in: `auto` on a CPU by `cpu_decoding_dtype`,
    anything else as `resolve_precision` decides it for training."""
    if name == "auto" and device.type == "cpu":
        return cpu_decoding_dtype()[0]
    return resolve_precision(device, name).dtype
