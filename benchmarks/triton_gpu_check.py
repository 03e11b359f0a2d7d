"""The Triton kernel where it runs for real: its error against float64 in each dtype, and
torch.compile tracing a model through it without a graph break. Exits 1 if either fails.

On a CUDA GPU, from the repository root: ``python benchmarks/triton_gpu_check.py`` (bfloat16,
float16 and float32; T = 17 and 1,000; head sizes 64 and 128, bench_attention's, so that the two
share their compiled kernels through Triton's cache). On a CPU, under Triton's interpreter (as
the tests run it; scripts/gpu_check.sh --smoke): ``TRITON_INTERPRET=1 python
benchmarks/triton_gpu_check.py --device cpu --head-sizes 16 --lengths 40``. Prints two markdown
tables.

Errors: Y, dQ, dK and dV of the kernel and of the formula (model/gpt.py's causal_attention) in
the same dtype, each against the formula in float64 on the same inputs (q, k, v views of one
fused projection, as in the model), as the largest absolute difference. A row passes when the
kernel's is within 3 times the formula's own, plus 1e-5 of the largest value: the bounds of
tests/model/test_triton_attention.py, as FlashAttention's tests measure. float32 runs last, on
each kernel's last tiling only: IEEE float32 dots compile slowly, and autotuning all of them did
not finish in an earlier GPU call (docs/performance.md).

Compile: torch._dynamo.explain of a 2-layer model's loss with attention=triton on the device,
as the tests' graph-break check: one graph, no break.
"""

from __future__ import annotations

import argparse

import harness
from harness import head, row

NAMES = ("Y", "dQ", "dK", "dV")


def errors(device, dtype, hs: int, T: int) -> list[str]:
    """One table row: the kernel's and the formula's error against float64 on the same inputs
    (in the dtype: its rounding of the inputs is no one's error), and the verdict."""
    import torch

    from model.gpt import causal_attention
    from model.triton_attention import triton_causal_attention

    B, H = 2, 4
    torch.manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * hs, device=device, dtype=dtype)
    grad = torch.randn(B, H, T, hs, device=device, dtype=dtype)
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()

    def run(attend, precision):
        x = qkv.to(precision).requires_grad_()
        q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in x.split(H * hs, dim=2))
        y = attend(q, k, v)
        return [y, *torch.autograd.grad(y, (q, k, v), grad.to(precision))]

    def formula(q, k, v):
        return causal_attention(q, k, v, allowed)

    exact = run(formula, torch.float64)
    kernel, own = run(triton_causal_attention, dtype), run(formula, dtype)
    cells, ok = [], True
    for a, b, e in zip(kernel, own, exact, strict=True):
        error, bound = (a.double() - e).abs().max().item(), (b.double() - e).abs().max().item()
        ok &= error <= 3 * bound + 1e-5 * e.abs().max().item()
        cells.append(f"{error:.2e} / {bound:.2e}")
    return [str(dtype).removeprefix("torch."), str(hs), f"{T:,}", *cells, "ok" if ok else "FAIL"]


def graph_breaks(device) -> list[str]:
    """One table row: graphs and graph breaks of a model's loss traced by torch.compile."""
    import torch

    from model import GPT, GPTConfig

    config = GPTConfig(vocab_size=101, block_size=20, n_layer=2, n_head=2, n_embd=32,
                       dropout=0.0, attention="triton")  # fmt: skip
    model = GPT(config).to(device)
    idx = torch.randint(0, 101, (2, 20), device=device)
    explained = torch._dynamo.explain(lambda i: model(i, i)[1])(idx)
    ok = explained.graph_count == 1 and explained.graph_break_count == 0
    counts = [str(explained.graph_count), str(explained.graph_break_count)]
    return ["GPT, attention=triton, loss", *counts, "ok" if ok else "FAIL"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    parser.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--lengths", type=int, nargs="+", default=[17, 1000])
    args = harness.parse_args(parser)
    import torch

    from model import triton_attention as kernel

    device = torch.device(args.device)
    print(harness.machine(args.device))
    print("\nErrors against the formula in float64: the kernel's / the formula's own in the "
          "dtype (largest absolute difference)\n")  # fmt: skip
    head("dtype | d_k | T | " + " | ".join(NAMES) + " | within 3x", "lrr" + "r" * len(NAMES) + "l")
    failed = False
    for dtype in sorted(args.dtypes, key=lambda d: d == "float32"):
        if dtype == "float32" and device.type == "cuda":  # one tiling each (docstring)
            for tuned in (kernel.forward, kernel.backward_dk_dv, kernel.backward_dq):
                tuned.configs = tuned.configs[-1:]
        for hs in args.head_sizes:
            for T in args.lengths:
                cells = errors(device, getattr(torch, dtype), hs, T)
                failed |= cells[-1] != "ok"
                row(cells)
    print("\ntorch.compile through the kernel's custom operator (torch._dynamo.explain)\n")
    head("traced | graphs | graph breaks | one graph", "lrrl")
    cells = graph_breaks(device)
    failed |= cells[-1] != "ok"
    row(cells)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
