"""A checkpoint that cannot be written (read-only directory, full disk) is one clear error, and
the previous checkpoint survives it, complete and loadable."""

from __future__ import annotations

import errno
import io
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

import checkpoints.store as checkpoint
from checkpoints.store import CheckpointError, check_writable, load_checkpoint, save_checkpoint
from model import GPT
from tests.conftest import HANG_SECONDS, ROOT, TINY, make_trainer, run_script, tiny_config

ENOSPC = os.strerror(errno.ENOSPC)  # "No space left on device"


def save(path: Path, step: int) -> GPT:
    torch.manual_seed(step)
    model = GPT(tiny_config())
    state = {"step": step, "blob": torch.ones(50_000)}
    save_checkpoint(path, model, {"x": 1}, {"step": step}, state)
    return model


def unwritable(tmp_path: Path) -> Path:
    """A directory path nothing can be written under. chmod 555 does that, except for root
    (CI containers): there, a path through a regular file, where mkdir fails for everyone."""
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    try:
        (readonly / "probe").touch()
    except PermissionError:
        return readonly / "run"
    (readonly / "probe").unlink()  # root ignores permission bits
    readonly.chmod(0o755)
    (tmp_path / "a-file").write_text("not a directory")
    return tmp_path / "a-file" / "run"


def assert_intact(path: Path, step: int, model: GPT) -> None:
    ckpt = load_checkpoint(path, with_trainer_state=True)
    assert ckpt.meta["step"] == step and ckpt.trainer_state["step"] == step
    for (name, a), (_, b) in zip(
        model.state_dict().items(), ckpt.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def fill_disk_in(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Make the next checkpoint write run out of space part-way through `where`, failing the
    way each writer really reports it (measured on a full tmpfs)."""
    if where == "model.safetensors":

        def save_file(tensors, filename, metadata=None):
            blob = safetensors.torch.save(tensors, metadata)
            Path(filename).write_bytes(blob[: len(blob) // 2])
            raise SafetensorError(f"Error while serializing: I/O error: {ENOSPC} (os error 28)")

        monkeypatch.setattr(checkpoint, "save_file", save_file)
    elif where == "trainer.pt":
        real_save = torch.save

        def torch_save(obj, f):
            buffer = io.BytesIO()
            real_save(obj, buffer)
            f.write(buffer.getvalue()[:100])
            try:  # torch.save turns the OSError of its file object into a RuntimeError
                raise OSError(errno.ENOSPC, ENOSPC)
            except OSError:  # implicitly chained (__context__), as torch does
                raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")  # noqa: B904

        monkeypatch.setattr(checkpoint.torch, "save", torch_save)
    else:  # delayed allocation: the space runs out when the data reaches the disk

        def fsync(fd):
            raise OSError(errno.ENOSPC, ENOSPC)

        monkeypatch.setattr(checkpoint.os, "fsync", fsync)


@pytest.mark.parametrize("where", ["model.safetensors", "trainer.pt", "fsync"])
def test_a_full_disk_mid_write_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, where
):
    path = tmp_path / "last"
    model = save(path, step=1)
    with monkeypatch.context() as patch:
        fill_disk_in(patch, where)
        with pytest.raises(CheckpointError) as failure:
            save(path, step=2)
    assert str(failure.value) == (
        f"cannot write checkpoint to {path}: {ENOSPC}; "
        f"the previous checkpoint at {path} (step 1) is intact"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["last"]  # no staging directory left
    assert_intact(path, 1, model)
    model = save(path, step=3)  # space freed: the next save works
    assert_intact(path, 3, model)
    assert [p.name for p in tmp_path.iterdir()] == ["last"]


@pytest.mark.parametrize("fail_in", ["model.safetensors", "trainer.pt"])
def test_a_real_failed_write_in_either_writer_becomes_a_checkpoint_error(tmp_path, fail_in):
    """Real write errors from the OS (a file size limit: EFBIG, as ENOSPC would come), through
    the real safetensors and torch.save code."""
    path = tmp_path / "last"
    model = save(path, step=1)
    sizes = {f.name: f.stat().st_size for f in path.iterdir()}
    assert sizes["model.safetensors"] < sizes["trainer.pt"]
    limit = sizes[fail_in] - 10 if fail_in == "model.safetensors" else sizes["trainer.pt"] - 10
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else SIGXFSZ kills us
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        with pytest.raises(CheckpointError) as failure:
            save(path, step=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert str(failure.value) == (
        f"cannot write checkpoint to {path}: {os.strerror(errno.EFBIG)}; "
        f"the previous checkpoint at {path} (step 1) is intact"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["last"]
    assert_intact(path, 1, model)


def test_an_unwritable_directory_is_a_checkpoint_error(tmp_path, corpus):
    directory = unwritable(tmp_path)
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint to {directory / 'last'}: "):
        save(directory / "last", step=1)
    with pytest.raises(CheckpointError, match="there is no previous checkpoint there"):
        save(directory / "last", step=1)
    with pytest.raises(CheckpointError, match=f"cannot write checkpoints to {directory}"):
        check_writable(directory)
    # Training fails up front, before preparing data or training a step it could not save.
    with pytest.raises(CheckpointError, match=f"cannot write checkpoints to {directory}"):
        make_trainer(directory, corpus)


def test_train_py_in_an_unwritable_run_dir_is_one_error_line(tmp_path, corpus):
    run_dir = unwritable(tmp_path)
    result = run_script("train.py", *TINY, *corpus, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: cannot write to the run directory {run_dir}: ")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


FULL_DISK = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
import checkpoints.store as checkpoint
from safetensors import SafetensorError

real, saves = checkpoint.save_file, []

def save_file(tensors, filename, metadata=None):
    saves.append(filename)
    if len([f for f in saves if ".last.tmp-" in f]) == 2 and ".last.tmp-" in filename:
        open(filename, "wb").write(b"half a file")
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")
    return real(tensors, filename, metadata)

checkpoint.save_file = save_file
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_train_py_on_a_full_disk_stops_with_one_line_and_the_last_checkpoint(tmp_path, corpus):
    run_dir = tmp_path / "run"
    args = [*TINY, *corpus, "train.eval_interval=0", f"hydra.run.dir={run_dir}"]
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(ROOT), str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env={**os.environ, "WANDB_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=HANG_SECONDS,
    )
    last = run_dir / "checkpoints" / "last"
    assert result.returncode == 1, result.stderr
    assert result.stderr == (
        f"error: cannot write checkpoint to {last}: {ENOSPC}; "
        f"the previous checkpoint at {last} (step 6) is intact\n"
    )
    ckpt = load_checkpoint(last, with_trainer_state=True)
    assert ckpt.trainer_state["train_state"]["step"] == 6
    assert sorted(p.name for p in last.parent.iterdir()) == ["last"]  # no staging
