"""The causality guard's cost at the start of every `python train.py`, per preset and shipped
experiment: `python benchmarks/bench_causality_guard.py`. Prints a markdown table (median of 5)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hardware.device import cpu_name  # noqa: E402
from model import load_preset, preset_names  # noqa: E402
from model.causality import guard_report  # noqa: E402

EXPERIMENTS = Path(__file__).resolve().parent.parent / "configs" / "experiment"


def architectures() -> dict[str, dict]:
    """Each preset, and each shipped experiment's model (its preset with its overrides)."""
    table = {name: load_preset(name) for name in preset_names()}
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        recipe = yaml.safe_load(path.read_text())
        preset = next(
            (d["override /model"] for d in recipe.get("defaults", []) if "override /model" in d),
            "mini",
        )
        table[f"experiment={path.stem}"] = {**load_preset(preset), **recipe.get("model", {})}
    return table


def main() -> None:
    torch.set_num_threads(1)
    print(f"CPU: {cpu_name()}, 1 torch thread\n")
    print("| architecture | checks | guard (s), median of 5 |")
    print("| --- | ---: | ---: |")
    for name, values in architectures().items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            report, _ = guard_report(values)
            times.append(time.perf_counter() - start)
        assert report.causal, name
        print(f"| `{name}` | {len(report.checks)} | {statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
