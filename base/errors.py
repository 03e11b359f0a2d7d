"""The user-error boundary: a mistake the user can fix is one `error:` line and exit code 2.

Every error the project raises for bad input derives from ValueError (ConfigError and
DataError here, CheckpointError in checkpoints/store.py), so one handler covers them all.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import NoReturn


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and what it accepts."""


class DataError(ValueError):
    """A user mistake in the data (bad name, missing file, too little data), said in one line:
    what was wrong and how to fix it."""


def exit_user_error(message: str) -> NoReturn:
    """The one way out for a user mistake: `error: <message>` as one line on stderr, exit 2."""
    print(f"error: {' '.join(message.splitlines())}", file=sys.stderr)
    sys.exit(2)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A user mistake inside the block exits through `exit_user_error`, without a traceback."""
    # Bad config, data or checkpoint (the project's errors all derive from ValueError, as
    # UnicodeDecodeError does), or a file that is missing or cannot be written.
    try:
        yield
    except (ValueError, OSError) as e:
        exit_user_error(str(e) or type(e).__name__)
