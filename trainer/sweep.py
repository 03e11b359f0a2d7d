"""The table a `python train.py -m ...` sweep ends with: one row per run, its final validation.

A Hydra callback (configs/train.yaml) that reads what each job left in its run directory
(`.hydra/overrides.yaml` and `metrics.jsonl`), so it works for any launcher whose jobs write to
a filesystem the launching process can read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from trainer.metrics_log import METRICS_FILE, read_metrics


def _overrides(job_dir: Path) -> dict[str, str]:
    try:
        items = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    except (OSError, yaml.YAMLError):
        return {}
    return dict(str(item).split("=", 1) for item in items if "=" in str(item))


def _result(job_dir: Path) -> list[str]:
    """The cells of a run: its last step and final validation loss and bpb (the last periodic
    one without a final evaluation)."""
    rows = read_metrics(job_dir / METRICS_FILE)
    if not rows:
        return ["failed or no metrics", "-", "-"]
    loss, bpb = rows[-1].get("final_val_loss"), rows[-1].get("final_val_bpb")
    if loss is None:
        evaluated = next((r for r in reversed(rows) if "val_loss" in r), {})
        loss, bpb = evaluated.get("val_loss"), evaluated.get("val_bpb")
    return [str(rows[-1]["step"]), *("-" if v is None else f"{v:.4f}" for v in (loss, bpb))]


def sweep_table(sweep_dir: str | Path) -> str:
    """A markdown table of the runs under `sweep_dir` (`<n>/` each), showing the overrides that
    differ between them, the last step, and the final validation loss and bpb."""
    jobs = sorted(
        (p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    overrides = {job: _overrides(job) for job in jobs}
    keys = sorted({k for o in overrides.values() for k in o})
    varied = [k for k in keys if len({o.get(k) for o in overrides.values()}) > 1]
    lines = [
        "| run | " + " | ".join([*varied, "step", "val loss", "val bpb"]) + " |",
        "|" + " --- |" * (len(varied) + 4),
    ]
    for job in jobs:
        cells = [overrides[job].get(k, "") for k in varied] + _result(job)
        lines.append(f"| {job.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


class SweepTable(Callback):
    """Print the sweep's table when all its runs are done."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).absolute()
        if sweep_dir.is_dir():
            print(f"\nsweep: {sweep_dir}\n{sweep_table(sweep_dir)}", flush=True)
