"""The one exception type for user mistakes in the data pipeline."""


class DataError(ValueError):
    """A user mistake (bad name, missing file, too little data).

    The message is a single line saying what was wrong and how to fix it, so entry points can
    print ``error: <msg>`` and exit 2 instead of showing a traceback.
    """
