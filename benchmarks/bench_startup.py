"""How fast a mistake is reported: the entry points' start-up against `import torch` alone.

Run: ``python benchmarks/bench_startup.py [--runs 5]``. Each command runs --runs times, the
commands interleaved (so a noisy stretch of the machine touches every row alike); a row is the
median wall time and its ratio to `python -c "import torch"`. Issue 32's target: a config
typo reported in at most 1.5x the time of importing torch.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import harness
from harness import ROOT, head, row

COMMANDS = {
    'python -c "import torch"': ["-c", "import torch"],
    "train.py model=nanoo (a group typo)": ["train.py", "model=nanoo"],
    "train.py train.batch_size=abc (a bad value)": ["train.py", "train.batch_size=abc"],
    "train.py trian.max_steps=1 (a key typo)": ["train.py", "trian.max_steps=1"],
    "sample.py tempp=1 (a key typo)": ["sample.py", "tempp=1"],
    "evaluate.py strid=4 (a key typo)": ["evaluate.py", "strid=4"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = harness.parse_args(parser)
    print(harness.machine())
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, argv in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, check=False)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times['python -c "import torch"'])
    print(f"\nmedian of {args.runs} runs each, interleaved\n")
    head("command | seconds | x import torch", "lrr")
    for name, values in times.items():
        median = statistics.median(values)
        row([name, f"{median:.2f}", f"{median / base:.2f}x"])


if __name__ == "__main__":
    main()
