"""Test-only fault injection: SIGKILL this process at an exact point of a write.

A crash-safety test must kill a writer *inside* a write, every time. A kill timed by the clock
lands there only by chance, which depends on the machine's speed and load; so the writers mark
the instants worth a crash with `fault_point("<writer>.<stage>")`, and a test sets

    CAUSALGPT_FAULT=<point>:<n>        e.g. CAUSALGPT_FAULT=checkpoint.swap:2

to make the process kill itself with SIGKILL the n-th time it reaches <point>. Before dying it
writes `fault: SIGKILL at <point> (<spec>)` to stderr, so that the test knows where it died.
Unset (always, outside tests), a fault point does nothing.

The points (each writer's docstring says what is on disk at each):
    checkpoint.partial   checkpoints/store.py: some of a checkpoint's files written, no manifest
    checkpoint.complete  every file and the manifest written and fsynced, not yet in place
    checkpoint.swap      the previous checkpoint moved aside, the new one not yet renamed in
    checkpoint.replaced  the new checkpoint in place, the previous one not yet deleted
    data.file            data/cache.py: a prepared file written under its temporary name

This module lives in data/, the lowest layer that writes files, so that both writers (data/ and
core/) use the one hook without importing upward.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "CAUSALGPT_FAULT"
_reached: Counter[str] = Counter()  # arrivals at the armed point in this process


def fault_point(name: str) -> None:
    """SIGKILL this process here if CAUSALGPT_FAULT names this point's n-th arrival."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, n = spec.rpartition(":")
    if not point or not n.isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected <point>:<n>, e.g. checkpoint.swap:2")
    if name != point:
        return
    _reached[point] += 1
    if _reached[point] == int(n):
        os.write(2, f"fault: SIGKILL at {name} ({spec})\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
