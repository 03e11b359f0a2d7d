"""Device and precision: pick what the machine has, and know its peak FLOP/s for MFU."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from base.errors import ConfigError
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
# slower. The probe is one matmul of a small model's MLP shape (tokens x C x 4C).
PROBE_SHAPE = (1024, 512, 2048)
BF16_MIN_SPEEDUP = 1.3
# Skips the probe with a fixed answer (float32 or bfloat16): the test suite pins float32 so that
# its figures do not depend on the CPU it runs on.
AUTO_DTYPE_ENV = "CAUSALGPT_CPU_AUTO_DTYPE"


@dataclass
class Precision:
    device: torch.device
    dtype: torch.dtype  # the autocast dtype; float32 means no autocast
    why: str = ""  # how dtype=auto decided, for the startup line

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @property
    def needs_grad_scaler(self) -> bool:
        """float16 gradients underflow without loss scaling; bfloat16 has float32's range."""
        return self.dtype == torch.float16


def resolve_device(name: str) -> torch.device:
    """`auto` is the best the machine has: CUDA, then Apple's MPS, then the CPU. An explicit
    device (cpu, cuda, cuda:1, mps) must exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name!r} is not a device; use auto, cpu, cuda or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but no CUDA GPU is available; use device=auto or cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={name} but MPS is not available; use device=auto or cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on GPUs that support it, float16 on older GPUs; on a CPU, bfloat16 where
    this machine's probe measured its matmuls clearly faster than float32 (`cpu_auto_dtype`);
    float32 elsewhere."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu":
            return cpu_auto_dtype()[0]
        return torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r} is unknown; choose auto or one of {list(DTYPES)}")
    if name == "float16" and device.type == "cpu":
        raise ConfigError("dtype=float16 is not supported on CPU; use bfloat16 or float32")
    return DTYPES[name]


def resolve_precision(device: torch.device, dtype: str) -> Precision:
    """The autocast precision for training: see `resolve_dtype`."""
    why = cpu_auto_dtype()[1] if dtype == "auto" and device.type == "cpu" else ""
    return Precision(device, resolve_dtype(dtype, device), why)


def fast_matmul_dtype(device: torch.device) -> torch.dtype:
    """The dtype for matmul-heavy work that tolerates bfloat16 (Muon's Newton-Schulz): bfloat16
    on CUDA, and on a CPU whose probe picked it; float32 elsewhere."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu":
        return cpu_auto_dtype()[0]
    return torch.float32


def precision_cache_file() -> Path:
    root = os.environ.get("CAUSALGPT_CACHE") or Path.home() / ".cache" / "causalgpt"
    return Path(root).expanduser() / "cpu_precision.json"


@cache
def cpu_auto_dtype() -> tuple[torch.dtype, str]:
    """(the CPU's dtype for dtype=auto, a line saying why): bfloat16 where `bf16_speedup` (a
    second or two, measured once: `measured_once`) is at least BF16_MIN_SPEEDUP."""
    return pinned_cpu_dtype() or bf16_verdict("matmuls", measured_once("", bf16_speedup))


def pinned_cpu_dtype() -> tuple[torch.dtype, str] | None:
    """The choice CAUSALGPT_CPU_AUTO_DTYPE=float32|bfloat16 makes for every probe, if it is set."""
    pinned = os.environ.get(AUTO_DTYPE_ENV)
    if not pinned:
        return None
    if pinned not in ("float32", "bfloat16"):
        raise ConfigError(f"{AUTO_DTYPE_ENV}={pinned!r}: use float32 or bfloat16")
    return DTYPES[pinned], f"dtype=auto: {pinned}, set by {AUTO_DTYPE_ENV}"


def bf16_verdict(what: str, speedup: float) -> tuple[torch.dtype, str]:
    """bfloat16 if a probe measured `what` at least BF16_MIN_SPEEDUP times faster in it."""
    dtype = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else torch.float32
    verdict = "picked" if dtype == torch.bfloat16 else f"under {BF16_MIN_SPEEDUP}x: float32"
    return dtype, f"dtype=auto: bfloat16 {what} {speedup:.2g}x float32's on this CPU ({verdict})"


def measured_once(what: str, measure: Callable[[], float]) -> float:
    """`measure()`, a positive ratio, taken once per machine, torch version and thread count,
    then read from a JSON file in the cache directory (`what` names it there; "" is the
    training probe's)."""
    key = f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    key += f" | {what}" if what else ""
    file = precision_cache_file()
    try:
        known = json.loads(file.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    value = known.get(key)
    if not isinstance(value, (int, float)) or value <= 0:
        value = measure()
        known[key] = value
        with contextlib.suppress(OSError):  # a read-only home only costs a probe per run
            file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(file, json.dumps(known, indent=2))
    return value


def bf16_speedup(shape: tuple[int, int, int] = PROBE_SHAPE, repeats: int = 3) -> float:
    """float32 time / bfloat16 time of one (m, k) @ (k, n) matmul, best of `repeats` each."""
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)  # leaves the global RNG (dropout) untouched
    a = torch.randn(m, k, generator=generator)
    b = torch.randn(k, n, generator=generator)
    a16, b16 = a.bfloat16(), b.bfloat16()
    return fastest(lambda: a @ b, repeats) / fastest(lambda: a16 @ b16, repeats)


def fastest(run: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `run`, after one untimed warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def configure_backends(device: torch.device) -> None:
    """TF32 matmuls on CUDA: float32 range, 10-bit mantissa, much faster on Ampere and later."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def peak_flops(precision: Precision) -> tuple[float | None, str]:
    """The peak FLOP/s that MFU is measured against, and where the figure comes from.

    GPUs: the datasheet figure for this GPU and dtype, or None (no MFU) for an unknown GPU.
    CPUs: a measured dense-matmul rate on this machine, which is the best the CPU shows.
    """
    device, dtype = precision.device, precision.dtype
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_FLOPS.items():
            if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", name) and dtype in table:
                return table[dtype], f"{name} datasheet"
        return None, f"unknown GPU {name!r}: no MFU"
    if device.type == "cpu":
        # The best of float32 and the autocast dtype: autocast keeps part of the model in
        # float32, and a CPU without native bfloat16 (no AVX512-BF16 or AMX) emulates it far
        # below its float32 rate, which alone would put MFU above 100%.
        peak = measured_cpu_matmul_flops(torch.float32)
        if dtype != torch.float32:
            peak = max(peak, measured_cpu_matmul_flops(dtype, n=512))
        return peak, "measured CPU matmul peak"
    return None, f"no peak figure for {device.type}: no MFU"


@cache
def measured_cpu_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 1024) -> float:
    """FLOP/s of a large square matmul on this CPU (best of a few runs, ~0.2 s in float32; an
    emulated bfloat16 is ~100x slower, hence a smaller n for other dtypes)."""
    generator = torch.Generator().manual_seed(0)  # leaves the global RNG (dropout) untouched
    a = torch.randn(n, n, dtype=dtype, generator=generator)
    b = torch.randn(n, n, dtype=dtype, generator=generator)
    a @ b  # warm up
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def cpu_bf16_features() -> list[str]:
    """This CPU's flags for native bfloat16 arithmetic (none: bfloat16 is emulated)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return []
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx_vnni"})
    return []


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers where /proc/cpuinfo has them
    ("AMD EPYC" alone names CPUs both with and without native bfloat16), for benchmark headers
    and the precision probes' cache."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        fields: dict[str, str] = {}
        for line in cpuinfo.read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
        if "model name" in fields:
            family, model = fields.get("cpu family"), fields.get("model")
            numbers = f" (family {family}, model {model})" if family and model else ""
            return fields["model name"] + numbers
    return platform.processor() or platform.machine()
