"""Benchmark: prepare shakespeare from scratch in a temporary cache; print a markdown table.

Run from the repository root: ``python benchmarks/bench_prepare.py [--num-proc N]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import prepare  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        cfg = {"name": "shakespeare", "cache_dir": cache, "num_proc": args.num_proc}
        prepared = prepare(cfg, verbose=False)
        total = time.perf_counter() - start
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


if __name__ == "__main__":
    main()
