"""Benchmark: peak host memory of a training step and an evaluation batch, with and without
the full (B, T, vocab) logits (GPT.forward's return_logits).

Run from anywhere: ``python benchmarks/bench_logits_memory.py`` (``--help`` for the options). Prints
a markdown table. CPU only; the same saving holds on a GPU (benchmarks/bench_gpu.py measures it
there with torch.cuda.max_memory_allocated).

Method. Each cell runs in a fresh subprocess: it builds the model, takes one tiny step so that
gradients exist, reads the process's peak resident memory (ru_maxrss), runs the cell once and
reads it again; the difference is what the cell adds at its peak. Cells:
- train, logits kept: ``logits, loss = model(x, y); loss.backward()`` (the logits stay alive
  through backward, as the training step did);
- train, no logits: ``model(x, y, return_logits=False)`` (what trainer/loop.py does now);
- eval, full: under no_grad, the full logits and their float32 softmax at once;
- eval, chunked: under no_grad with return_logits=False: LOSS_CHUNK rows of logits at a time.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hardware.device import cpu_name  # noqa: E402 - after the path insert

CELLS = ("train, logits kept", "train, no logits", "eval, full", "eval, chunked")


def run_cell(cell: str, args: argparse.Namespace) -> float:
    """Peak memory the cell adds, in MB (run in a child process)."""
    import torch

    from model import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=args.vocab, block_size=args.block_size, n_layer=2, n_head=4, n_embd=128
    )
    model = GPT(config)
    tiny = torch.randint(0, args.vocab, (1, 8))
    model(tiny, tiny)[1].backward()  # gradients allocated: the steady state of training
    x = torch.randint(0, args.vocab, (args.batch_size, args.block_size))
    y = torch.randint(0, args.vocab, (args.batch_size, args.block_size))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cell == "train, logits kept":
        logits, loss = model(x, y)
        loss.backward()
    elif cell == "train, no logits":
        _, loss = model(x, y, return_logits=False)
        loss.backward()
    else:
        with torch.no_grad():
            model(x, y, return_logits=cell == "eval, full")
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KB -> MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # the child's cell
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(run_cell(args.cell, args)))
        return
    logits_mb = args.batch_size * args.block_size * args.vocab * 4 / 2**20
    print(
        f"{cpu_name()}, float32, vocab {args.vocab}, "
        f"batch {args.batch_size} x {args.block_size} (one float32 logits tensor: "
        f"{logits_mb:,.0f} MB)\n"
    )
    print("| cell | peak memory added (MB) | in logits tensors |")
    print("| --- | ---: | ---: |")
    for cell in CELLS:
        cmd = [sys.executable, __file__, f"--cell={cell}", f"--vocab={args.vocab}"]
        cmd += [f"--batch-size={args.batch_size}", f"--block-size={args.block_size}"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        mb = json.loads(out.strip().splitlines()[-1])
        print(f"| {cell} | {mb:,.0f} | {mb / logits_mb:.2f} |")


if __name__ == "__main__":
    main()
