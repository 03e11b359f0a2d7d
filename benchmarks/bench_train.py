"""Benchmark: training throughput (tokens/s) and MFU of whole optimizer steps, side by side.

Run from anywhere: ``python benchmarks/bench_train.py`` (nano and mini, every attention impl,
float32 and bfloat16 autocast, torch.compile off and on: 24 cells, several minutes on a small
CPU); ``--help`` for the options. Prints a markdown table.

Method. Each cell (preset, attention, dtype, compile, optimizer) runs in a fresh subprocess
(benchmarks/harness.py), so no compiled kernels, allocator cache or thread state carries over.
The child builds a real ``Trainer`` from configs/train.yaml with the cell's overrides, on a text
dataset of random printable characters tokenized with ``bytes`` (prepared once, by the parent),
with ``model.vocab_size=--vocab``: the embedding and head cost what a tokenizer of that size
costs (50257: GPT-2's), whatever the token values. It then calls ``Trainer.train_step`` (the
step that ``python train.py`` takes: learning rate, micro-batches under autocast, backward,
gradient clipping, optimizer step) for --warmup steps, untimed (torch.compile compiles in the
first), and times each of --steps more (CUDA: synchronized). A cell's time is the median step;
tokens/s is batch_size * block_size / that time. MFU is tokens/s * model.flops_per_token / the
peak FLOP/s of hardware/device.py: the datasheet figure of a known GPU, or on a CPU its
dense-matmul rate in that dtype measured once by this process. The ratio column is each cell's
tokens/s over its preset's first cell (the baseline, marked). A cell whose estimated memory
(trainer/preflight.py, as train.py checks it) is over 80% of what the device has is skipped.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import string
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import harness
from harness import head, row

GPT2_VOCAB = 50257
IMPLS = ("manual", "sdpa", "flash")
DTYPES = ("float32", "bfloat16")
TEXT_BYTES = 400_000  # train split; val is a tenth (unused, but a dataset needs one)


def compose(cell: dict, args: argparse.Namespace):
    """(RunConfig, resolved tree) of configs/train.yaml with the cell's overrides, as train.py
    builds them."""
    data = Path(cell["data"])
    values = [
        f"model={cell['preset']}",
        f"model.attention={cell['impl']}",
        f"model.block_size={args.block_size}",
        f"model.vocab_size={args.vocab}",
        f"optim={cell['optim']}",
        f"dtype={cell['dtype']}",
        f"compile={str(cell.get('compile', False)).lower()}",
        f"device={args.device}",
        f"train.batch_size={args.batch_size}",
        "train.max_steps=1000000",
        "wandb.mode=disabled",
        "data=text",
        "data.tokenizer=bytes",
        f"data.train_files=[{data / 'train.txt'}]",
        f"data.val_files=[{data / 'val.txt'}]",
        f"data.cache_dir={data / 'cache'}",
    ]
    return harness.train_config(values)


@contextmanager
def random_text(args: argparse.Namespace) -> Iterator[str]:
    """A temporary directory of random printable text (token values do not change speed),
    prepared here once, so that every cell finds the prepared cache."""
    from data.pipeline import prepare_data

    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + " .,;\n"
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in (("train.txt", TEXT_BYTES), ("val.txt", TEXT_BYTES // 10)):
            (Path(tmp) / name).write_text("".join(rng.choices(alphabet, k=size)))
        cell = dict(preset="nano", impl="manual", optim="adamw", dtype="float32", data=tmp)
        prepare_data(compose(cell, args)[0].data, verbose=False)
        yield tmp


def child(cell: dict, args: argparse.Namespace) -> dict:
    """One cell in this process: median seconds per training step, and the model's numbers."""
    import torch

    from trainer.loop import Trainer

    settings, resolved = compose(cell, args)
    times = []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(settings, run_dir, resolved)
        for _ in range(args.warmup + args.steps):
            start = time.perf_counter()
            trainer.train_step()
            trainer.state.step += 1
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)
            times.append(time.perf_counter() - start)
    return {
        "seconds": statistics.median(times[args.warmup :]),
        "params": trainer.model.num_params(),
        "flops_per_token": trainer.model.flops_per_token(args.block_size),
    }


def too_big(cell: dict, args: argparse.Namespace) -> str | None:
    """Why the cell is skipped: its estimated peak memory is over 80% of what the device has."""
    import torch

    from base.errors import yaml_config
    from hardware.device import resolve_device
    from model import GPTConfig
    from trainer.preflight import available_memory, estimate_memory

    values = {**yaml_config(f"model/{cell['preset']}.yaml"), "block_size": args.block_size}
    config = GPTConfig.from_dict({**values, "vocab_size": args.vocab, "attention": cell["impl"]})
    dtype = getattr(torch, cell["dtype"])
    need = estimate_memory(config, args.batch_size, cell["optim"], dtype).total
    budget, _ = available_memory(resolve_device(args.device))
    if budget is not None and need > 0.8 * budget:
        return f"skipped: needs ~{need / 2**30:.1f} GiB"
    return None


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
    args = harness.parse_args(parser, child)
    if args.vocab < 257:
        parser.error("--vocab must be at least 257 (the bytes tokenizer's 256 bytes + <|eot|>)")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    from hardware.device import peak_flops, resolve_device, resolve_precision

    device = resolve_device(args.device)
    peaks = {d: peak_flops(resolve_precision(device, d)) for d in args.dtypes}
    print(harness.machine(args.device))
    print(
        f"\nTraining steps (forward + backward + clip + {'/'.join(args.optims)} step, as "
        f"train.py): batch {args.batch_size} x block {args.block_size} = "
        f"{args.batch_size * args.block_size} tokens/step, vocab {args.vocab}; median of "
        f"{args.steps} timed steps after {args.warmup} warm-up; fresh process per cell. "
        "MFU vs the peak FLOP/s for "
        + "; ".join(
            f"{d}: {'none' if p is None else f'{p / 1e12:.3g} TFLOP/s'} ({src})"
            for d, (p, src) in peaks.items()
        )
        + ".\n"
    )
    columns = "preset | params | attention | dtype | compile | optim | ms/step | tokens/s | MFU"
    head(f"{columns} | ratio", "lrllllrrrr")
    presets = list(dict.fromkeys([*args.presets, *(["gpt2"] if args.gpt2 else [])]))
    cells = itertools.product(presets, args.impls, args.dtypes, args.compiles, args.optims)
    baselines: dict[str, float] = {}
    with random_text(args) as data:
        for preset, impl, dtype, compiled, optim in cells:
            cell = dict(preset=preset, impl=impl, dtype=dtype, optim=optim, data=data)
            cell["compile"] = compiled == "on"
            skip = too_big(cell, args)
            res = {"error": skip} if skip else harness.measure(__file__, cell, args.timeout)
            line = [preset, "", impl, dtype, compiled, optim]
            if "error" in res:
                row([*line, res["error"], "", "", ""])
                continue
            tok_s = args.batch_size * args.block_size / res["seconds"]
            peak = peaks[dtype][0]
            mfu = f"{tok_s * res['flops_per_token'] / peak:.1%}" if peak else "-"
            if preset not in baselines:
                baselines[preset], ratio = tok_s, "**1.00** (baseline)"
            else:
                ratio = f"{tok_s / baselines[preset]:.2f}"
            line[1] = f"{res['params'] / 1e6:.1f}M"
            row([*line, f"{res['seconds'] * 1e3:.0f}", f"{tok_s:,.0f}", mfu, ratio])


if __name__ == "__main__":
    main()
