"""One owner per run directory: `<run_dir>/.run.lock`, held by the training process.

Two trainings writing the same `checkpoints/` race (one deletes the directory the other is
renaming into). `acquire_run_lock` writes its owner record aside and hard-links it to the lock
file's name: link(2) fails if the name exists, atomically on local filesystems and on NFS, so
the lock holds across the hosts of a shared filesystem (flock alone may not), and nobody ever
reads a half-written record. The file records its owner:

    {"pid": ..., "host": ..., "boot_id": ..., "process_start": ..., "started": ..., "token": ...}

and its modification time is the owner's heartbeat, refreshed every HEARTBEAT_S seconds by a
background thread. A lock left by a process that died (kill -9, a node crash) is stale, and taken
over, by this rule:

- same host and boot (same hostname and kernel boot id): stale at once when the owner's pid is
  not running, or is a zombie, or is a newer process that reused the pid (its start time differs);
- same host, another boot (the machine rebooted): stale at once;
- another host: stale when the heartbeat is older than STALE_AFTER_S seconds (the hosts' clocks
  must agree to well within that; NTP does).

Taking over a stale lock is serialised by an flock on `.run.lock.guard`, so of two processes that
find the same stale lock, one takes it and the other is refused.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

LOCK_FILE = ".run.lock"
GUARD_FILE = ".run.lock.guard"
HEARTBEAT_S = 15.0  # how often the owner refreshes the lock file's modification time
STALE_AFTER_S = 120.0  # another host's lock with an older heartbeat is stale


class RunDirLocked(ValueError):
    """The run directory belongs to a running process (the message names its pid and host)."""


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), or None. Also None for a
    zombie: it has exited, only its exit status is left to collect."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (command) ": field 3 on
    return None if fields[0] == "Z" else fields[19]


def _running(pid: int, process_start: str | None) -> bool:
    """Whether `pid` on this host is still the process that took the lock."""
    if Path("/proc/self/stat").exists():  # Linux: the pid and its start time identify it
        return _process_start(pid) is not None and _process_start(pid) == process_start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # running, as another user
        return True
    return True


def _owner_record() -> dict[str, Any]:
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "process_start": _process_start(pid),
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
        "token": uuid.uuid4().hex,
    }


def stale_reason(owner: dict[str, Any], heartbeat: float, now: float | None = None) -> str | None:
    """Why the lock recorded in `owner` (last heartbeat at `heartbeat`, a time.time()) is stale,
    or None while its owner may still be running: the rule in this module's docstring."""
    if "pid" not in owner or "host" not in owner:
        return "it names no owner"
    if owner["host"] == socket.gethostname():
        if owner.get("boot_id") != _boot_id():
            return "its host has rebooted since"
        if not _running(int(owner["pid"]), owner.get("process_start")):
            return "that process is not running"
        return None
    age = (time.time() if now is None else now) - heartbeat
    if age > STALE_AFTER_S:
        return f"its heartbeat is {age:.0f} s old (stale after {STALE_AFTER_S:.0f} s)"
    return None


def _read(path: Path) -> tuple[dict[str, Any], float] | None:
    """(owner record, heartbeat) of the lock file, or None if there is none. A file that is
    not a record (not written by acquire_run_lock) is an empty record: stale."""
    try:
        heartbeat = path.stat().st_mtime
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        owner = None
    return (owner if isinstance(owner, dict) else {}), heartbeat


@dataclass
class RunLock:
    """A held run-directory lock; `release` (also run at exit) removes it."""

    path: Path
    owner: dict[str, Any]

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._heart = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._heart.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file, if it is still ours."""
        self._stop.set()
        found = _read(self.path)
        if found is not None and found[0].get("token") == self.owner["token"]:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


@contextlib.contextmanager
def _guard(run_dir: Path) -> Iterator[None]:
    """Serialise stale-lock takeovers (flock: released by the kernel if the holder dies)."""
    fd = os.open(run_dir / GUARD_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _create(path: Path, owner: dict[str, Any]) -> bool:
    """Create the lock file holding `owner`, atomically and complete from its first instant
    (written aside, then hard-linked into place); False if it already exists."""
    tmp = path.with_name(f"{path.name}.{owner['token']}")
    tmp.write_text(json.dumps(owner))
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError:  # NFS may report a link that succeeded as failed: the link count says
        if tmp.stat().st_nlink != 2:
            raise
    finally:
        tmp.unlink()
    return True


def _refusal(run_dir: Path, owner: dict[str, Any]) -> RunDirLocked:
    return RunDirLocked(
        f"the run directory {run_dir} is in use by pid {owner.get('pid')} on host "
        f"{owner.get('host')} (since {owner.get('started')}); wait for it to end, or choose "
        f"another hydra.run.dir (a lock left by a process that died is taken over: at once on "
        f"its host, after {STALE_AFTER_S:.0f} s without heartbeat from another)"
    )


def acquire_run_lock(run_dir: str | Path) -> RunLock:
    """Take `run_dir`'s lock for this process until it exits, taking over a stale one (and
    saying so); raise RunDirLocked naming the owner if a running process holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    owner = _owner_record()
    if not _create(path, owner):
        with _guard(run_dir):  # re-read under the guard: another process may have taken over
            found = _read(path)
            if found is not None:
                previous, heartbeat = found
                reason = stale_reason(previous, heartbeat)
                if reason is None:
                    raise _refusal(run_dir, previous)
                path.unlink()
                print(
                    f"run dir: took over the lock of pid {previous.get('pid')} on host "
                    f"{previous.get('host')} ({reason})"
                )
            if not _create(path, owner):  # a newcomer created it since we unlinked it
                raise _refusal(run_dir, (_read(path) or ({}, 0.0))[0])
    lock = RunLock(path, owner)
    atexit.register(lock.release)
    return lock
