"""The user-error boundary: a mistake the user can fix is one `error:` line and exit code 2.

Every error the project raises for bad input derives from ValueError (ConfigError here,
DataError in data/, CheckpointError in core/checkpoint.py), so one handler covers them all.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

EXIT_USER_ERROR = 2


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and what it accepts."""


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """ValueError (bad config, data or checkpoint: the project's errors all derive from it) and
    missing files become `error: <message>` on stderr and exit code 2, without a traceback."""
    try:
        yield
    except (ValueError, FileNotFoundError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
