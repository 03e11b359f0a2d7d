"""One owner per run directory: an flock on `<run_dir>/.run.lock`, held by the training process.

Two trainings writing the same `checkpoints/` race (one deletes the directory the other is
renaming into). The holder writes `{"pid", "host", "started"}` into the file for the error that
refuses another. The kernel drops the lock with the last descriptor of the open file, so with
its process however that ends: after kill -9 nothing is stale to judge. flock is advisory and
per open file description, which a child sharing it would keep locked after we die: so ours
closes on exec (os.open's default) and in forked children. NFS may not enforce it across hosts.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".run.lock"


class RunDirLocked(ValueError):
    """The run directory belongs to a running process (the message names its pid and host)."""


_held: list[int] = []  # this process's lock descriptors, open until it exits


def _in_forked_child() -> None:  # close the child's copies of our locks' descriptors
    for fd in _held:
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_in_forked_child)


def acquire_run_lock(run_dir: str | Path) -> dict:
    """Take `run_dir`'s lock for this process until it exits and return the owner record it
    wrote; raise RunDirLocked naming the owner if another process (or an earlier
    acquire_run_lock in this one) holds it. The file is never unlinked: a newcomer could then
    lock a new file of that name while a process that had opened this one locks it."""
    path = Path(run_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            owner = json.loads(os.pread(fd, 4096, 0))
        except ValueError:  # not written yet (the owner locked it an instant ago)
            owner = {}
        os.close(fd)
        raise RunDirLocked(
            f"the run directory {path.parent} is in use by pid {owner.get('pid', '?')} on host "
            f"{owner.get('host', '?')} (since {owner.get('started', '?')}); wait for it to "
            f"end, or choose another hydra.run.dir"
        ) from None
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%FT%T%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    _held.append(fd)
    return owner
