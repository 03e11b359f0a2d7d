"""Benchmark: the ATen operations of a compiled training step, ours beside nanoGPT's; prints a
markdown table.

Run from anywhere: ``python benchmarks/bench_graph.py [--nanogpt DIR] [--batch 2] [--seq 32]``.
GPT-2 124M's shape (configs/model/gpt2.yaml: 12 x 768, vocabulary 50,304, biases, tied
embeddings) in float32, one forward and backward of ``model(x, y)``'s loss, captured by
torch.compile's own front end (Dynamo, then AOTAutograd's joint graph split into a forward and a
backward graph) with a backend that counts each graph's ``call_function`` nodes by operation
instead of compiling them: what Inductor is handed; then the kernels Inductor generates from
them, compiled for real (about 3 minutes on 2 cores). Counted for our GPT with
``attention: sdpa`` and ``attention: triton`` (the kernel is one custom operation each way; the
graph is traced with fake tensors, so Triton's interpreter never runs), and for nanoGPT's
model.py (``../shared/anchors/nanoGPT`` by default) with the same config. A row per operation
that any of them calls; ``=`` where ours matches nanoGPT's count. The graphs are made on the CPU;
a CUDA graph holds the same ATen operations (the decomposition is the device's only where an
operation has a device kernel, as sdpa's backends). The counts do not depend on the batch or the
length (2 x 256 and 2 x 32 give the same graphs); 32 keeps the one run of the captured graphs
quick where Triton's interpreter runs the kernel.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections import Counter
from pathlib import Path

import harness
from harness import head, row

SHAPE = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=True)


def counted_step(model, x, y) -> dict[str, Counter]:
    """{"fwd": ..., "bwd": ...}: each graph's operations (e.g. ``aten.mm.default``) counted."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: dict[str, Counter] = {}

    def counter(kind: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            nodes = (n for n in gm.graph.nodes if n.op == "call_function")
            graphs[kind] = graphs.get(kind, Counter()) + Counter(str(n.target) for n in nodes)
            return make_boxed_func(gm.forward)

        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=counter("fwd"), bw_compiler=counter("bwd"))
    step = torch.compile(model, backend=backend, fullgraph=True)
    _, loss = step(x, y)
    loss.backward()
    return graphs


def compiled_kernels(model, x, y) -> dict[str, int]:
    """{"fwd": ..., "bwd": ...}: the kernels Inductor generates for each graph (on a CPU, C++
    loops; a CUDA build fuses into Triton kernels by the same rules, not the same count)."""
    import torch
    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    torch._inductor.config.fx_graph_cache = False  # a cached graph loads its backward with the
    torch._functorch.config.enable_autograd_cache = False  # forward: no split to count
    _, loss = torch.compile(model, fullgraph=True)(x, y)
    fwd = metrics.generated_kernel_count
    loss.backward()
    return {"fwd": fwd, "bwd": metrics.generated_kernel_count - fwd}


def ours(attention: str):
    from model import GPT, GPTConfig

    return GPT(GPTConfig(**SHAPE, attention=attention))


def nanogpt(directory: Path):
    spec = importlib.util.spec_from_file_location("nanogpt_model", directory / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT(module.GPTConfig(**SHAPE, dropout=0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--nanogpt", type=Path, default=harness.ROOT.parent / "shared" / "anchors" / "nanoGPT"
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    args = harness.parse_args(parser)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel's module imports on a CPU
    import torch

    torch.manual_seed(0)
    x = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.seq))
    y = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.seq))
    models = {"nanoGPT": lambda: nanogpt(args.nanogpt.resolve())}
    models |= {f"ours, {a}": lambda a=a: ours(a) for a in ("sdpa", "triton")}
    counts = {name: counted_step(make(), x, y) for name, make in models.items()}
    kernels = {name: compiled_kernels(make(), x, y) for name, make in models.items()}

    print(f"{harness.machine()}; torch {torch.__version__}; the compiled step's ATen operations, "
          f"GPT-2 124M shape, float32, batch {args.batch} x {args.seq}\n")  # fmt: skip
    names, anchor = list(counts), counts["nanoGPT"]
    head(" | ".join(["operation", *(f"{n} {k}" for n in names for k in ("fwd", "bwd"))]),
         "l" + "r" * 2 * len(names))  # fmt: skip
    ops = sorted({op for c in counts.values() for g in c.values() for op in g})
    for op in ops:
        cells = []
        for name in names:
            for kind in ("fwd", "bwd"):
                n = counts[name][kind][op]
                same = name != "nanoGPT" and n == anchor[kind][op]
                cells.append("=" if same else str(n))
        row([op.removeprefix("aten."), *cells])
    row(["**all**", *(str(sum(counts[n][k].values())) for n in names for k in ("fwd", "bwd"))])
    row(
        [
            "**fused kernels** (Inductor, CPU)",
            *(str(kernels[n][k]) for n in names for k in ("fwd", "bwd")),
        ]
    )


if __name__ == "__main__":
    main()
