"""base/files.py: a file or directory is replaced whole or not at all, and sha256_file streams.
(kill -9 at each instant of these writes: tests/faults/test_kill9.py for a directory,
tests/data/test_prepare.py for files.)"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

import base.files
from base.files import recover_swap, sha256_file, write_atomic, write_dir_atomic


def test_sha256_file_streams_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blob = os.urandom(2500)
    (tmp_path / "f").write_bytes(blob)
    monkeypatch.setattr(base.files, "HASH_CHUNK", 1000)  # 2.5 chunks: the loop and its tail
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("read the whole file"))
    assert sha256_file(tmp_path / "f") == hashlib.sha256(blob).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_write_atomic_takes_bytes_text_or_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_atomic(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    write_atomic(path, "caf\u00e9")
    assert path.read_text(encoding="utf-8") == "caf\u00e9"
    write_atomic(path, lambda tmp: tmp.write_text("written"))
    assert path.read_text() == "written"
    assert os.listdir(tmp_path) == ["f"]


def test_a_failed_file_write_keeps_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("ha")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, half_then_fail)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f"]


def fill(text: str):
    return lambda tmp: (tmp / "a").write_text(text)


def test_write_dir_atomic_replaces_the_directory_whole(tmp_path: Path) -> None:
    path = tmp_path / "d"
    write_dir_atomic(path, fill("one"))
    (path / "stray").write_text("not in the new one")
    write_dir_atomic(path, fill("two"))
    assert os.listdir(path) == ["a"] and (path / "a").read_text() == "two"
    assert os.listdir(tmp_path) == ["d"]


def test_a_failed_directory_write_keeps_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "d"
    write_dir_atomic(path, fill("old"))

    def half_then_fail(tmp: Path) -> None:
        fill("new")(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_dir_atomic(path, half_then_fail)
    assert (path / "a").read_text() == "old" and os.listdir(tmp_path) == ["d"]


def test_a_failed_rename_in_puts_the_old_directory_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "d"
    write_dir_atomic(path, fill("old"))
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(Path(dst).name)
        if len(calls) == 2:  # the old one is aside, the new one fails to go in
            raise OSError("rename failed")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"):
        write_dir_atomic(path, fill("new"))
    assert calls[:2] == [".d.old", "d"]
    assert (path / "a").read_text() == "old" and os.listdir(tmp_path) == ["d"]


def test_two_readers_recovering_one_swap_at_once_both_find_it(tmp_path, monkeypatch) -> None:
    """Every rank of a restarted torchrun job checks `last` at once: the one that finds the
    aside already put back (between its check and its rename) goes on, and finds it there."""
    path = tmp_path / "d"
    write_dir_atomic(path, fill("old"))
    os.replace(path, tmp_path / ".d.old")  # killed between the two renames
    real = os.replace

    def the_other_reader_first(src, dst):  # the other rank's rename, then this one's
        real(src, dst)
        real(src, dst)

    monkeypatch.setattr(os, "replace", the_other_reader_first)
    recover_swap(path)
    assert (path / "a").read_text() == "old" and os.listdir(tmp_path) == ["d"]


def test_a_swap_cut_short_is_recovered_and_crash_debris_removed(tmp_path: Path) -> None:
    path = tmp_path / "d"
    write_dir_atomic(path, fill("old"))
    os.replace(path, tmp_path / ".d.old")  # killed between the two renames
    recover_swap(path)
    assert (path / "a").read_text() == "old" and os.listdir(tmp_path) == ["d"]
    os.replace(path, tmp_path / ".d.old")
    (tmp_path / ".d.tmp-99999").mkdir()  # killed mid-write, earlier
    write_dir_atomic(path, fill("new"))
    assert (path / "a").read_text() == "new" and os.listdir(tmp_path) == ["d"]
