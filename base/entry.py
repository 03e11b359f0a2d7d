"""The entry points' `hydra.main`, with Hydra's own user errors at the user-error boundary.

Hydra reports a typo'd key, a malformed override or an unknown config group option in several
lines and exits 1. `hydra_main` lets Hydra raise instead (HYDRA_FULL_ERROR) and prints each as
one `error:` line, exit code 2, like every other user error (base/errors.py). Errors raised by
the task itself pass through untouched: the task handles its users' mistakes with
`user_errors()`, and anything else is a bug whose traceback must show.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import PurePosixPath
from typing import Any

import hydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from base.errors import exit_user_error


def hydra_main(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], None]]:
    """`@hydra.main(config_path="configs", config_name=...)` for the scripts in the repository
    root; `-m`, `--cfg`, `--help` and every other Hydra flag work as with hydra.main."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], None]:
        raised_by_task: list[BaseException] = []

        @functools.wraps(task)
        def tracked_task(cfg: DictConfig) -> Any:
            try:
                return task(cfg)
            except Exception as e:
                raised_by_task.append(e)
                raise

        run = hydra.main(config_path="configs", config_name=config_name, version_base=None)(
            tracked_task
        )

        @functools.wraps(task)
        def main() -> None:
            with _hydra_raises():
                try:
                    run()
                except (HydraException, OmegaConfBaseException, ValueError) as e:
                    if any(e is r for r in raised_by_task):
                        raise
                    exit_user_error(describe(e))

        return main

    return decorate


@contextlib.contextmanager
def _hydra_raises() -> Iterator[None]:
    """Hydra re-raises errors instead of printing them (its documented HYDRA_FULL_ERROR)."""
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


def describe(e: Exception) -> str:
    """One line for an error Hydra or OmegaConf raised while composing the config."""
    if isinstance(e, MissingConfigException) and e.options is not None and e.missing_cfg_file:
        missing = PurePosixPath(e.missing_cfg_file)
        group = str(missing.parent)
        return f"{group}={missing.name} is not in configs/{group}/; choose one of: " + ", ".join(
            sorted(e.options)
        )
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
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if first.startswith("Could not override '"):  # a key or group this script does not have
        key = first.split("'")[1]
        script = PurePosixPath(sys.argv[0]).name
        return f"unknown config key {key}; `python {script} --help` lists the keys"
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
