"""The run-directory lock: one owner per run dir, stale locks recognised and taken over."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from tests.trainer.lock_holder import start_holder
from trainer.run_lock import (
    LOCK_FILE,
    STALE_AFTER_S,
    RunDirLocked,
    acquire_run_lock,
    stale_reason,
)


def owner_of(run_dir: Path) -> dict:
    return json.loads((run_dir / LOCK_FILE).read_text())


def test_a_second_process_is_refused_naming_the_owner_and_the_lock_goes_at_exit(tmp_path):
    holder = start_holder(tmp_path)
    try:
        assert owner_of(tmp_path)["pid"] == holder.pid
        with pytest.raises(RunDirLocked, match=f"in use by pid {holder.pid} on host"):
            acquire_run_lock(tmp_path)
    finally:
        holder.communicate("")  # closes its stdin: it exits, releasing the lock
    assert holder.returncode == 0
    assert not (tmp_path / LOCK_FILE).exists()
    lock = acquire_run_lock(tmp_path)  # negative control: a free directory is taken
    assert owner_of(tmp_path)["token"] == lock.owner["token"]
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_left_by_kill_9_is_stale_and_taken_over(tmp_path, capsys):
    holder = start_holder(tmp_path)
    holder.kill()
    holder.wait()
    left = owner_of(tmp_path)
    assert left["pid"] == holder.pid  # nothing cleaned up after the kill
    lock = acquire_run_lock(tmp_path)
    assert f"took over the lock of pid {holder.pid}" in capsys.readouterr().out
    assert owner_of(tmp_path)["pid"] == os.getpid()
    lock.release()


def test_a_zombie_owner_is_not_running(tmp_path):
    """Killed and not yet reaped by its parent: the pid exists, the process does not."""
    holder = start_holder(tmp_path)
    holder.kill()
    os.waitid(os.P_PID, holder.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    try:
        assert stale_reason(owner_of(tmp_path), time.time()) == "that process is not running"
    finally:
        holder.wait()


def test_a_reused_pid_does_not_keep_a_lock_alive(tmp_path):
    record = {**_this_process(), "process_start": "1"}  # same pid, another process's start
    assert stale_reason(record, time.time()) == "that process is not running"
    assert stale_reason(_this_process(), time.time()) is None  # control: this process runs


def test_a_lock_from_another_boot_is_stale():
    record = {**_this_process(), "boot_id": "another-boot"}
    assert stale_reason(record, time.time()) == "its host has rebooted since"


def test_another_hosts_lock_is_stale_only_when_its_heartbeat_stops():
    record = {**_this_process(), "host": "node-that-is-not-this-one"}
    now = 1_000_000.0
    assert stale_reason(record, now - STALE_AFTER_S / 2, now) is None
    assert "heartbeat is" in stale_reason(record, now - STALE_AFTER_S - 1, now)


def test_a_lock_file_naming_no_owner_is_taken_over(tmp_path, capsys):
    (tmp_path / LOCK_FILE).write_text("not a record")
    acquire_run_lock(tmp_path).release()
    assert "it names no owner" in capsys.readouterr().out


def test_release_leaves_a_lock_that_another_process_took_over(tmp_path):
    lock = acquire_run_lock(tmp_path)
    (tmp_path / LOCK_FILE).write_text(json.dumps({**lock.owner, "token": "someone else"}))
    lock.release()
    assert owner_of(tmp_path)["token"] == "someone else"


def _this_process() -> dict:
    from trainer.run_lock import _owner_record

    record = _owner_record()
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    return record
