"""What the benchmarks share: one measurement cell per fresh interpreter, the machine line that
heads every table, markdown rows, and the process's resident memory.

A cell runs in a fresh subprocess, so no compiled kernels, allocator cache, earlier memory peak
or thread state carries over from the cells before it. The subprocess is the same script with
the same command line plus ``--cell JSON``, so every flag reaches it as it was typed; there,
`parse_args` runs the script's child function on the cell and prints its result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(parser: argparse.ArgumentParser, child: Callable | None = None):
    """The parsed command line, with torch's threads set from ``--threads`` where the script has
    it (0: torch's default). In a cell's subprocess, print ``child(cell, args)`` as JSON and exit.
    """
    if child:
        parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    if getattr(args, "cell", None):
        print(json.dumps(child(json.loads(args.cell), args)))
        sys.exit()
    return args


def measure(script: str, cell: dict, timeout: float | None = None) -> dict:
    """`script`'s child on `cell` in a fresh interpreter, with this process's command line;
    {"error": why} when it fails or runs past `timeout` seconds."""
    cmd = [sys.executable, script, *sys.argv[1:], f"--cell={json.dumps(cell)}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        return {"error": lines[-1][:80].replace("|", "/")}
    return json.loads(done.stdout.strip().splitlines()[-1])


def train_config(overrides: list[str]):
    """(RunConfig, resolved tree) of configs/train.yaml with `overrides`, as train.py builds
    them."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from trainer.config import RunConfig

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("train", overrides=overrides)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return RunConfig.from_dict(resolved), resolved


def machine(device: str = "cpu") -> str:
    """The line that heads every table: the CPU (hardware.device.cpu_name, its native bfloat16
    features, dtype=auto's choice), cores, torch and its threads, Python, and the device."""
    import torch

    from hardware.device import cpu_auto_dtype, cpu_name, cpuinfo, resolve_device

    flags = set(cpuinfo().get("flags", "").split())  # native bfloat16 arithmetic, if any
    bf16 = flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx_vnni"}
    features = ", ".join(sorted(bf16)) or "none: bfloat16 is emulated"
    where = resolve_device(device)
    gpu = f", GPU: {torch.cuda.get_device_name(where)}" if where.type == "cuda" else ""
    return (
        f"CPU: {cpu_name()} (bf16 features: {features}; {cpu_auto_dtype()[1]}), "
        f"{os.cpu_count()} logical cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}; "
        f"device: {where}{gpu}"
    )


def head(columns: str, align: str) -> None:
    """A markdown table's first two lines: `columns` (joined by " | "), then one letter of
    `align` a column: r right-aligns it (numbers), anything else left."""
    print(f"| {columns} |\n|" + "".join("---:|" if a == "r" else "---|" for a in align))


def row(cells: list[str]) -> None:
    print("| " + " | ".join(cells) + " |", flush=True)


def rss_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident, what getrusage's ru_maxrss reports) of
    this process, from /proc (Linux only)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Make VmHWM forget earlier peaks (Linux >= 4.0), e.g. freed temporaries of the setup."""
    Path("/proc/self/clear_refs").write_text("5")
