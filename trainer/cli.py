"""train.py's Hydra glue: the validated run config, and a run directory checked before use."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from core.errors import EXIT_USER_ERROR
from trainer.config import RunConfig
from trainer.init_from import RUNTIME_KEYS


def run_config(cfg: DictConfig) -> tuple[RunConfig, dict]:
    """The validated run config and the resolved plain tree (saved with checkpoints). With
    train.init_from, its model section holds only what the run asks of the source model."""
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    resolved.pop("hydra", None)
    if (resolved.get("train") or {}).get("init_from") is not None:
        hydra_cfg = HydraConfig.get()
        default = compose(config_name=hydra_cfg.job.config_name, overrides=[])
        resolved["model"] = requested_model(
            resolved["model"],
            OmegaConf.to_container(default.model, resolve=True),
            list(hydra_cfg.overrides.task),
        )
    return RunConfig.from_dict(resolved), resolved


def requested_model(
    model: dict[str, Any], default_model: dict[str, Any], overrides: list[str]
) -> dict[str, Any]:
    """The model keys a run sets itself: the run-time ones (trainer/init_from.py), those named
    in its command-line `overrides`, and those differing from `default_model`, the model section
    of the config composed without overrides (so set by an experiment or a model=<preset>
    choice). The default preset's other values are no request: train.init_from's source
    replaces them."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    named = {o.key_or_group[6:] for o in parsed if o.key_or_group.startswith("model.")}
    keep = {"block_size", *RUNTIME_KEYS, *named}
    return {
        k: v
        for k, v in model.items()
        if k in keep or k not in default_model or default_model[k] != v
    }


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
