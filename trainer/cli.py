"""What the entry points share: turning user mistakes into one line and an exit code."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

from trainer.config import RunConfig

EXIT_USER_ERROR = 2


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """ValueError (bad config, data or checkpoint: the project's errors all derive from it) and
    missing files become `error: <message>` on stderr and exit code 2, without a traceback."""
    try:
        yield
    except (ValueError, FileNotFoundError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def run_config(cfg: DictConfig) -> tuple[RunConfig, dict]:
    """The validated run config and the resolved plain tree (saved with checkpoints)."""
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    resolved.pop("hydra", None)
    return RunConfig.from_dict(resolved), resolved
