"""Benchmark: trainer/memory.py's estimated peak of a training step against the measured one.

Run from anywhere: ``python benchmarks/bench_memory.py`` (nano, mini and gpt2 presets, a few
attention, dtype and optimizer variants; a few minutes on a small CPU); ``--help`` for options.
Prints a markdown table; the target is an estimate within 25% of the measurement.

Method. Each cell runs in a fresh subprocess (no allocator cache or earlier peak carries over)
that builds a real ``Trainer`` the way benchmarks/bench_train.py does (configs/train.yaml with
the cell's overrides; random text tokenized with ``bytes``, ``model.vocab_size=--vocab``). Just
before the Trainer is built (imports done, data prepared), it reads its resident memory (VmRSS)
and resets its peak (VmHWM, which ru_maxrss reports); it then builds the Trainer (model,
optimizer) and takes --steps training steps (the second one on has the optimizer state). The
measured peak is VmHWM minus that baseline. CPU only: on a GPU compare with
torch.cuda.max_memory_allocated instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_attention import _reset_peak_rss, _rss_bytes  # noqa: E402
from bench_train import (  # noqa: E402
    GPT2_VOCAB,
    compose,
    machine,
    measure,
    overrides,
    write_text,
)

# (preset, attention, dtype, optimizer)
CELLS = [
    ("nano", "manual", "float32", "adamw"),
    ("nano", "flash", "float32", "adamw"),
    ("nano", "manual", "bfloat16", "adamw"),
    ("mini", "manual", "float32", "adamw"),
    ("mini", "sdpa", "float32", "adamw"),
    ("mini", "flash", "float32", "adamw"),
    ("mini", "manual", "float32", "muon"),
    ("gpt2", "manual", "float32", "adamw"),
]


def child(cell: dict, args: argparse.Namespace, data_dir: Path) -> dict:
    """One cell in this process: the estimate and the measured peak above the baseline."""
    import torch

    from trainer.loop import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    settings, resolved = compose(overrides({**cell, "compile": False}, args, data_dir))
    from data import prepare_data

    prepare_data(settings.data, verbose=False)  # loaded before the baseline: not the step's memory
    with tempfile.TemporaryDirectory() as run_dir:
        baseline = _rss_bytes("VmRSS")
        _reset_peak_rss()
        trainer = Trainer(settings, run_dir, resolved)
        for _ in range(args.steps):
            trainer.train_step()
        peak = _rss_bytes("VmHWM") - baseline
    from trainer.memory import estimate_memory

    estimate = estimate_memory(
        trainer.model.config, args.batch_size, cell["optim"], trainer.precision.dtype
    )
    return {
        "params": trainer.model.num_params(),
        "estimate": estimate.total,
        "logits": estimate.logits,
        "measured": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["nano", "mini", "gpt2"])
    parser.add_argument("--steps", type=int, default=2, help="training steps per cell (>= 2)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=GPT2_VOCAB, help="model.vocab_size (>= 257)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per cell")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.device = "cpu"  # bench_train's overrides and machine() read it
    if args.child:
        print(json.dumps(child(json.loads(args.child), args, Path(args.data_dir))))
        return
    if args.steps < 2:
        parser.error("--steps must be at least 2: the optimizer state exists from the second")
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        write_text(data_dir)
        argv = [
            f"--data-dir={data_dir}",
            *(
                f"--{n}={getattr(args, n.replace('-', '_'))}"
                for n in ("steps", "batch-size", "block-size", "vocab", "threads")
            ),
        ]
        print(machine(args))
        print(
            f"\nPeak memory of a training step: batch {args.batch_size} x block "
            f"{args.block_size}, vocab {args.vocab}, {args.steps} steps; measured = peak RSS "
            "(VmHWM) above the RSS before the Trainer was built; fresh process per cell.\n"
        )
        print("| preset | params | attention | dtype | optim | estimate | measured | est/meas |")
        print("|---|---:|---|---|---|---:|---:|---:|")
        for preset, impl, dtype, optim in CELLS:
            if preset not in args.presets:
                continue
            cell = dict(preset=preset, impl=impl, dtype=dtype, optim=optim)
            res = measure(cell, argv, args.timeout, script=__file__)
            row = [preset, "", impl, dtype, optim]
            if "error" in res:
                print("| " + " | ".join([*row, res["error"], "", ""]) + " |", flush=True)
                continue
            row[1] = f"{res['params'] / 1e6:.1f}M"
            ratio = res["estimate"] / res["measured"]
            row += [f"{res['estimate'] / 2**20:,.0f} MiB", f"{res['measured'] / 2**20:,.0f} MiB"]
            print("| " + " | ".join([*row, f"{ratio:.2f}"]) + " |", flush=True)


if __name__ == "__main__":
    main()
