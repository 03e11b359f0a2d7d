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
  in float32 and, where `dtype=auto` picks it, bfloat16 weights (half the bytes a token);
- the decoding step's matrix-vector products alone (every block's Linear layers, then the head),
  nothing else: how fast this machine's BLAS reads the weights, the ceiling of any decoder that
  calls it. The gap between this row and the cached one is everything else a token costs
  (attention over the cache, norms, activations, sampling, Python and dispatch).

Bandwidth is a 256 MiB tensor copy (bytes read + written per second), the best of 5. The
machines this runs on are shared, and their speed drifts within minutes, so the rows are
measured --rounds times, interleaved, each round with its own bandwidth: a row's tok/s is its
median over the rounds, "vs nanoGPT" the median of the per-round ratios, and the roofline uses
the highest bandwidth measured (the strictest). A first table compares the head's two layouts
(GPT.decoding_head). Run from anywhere:
``python benchmarks/bench_sample.py [--new-tokens N] [--rounds N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.device import cpu_auto_dtype, cpu_name  # noqa: E402
from inference import SamplingParams, generate  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

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
        idx_cond = idx[:, -model.config.block_size :]
        logits, _ = model(idx_cond, last_only=True)
        probs = F.softmax(logits[:, -1, :], dim=-1)
        idx = torch.cat((idx, torch.multinomial(probs, num_samples=1, generator=gen)), dim=1)
    return idx


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_matmuls(model: GPT) -> Callable[[], None]:
    """One decoding step's matrix-vector products and nothing else: every block's Linear
    layers on a random vector of their input width, then the head from its decoding layout."""
    linears = [m for m in model.transformer.modules() if isinstance(m, torch.nn.Linear)]
    head_t = model.decoding_head()
    w = model.lm_head.weight
    inputs = {m.in_features: torch.randn(1, m.in_features, dtype=w.dtype) for m in linears}

    def step() -> None:
        for m in linears:
            m(inputs[m.in_features])
        inputs[head_t.size(0)] @ head_t

    return step


def head_layouts(model: GPT) -> list[tuple[str, Callable[[], None]]]:
    """The head's matrix-vector product from lm_head's (vocab, C) layout and from the
    (C, vocab) copy generation decodes with (GPT.decoding_head)."""
    w = model.lm_head.weight
    x = torch.randn(1, w.size(1), dtype=w.dtype)
    head_t = model.decoding_head()
    return [
        ("lm_head as stored, (vocab, C): F.linear(x, W)", lambda: F.linear(x, w)),
        ("decoding_head() copy, (C, vocab): x @ head_t", lambda: x @ head_t),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: default")
    parser.add_argument(
        "--dtypes",
        default="auto",
        help="weight dtypes of our rows, e.g. float32,bfloat16; auto: float32, and bfloat16 "
        "too where dtype=auto's probe picks it on this CPU",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.new_tokens
    torch.manual_seed(0)
    prompt = torch.zeros(1, 1, dtype=torch.long)
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"nanoGPT's 30M shape (6x384, block 256, vocab 50,304), batch 1, {n} new tokens, "
        f"{args.rounds} interleaved rounds\n"
    )
    dtypes = args.dtypes.split(",")
    if args.dtypes == "auto":
        picked, why = cpu_auto_dtype()
        print(f"{why}\n")
        dtypes = ["float32", "bfloat16"] if picked == torch.bfloat16 else ["float32"]

    gen = torch.Generator().manual_seed(0)
    sample = SamplingParams(temperature=1.0)
    nanogpt = GPT(GPTConfig(**SHAPE, attention="sdpa")).eval()
    # (name, model, function returning seconds for n tokens); the first row is the baseline
    rows = [
        (
            "nanoGPT generate (sliding window, no cache)",
            nanogpt,
            lambda: timed(lambda: nanogpt_generate(nanogpt, prompt, n, gen)),
        )
    ]
    for dtype in dtypes:
        ours = GPT(GPTConfig(**SHAPE)).eval().to(getattr(torch, dtype))
        matmuls = decode_matmuls(ours)
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
    head_model = rows[-1][1]
    heads = head_layouts(head_model)
    nanogpt_generate(nanogpt, prompt, 5, gen)  # warm-up
    for _, m, _ in rows[1:]:
        generate(m, prompt, 5, sample, gen)
    bandwidths, seconds, head_seconds = [], [[] for _ in rows], [[] for _ in heads]
    for r in range(args.rounds):
        bandwidths.append(bandwidth())
        for times, (_, _, run) in zip(seconds, rows, strict=True):
            times.append(run())
        tok_s = " | ".join(f"{n / times[-1]:,.1f}" for times in seconds)
        print(f"round {r + 1}: copy bandwidth {bandwidths[-1] / 1e9:.1f} GB/s; tok/s {tok_s}")
        for _ in range(10):
            for times, (_, product) in zip(head_seconds, heads, strict=True):
                times.append(timed(product))
    bw = max(bandwidths)
    w = head_model.lm_head.weight
    print(f"\n| head matrix-vector product ({w.dtype}) | ms | GB/s |")
    print("|---|---:|---:|")
    for (name, _), times in zip(heads, head_seconds, strict=True):
        median = statistics.median(times)
        gb_s = w.numel() * w.element_size() / median / 1e9
        print(f"| {name} | {median * 1e3:.2f} | {gb_s:.1f} |")
    print(f"\ncopy bandwidth {bw / 1e9:.1f} GB/s (the best round), the roofline's\n")
    header = "generation | weights | MB read/token | roofline tok/s | tok/s | of roofline"
    print(f"| {header} | vs nanoGPT |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (name, m, _), times in zip(rows, seconds, strict=True):
        mb = weight_bytes(m)
        tok_s = statistics.median(n / t for t in times)
        vs = statistics.median(base / t for base, t in zip(seconds[0], times, strict=True))
        roof = bw / mb
        print(
            f"| {name} | {m.lm_head.weight.dtype} | {mb / 1e6:.0f} | {roof:,.0f} | {tok_s:,.1f} | "
            f"{tok_s / roof:.0%} | {vs:.1f}x |"
        )


if __name__ == "__main__":
    main()
