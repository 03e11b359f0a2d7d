"""Benchmark: batch-1 generation speed against the memory roofline; print a markdown table.

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
  in float32 and, where `dtype=auto` picks it, bfloat16 weights (half the bytes a token).

Bandwidth is a 256 MiB tensor copy (bytes read + written per second), the best of 5.
Run from anywhere: ``python benchmarks/bench_sample.py [--new-tokens N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import sys
import time
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=500)
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
    bw = bandwidth()
    torch.manual_seed(0)
    prompt = torch.zeros(1, 1, dtype=torch.long)
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"nanoGPT's 30M shape (6x384, block 256, vocab 50,304), batch 1, {n} new tokens; "
        f"copy bandwidth {bw / 1e9:.1f} GB/s\n"
    )
    header = "generation | weights | MB read/token | roofline tok/s | tok/s | of roofline"
    print(f"| {header} | vs nanoGPT |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rows = []
    model = GPT(GPTConfig(**SHAPE, attention="sdpa")).eval()
    gen = torch.Generator().manual_seed(0)
    nanogpt_generate(model, prompt, 5, gen)  # warm-up
    rows.append(
        (
            "nanoGPT generate (sliding window, no cache)",
            model,
            timed(lambda: nanogpt_generate(model, prompt, n, gen)),
        )
    )
    sample = SamplingParams(temperature=1.0)
    dtypes = args.dtypes.split(",")
    if args.dtypes == "auto":
        picked, why = cpu_auto_dtype()
        print(f"{why}\n")
        dtypes = ["float32", "bfloat16"] if picked == torch.bfloat16 else ["float32"]
    for dtype in dtypes:
        ours = GPT(GPTConfig(**SHAPE)).eval().to(getattr(torch, dtype))
        generate(ours, prompt, 5, sample, gen)  # warm-up
        rows.append(
            (
                f"ours, no cache ({dtype})",
                ours,
                timed(lambda m=ours: generate(m, prompt, n, sample, gen, use_cache=False)),
            )
        )
        rows.append(
            (
                f"ours, KV cache ({dtype})",
                ours,
                timed(lambda m=ours: generate(m, prompt, n, sample, gen)),
            )
        )
    baseline = n / rows[0][2]
    for name, m, seconds in rows:
        mb = weight_bytes(m)
        tok_s = n / seconds
        roof = bw / mb
        print(
            f"| {name} | {m.lm_head.weight.dtype} | {mb / 1e6:.0f} | {roof:,.0f} | {tok_s:,.1f} | "
            f"{tok_s / roof:.0%} | {tok_s / baseline:.1f}x |"
        )


if __name__ == "__main__":
    main()
