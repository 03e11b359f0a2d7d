"""Benchmark: prepare shakespeare from scratch in a temporary cache; print markdown tables.

Run from the repository root:
``python benchmarks/bench_prepare.py [--num-proc N] [--tokenizers gpt2,bytes,bpe-1024]``.
The first table is the per-split throughput of the first tokenizer; the second compares the
tokenizers: vocabulary, BPE training time (train split only), preparation time and bytes per
token (higher is better compression).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import PreparedData, prepare_data  # noqa: E402

TOKENIZERS = "gpt2,bytes,bpe-512,bpe-1024,bpe-2048"


def prepare_timed(cache: str, tokenizer: str, num_proc: int) -> tuple[PreparedData, float]:
    start = time.perf_counter()
    cfg = {"name": "shakespeare", "cache_dir": cache, "num_proc": num_proc, "tokenizer": tokenizer}
    prepared = prepare_data(cfg, verbose=False)
    return prepared, time.perf_counter() - start


def print_splits(prepared: PreparedData, total: float) -> None:
    print(f"shakespeare, {prepared.tokenizer_name}:\n")
    print("| split | tokens | MB | seconds | MB/s | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for split, s in prepared.meta["splits"].items():
        mb = s["bytes"] / 1e6
        row = [split, f"{s['tokens']:,}", f"{mb:.2f}", f"{s['seconds']:.2f}"]
        row += [f"{mb / s['seconds']:.2f}", f"{s['tokens'] / s['seconds']:,.0f}"]
        print("| " + " | ".join(row) + " |")
    tokens = sum(s["tokens"] for s in prepared.meta["splits"].values())
    mb = sum(s["bytes"] for s in prepared.meta["splits"].values()) / 1e6
    print(
        f"| **total (wall)** | {tokens:,} | {mb:.2f} | {total:.2f} | {mb / total:.2f} | "
        f"{tokens / total:,.0f} |"
    )


def print_tokenizers(results: list[tuple[PreparedData, float]]) -> None:
    columns = ["tokenizer", "vocab", "BPE training s", "prepare s (wall)"]
    columns += ["train bytes/token", "val bytes/token"]
    print("\n| " + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|---:|---:|")
    for prepared, total in results:
        training = prepared.meta.get("tokenizer_training")
        trained = f"{training['seconds']:.2f}" if training else "-"
        row = [prepared.tokenizer_name, f"{prepared.vocab_size:,}", trained, f"{total:.2f}"]
        row += [f"{prepared.bytes_per_token(s):.3f}" for s in ("train", "val")]
        print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--tokenizers", default=TOKENIZERS, help="comma-separated names")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        results = [prepare_timed(cache, name, args.num_proc) for name in args.tokenizers.split(",")]
    print_splits(*results[0])
    print_tokenizers(results)


if __name__ == "__main__":
    main()
