"""The user-error boundary: a mistake the user can fix is one `error:` line and exit code 2.

Every error the project raises for bad input derives from ValueError (ConfigError here,
DataError in data/, CheckpointError in checkpoints/store.py), so one handler covers them all.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

EXIT_USER_ERROR = 2


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and what it accepts."""


# A user mistake: bad config, data or checkpoint (the project's errors all derive from
# ValueError, as UnicodeDecodeError does), or a file that is missing or cannot be written.
USER_ERRORS = (ValueError, OSError)


def report_user_error(error: BaseException) -> int:
    """Print `error` as one `error: <message>` line on stderr; return the exit code."""
    message = " ".join(str(error).splitlines()) or type(error).__name__
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A user mistake inside the block exits with `error: <message>` and code 2, without a
    traceback."""
    try:
        yield
    except USER_ERRORS as e:
        sys.exit(report_user_error(e))
