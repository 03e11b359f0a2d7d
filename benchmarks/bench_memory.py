"""Benchmark: trainer/preflight.py's estimated peak of a training step against the measured one.

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
import tempfile

import harness
from bench_train import GPT2_VOCAB, compose, random_text
from harness import head, row

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


def child(cell: dict, args: argparse.Namespace) -> dict:
    """One cell in this process: the estimate and the measured peak above the baseline."""
    from data.pipeline import prepare_data
    from trainer.loop import Trainer
    from trainer.preflight import estimate_memory

    settings, resolved = compose(cell, args)
    prepare_data(settings.data, verbose=False)  # loaded before the baseline: not the step's memory
    with tempfile.TemporaryDirectory() as run_dir:
        baseline = harness.rss_bytes("VmRSS")
        harness.reset_peak_rss()
        trainer = Trainer(settings, run_dir, resolved)
        for _ in range(args.steps):
            trainer.train_step()
        peak = harness.rss_bytes("VmHWM") - baseline
    model, dtype = trainer.model, trainer.precision.dtype
    estimate = estimate_memory(model.config, args.batch_size, cell["optim"], dtype)
    return {"params": model.num_params(), "estimate": estimate.total, "measured": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["nano", "mini", "gpt2"])
    parser.add_argument("--steps", type=int, default=2, help="training steps per cell (>= 2)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=GPT2_VOCAB, help="model.vocab_size (>= 257)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per cell")
    parser.set_defaults(device="cpu")  # bench_train's compose reads it
    args = harness.parse_args(parser, child)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the optimizer state exists from the second")
    print(harness.machine())
    print(
        f"\nPeak memory of a training step: batch {args.batch_size} x block "
        f"{args.block_size}, vocab {args.vocab}, {args.steps} steps; measured = peak RSS "
        "(VmHWM) above the RSS before the Trainer was built; fresh process per cell.\n"
    )
    head("preset | params | attention | dtype | optim | estimate | measured | est/meas", "lrlllrrr")
    with random_text(args) as data:
        for preset, impl, dtype, optim in CELLS:
            if preset not in args.presets:
                continue
            cell = dict(preset=preset, impl=impl, dtype=dtype, optim=optim, data=data)
            res = harness.measure(__file__, cell, args.timeout)
            line = [preset, "", impl, dtype, optim]
            if "error" in res:
                row([*line, res["error"], "", ""])
                continue
            line[1] = f"{res['params'] / 1e6:.1f}M"
            line += [f"{res[k] / 2**20:,.0f} MiB" for k in ("estimate", "measured")]
            row([*line, f"{res['estimate'] / res['measured']:.2f}"])


if __name__ == "__main__":
    main()
