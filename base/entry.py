"""The entry points' `hydra.main`, with Hydra's own user errors at the user-error boundary.

Hydra reports a typo'd key, a malformed override or an unknown config group option in several
lines and exits 1. `hydra_main` lets Hydra raise instead (HYDRA_FULL_ERROR) and prints each as
one `error:` line, exit code 2, like every other user error (base/errors.py). Errors raised by
the task itself pass through untouched: the task handles its users' mistakes with
`user_errors()`, and anything else is a bug whose traceback must show.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any
from unittest import mock

import hydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from base.errors import exit_user_error

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"  # what every entry point composes


def hydra_main(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], None]]:
    """`@hydra.main(config_path="configs", config_name=...)` for the scripts in the repository
    root; `-m`, `--cfg`, `--help` and every other Hydra flag work as with hydra.main."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], None]:
        raised_by_task: list[BaseException] = []

        @hydra.main(config_path="configs", config_name=config_name, version_base=None)
        @functools.wraps(task)  # Hydra unwraps to `task`: configs/ next to its script
        def run(cfg: DictConfig) -> Any:
            try:
                return task(cfg)
            except Exception as e:
                raised_by_task.append(e)
                raise

        @functools.wraps(task)
        def main() -> None:
            # Hydra re-raises its errors instead of printing them (its documented
            # HYDRA_FULL_ERROR); patch.dict puts the environment back afterwards.
            with mock.patch.dict(os.environ, HYDRA_FULL_ERROR="1"):
                try:
                    run()
                except (HydraException, OmegaConfBaseException, ValueError) as e:
                    if e in raised_by_task:  # the task's own: a bug, its traceback shows
                        raise
                    exit_user_error(describe(e))

        return main

    return decorate


def describe(e: Exception) -> str:
    """One line for an error Hydra or OmegaConf raised while composing the config."""
    if isinstance(e, MissingConfigException) and e.options is not None and e.missing_cfg_file:
        missing = PurePosixPath(e.missing_cfg_file)
        group, choices = missing.parent, ", ".join(sorted(e.options))
        return f"{group}={missing.name} is not in configs/{group}/; choose one of: {choices}"
    if isinstance(e, OverrideParseException):
        reason = e.message.splitlines()[0]
        return (
            f"cannot parse the override {e.override!r} ({reason}); write key=value, quoting "
            "lists and strings for the shell: 'data.train_files=[a.txt,b.txt]'"
        )
    cause = e.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:  # unknown key
        key = cause.full_key
        known = getattr(cause.parent_node, "keys", lambda: [])()
        prefix = key.rpartition(".")[0]
        names = [f"{prefix}.{k}" if prefix else str(k) for k in sorted(known) if k != "hydra"]
        return f"unknown config key {key}; known keys: {', '.join(names)}"
    if str(e).startswith("Could not override '"):  # a key or group this script does not have
        key, script = str(e).split("'")[1], PurePosixPath(sys.argv[0]).name
        return f"unknown config key {key}; `python {script} --help` lists the keys"
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
