"""Benchmark: generation speed with and without the KV cache; print a markdown table.

The `mini` preset with its context raised to 512 (it trains at 128), GPT-2 vocabulary, randomly
initialised (speed does not depend on the weights), greedy, 500 new tokens after a one-token
prompt, so the whole run stays inside block_size where the cache applies. Both runs must produce
the same tokens.
Run from anywhere:
``python benchmarks/bench_sample.py [--new-tokens N] [--device D] [--threads N]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference import SamplingParams, generate  # noqa: E402
from model import GPT, GPTConfig, load_preset  # noqa: E402

GPT2_VOCAB = 50257


def timed_generate(model: GPT, idx: torch.Tensor, n: int, use_cache: bool) -> tuple:
    """(tokens, seconds) for n greedy tokens."""
    start = time.perf_counter()
    out = generate(model, idx, n, SamplingParams(temperature=0), use_cache=use_cache)
    if idx.device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=500)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads; 0: torch's default. On a "
        "busy machine 1 thread is much faster for one-token steps (no OpenMP wake-ups)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    preset = load_preset("mini")
    vocab = preset["vocab_size"] or GPT2_VOCAB
    config = GPTConfig.from_dict({**preset, "block_size": 512, "vocab_size": vocab})
    model = GPT(config).to(args.device).eval()
    idx = torch.full((1, 1), GPT2_VOCAB - 1, device=args.device)  # <|endoftext|>
    generate(model, idx, 5)  # warm-up: allocator, kernels
    cached, t_cached = timed_generate(model, idx, args.new_tokens, use_cache=True)
    full, t_full = timed_generate(model, idx, args.new_tokens, use_cache=False)
    if not torch.equal(cached, full):
        raise SystemExit("the cached and uncached runs produced different tokens")
    n = args.new_tokens
    print(
        f"mini ({model.num_params() / 1e6:.1f}M params), {n} new tokens, greedy, "
        f"{args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}\n"
    )
    print("| generation | seconds | tokens/s |")
    print("|---|---:|---:|")
    print(f"| without cache (recompute the window) | {t_full:.2f} | {n / t_full:,.1f} |")
    print(f"| with KV cache | {t_cached:.2f} | {n / t_cached:,.1f} |")
    print(f"| **speed-up** | | **{t_full / t_cached:.1f}x** |")


if __name__ == "__main__":
    main()
