"""Benchmark: training throughput (tokens/s) and MFU of whole optimizer steps, side by side.

Run from anywhere: ``python benchmarks/bench_train.py`` (nano and mini, every attention impl,
float32 and bfloat16 autocast, torch.compile off and on: 24 cells, several minutes on a small
CPU); ``--help`` for the options. Prints a markdown table.

Method. Each cell (preset, attention, dtype, compile, optimizer) runs in a fresh subprocess, so
no compiled kernels, allocator cache or thread state carries over. The child builds a real
``Trainer`` from configs/train.yaml with the cell's overrides, on a text dataset of random
printable characters tokenized with ``bytes`` (prepared once, by the parent), with
``model.vocab_size=--vocab``: the embedding and head cost what a tokenizer of that size costs
(50257: GPT-2's), whatever the token values. It then calls ``Trainer.train_step`` (the step that
``python train.py`` takes: learning rate, micro-batches under autocast, backward, gradient
clipping, optimizer step) for --warmup steps, untimed (torch.compile compiles in the first), and
times each of --steps more (CUDA: synchronized). A cell's time is the median step; tokens/s is
batch_size * block_size / that time. MFU is tokens/s * model.flops_per_token / the peak FLOP/s
of hardware/device.py: the datasheet figure of a known GPU, or on a CPU its dense-matmul rate in
that dtype measured once by this process. The ratio column is each cell's tokens/s over its
preset's first cell (the baseline, marked).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPT2_VOCAB = 50257
IMPLS = ("manual", "sdpa", "flash")
DTYPES = ("float32", "bfloat16")
TEXT_BYTES = 400_000  # train split; val is a tenth (unused, but a dataset needs one)


def overrides(cell: dict, args: argparse.Namespace, data_dir: Path) -> list[str]:
    """The `python train.py` overrides of one cell."""
    return [
        f"model={cell['preset']}",
        f"model.attention={cell['impl']}",
        f"model.block_size={args.block_size}",
        f"model.vocab_size={args.vocab}",
        f"optim={cell['optim']}",
        f"dtype={cell['dtype']}",
        f"compile={str(cell['compile']).lower()}",
        f"device={args.device}",
        f"train.batch_size={args.batch_size}",
        "train.max_steps=1000000",
        "wandb.mode=disabled",
        "data=text",
        "data.tokenizer=bytes",
        f"data.train_files=[{data_dir / 'train.txt'}]",
        f"data.val_files=[{data_dir / 'val.txt'}]",
        f"data.cache_dir={data_dir / 'cache'}",
    ]


def compose(values: list[str]):
    """(RunConfig, resolved tree) of configs/train.yaml with `values`, as train.py builds them."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from trainer.config import RunConfig

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = hydra_compose("train", overrides=values)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return RunConfig.from_dict(resolved), resolved


def child(cell: dict, args: argparse.Namespace, data_dir: Path) -> dict:
    """One cell in this process: median seconds per training step, and the model's numbers."""
    import torch

    from trainer.loop import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    settings, resolved = compose(overrides(cell, args, data_dir))
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(settings, run_dir, resolved)
        device = trainer.device

        def step() -> None:
            trainer.train_step()
            trainer.state.step += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    model = trainer.model
    return {
        "seconds": statistics.median(times),
        "params": model.num_params(),
        "flops_per_token": model.flops_per_token(args.block_size),
    }


def machine(args: argparse.Namespace) -> str:
    import torch

    from hardware.device import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    from hardware.device import cpu_auto_dtype, cpu_bf16_features, cpu_name

    features = ", ".join(cpu_bf16_features()) or "none: bfloat16 is emulated"
    cpu = f"{cpu_name()} (bf16 features: {features}; {cpu_auto_dtype()[1]})"
    device = resolve_device(args.device)
    gpu = f", GPU: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    return (
        f"CPU: {cpu}, {os.cpu_count()} logical cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}; "
        f"device: {device}{gpu}"
    )


def peak(dtype: str, args: argparse.Namespace) -> tuple[float | None, str]:
    """hardware/device.py's peak FLOP/s for this device and autocast dtype."""
    from hardware.device import peak_flops, resolve_device, resolve_precision

    return peak_flops(resolve_precision(resolve_device(args.device), dtype))


def _tflops(value: float | None) -> str:
    return "none" if value is None else f"{value / 1e12:.3g} TFLOP/s"


def estimated_bytes(preset: str, args: argparse.Namespace, impl: str, dtype: str) -> int:
    """One cell's estimated peak memory (trainer/memory.py, as train.py checks it)."""
    import torch

    from model import GPTConfig, load_preset
    from trainer.memory import estimate_memory

    values = {**load_preset(preset), "block_size": args.block_size, "vocab_size": args.vocab}
    config = GPTConfig.from_dict({**values, "attention": impl})
    return estimate_memory(config, args.batch_size, "adamw", getattr(torch, dtype)).total


def available_bytes(args: argparse.Namespace) -> float:
    from hardware.device import resolve_device
    from trainer.memory import available_memory

    budget, _ = available_memory(resolve_device(args.device))
    return float("inf") if budget is None else budget


def measure(cell: dict, argv: list[str], timeout: float, script: str = __file__) -> dict:
    """`script`'s child() for `cell` in a fresh interpreter; {"error": why} when it fails."""
    cmd = [sys.executable, script, "--child", json.dumps(cell), *argv]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        return {"error": lines[-1][:80].replace("|", "/")}
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_text(data_dir: Path) -> None:
    """Random printable text for the train and val files (token values do not change speed)."""
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + " .,;\n"
    for name, size in (("train.txt", TEXT_BYTES), ("val.txt", TEXT_BYTES // 10)):
        (data_dir / name).write_text("".join(rng.choices(alphabet, k=size)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["nano", "mini"])
    parser.add_argument("--gpt2", action="store_true", help="add the gpt2 preset (124M)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument(
        "--compile", nargs="+", choices=("off", "on"), default=["off", "on"], dest="compiles"
    )
    parser.add_argument("--optims", nargs="+", choices=("adamw", "muon"), default=["adamw"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=GPT2_VOCAB, help="model.vocab_size (>= 257)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per cell")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child), args, Path(args.data_dir))))
        return
    if args.vocab < 257:
        parser.error("--vocab must be at least 257 (the bytes tokenizer's 256 bytes + <|eot|>)")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    presets = list(dict.fromkeys([*args.presets, *(["gpt2"] if args.gpt2 else [])]))

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        write_text(data_dir)
        from data import prepare_data  # once here: every child finds the prepared cache

        cell = dict(preset="nano", impl="manual", optim="adamw", dtype="float32", compile=False)
        settings, _ = compose(overrides(cell, args, data_dir))
        prepare_data(settings.data, verbose=False)
        run_all(presets, args, data_dir)


def run_all(presets: list[str], args: argparse.Namespace, data_dir: Path) -> None:
    argv = [
        f"--data-dir={data_dir}",
        *(
            f"--{n}={getattr(args, n.replace('-', '_'))}"
            for n in ("steps", "warmup", "batch-size", "block-size", "vocab", "threads", "device")
        ),
    ]
    peaks = {dtype: peak(dtype, args) for dtype in args.dtypes}
    print(machine(args))
    print(
        f"\nTraining steps (forward + backward + clip + {'/'.join(args.optims)} step, as "
        f"train.py): batch {args.batch_size} x block {args.block_size} = "
        f"{args.batch_size * args.block_size} tokens/step, vocab {args.vocab}; median of "
        f"{args.steps} timed steps after {args.warmup} warm-up; fresh process per cell. "
        "MFU vs the peak FLOP/s for "
        + "; ".join(f"{d}: {_tflops(value)} ({src})" for d, (value, src) in peaks.items())
        + ".\n"
    )
    header = (
        "preset | params | attention | dtype | compile | optim | ms/step | tokens/s | MFU | ratio"
    )
    print(f"| {header} |")
    print("|---|---:|---|---|---|---|---:|---:|---:|---:|")
    available = available_bytes(args)
    baselines: dict[str, float] = {}
    cells = itertools.product(presets, args.impls, args.dtypes, args.compiles, args.optims)
    for preset, impl, dtype, compiled, optim in cells:
        row = [preset, "", impl, dtype, compiled, optim]
        need = estimated_bytes(preset, args, impl, dtype)
        if need > 0.8 * available:
            res = {"error": f"skipped: needs ~{need / 2**30:.1f} GiB"}
        else:
            cell = dict(
                preset=preset, impl=impl, dtype=dtype, optim=optim, compile=compiled == "on"
            )
            res = measure(cell, argv, args.timeout)
        if "error" in res:
            print("| " + " | ".join([*row, res["error"], "", "", ""]) + " |", flush=True)
            continue
        tok_s = args.batch_size * args.block_size / res["seconds"]
        peak_flops = peaks[dtype][0]
        mfu = f"{tok_s * res['flops_per_token'] / peak_flops:.1%}" if peak_flops else "-"
        if preset not in baselines:
            baselines[preset], ratio = tok_s, "**1.00** (baseline)"
        else:
            ratio = f"{tok_s / baselines[preset]:.2f}"
        row[1] = f"{res['params'] / 1e6:.1f}M"
        row += [f"{res['seconds'] * 1e3:.0f}", f"{tok_s:,.0f}", mfu, ratio]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
