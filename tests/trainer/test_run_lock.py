"""The run-directory lock: one owner per run dir, nothing left held by a process that died."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest

from tests.trainer.lock_holder import start_holder
from trainer.preflight import LOCK_FILE, RunDirLocked, acquire_run_lock


def owner_of(run_dir: Path) -> dict:
    return json.loads((run_dir / LOCK_FILE).read_text())


def test_a_second_process_is_refused_naming_the_holder_whose_record_stays(tmp_path):
    holder = start_holder(tmp_path)
    try:
        record = (tmp_path / LOCK_FILE).read_text()
        assert json.loads(record)["pid"] == holder.pid
        host = re.escape(socket.gethostname())
        with pytest.raises(RunDirLocked, match=f"in use by pid {holder.pid} on host {host} "):
            acquire_run_lock(tmp_path)
        assert (tmp_path / LOCK_FILE).read_text() == record
    finally:
        holder.communicate("")  # closes its stdin: it exits
    assert holder.returncode == 0
    owner = acquire_run_lock(tmp_path)  # control: a directory nobody holds is taken
    assert owner_of(tmp_path) == owner and owner["pid"] == os.getpid()


def test_the_lock_of_a_process_killed_with_sigkill_is_free_at_once(tmp_path):
    holder = start_holder(tmp_path)
    try:
        with pytest.raises(RunDirLocked):  # control: held while the holder lives
            acquire_run_lock(tmp_path)
        holder.kill()
        os.waitid(os.P_PID, holder.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        assert owner_of(tmp_path)["pid"] == holder.pid  # its record is left, and does not count
        acquire_run_lock(tmp_path)
        assert owner_of(tmp_path)["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.communicate()


def test_children_that_outlive_the_holder_do_not_keep_its_lock(tmp_path):
    """A forked child and an exec'd one (torch's workers, a shell) share the holder's open
    files unless run_lock keeps its own from them: either would keep the lock of a dead holder."""
    holder = start_holder(tmp_path, "children")
    try:
        with pytest.raises(RunDirLocked):  # control: held while the holder lives
            acquire_run_lock(tmp_path)
        holder.kill()
        holder.wait()
        acquire_run_lock(tmp_path)
    finally:
        holder.stdin.close()  # the children's cue to end
        said = holder.stdout.read()  # until they have ended: they hold the pipe's other end
    assert said == "child done\n" * 2  # both lived until after the lock was taken


def test_a_lock_is_held_in_its_own_process_too(tmp_path):
    acquire_run_lock(tmp_path)
    with pytest.raises(RunDirLocked, match=f"in use by pid {os.getpid()} on host "):
        acquire_run_lock(tmp_path)


def test_a_lock_file_nobody_holds_is_taken_whatever_it_says(tmp_path):
    (tmp_path / LOCK_FILE).write_text('{"pid": 1, "host": "elsewhere", "token": "old"} ' * 9)
    owner = acquire_run_lock(tmp_path)
    assert owner_of(tmp_path) == owner  # rewritten whole, nothing of the old left
