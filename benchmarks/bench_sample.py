"""Benchmark: batch-1 generation speed against the memory roofline; print markdown tables.

Decoding one token at batch 1 reads every weight once, so its speed limit is the memory
bandwidth: roofline tokens/s = measured bandwidth / weight bytes read per token. The model is
nanoGPT's 30M shape (6 layers x 384, block_size 256, vocabulary 50,304), randomly initialised
(speed does not depend on the weights), a 1-token prompt and --new-tokens tokens (default 500:
past the 256-token block, so the window restarts). Rows:

- nanoGPT's `generate` loop, written out here on our model with `sdpa` attention as nanoGPT
  uses: every step a forward over the last block_size tokens (the window slides by one), the
  head at the last position, softmax and torch.multinomial;
- ours without the KV cache (a forward over the window each step);
- ours with the KV cache (one token a step, half a window re-processed every 128 tokens),
  in float32 and, where either precision probe picks it (training's or generation's, see
  hardware/device.py), bfloat16 weights (half the bytes a token);
- the decoding step's matrix-vector products alone (every block's Linear layers, then the head,
  in the layout generation uses), nothing else: how fast this machine's BLAS reads the weights,
  the ceiling of any decoder that calls it. The gap between this row and the cached one is
  everything else a token costs (attention over the cache, norms, activations, sampling, Python
  and dispatch).

Bandwidth is a 256 MiB tensor copy (bytes read + written per second), the best of 5. The
machines this runs on are shared, and their bandwidth jumps within seconds (a 2-core AMD EPYC:
between ~30 and ~58 GB/s), so every run of a row is framed by two copies, and its roofline is
the higher of the two (the stricter). The rows are measured --rounds times, interleaved: a
row's tok/s and roofline are medians over the rounds, "of roofline" the median of the runs'
own fractions, and "vs nanoGPT" the median of the per-round ratios. A first table times those
matrix-vector products in each layout (hardware/device.py): nn.Linear's, an (in, out) copy,
and that copy cut into blocks of rows, one per thread, as generation uses on a CPU. A last
table runs the cached float32 row on a quiet machine and with one core kept busy by another
process: on every thread, on one, and as generation does (trial steps on each count, then the
faster), --rounds times interleaved, medians. Run from anywhere:
``python benchmarks/bench_sample.py [--new-tokens N] [--rounds N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import harness
import torch
import torch.nn.functional as F
from harness import head, row
from torch import nn

from hardware import device
from hardware.device import SplitLinear, cpu_auto_dtype, cpu_decoding_dtype, cpu_threads
from inference import SamplingParams, generate
from model import GPT, GPTConfig

SHAPE = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=50304, dropout=0.0)


def bandwidth(mib: int = 256) -> float:
    """Bytes per second of a large copy (read + write), the best of 5."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def weight_bytes(model: GPT) -> int:
    """Bytes of the weights one decoding step reads: every matrix once (the tied head counted
    once), not the position table (one row a step)."""
    return model.num_params(exclude_positions=True) * model.lm_head.weight.element_size()


@torch.no_grad()
def nanogpt_generate(model: GPT, idx: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """nanoGPT's model.generate (temperature 1, no top_k), step for step."""
    for _ in range(n):
        logits = model(idx[:, -model.config.block_size :], last_only=True)[0]  # (B, 1, vocab)
        probs = F.softmax(logits[:, -1], dim=-1)  # the head at the last position only
        idx = torch.cat((idx, torch.multinomial(probs, num_samples=1, generator=gen)), dim=1)
    return idx


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_matmuls(model: GPT, parts: int | None) -> Callable[[], None]:
    """One decoding step's matrix-vector products and nothing else: every block's Linear layers,
    then the head, on a random vector of their input width; from nn.Linear's (out, in) layout
    (parts None), or as SplitLinear copies in `parts` blocks of rows (hardware/device.py)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]  # the head is last
    layers = linears if parts is None else [SplitLinear(m, parts) for m in linears]
    w = model.lm_head.weight
    inputs = {m.in_features: torch.randn(1, m.in_features, dtype=w.dtype) for m in linears}
    widths = [m.in_features for m in linears]

    def step() -> None:
        for layer, width in zip(layers, widths, strict=True):
            layer(inputs[width])

    return step


def busy_core(model: GPT, prompt: torch.Tensor, n: int, rounds: int) -> None:
    """Print cached float32 generation's tok/s on a quiet machine and with one core kept busy by
    another process (`while True: pass`): on torch's threads throughout (as before generation's
    trial steps, hardware/device.py), on one thread (a decoding copy in one block, as with
    OMP_NUM_THREADS=1), and as generation runs now (its trial steps included, its pick shown)."""
    trials, threads, used = device.THREAD_TRIALS, torch.get_num_threads(), []
    device.cpu_threads = lambda count: used.append(count) or cpu_threads(count)  # the picks
    columns = {
        f"{threads} threads (before)": (threads, 0),
        "1 thread": (1, 0),
        "trial steps, then the faster (now)": (threads, trials),
    }
    picks = {"quiet": [], "one core busy": []}  # the thread count the last column decoded on
    seconds = {(machine, column): [] for machine in picks for column in columns}
    gen, sample = torch.Generator().manual_seed(0), SamplingParams(temperature=1.0, top_k=None)
    spin = [sys.executable, "-c", "while True: pass"]
    for _ in range(rounds):
        for machine, picked in picks.items():
            spinner = subprocess.Popen(spin) if machine != "quiet" else None
            for column, (count, steps) in columns.items():
                device.THREAD_TRIALS = steps
                with cpu_threads(count):
                    run = timed(lambda: generate(model, prompt, n, sample, gen))
                seconds[machine, column].append(run)
            picked.append(used[-1])
            if spinner:
                spinner.kill()
                spinner.wait()
    device.THREAD_TRIALS, device.cpu_threads = trials, cpu_threads
    head(f"KV cache (float32) tok/s | {' | '.join(columns)} | picked", "lrrrl")
    for machine, picked in picks.items():
        tok_s = [f"{statistics.median(n / t for t in seconds[machine, c]):,.1f}" for c in columns]
        row([machine, *tok_s, ", ".join(map(str, picked))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: default")
    parser.add_argument(
        "--dtypes",
        default="auto",
        help="weight dtypes of our rows, e.g. float32,bfloat16; auto: float32, and bfloat16 "
        "too where either precision probe (training's, generation's) picks it on this CPU",
    )
    args = harness.parse_args(parser)
    n = args.new_tokens
    torch.manual_seed(0)
    prompt = torch.zeros(1, 1, dtype=torch.long)
    print(
        f"{harness.machine()}\nnanoGPT's 30M shape (6x384, block 256, vocab 50,304), batch 1, "
        f"{n} new tokens, {args.rounds} interleaved rounds\n"
    )
    dtypes = args.dtypes.split(",")
    if args.dtypes == "auto":
        training, decoding = cpu_auto_dtype(), cpu_decoding_dtype()
        print(f"training's probe: {training[1]}\ngeneration's probe: {decoding[1]}\n")
        bf16 = torch.bfloat16 in (training[0], decoding[0])
        dtypes = ["float32", "bfloat16"] if bf16 else ["float32"]

    gen = torch.Generator().manual_seed(0)
    sample = SamplingParams(temperature=1.0, top_k=None)
    nanogpt = GPT(GPTConfig(**SHAPE, attention="sdpa")).eval()
    # (name, model, function returning seconds for n tokens); the first row is the baseline
    rows = [
        (
            "nanoGPT generate (sliding window, no cache)",
            nanogpt,
            lambda: timed(lambda: nanogpt_generate(nanogpt, prompt, n, gen)),
        )
    ]
    threads = torch.get_num_threads()
    for dtype in dtypes:
        ours = GPT(GPTConfig(**SHAPE)).eval().to(getattr(torch, dtype))
        # generation's layout: the decoding copy's row blocks for float32 (generate.py)
        matmuls = decode_matmuls(ours, threads if dtype == "float32" else None)
        rows += [
            (
                f"ours, no cache ({dtype})",
                ours,
                lambda m=ours: timed(lambda: generate(m, prompt, n, sample, gen, use_cache=False)),
            ),
            (
                f"ours, KV cache ({dtype})",
                ours,
                lambda m=ours: timed(lambda: generate(m, prompt, n, sample, gen)),
            ),
            (
                f"the matrix-vector products alone ({dtype})",
                ours,
                lambda f=matmuls: sum(timed(f) for _ in range(n)),
            ),
        ]
    layouts = [
        ("nn.Linear as stored, (out, in): F.linear(x, W)", None),
        ("an (in, out) copy, one block: x @ W^T", 1),
    ]
    if threads > 1:
        layouts.append((f"an (in, out) copy in {threads} blocks of rows: torch.bmm, sum", threads))
    layouts = [(name, decode_matmuls(nanogpt, parts)) for name, parts in layouts]  # float32
    nanogpt_generate(nanogpt, prompt, 5, gen)  # warm-up
    for _, m, _ in rows[1:]:
        generate(m, prompt, 5, sample, gen)
    # per round and row: seconds, and the copy bandwidth just before and after the row ran
    seconds = [[] for _ in rows]
    bandwidths = [[] for _ in rows]
    layout_seconds = [[] for _ in layouts]
    for r in range(args.rounds):
        for times, bws, (_, _, run) in zip(seconds, bandwidths, rows, strict=True):
            before = bandwidth()
            times.append(run())
            bws.append(max(before, bandwidth()))
        tok_s = " | ".join(f"{n / times[-1]:,.1f}" for times in seconds)
        bws = " | ".join(f"{b[-1] / 1e9:.1f}" for b in bandwidths)
        print(f"round {r + 1}: tok/s {tok_s}; copy GB/s {bws}")
        for _ in range(10):
            for times, (_, step) in zip(layout_seconds, layouts, strict=True):
                times.append(timed(step))
    print()
    head("a decoding step's matrix-vector products (float32), layout | ms | GB/s", "lrr")
    for (name, _), times in zip(layouts, layout_seconds, strict=True):
        median = statistics.median(times)
        row([name, f"{median * 1e3:.2f}", f"{weight_bytes(nanogpt) / median / 1e9:.1f}"])
    every = [b for bws in bandwidths for b in bws]
    print(
        f"\ncopy bandwidth {min(every) / 1e9:.1f}-{max(every) / 1e9:.1f} GB/s over the run; "
        "each run's roofline is the higher of the copies just before and after it\n"
    )
    columns = "generation | weights | MB read/token | roofline tok/s | tok/s | of roofline"
    head(f"{columns} | vs nanoGPT", "llrrrrr")
    for (name, m, _), times, bws in zip(rows, seconds, bandwidths, strict=True):
        mb = weight_bytes(m)
        tok_s = statistics.median(n / t for t in times)
        roof = statistics.median(bw / mb for bw in bws)
        of_roof = statistics.median(n / t / (bw / mb) for t, bw in zip(times, bws, strict=True))
        vs = statistics.median(base / t for base, t in zip(seconds[0], times, strict=True))
        dtype = str(m.lm_head.weight.dtype).removeprefix("torch.")
        line = [name, dtype, f"{mb / 1e6:.0f}", f"{roof:,.0f}", f"{tok_s:,.1f}"]
        row([*line, f"{of_roof:.0%}", f"{vs:.1f}x"])
    if threads > 1:
        print()
        busy_core(GPT(GPTConfig(**SHAPE)).eval(), prompt, n, args.rounds)


if __name__ == "__main__":
    main()
