"""Build runs from the real configs (configs/train.yaml), shrunk to a tiny model and budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from trainer.config import RunConfig
from trainer.loop import Trainer
from trainer.reporting import METRICS_FILE, read_metrics

ROOT = Path(__file__).resolve().parents[2]
# The limit on a test's wait for a process: it only turns a hang into a failure. Processes here
# take seconds, a minute at worst on a 2-core machine loaded by other jobs; every wait ends at an
# event (the process's exit or output), never at this limit, unless something hangs.
HANG_SECONDS = 600
CONFIGS = str(ROOT / "configs")

TINY = [
    "model=nano",
    "model.block_size=32",
    "train.batch_size=4",
    "train.max_steps=12",
    "train.eval_interval=6",
    "train.eval_steps=2",
    "train.ckpt_interval=6",
    "train.log_interval=1",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "wandb.mode=disabled",
]


def compose_run(data: list[str], *overrides: str) -> tuple[RunConfig, dict]:
    """The run config of `python train.py <TINY> <data> <overrides>`."""
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose("train", overrides=[*TINY, *data, *overrides])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return RunConfig.from_dict(resolved), resolved


def make_trainer(run_dir: Path, data: list[str], *overrides: str) -> Trainer:
    settings, resolved = compose_run(data, *overrides)
    return Trainer(settings, run_dir, resolved)


def run_script(
    script: str, *args: str, cwd: Path, timeout: float = HANG_SECONDS, **popen
) -> subprocess.CompletedProcess:
    """Run one of the entry points as a user would, from `cwd` (not the repository root)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "default"}
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def losses(trainer: Trainer) -> dict[int, float]:
    """Step -> training loss at every logged step, as the run's metrics.jsonl records it."""
    rows = read_metrics(trainer.run_dir / METRICS_FILE)
    return {row["step"]: row["train_loss"] for row in rows if "train_loss" in row}
