"""Benchmark: causal attention alone, forward, backward and both, one implementation a row.

On a CPU, from the repository root: ``python benchmarks/bench_attention.py`` (manual, flash and
sdpa; float32; batch 1, 4 heads of 64; T = 128 to 8,192). On a CUDA GPU: ``python
benchmarks/bench_attention.py --device cuda`` (manual, each sdpa backend, triton and each of
its variants; bfloat16;
16,384 tokens a batch in heads of 64 and of 128 over a width of 2,048, as FlashAttention-2's
paper measures; T = 1,024 to 16,384). ``--help`` for the shapes, lengths and implementations.
Prints a markdown table, one row per (head size, T, implementation).

Columns: the forward's, the backward's and the forward + backward's time and TFLOP/s
(FlashAttention's count for causal attention: 2 B H T^2 d_k forward, 2.5 times that backward),
peak memory, and forward + backward against the fastest sdpa backend of the same row group
(above 1: faster).

Method, as FlashAttention's own harness: the backward returns the gradients
(torch.autograd.grad: nothing accumulates into .grad across calls) and is timed alone on a
retained graph; a time is the fastest of at least 3 batches of calls within --seconds (after a
warm-up that compiles and autotunes Triton's kernels), a batch timed on a GPU between two CUDA
events with no synchronisation between its calls, so the launches overlap the GPU's work as in
training. Peak memory is what one forward + backward adds above q, k, v, dO and manual's mask:
on a CPU each cell runs in a fresh subprocess (benchmarks/harness.py) and the peak is the growth
of its peak resident set (VmHWM, reset after setup); on a GPU, cells run in one process and the
peak is torch.cuda.max_memory_allocated above the allocated baseline. A cell out of memory prints
OOM.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import harness
from harness import head, row

from model.gpt import GPTConfig

SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION"}
SDPA_BACKENDS["sdpa-cudnn"] = "CUDNN_ATTENTION"
TIMES = ("forward", "backward", "both")
# The Triton kernel's variants (model/triton_attention.py's VARIANTS), alone and together: the
# ablation rows a lent GPU measures beside cuDNN and FlashAttention-2 (sdpa-flash)
VARIANTS = ("log2", "fused_d", "heavy_first", "one_launch", "half_diagonal", "descriptors")
TRITON = ("triton", *(f"triton+{name}" for name in VARIANTS), "+".join(("triton", *VARIANTS)))
IMPLS = ("manual", "flash", "sdpa", *SDPA_BACKENDS, *TRITON)
DEFAULTS = {  # per device: implementations, dtype, lengths, head sizes
    "cpu": (["manual", "flash", "sdpa"], "float32", [2**i for i in range(7, 14)], [64]),
    "cuda": (["manual", *SDPA_BACKENDS, *TRITON], "bfloat16", [2**i for i in range(10, 15)],
             [64, 128]),
}  # fmt: skip


def child(cell: dict, args: argparse.Namespace) -> dict[str, float | str]:
    """One (impl, head size, T) cell in this process: times and peak memory."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from model.flash_attention import flash_causal_attention
    from model.gpt import causal_attention

    impl, hs, T = cell["impl"], cell["head_size"], cell["T"]
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or DEFAULTS[args.device][1])
    cuda = device.type == "cuda"

    def attend(q, k, v, allowed):
        if impl == "manual":
            return causal_attention(q, k, v, allowed)
        if impl == "flash":
            return flash_causal_attention(q, k, v, args.block_q, args.block_k)
        if impl in TRITON:
            from model.triton_attention import triton_causal_attention

            return triton_causal_attention(q, k, v, variants=tuple(impl.split("+")[1:]))
        backend = SDPA_BACKENDS.get(impl)  # None: torch's own choice
        with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        batch, heads = (args.tokens // n, args.width // hs) if cuda else (args.batch, args.heads)
        shape = (max(batch, 1), heads, n, hs)
        new = dict(device=device, dtype=dtype)
        q, k, v = (torch.randn(shape, **new, requires_grad=True) for _ in "qkv")
        allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        return q, k, v, allowed, torch.randn(shape, device=device, dtype=dtype)

    def batch(fn, n: int) -> float:
        """Seconds of n calls of fn back to back."""
        if not cuda:
            start = time.perf_counter()
            for _ in range(n):
                fn()
            return time.perf_counter() - start
        start, end = (torch.cuda.Event(enable_timing=True) for _ in "se")
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def per_call(fn) -> float:
        """Seconds a call: the fastest of at least 3 batches within --seconds, a tenth each."""
        n = max(1, round(args.seconds / 10 / batch(fn, 1)))
        batches = [batch(fn, n) for _ in range(3)]
        while sum(batches) < args.seconds:
            batches.append(batch(fn, n))
        return min(batches) / n

    def both():  # forward + backward
        return torch.autograd.grad(attend(q, k, v, allowed), (q, k, v), g)

    def backward():  # alone, on the retained graph of one forward
        return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

    torch.manual_seed(0)
    try:
        q, k, v, allowed, g = inputs(64)
        both()  # warm-up: thread pools, kernels compiled
        q, k, v, allowed, g = inputs(T)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        else:
            harness.reset_peak_rss()
            baseline = harness.rss_bytes("VmRSS")
        both()  # on a GPU, Triton's kernels autotune for this T here
        if cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() if cuda else harness.rss_bytes("VmHWM")
        with torch.no_grad():
            times = {"forward": per_call(lambda: attend(q, k, v, allowed))}
        times["both"] = per_call(both)
        out = attend(q, k, v, allowed)
        times["backward"] = per_call(backward)
    except torch.OutOfMemoryError:
        return {"error": "OOM"}
    except Exception as error:  # e.g. an sdpa backend that does not take this shape
        return {"error": str(error).splitlines()[0][:60]}
    flops = 2 * q.size(0) * q.size(1) * T * T * hs  # causal: half of 4 B H T^2 d_k
    work = {"forward": flops, "backward": 2.5 * flops, "both": 3.5 * flops}
    return {**times, **{f"{name}_tflops": work[name] / t / 1e12 for name, t in times.items()},
            "peak_bytes": peak - baseline}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=1, help="CPU: batch size")
    parser.add_argument("--heads", type=int, default=4, help="CPU: heads")
    parser.add_argument("--tokens", type=int, default=16384, help="GPU: batch x T")
    parser.add_argument("--width", type=int, default=2048, help="GPU: heads x head size")
    parser.add_argument("--head-sizes", type=int, nargs="+")
    parser.add_argument("--block-q", type=int, default=GPTConfig.flash_block_q, help="flash tile")
    parser.add_argument("--block-k", type=int, default=GPTConfig.flash_block_k, help="flash tile")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--impls", nargs="+", choices=IMPLS)
    parser.add_argument("--seconds", type=float, default=1.0, help="timed runs per measurement")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = harness.parse_args(parser, child)
    impls, dtype, lengths, head_sizes = DEFAULTS[args.device]
    args.impls, args.dtype = args.impls or impls, args.dtype or dtype
    args.lengths, args.head_sizes = args.lengths or lengths, args.head_sizes or head_sizes
    print(harness.machine(args.device))
    shape = f"{args.tokens:,} tokens x width {args.width:,}" if args.device == "cuda" else (
        f"B={args.batch}, H={args.heads}")  # fmt: skip
    print(f"\nCausal attention alone, {args.dtype}, {shape}; fastest batch of calls within "
          f"{args.seconds:g} s; flash tiles {args.block_q}x{args.block_k}.\n")  # fmt: skip
    head("d_k | T | impl | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd ms | "
         "fwd+bwd TFLOP/s | peak MiB | fwd+bwd / fastest sdpa", "rrlrrrrrrrr")  # fmt: skip
    for hs in args.head_sizes:
        for T in args.lengths:
            cells = [dict(impl=impl, head_size=hs, T=T) for impl in args.impls]
            done = [(cell, run_cell(cell, args)) for cell in cells]
            sdpa = [r["both"] for c, r in done if "sdpa" in c["impl"] and "both" in r]
            for cell, r in done:
                if "error" in r:
                    row([str(hs), f"{T:,}", cell["impl"], r["error"], *[""] * 7])
                    continue
                times = [f"{r[n] * 1e3:.2f} | {r[n + '_tflops']:.3g}" for n in TIMES]
                ratio = f"{min(sdpa) / r['both']:.2f}" if sdpa else ""
                row([str(hs), f"{T:,}", cell["impl"], *times, f"{r['peak_bytes'] / 2**20:,.1f}",
                     ratio])  # fmt: skip


def run_cell(cell: dict, args: argparse.Namespace) -> dict:
    """A CPU cell in a fresh subprocess (its peak RSS is its own); a GPU cell here, its memory
    freed after it."""
    if args.device == "cpu":
        return harness.measure(__file__, cell)
    import torch

    result = child(cell, args)
    torch.cuda.empty_cache()
    return result


if __name__ == "__main__":
    main()
