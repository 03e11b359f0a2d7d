"""A second, real process that holds a run directory's lock until its stdin closes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# With "children": before saying "locked", it starts a forked child and an exec'd one (which
# gets every descriptor Python lets it inherit, close_fds=False), each waiting for the end of
# stdin and then saying "child done": children that could outlive it, sharing its open files.
HOLDER = """
import os, subprocess, sys
from trainer.preflight import acquire_run_lock
acquire_run_lock(sys.argv[1])
if sys.argv[2:] == ["children"]:
    forked, ready = os.pipe()
    if os.fork() == 0:  # once fork returns here, run_lock has acted on the fork
        os.write(ready, b"1")
        os.read(0, 1)
        os.write(1, b"child done\\n")
        os._exit(0)
    os.read(forked, 1)
    wait = "import os; os.read(0, 1); os.write(1, b'child done\\\\n')"
    subprocess.Popen([sys.executable, "-c", wait], close_fds=False)
print("locked", flush=True)
sys.stdin.read()
"""


def start_holder(run_dir: Path, *args: str) -> subprocess.Popen:
    """A process holding `run_dir`'s lock (returns once it holds it) until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "locked\n"
    return proc
