"""Benchmark: causal attention alone, forward + backward, manual vs flash vs sdpa against T.

Run from the repository root: ``python benchmarks/bench_attention.py`` (about 3 minutes on two
cores); ``--help`` for the shapes, tile sizes and lengths. Prints a markdown table.

Method. Each (implementation, T) runs in a fresh subprocess, so no allocator cache or earlier
peak carries over. The child imports torch, runs one small warm-up (thread pools, kernels),
allocates q, k, v (B, H, T, d_k), the output gradient and manual's (T, T) boolean mask (the
model keeps that mask as a buffer), resets the kernel's peak-RSS mark (write 5 to
/proc/self/clear_refs, so freed setup temporaries do not hide a smaller peak) and takes the
resident set size VmRSS as its baseline. It then runs forward + backward (q, k, v get their
.grad) once; the reported peak is the peak RSS after it (VmHWM, the number getrusage's
ru_maxrss reports) minus the baseline: every byte the attention itself touched at its worst
moment: S and its softmax, autograd's saved tensors, gradients, temporaries. Linux only.
Then it repeats forward + backward while under --seconds (at least once); the time is the
fastest of these runs (the minimum is the least disturbed by other processes on the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.config import GPTConfig  # noqa: E402

IMPLS = ("manual", "flash", "sdpa")


def _rss_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident) of this process, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    """Make VmHWM forget earlier peaks (Linux >= 4.0), e.g. freed temporaries of the setup."""
    Path("/proc/self/clear_refs").write_text("5")


def child(impl: str, T: int, args: argparse.Namespace) -> dict[str, float]:
    """One (impl, T) measurement in this process: time and peak memory of forward + backward."""
    import torch
    import torch.nn.functional as F

    from model.attention import causal_attention
    from model.flash_attention import flash_causal_attention

    T_ = torch.Tensor

    def run(q: T_, k: T_, v: T_, allowed: T_, g: T_) -> None:
        if impl == "manual":
            y, _ = causal_attention(q, k, v, allowed)
        elif impl == "flash":
            y = flash_causal_attention(q, k, v, args.block_q, args.block_k)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(g)  # (B, H, T, d_k) gradient into q, k, v

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        shape = (args.batch, args.heads, n, args.head_size)
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        return q, k, v, torch.ones(n, n, dtype=torch.bool).tril(), torch.randn(shape)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    run(*inputs(64))  # warm-up: thread pools and kernels are set up before the baseline
    q, k, v, allowed, g = inputs(T)
    _reset_peak_rss()
    baseline = _rss_bytes("VmRSS")
    run(q, k, v, allowed, g)
    peak = _rss_bytes("VmHWM") - baseline  # of one run: repeats could only add heap growth
    times = []
    while not times or sum(times) < args.seconds:
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        run(q, k, v, allowed, g)
        times.append(time.perf_counter() - start)
    return {"seconds": min(times), "peak_bytes": peak}


def machine(threads: int) -> str:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from hardware.device import cpu_name

    cpu = cpu_name()
    return (
        f"CPU: {cpu}, {os.cpu_count()} logical cores, torch {torch.__version__} "
        f"with {torch.get_num_threads()} threads, Python {platform.python_version()}"
    )


def measure(impl: str, T: int, argv: list[str]) -> dict[str, float]:
    """Run child() for (impl, T) in a fresh interpreter and return its result."""
    cmd = [sys.executable, __file__, "--child", impl, str(T), *argv]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-q", type=int, default=GPTConfig.flash_block_q, help="flash tile")
    parser.add_argument("--block-k", type=int, default=GPTConfig.flash_block_k, help="flash tile")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2**i for i in range(7, 14)])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--seconds", type=float, default=1.0, help="timed runs per cell")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args)))
        return

    argv = [
        f"--{n}={getattr(args, n.replace('-', '_'))}"
        for n in ("batch", "heads", "head-size", "block-q", "block-k", "seconds", "threads")
    ]
    print(machine(args.threads))
    print(
        f"\nCausal attention alone, forward + backward, float32, B={args.batch}, "
        f"H={args.heads}, d_k={args.head_size}, flash tiles {args.block_q}x{args.block_k}. "
        "Time: fastest run. Peak: growth of peak RSS (VmHWM = ru_maxrss, reset after setup) over "
        "the RSS after allocating q, k, v, dO and the mask, in a fresh process per cell.\n"
    )
    cols = [f"{i} ms | {i} MiB" for i in args.impls]
    ratios = [f"{i}/manual time | {i}/manual mem" for i in args.impls if i != "manual"]
    header = ["T", *cols, *(ratios if "manual" in args.impls else [])]
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * sum(h.count("|") + 1 for h in header))
    for T in args.lengths:
        res = {impl: measure(impl, T, argv) for impl in args.impls}
        row = [str(T)]
        for impl in args.impls:
            row += [f"{res[impl]['seconds'] * 1e3:.1f}", f"{res[impl]['peak_bytes'] / 2**20:.1f}"]
        if "manual" in args.impls:
            base = res["manual"]
            for impl in args.impls:
                if impl != "manual":
                    row.append(f"{res[impl]['seconds'] / base['seconds']:.2f}")
                    row.append(f"{res[impl]['peak_bytes'] / max(base['peak_bytes'], 1):.3f}")
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
