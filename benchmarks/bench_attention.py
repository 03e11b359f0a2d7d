"""Benchmark: causal attention alone, forward + backward, manual vs flash vs sdpa against T.

Run from the repository root: ``python benchmarks/bench_attention.py`` (about 3 minutes on two
cores); ``--help`` for the shapes, tile sizes and lengths. Prints a markdown table.

Method. Each (implementation, T) runs in a fresh subprocess (benchmarks/harness.py), so no
allocator cache or earlier peak carries over. The child imports torch, runs one small warm-up
(thread pools, kernels), allocates q, k, v (B, H, T, d_k), the output gradient and manual's
(T, T) boolean mask (the model keeps that mask as a buffer), resets the kernel's peak-RSS mark
(write 5 to /proc/self/clear_refs, so freed setup temporaries do not hide a smaller peak) and
takes the resident set size VmRSS as its baseline. It then runs forward + backward (q, k, v
get their .grad) once; the reported peak is the peak RSS after it (VmHWM, the number
getrusage's ru_maxrss reports) minus the baseline: every byte the attention itself touched at
its worst moment: S and its softmax, autograd's saved tensors, gradients, temporaries. Linux
only. Then it repeats forward + backward while under --seconds (at least once); the time is the
fastest of these runs (the minimum is the least disturbed by other processes on the machine).
"""

from __future__ import annotations

import argparse
import time

import harness
from harness import head, row

from model.gpt import GPTConfig

IMPLS = ("manual", "flash", "sdpa")


def child(cell: dict, args: argparse.Namespace) -> dict[str, float]:
    """One (impl, T) measurement in this process: time and peak memory of forward + backward."""
    import torch
    import torch.nn.functional as F

    from model.flash_attention import flash_causal_attention
    from model.gpt import causal_attention

    impl, T_ = cell["impl"], torch.Tensor

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

    torch.manual_seed(0)
    run(*inputs(64))  # warm-up: thread pools and kernels are set up before the baseline
    q, k, v, allowed, g = inputs(cell["T"])
    harness.reset_peak_rss()
    baseline = harness.rss_bytes("VmRSS")
    run(q, k, v, allowed, g)
    peak = harness.rss_bytes("VmHWM") - baseline  # of one run: repeats could only add heap growth
    times = []
    while not times or sum(times) < args.seconds:
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        run(q, k, v, allowed, g)
        times.append(time.perf_counter() - start)
    return {"seconds": min(times), "peak_bytes": peak}


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
    args = harness.parse_args(parser, child)
    print(harness.machine())
    print(
        f"\nCausal attention alone, forward + backward, float32, B={args.batch}, "
        f"H={args.heads}, d_k={args.head_size}, flash tiles {args.block_q}x{args.block_k}. "
        "Time: fastest run. Peak: growth of peak RSS (VmHWM = ru_maxrss, reset after setup) over "
        "the RSS after allocating q, k, v, dO and the mask, in a fresh process per cell.\n"
    )
    others = [i for i in args.impls if i != "manual"] if "manual" in args.impls else []
    columns = [f"{i} ms | {i} MiB" for i in args.impls]
    columns += [f"{i}/manual time | {i}/manual mem" for i in others]
    head(" | ".join(["T", *columns]), "r" * (1 + 2 * len(columns)))
    for T in args.lengths:
        res = {impl: harness.measure(__file__, dict(impl=impl, T=T)) for impl in args.impls}
        if error := next((r["error"] for r in res.values() if "error" in r), None):
            row([str(T), error])
            continue
        line = [str(T)]
        for r in res.values():
            line += [f"{r['seconds'] * 1e3:.1f}", f"{r['peak_bytes'] / 2**20:.1f}"]
        for impl in others:
            line.append(f"{res[impl]['seconds'] / res['manual']['seconds']:.2f}")
            line.append(f"{res[impl]['peak_bytes'] / max(res['manual']['peak_bytes'], 1):.3f}")
        row(line)


if __name__ == "__main__":
    main()
