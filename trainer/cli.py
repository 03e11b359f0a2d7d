"""train.py's Hydra glue: the validated run config, and a run directory checked before use."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from base.errors import EXIT_USER_ERROR
from trainer.config import RunConfig


def run_config(cfg: DictConfig) -> tuple[RunConfig, dict]:
    """The validated run config and the resolved plain tree (saved with checkpoints)."""
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    resolved.pop("hydra", None)
    return RunConfig.from_dict(resolved), resolved


class CheckRunDir(Callback):
    """Hydra callback (configs/train.yaml): a run directory that cannot be written is one
    `error:` line and exit code 2, before Hydra writes its config and log there (which would
    fail with a traceback) and long before the first checkpoint."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable(config.hydra.sweep.dir, "hydra.sweep.dir")


def _check_writable(directory: str, key: str) -> None:
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        print(
            f"error: cannot write to the run directory {Path(directory).absolute()}: "
            f"{e.strerror or e}; set {key} to a writable directory",
            file=sys.stderr,
        )
        sys.exit(EXIT_USER_ERROR)
