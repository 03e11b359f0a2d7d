"""Device and precision: pick what the machine has, and know its peak FLOP/s for MFU; and the
CPU's decoding layout, dtype and thread count, which generation takes from here (the end of this
file), so that every choice tuned to the machine is made in one module."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import os
import platform
import re
import sys
import time
import timeit
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from base.errors import ConfigError, check, choice
from base.files import write_atomic

# Dense (non-sparse) peak tensor-core FLOP/s per GPU, from the vendors' datasheets.
# Keys are matched as whole words of torch.cuda.get_device_name() ("L4" is not the L40's), most
# specific first.
# float32: configure_backends runs float32 matmuls as TF32 on Ampere and later, so their figure
# is the dense TF32 one (half of bf16's on these GPUs), not the far lower CUDA-core FP32 figure
# (which would put MFU above 100%). V100 and T4 have no TF32: their FP32 figure.
GPU_PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494.5e12},
    "H100 PCIe": {torch.bfloat16: 756e12, torch.float16: 756e12, torch.float32: 378e12},
    "H100 NVL": {torch.bfloat16: 835e12, torch.float16: 835e12, torch.float32: 417.5e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494.5e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 156e12},
    "A10G": {torch.bfloat16: 70e12, torch.float16: 70e12, torch.float32: 35e12},
    "L40S": {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 181e12},
    "L40": {torch.bfloat16: 181e12, torch.float16: 181e12, torch.float32: 90.5e12},
    "L4": {torch.bfloat16: 121e12, torch.float16: 121e12, torch.float32: 60.5e12},
    "RTX 4090": {torch.bfloat16: 165e12, torch.float16: 165e12, torch.float32: 82.6e12},
    "RTX 3090": {torch.bfloat16: 71e12, torch.float16: 71e12, torch.float32: 35.6e12},
    "V100": {torch.float16: 125e12, torch.float32: 15.7e12},
    "T4": {torch.float16: 65e12, torch.float32: 8.1e12},
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# dtype=auto on a CPU: bfloat16 only where this machine's probe shows its matmuls clearly faster
# than float32's (native bf16: AMX or AVX512-BF16, ~4-6x); where bf16 is emulated it is 7-18x
# slower.
BF16_MIN_SPEEDUP = 1.3
# Skips the probe with a fixed answer (float32 or bfloat16): the test suite pins float32 so that
# its figures do not depend on the CPU it runs on.
AUTO_DTYPE_ENV = "CAUSALGPT_CPU_AUTO_DTYPE"


@dataclass
class Precision:
    device: torch.device
    dtype: torch.dtype  # the autocast dtype; float32 means no autocast
    why: str = ""  # how dtype=auto decided, for the startup line

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, self.dtype, enabled=self.dtype != torch.float32)

    @property
    def needs_grad_scaler(self) -> bool:
        """float16 gradients underflow without loss scaling; bfloat16 has float32's range."""
        return self.dtype == torch.float16


def device_name(key: str, value: Any) -> str:
    """A device= value, wherever the key is read: auto, or a name torch.device parses."""
    try:
        return value if value == "auto" else str(torch.device(value))
    except (RuntimeError, TypeError):
        rule = "auto or a device (cpu, cuda, cuda:1, mps)"
        raise ConfigError(f"{key} must be {rule}, got {value!r}") from None


def dtype_name(key: str, value: Any) -> str:
    """A dtype= value, wherever the key is read: auto or one of DTYPES."""
    return choice(key, value, ["auto", *DTYPES])


def resolve_device(name: str) -> torch.device:
    """`auto` is the best the machine has: CUDA, then Apple's MPS, then the CPU. An explicit
    device (cpu, cuda, cuda:1, mps) must exist."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if name == "auto":
        name = "cuda" if available["cuda"] else "mps" if available["mps"] else "cpu"
    device = torch.device(device_name("device", name))
    if not available.get(device.type, True):
        kind = device.type.upper()
        raise ConfigError(f"device={name} but {kind} is not available; use device=auto or cpu")
    return device


def resolve_precision(device: torch.device, dtype: str) -> Precision:
    """The autocast precision for training. `auto`: bfloat16 on GPUs that support it, float16 on
    older GPUs; on a CPU, bfloat16 where this machine's probe measured its matmuls clearly faster
    than float32 (`cpu_auto_dtype`, which also says why); float32 elsewhere."""
    dtype_name("dtype", dtype)
    if dtype == "auto" and device.type == "cpu":
        return Precision(device, *cpu_auto_dtype())
    if dtype == "auto" and device.type == "cuda":
        dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    elif dtype == "auto":
        dtype = "float32"
    if dtype == "float16" and device.type == "cpu":
        raise ConfigError("dtype=float16 is not supported on CPU; use bfloat16 or float32")
    return Precision(device, DTYPES[dtype])


def fast_matmul_dtype(device: torch.device) -> torch.dtype:
    """The dtype for matmul-heavy work that tolerates bfloat16 (Muon's Newton-Schulz): bfloat16
    on CUDA, and on a CPU whose probe picked it; float32 elsewhere."""
    if device.type == "cpu":
        return cpu_auto_dtype()[0]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@cache
def cpu_auto_dtype() -> tuple[torch.dtype, str]:
    """(the CPU's dtype for dtype=auto, a line saying why): `probed_dtype` of training's
    matmuls (`bf16_speedup`: a second or two)."""
    return probed_dtype("matmuls", bf16_speedup)


def measured_once(what: str, measure: Callable[[], float], keep_highest: bool = False) -> float:
    """`measure()`, run once per machine, torch version, thread count and `what`, then read from
    cpu_precision.json in the cache directory (delete it to measure again): the CPU probes
    take seconds, and a run should not pay them each time. keep_highest (a peak rate, cheap to
    measure): measured at every call, the highest value seen kept, since a measurement on a busy
    machine reads low and only a later, quieter one can correct it."""
    key = f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {what}"
    root = os.environ.get("CAUSALGPT_CACHE") or Path.home() / ".cache" / "causalgpt"
    file = Path(root).expanduser() / "cpu_precision.json"
    try:
        known = json.loads(file.read_text())
    except (OSError, ValueError):
        known = {}
    if keep_highest or key not in known:
        value = max(measure(), known.get(key, 0.0) if keep_highest else 0.0)
        if known.get(key) != value:
            known[key] = value
            with contextlib.suppress(OSError):  # a read-only home only costs a probe per run
                file.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(file, json.dumps(known, indent=2))
    return known[key]


def probed_dtype(what: str, bf16_speedup: Callable[[], float]) -> tuple[torch.dtype, str]:
    """(bfloat16 or float32 for `what` on this CPU, a line saying why): as CAUSALGPT_CPU_AUTO_DTYPE
    pins it, else bfloat16 where `bf16_speedup()` (`measured_once`) is at least
    BF16_MIN_SPEEDUP."""
    if pinned := os.environ.get(AUTO_DTYPE_ENV):
        choice(AUTO_DTYPE_ENV, pinned, ["float32", "bfloat16"])
        return DTYPES[pinned], f"dtype=auto: {pinned}, set by {AUTO_DTYPE_ENV}"
    speedup = measured_once(what, bf16_speedup)
    dtype = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else torch.float32
    verdict = "picked" if dtype == torch.bfloat16 else f"under {BF16_MIN_SPEEDUP}x: float32"
    return dtype, f"dtype=auto: bfloat16 {what} {speedup:.2g}x float32's on this CPU ({verdict})"


def bf16_speedup(shape: tuple[int, int, int] = (1024, 512, 2048), repeats: int = 3) -> float:
    """float32 time / bfloat16 time of one (m, k) @ (k, n) matmul, best of `repeats` each; by
    default of a small model's MLP shape (tokens x C x 4C)."""
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)  # leaves the global RNG (dropout) untouched
    a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    a16, b16 = a.bfloat16(), b.bfloat16()
    return fastest(lambda: a @ b, repeats) / fastest(lambda: a16 @ b16, repeats)


def fastest(run: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `run`, after one untimed warm-up call."""
    return min(timeit.repeat(run, repeat=repeats + 1, number=1)[1:])


def configure_backends(device: torch.device) -> None:
    """How this process runs torch: freed memory kept for the next tensors (`keep_freed_memory`);
    on CUDA, TF32 matmuls (float32 range, 10-bit mantissa, much faster on Ampere and later)."""
    keep_freed_memory()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # cuDNN's convolutions use TF32 by default


def keep_freed_memory() -> None:
    """Keep the memory torch frees for its next tensors instead of handing it back to the kernel.

    glibc's malloc serves a block over its mmap threshold (at most 32 MB) with a fresh mapping
    and unmaps it when freed. A step allocates its activations and logits anew each time, so
    the kernel page-faults them in, zero-filled, every step: with GPT-2's 50k vocabulary, one
    batch's logits are hundreds of MB. Served from the heap and never trimmed, the pages stay
    mapped: 1.4-3.4x an eager step's tokens/s for the small presets on a 2-core Xeon, and the
    README's short run in 27 s instead of 70 (docs/performance.md). The process then holds the
    most it ever held, as a run does at every step anyway. Not glibc (macOS, musl): no-op."""
    if sys.platform != "linux":  # CDLL(None), the process's own symbols, is POSIX's alone
        return
    if (mallopt := getattr(ctypes.CDLL(None), "mallopt", None)) is not None:
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
        mallopt(M_MMAP_MAX, 0)  # every block from the heap
        mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # and the heap's freed top kept


def peak_flops(precision: Precision, remeasure: bool = False) -> tuple[float | None, str]:
    """The peak FLOP/s that MFU is measured against, and where the figure comes from.

    GPUs: the datasheet figure for this GPU and dtype, or None (no MFU) for an unknown GPU.
    CPUs: a measured dense-matmul rate on this machine, which is the best the CPU shows.
    remeasure: a run beat the CPU's peak, so a cached figure was measured on a busy machine:
    the bfloat16 speedup is measured again too, the highest kept (float32's always is).
    """
    device, dtype = precision.device, precision.dtype
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_FLOPS.items():
            if re.search(rf"\b{key}\b", name) and dtype in table:
                return table[dtype], f"{name} datasheet"
        return None, f"unknown GPU {name!r}: no MFU"
    if device.type == "cpu":
        # float32's measured rate, times what bfloat16 matmuls gain on this CPU where they gain
        # (AVX512-BF16, AMX): the same probe that picks dtype=auto, so MFU and the dtype choice
        # agree. Never below float32's: autocast keeps part of the model in float32, and a CPU
        # without native bfloat16 emulates it far below its float32 rate (MFU above 100%).
        peak = measured_cpu_matmul_flops()
        if dtype == torch.bfloat16:
            peak *= max(1.0, measured_once("matmuls", bf16_speedup, keep_highest=remeasure))
        return peak, "measured CPU matmul peak"
    return None, f"no peak figure for {device.type}: no MFU"


def measured_cpu_matmul_flops() -> float:
    """float32 FLOP/s of a large square matmul on this CPU (best of a few runs, ~0.1 s), the
    highest this machine has shown (`measured_once(keep_highest=True)`)."""

    def measure() -> float:
        n = 1024
        # its own generator leaves the global RNG (dropout) untouched
        a, b = torch.randn(2, n, n, generator=torch.Generator().manual_seed(0))
        return 2 * n**3 / fastest(lambda: a @ b, 5)

    return measured_once(f"{torch.float32} matmul FLOP/s", measure, keep_highest=True)


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (none where there is no such file)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.split("\n"))}


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers where /proc/cpuinfo has them
    ("AMD EPYC" alone names CPUs both with and without native bfloat16), for benchmark headers
    and the precision probes' cache."""
    fields = cpuinfo()
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    family, model = fields.get("cpu family"), fields.get("model")
    numbers = f" (family {family}, model {model})" if family and model else ""
    return fields["model name"] + numbers


# ----- decoding on a CPU: the layout, the dtype and the thread count ------------------------------

# The model's matrices laid out for decoding on a CPU: every matrix-vector product on every core.
#
# Decoding one token at batch 1 multiplies one vector by every weight matrix, so its speed is how
# fast the weights stream from memory. MKL, torch's CPU BLAS, runs such a product on one core, and
# from nn.Linear's (out, in) layout at a fraction of the bandwidth an (in, out) copy reaches.
# Cut that copy into one block of rows per core and `torch.bmm` runs the blocks side by side,
# each core reading its own part of the matrix against its slice of the input vector; the partial
# sums then add up to the product (faster than a block of columns per core: the sums stay in
# each core's registers). The figures per CPU are in docs/performance.md (Sampling);
# benchmarks/bench_sample.py prints them on any machine. `decoding_copy` gives
# generation a copy of the model whose Linear layers are `SplitLinear`s: the same values in that
# layout, the model's code unchanged.


@torch.library.custom_op("causalgpt::block_products", mutates_args=())
def block_products(slices: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """SplitLinear's sum of its blocks' products, (n, out), as one operation a compiled step
    calls as it is (inductor turns a bmm of one row into its own C++ loops: 0.55x the tokens/s,
    docs/performance.md, Sampling)."""
    return torch.bmm(slices, blocks).sum(0)


@block_products.register_fake
def _block_products_shape(slices: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return slices.new_empty(slices.size(1), blocks.size(2))


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
        if torch.compiler.is_compiling():  # inductor's own loops would read W at half the speed
            y = block_products(slices, self.blocks).view(*lead, out)
        else:
            y = torch.bmm(slices, self.blocks).sum(0).view(*lead, out)  # (..., out)
        return y if self.bias is None else y + self.bias


class LowBitLinear(nn.Module):
    """What Int8Linear and Int4Linear share: nn.Linear's bias kept as it was, and x padded with
    zeros to the `width` their kernels want, in bfloat16, the product trimmed to out_features and
    returned in x's dtype. Inference only, like SplitLinear."""

    def __init__(self, linear: nn.Linear, width: int):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.width = width  # in_features padded to the kernel's multiple
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)  # (out,) or None, as it was

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (n, width) in bfloat16 -> (n, out padded) in bfloat16: the subclass's kernel."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        rows = F.pad(x, (0, self.width - self.in_features)).reshape(-1, self.width)
        y = self.product(rows.bfloat16())[:, : self.out_features]
        y = y.reshape(*x.shape[:-1], -1).type_as(x)
        return y if self.bias is None else y + self.bias


class Int8Linear(LowBitLinear):
    """nn.Linear's y = x W^T + b with W in 8 bits: each row of W (an output's weights) as
    integers in [-127, 127] times the row's scale, max |row| / 127, rounded to nearest (llama.cpp's
    q8_0 has a scale per 32 weights instead). A quarter of float32's bytes a token. torch's CPU
    kernel for it, `torch._weight_int8pack_mm`, takes x and the scales in bfloat16 and returns
    bfloat16 (in float32 it runs ~10x slower), and wants the rows a multiple of 16 long: x and W
    are padded with zeros to that."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear, -(-linear.in_features // 16) * 16)
        weight = F.pad(linear.weight.detach().float(), (0, self.width - self.in_features))
        scales = (weight.abs().amax(dim=1).clamp(min=1e-30) / 127).bfloat16()  # (out,)
        ints = (weight / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("ints", ints, persistent=False)  # (out, width)
        self.register_buffer("scales", scales, persistent=False)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.ints, self.scales)


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


class Int4Linear(LowBitLinear):
    """nn.Linear's y = x W^T + b with W in 4 bits: each group of 32 consecutive weights of a row
    as integers q in [0, 15], w = (q - 8) * scale + zero, with the group's scale (max - min) / 15
    and zero min + 8 * scale (q = 0 at its min, 15 at its max; llama.cpp's q4_1 has the same
    groups). An eighth of float32's bytes. torch's CPU kernel, `torch._weight_int4pack_mm_for_cpu`,
    takes x, the scales and the zeros in bfloat16 and returns bfloat16, and wants whole groups and
    a multiple of 16 outputs: x and W are padded with zeros to that. CPU only."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear, -(-linear.in_features // 32) * 32)
        if linear.weight.device.type != "cpu":
            raise ConfigError(
                f"quantize=int4 runs torch's CPU kernel, not on {linear.weight.device.type}: "
                "use quantize=int8 there"
            )
        padding = (0, self.width - self.in_features, 0, -self.out_features % 16)
        weight = F.pad(linear.weight.detach().float(), padding)  # (out padded, width)
        groups = weight.view(weight.size(0), -1, 32)  # (out padded, width / 32, 32)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scales = ((high - low).clamp(min=1e-30) / 15).bfloat16()  # rounded as the kernel has them
        zeros = (low + 8 * scales.float()).bfloat16()
        ints = ((groups - zeros.float()) / scales.float() + 8).round().clamp(0, 15)
        packed = torch._convert_weight_to_int4pack_for_cpu(ints.int().flatten(1), 2)
        self.register_buffer("packed", packed, persistent=False)
        both = torch.cat([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # (in/32, out, 2)
        self.register_buffer("scales_and_zeros", both, persistent=False)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, self.packed, 32, self.scales_and_zeros)


QUANTIZED = dict(int8=Int8Linear, int4=Int4Linear)  # quantize= of sample, evaluate and serve


def quantize_setting(value: Any) -> str | None:
    """The `quantize` key of sample.py, evaluate.py and serve.py, checked."""
    rule = "int8, int4, or null: the weights as stored"
    return check("quantize", value, value in (None, *QUANTIZED), rule)


def decoding_copy(
    model: nn.Module, parts: int | None = None, quantize: str | None = None
) -> nn.Module:
    """A copy of `model` whose nn.Linear layers are SplitLinear (`parts` blocks each; default:
    torch's CPU thread count), or with `quantize` (int8, int4) its QUANTIZED layer. Everything
    else is shared with `model`, not copied: the extra memory is one copy of the Linear weights,
    the head's included. Take a new copy after the weights change."""
    parts = parts or torch.get_num_threads()
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    decoder = copy.deepcopy(model, memo=shared)
    for module in list(decoder.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                low_bits = quantize and QUANTIZED[quantize](child)
                setattr(module, name, low_bits or SplitLinear(child, parts))
    return decoder


def decoder_for(model: nn.Module, quantize: str | None = None) -> nn.Module:
    """The module decoding runs: a `decoding_copy` where `quantize` asks for low-bit weights or
    the copy reads faster (`decodes_from_a_copy`), else `model` itself. Sampling's and the
    server's batch alike."""
    copied = quantize is not None or decodes_from_a_copy(model)
    return decoding_copy(model, quantize=quantize) if copied else model


@contextlib.contextmanager
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

    @contextlib.contextmanager
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
