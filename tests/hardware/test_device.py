"""The peak FLOP/s that MFU is measured against: datasheet figures for known GPUs (matched by
the name torch reports), none for unknown ones, a measured rate on the CPU. dtype=auto on a CPU:
bfloat16 only where a probe, run once per machine, measured it clearly faster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hardware.device as device_module
from base.errors import ConfigError
from hardware.device import Precision, peak_flops, resolve_precision

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def gpu_peak(monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype):
    """peak_flops on a CUDA GPU that torch names `name` (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return peak_flops(Precision(torch.device("cuda"), dtype))


@pytest.mark.parametrize(
    "name, dtype, expected",
    [
        ("NVIDIA H100 80GB HBM3", BF16, 989e12),
        ("NVIDIA H100 80GB HBM3", FP32, 494.5e12),  # float32 matmuls run as TF32
        ("NVIDIA H100 NVL", BF16, 835e12),
        ("NVIDIA H100 PCIe", BF16, 756e12),  # not the SXM figure, though "H100" matches too
        ("NVIDIA H200", FP16, 989e12),
        ("NVIDIA A100-SXM4-80GB", BF16, 312e12),
        ("NVIDIA A100-PCIE-40GB", FP32, 156e12),  # TF32, not the 19.5 TF of CUDA cores
        ("NVIDIA A10G", BF16, 70e12),
        ("NVIDIA L40S", BF16, 362e12),  # not the L4's, though "L4" matches too
        ("NVIDIA L4", BF16, 121e12),
        ("NVIDIA L40", BF16, 181e12),  # not the L4's, though "L4" is its prefix
        ("NVIDIA GeForce RTX 4090", BF16, 165e12),
        ("NVIDIA GeForce RTX 3090", FP16, 71e12),
        ("Tesla V100-SXM2-16GB", FP16, 125e12),
        ("Tesla T4", FP16, 65e12),
        ("Tesla V100-SXM2-16GB", FP32, 15.7e12),  # no TF32 before Ampere
    ],
)
def test_known_gpus_get_their_datasheet_figure(monkeypatch, name, dtype, expected):
    flops, source = gpu_peak(monkeypatch, name, dtype)
    assert flops == expected
    assert source == f"{name} datasheet"


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("NVIDIA GeForce GTX 1080", BF16),  # not in the table
        ("Tesla V100-SXM2-16GB", BF16),  # in the table, but without bfloat16
    ],
)
def test_an_unknown_gpu_or_dtype_gives_no_mfu(monkeypatch, name, dtype):
    flops, source = gpu_peak(monkeypatch, name, dtype)
    assert flops is None
    assert "no MFU" in source and name in source


def test_the_cpu_figure_is_measured_on_this_machine():
    flops, source = peak_flops(Precision(CPU, FP32))
    assert source == "measured CPU matmul peak"
    assert 1e8 < flops < 1e14  # 0.1 GFLOP/s to 100 TFLOP/s: a real rate, not 0 or inf


def test_other_devices_give_no_mfu():
    flops, source = peak_flops(Precision(torch.device("mps"), FP32))
    assert flops is None and "no MFU" in source


def test_the_cpu_bfloat16_peak_is_float32s_times_the_probed_gain_never_below(monkeypatch, tmp_path):
    """Autocast keeps part of the model in float32, and a CPU without native bfloat16 emulates
    it ~100x below its float32 rate: a bf16-only peak put MFU at 272% on such a CPU. A native
    one gains what the dtype probe measured: a bfloat16 matmul peak of its own (a smaller
    matrix) put MFU above 100% on an AVX512-BF16 CPU whose probe measured 2.1x."""
    monkeypatch.setenv("CAUSALGPT_CACHE", str(tmp_path))
    monkeypatch.setattr(device_module, "measured_cpu_matmul_flops", lambda: 1e11)
    monkeypatch.setattr(device_module, "bf16_speedup", lambda: 0.01)  # emulated
    assert peak_flops(Precision(CPU, BF16))[0] == 1e11
    (tmp_path / "cpu_precision.json").unlink()  # a new machine: probed again
    monkeypatch.setattr(device_module, "bf16_speedup", lambda: 2.1)  # AVX512-BF16
    assert peak_flops(Precision(CPU, BF16))[0] == pytest.approx(2.1e11)
    assert peak_flops(Precision(CPU, FP32))[0] == 1e11


def test_a_bfloat16_gain_probed_on_a_busy_machine_is_raised_when_measured_again(
    monkeypatch, tmp_path
):
    """The gain is cached once per machine; a run that beats the peak asks again (remeasure):
    the higher figure is kept, a lower one never replaces it."""
    monkeypatch.setenv("CAUSALGPT_CACHE", str(tmp_path))
    monkeypatch.setattr(device_module, "measured_cpu_matmul_flops", lambda: 1e11)
    monkeypatch.setattr(device_module, "bf16_speedup", lambda: 1.2)  # probed under load
    assert peak_flops(Precision(CPU, BF16))[0] == pytest.approx(1.2e11)
    monkeypatch.setattr(device_module, "bf16_speedup", lambda: 2.5)  # the quiet machine's
    assert peak_flops(Precision(CPU, BF16))[0] == pytest.approx(1.2e11)  # cached: not asked
    assert peak_flops(Precision(CPU, BF16), remeasure=True)[0] == pytest.approx(2.5e11)
    monkeypatch.setattr(device_module, "bf16_speedup", lambda: 1.0)
    assert peak_flops(Precision(CPU, BF16), remeasure=True)[0] == pytest.approx(2.5e11)
    assert peak_flops(Precision(CPU, BF16))[0] == pytest.approx(2.5e11)


def test_the_cpu_peak_is_the_highest_measured_and_kept_in_the_cache(monkeypatch, tmp_path):
    """A peak measured on a busy machine reads low: measured once and cached, 67 GFLOP/s stood
    on a 2-core AMD EPYC whose quiet 1024 x 1024 matmul runs at ~200, and bench_train showed
    MFU 137%. Each run measures again (~0.1 s) and the cache keeps the highest."""
    monkeypatch.setenv("CAUSALGPT_CACHE", str(tmp_path))
    timings = iter([0.5, 0.25, 1.0])  # busy, quiet, busy again
    monkeypatch.setattr(device_module, "fastest", lambda run, repeats: next(timings))
    assert peak_flops(Precision(CPU, FP32))[0] == 2 * 1024**3 / 0.5
    assert peak_flops(Precision(CPU, FP32))[0] == 2 * 1024**3 / 0.25  # raised
    assert peak_flops(Precision(CPU, FP32))[0] == 2 * 1024**3 / 0.25  # never lowered
    cached = json.loads((tmp_path / "cpu_precision.json").read_text())
    assert list(cached.values()) == [2 * 1024**3 / 0.25]
    assert next(iter(cached)).endswith("| torch.float32 matmul FLOP/s")


# ----- dtype=auto on a CPU: decided by a probe, measured once per machine ----------------------


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[float]:
    """The probe unpinned, its cache in tmp_path, and bf16_speedup stubbed: append the speedup
    the stub should report; the list's length after a call is the number of probes run."""
    monkeypatch.delenv(device_module.AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setenv("CAUSALGPT_CACHE", str(tmp_path))
    answers: list[float] = []
    calls: list[float] = []

    def stub(*args: object, **kwargs: object) -> float:
        calls.append(answers[len(calls)])
        return calls[-1]

    monkeypatch.setattr(device_module, "bf16_speedup", stub)
    device_module.cpu_auto_dtype.cache_clear()
    yield answers, calls
    device_module.cpu_auto_dtype.cache_clear()


def test_auto_picks_bfloat16_on_a_cpu_whose_bf16_matmuls_are_clearly_faster(probe):
    answers, calls = probe
    answers.append(4.2)
    precision = resolve_precision(CPU, "auto")
    assert precision.dtype == torch.bfloat16
    assert "4.2x" in precision.why and "picked" in precision.why
    assert device_module.fast_matmul_dtype(CPU) == torch.bfloat16
    assert len(calls) == 1


def test_auto_stays_float32_where_bf16_is_emulated(probe):
    answers, _ = probe
    answers.append(0.0032)  # an AMD EPYC (Zen 3): two significant digits, never "0.00x"
    precision = resolve_precision(CPU, "auto")
    assert precision.dtype == torch.float32
    assert "0.0032x" in precision.why
    assert device_module.fast_matmul_dtype(CPU) == torch.float32
    # an explicit dtype is never second-guessed
    assert resolve_precision(CPU, "bfloat16").dtype == torch.bfloat16


def test_the_probe_runs_once_per_machine_and_is_then_read_from_the_cache(probe, tmp_path):
    answers, calls = probe
    answers += [4.2, 0.08]  # a second probe would flip the decision
    assert resolve_precision(CPU, "auto").dtype == torch.bfloat16
    device_module.cpu_auto_dtype.cache_clear()  # a new process
    assert resolve_precision(CPU, "auto").dtype == torch.bfloat16
    assert len(calls) == 1
    cached = json.loads((tmp_path / "cpu_precision.json").read_text())
    assert list(cached.values()) == [4.2]
    assert torch.__version__ in next(iter(cached))  # keyed by machine and torch version


def test_a_corrupt_cache_file_is_measured_again(probe, tmp_path):
    answers, calls = probe
    answers.append(0.5)
    (tmp_path / "cpu_precision.json").write_text("{not json")
    assert resolve_precision(CPU, "auto").dtype == torch.float32
    assert len(calls) == 1


def test_the_environment_can_pin_the_choice_and_a_bad_pin_is_one_line(probe, monkeypatch):
    _, calls = probe
    monkeypatch.setenv(device_module.AUTO_DTYPE_ENV, "bfloat16")
    assert resolve_precision(CPU, "auto").dtype == torch.bfloat16
    device_module.cpu_auto_dtype.cache_clear()
    monkeypatch.setenv(device_module.AUTO_DTYPE_ENV, "fp8")
    with pytest.raises(ConfigError, match="CAUSALGPT_CPU_AUTO_DTYPE must be one of .*, got 'fp8'"):
        resolve_precision(CPU, "auto")
    assert calls == []


def test_the_real_probe_measures_a_positive_ratio():
    assert device_module.bf16_speedup((64, 64, 64), repeats=1) > 0


def test_auto_falls_back_to_the_cpu_and_an_explicit_device_must_exist(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert device_module.resolve_device("auto") == CPU
    with pytest.raises(ConfigError, match="device=cuda:1 but CUDA is not available"):
        device_module.resolve_device("cuda:1")


# A 128 MiB tensor (a step's logits) allocated, then freed: where glibc's malloc put it (mallinfo2:
# hblkhd, bytes in blocks mapped on their own; arena, bytes of the heap).
REFILL = """
import ctypes, json, sys, torch
from hardware.device import configure_backends
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in FIELDS.split()]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
if sys.argv[1] == "configured":
    configure_backends(torch.device("cpu"))
x = torch.ones(2**25)
mapped = mallinfo2().hblkhd
del x
print(json.dumps({"mapped": mapped, "heap_after_free": mallinfo2().arena}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc (Linux)")
def test_a_configured_process_keeps_a_freed_tensor_in_its_heap_for_the_next():
    """keep_freed_memory: a tensor the size of a step's logits comes from the heap, which keeps
    its pages when it is freed, so the next step's tensors reuse them (docs/performance.md: the
    page faults it saves). glibc's default (the control) maps such a block on its own and unmaps
    it when freed."""
    run = {
        mode: json.loads(
            subprocess.run(
                [sys.executable, "-c", REFILL, mode],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout  # fmt: skip
        )
        for mode in ("configured", "default")
    }
    assert run["default"]["mapped"] >= 2**27 > run["default"]["heap_after_free"], run
    assert run["configured"]["mapped"] < 2**27 <= run["configured"]["heap_after_free"], run
