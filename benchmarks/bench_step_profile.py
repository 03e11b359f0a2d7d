"""Benchmark: where a training step's time goes, by kind of work; prints a markdown table.

Run from anywhere: ``python benchmarks/bench_step_profile.py [train.py overrides ...]``
(default: ``experiment=speedrun_cpu``, the CPU speedrun's step). It builds the ``Trainer`` that
``python train.py`` builds from the same overrides, takes --warmup steps (torch.compile compiles
in the first), times --steps steps bare, then the same number under torch.profiler, and splits
the profiled time by the innermost operation that spent it (self time on the main thread, where
every CPU operation runs; its OpenMP threads work inside it):

- optimizer: everything under ``Optimizer.step`` (Muon's Newton-Schulz matmuls included),
  labelled with the optimizer's step, e.g. ``optimizer (Muon.step)``;
- matmuls: ``mm``/``addmm`` (the Linear layers and the head, forward and backward);
- attention: ``bmm`` (QK^T and SV) and the kernels with softmax or the causal mask in them;
- norms, activations, rope, loss, gradient clipping: eager operations and compiled kernels by
  the operations in their names (inductor names a fused kernel after what it fuses, e.g.
  ``cpp_fused__softmax_masked_fill_...``; a kernel fusing several kinds goes to the first rule
  it matches, in the order of RULES);
- compiled-graph calls and dispatch: the wrappers' own time around the compiled kernels;
- the rest: what no rule names (copies, views, Python between kernels), and the gap between
  the bare step and the profiled operations.

The shares are of the sum of the rows (the profiler's own overhead can make its operations
add up to more than the bare step).

The data's share is timed apart: ``sampler.next_batch()`` alone, as many calls as steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict

import harness
from harness import head, row

# (category, substrings of an operation's or kernel's name), first match wins
RULES = (
    ("matmuls (Linear layers, head)", ("aten::mm", "aten::addmm", "linear_pointwise")),
    ("loss (log-softmax, NLL)", ("nll_loss", "log_softmax", "cross_entropy")),
    ("attention (bmm, mask, softmax)", ("bmm", "softmax", "masked_fill")),
    # RMSNorm: rsqrt forward; its backward fuses a mean's gradient (div, expand) with pow, sum
    ("norms", ("rsqrt", "layer_norm", "div_expand_mul_pow_sum")),
    ("activations (ReLU², GELU)", ("relu", "gelu", "threshold")),
    ("rope", ("cat", "neg", "index")),
    ("gradient clipping", ("foreach_norm", "linalg_vector_norm")),
    ("compiled-graph calls and dispatch", ("compiledfxgraph", "compiledfunction", "dynamo")),
)


def category(name: str, ancestors: list[str]) -> str:
    for scope in [name, *ancestors]:
        if scope.startswith("Optimizer.step#"):  # e.g. Optimizer.step#Muon.step
            return f"optimizer ({scope.removeprefix('Optimizer.step#')})"
    lowered = name.lower()
    for label, parts in RULES:
        if any(part in lowered for part in parts):
            return label
    return "the rest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", default=["experiment=speedrun_cpu"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps, then profiled steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles)")
    parser.add_argument("--top", type=int, default=0, help="also list the N costliest operations")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = harness.parse_args(parser)

    import torch._inductor.config as inductor
    from torch.profiler import ProfilerActivity, profile

    from trainer.loop import Trainer

    inductor.cpp.enable_kernel_profile = True  # compiled kernels appear by name
    os.environ["WANDB_MODE"] = "disabled"  # a benchmark, not a run to track
    settings, resolved = harness.train_config(args.overrides)
    print(harness.machine(settings.device))
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(settings, run_dir, resolved)
        for _ in range(args.warmup):
            trainer.train_step()
        bare = []
        for _ in range(args.steps):
            start = time.perf_counter()
            trainer.train_step()
            bare.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                trainer.train_step()
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.sampler.next_batch()
        data = (time.perf_counter() - start) / args.steps
    step = statistics.median(bare)
    spent: dict[str, float] = defaultdict(float)  # a step's seconds by category
    by_name: dict[tuple[str, str], float] = defaultdict(float)  # and by operation
    for event in prof.events():
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        seconds = event.self_cpu_time_total / 1e6 / args.steps
        label = category(event.name, ancestors)
        spent[label] += seconds
        by_name[label, event.name] += seconds
    profiled = sum(spent.values())
    spent["data (next_batch)"] = data
    spent["the rest"] += max(step - profiled - data, 0.0)
    tokens = settings.train.batch_size * trainer.model.config.block_size
    print(
        f"\n`{' '.join(args.overrides)}`: {trainer.model.num_params() / 1e6:.2f}M parameters, "
        f"{tokens:,} tokens a step, {trainer.precision.dtype}; median bare step "
        f"{step * 1e3:.1f} ms ({tokens / step:,.0f} tokens/s) over {args.steps} steps; "
        f"profiled: {profiled * 1e3:.1f} ms of operations a step.\n"
    )
    total = sum(spent.values())  # the profiler's own overhead can make it more than the step
    head("work | ms/step | share", "lrr")
    for label, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        row([label, f"{seconds * 1e3:.1f}", f"{seconds / total:.0%}"])
    if args.top:
        print(f"\nThe {args.top} costliest operations (profiled), to check the categories:\n")
        head("operation or compiled kernel | category | ms/step", "llr")
        costliest = sorted(by_name.items(), key=lambda item: -item[1])[: args.top]
        for (label, name), seconds in costliest:
            row([f"`{name[:70]}`", label, f"{seconds * 1e3:.2f}"])


if __name__ == "__main__":
    main()
