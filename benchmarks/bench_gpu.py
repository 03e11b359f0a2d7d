"""Benchmark for the first GPU this project gets: what issue 18's fixes buy, measured.

Run from anywhere on a CUDA machine: ``python benchmarks/bench_gpu.py`` (GPT-2 124M, bf16
autocast, batch 16 x 1024, fused AdamW, torch.compile on; ``--help`` for the options). Prints a
markdown table: tokens/s, MFU against hardware/device.py's datasheet peak, and peak GPU memory per
cell. ``--device cpu --preset nano --batch-size 2 --block-size 64 --no-compile`` runs the same
cells on a CPU (a smoke test of the script, not a measurement).

Cells (each in a fresh subprocess; a cell's time is the median of --steps timed steps after
--warmup untimed ones, synchronized):
- baseline: vocab 50257, logits kept through backward (the training step before issue 18);
- padded vocab: 50304 rows (nanoGPT's padding: aligned matmuls in the head);
- + no logits: return_logits=False (the training step now);
- flash: attention=flash instead of sdpa (our tiled PyTorch FlashAttention; expected far slower
  than the fused kernel, it is the memory-linear teaching version);
- muon: optim=muon (Newton-Schulz on every matrix, on every rank).
A cell that runs out of memory prints OOM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CELLS = {
    "baseline (vocab 50257, logits kept)": dict(vocab=50257, logits=True),
    "padded vocab 50304": dict(vocab=50304, logits=True),
    "padded vocab + no logits": dict(vocab=50304, logits=False),
    "flash attention": dict(vocab=50304, logits=False, attention="flash"),
    "muon": dict(vocab=50304, logits=False, optim="muon"),
}


SKIP = ("cells", "cell", "compile")  # not passed on as --key=value


def run_cell(name: str, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from hardware.device import Precision, configure_backends, peak_flops
    from model import GPT, GPTConfig, load_preset
    from trainer.config import OptimSettings
    from trainer.optim import build_optimizer

    cell = CELLS[name]
    device = torch.device(args.device)
    configure_backends(device)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    precision = Precision(device, dtype)
    values = {**load_preset(args.preset), "vocab_size": cell["vocab"]}
    values.update(block_size=args.block_size, attention=cell.get("attention", "sdpa"))
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_dict(values)).to(device)
    optimizer = build_optimizer(model, OptimSettings(name=cell.get("optim", "adamw")), device)
    step_model = torch.compile(model) if args.compile else model
    shape = (args.batch_size, args.block_size)

    def step() -> None:
        x = torch.randint(0, 50257, shape, device=device)
        with precision.autocast():
            logits, loss = step_model(x, x, return_logits=cell["logits"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del logits

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    try:
        for _ in range(args.warmup):
            step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            sync()
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        return {"oom": 1}
    tok_s = args.batch_size * args.block_size / statistics.median(times)
    peak, _ = peak_flops(precision)
    mfu = tok_s * model.flops_per_token(args.block_size) / peak if peak else float("nan")
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"tok_s": tok_s, "mfu": mfu, "peak_gib": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cells", nargs="*", default=list(CELLS), choices=list(CELLS))
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # the child's cell
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(run_cell(args.cell, args)))
        return
    import torch

    from hardware.device import cpu_name

    where = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    print(
        f"{where}, {args.preset}, {args.dtype}, batch {args.batch_size} x {args.block_size}, "
        f"compile {'on' if args.compile else 'off'}\n"
    )
    print("| cell | tokens/s | MFU | peak memory (GiB) |")
    print("| --- | ---: | ---: | ---: |")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in SKIP]
    flags.append("--compile" if args.compile else "--no-compile")
    for name in args.cells:
        cmd = [sys.executable, __file__, *flags, f"--cell={name}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"| {name} | failed: {done.stderr.strip().splitlines()[-1]} | | |")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        if "oom" in r:
            print(f"| {name} | OOM | | |")
            continue
        print(f"| {name} | {r['tok_s']:,.0f} | {r['mfu']:.1%} | {r['peak_gib']:.2f} |")


if __name__ == "__main__":
    main()
