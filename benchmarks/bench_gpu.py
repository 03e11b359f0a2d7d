"""Benchmark for the first GPU this project gets: GPT-2 124M's training step, cell by cell.

Run from anywhere on a CUDA machine: ``python benchmarks/bench_gpu.py`` (GPT-2 124M, bf16
autocast, batch 16 x 1024, fused AdamW, torch.compile on; ``--help`` for the options). Prints a
markdown table: tokens/s, MFU against hardware/device.py's datasheet peak, and peak GPU memory per
cell, beside trainer/preflight.py's estimate of that peak. ``--device cpu --preset nano
--batch-size 2 --block-size 64 --no-compile`` runs the same cells on a CPU (a smoke test of the
script, not a measurement; the triton cell needs TRITON_INTERPRET=1 there).

Cells (each in a fresh subprocess, benchmarks/harness.py; a cell's time is the median of
--steps timed steps after --warmup untimed ones, synchronized). The step is the model's own
forward with targets, which keeps no (B, T, vocab) logits through backward (issue 18):
- vocab 50257: GPT-2's own vocabulary, the baseline;
- padded vocab: 50304 rows (nanoGPT's padding: aligned matmuls in the head), with sdpa;
- manual, triton, flash: that attention instead of sdpa (triton: our Triton kernel; flash: our
  tiled PyTorch FlashAttention, the memory-linear teaching version, far slower);
- muon: optim=muon (Newton-Schulz on every matrix, on every rank);
- no clipping: the padded cell without clip_grad_norm_, as nanoGPT's bench.py steps (its graph
  is ours, operation for operation: benchmarks/bench_graph.py), so the two loops compare.
A cell that runs out of memory prints OOM; one that fails, the last line of its error.
"""

from __future__ import annotations

import argparse
import statistics
import time

import harness
from harness import head, row

CELLS = {
    "baseline (vocab 50257)": dict(vocab=50257),
    "padded vocab 50304": dict(vocab=50304),
    "manual attention": dict(vocab=50304, attention="manual"),
    "triton attention": dict(vocab=50304, attention="triton"),
    "flash attention": dict(vocab=50304, attention="flash"),
    "muon": dict(vocab=50304, optim="muon"),
    "padded vocab, no clipping": dict(vocab=50304, clip=False),
    # issue 61's variants of the kernel together (model/triton_attention.py): until a GPU's
    # ablation rows say which win, the step with all of them
    "triton, every variant": dict(vocab=50304, attention="triton", every_variant=True),
}


def child(cell: dict, args: argparse.Namespace) -> dict[str, float | str]:
    """One cell in this process: tokens/s, MFU and peak GPU memory of the training step."""
    import torch

    from base.errors import yaml_config
    from hardware.device import Precision, configure_backends, peak_flops
    from model import GPT, GPTConfig
    from trainer.config import OptimSettings
    from trainer.optim import build_optimizer
    from trainer.preflight import estimate_memory

    device = torch.device(args.device)
    configure_backends(device)
    precision = Precision(device, getattr(torch, args.dtype))
    values = {**yaml_config(f"model/{args.preset}.yaml"), "vocab_size": cell["vocab"]}
    values.update(block_size=args.block_size, attention=cell.get("attention", "sdpa"))
    if cell.get("every_variant"):  # the table's triton entry, through the variants
        import model.gpt as gpt
        from model.triton_attention import VARIANTS, triton_causal_attention

        def triton(q, k, v, allowed, fresh, dropout_p):  # noqa: ARG001 - the table's signature
            return triton_causal_attention(q, k, v, dropout_p, variants=tuple(VARIANTS))

        gpt.ATTENTION["triton"] = triton
    torch.manual_seed(0)
    config = GPTConfig.from_dict(values)
    model = GPT(config).to(device)
    optim = cell.get("optim", "adamw")
    optimizer = build_optimizer(model, OptimSettings(name=optim), device)
    compiled = args.compile and device.type == "cuda"
    estimate = estimate_memory(config, args.batch_size, optim, precision.dtype, 1, compiled)
    step_model = torch.compile(model) if args.compile else model
    shape = (args.batch_size, args.block_size)

    def step() -> None:
        x = torch.randint(0, 50257, shape, device=device)
        with precision.autocast():
            _, loss = step_model(x, x)
        loss.backward()
        if cell.get("clip", True):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    try:
        for _ in range(args.warmup):
            step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        return {"error": "OOM"}
    tok_s = args.batch_size * args.block_size / statistics.median(times)
    peak, _ = peak_flops(precision)
    mfu = tok_s * model.flops_per_token(args.block_size) / peak if peak else float("nan")
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"tok_s": tok_s, "mfu": mfu, "peak_gib": memory, "estimate_gib": estimate.total / 2**30}


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
    args = harness.parse_args(parser, child)
    print(harness.machine(args.device))
    print(
        f"\n{args.preset}, {args.dtype}, batch {args.batch_size} x {args.block_size}, "
        f"compile {'on' if args.compile else 'off'}\n"
    )
    head("cell | tokens/s | MFU | peak memory (GiB) | estimated (GiB)", "lrrrr")
    for name in args.cells:
        r = harness.measure(__file__, CELLS[name])
        if "error" in r:
            row([name, r["error"], "", "", ""])
        else:
            numbers = [f"{r['tok_s']:,.0f}", f"{r['mfu']:.1%}", f"{r['peak_gib']:.2f}"]
            row([name, *numbers, f"{r['estimate_gib']:.2f}"])


if __name__ == "__main__":
    main()
