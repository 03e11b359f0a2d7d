"""A second, real process that holds a run directory's lock until told to let go."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HOLDER = """
import sys
from trainer.run_lock import acquire_run_lock
lock = acquire_run_lock(sys.argv[1])
print(lock.owner["pid"], flush=True)
sys.stdin.read()
"""


def start_holder(run_dir: Path) -> subprocess.Popen:
    """A process holding `run_dir`'s lock (returns once it holds it) until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert int(proc.stdout.readline()) == proc.pid
    return proc
