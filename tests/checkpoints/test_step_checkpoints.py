"""Step checkpoints (train.keep_checkpoints): pruned oldest-written first, atomically, and
never touching a write in progress."""

from __future__ import annotations

import os
import shutil

from checkpoints.store import MANIFEST_FILE, prune_step_checkpoints, verify_checkpoint
from tests.checkpoints.conftest import save


def written(ckpt_dir, *steps):
    """Complete step checkpoints, written in this order (manifest times one second apart)."""
    for i, step in enumerate(steps):
        save(ckpt_dir / f"step-{step}", step=step)
        os.utime(ckpt_dir / f"step-{step}" / MANIFEST_FILE, (1000 + i, 1000 + i))


def names(ckpt_dir):
    return sorted(p.name for p in ckpt_dir.iterdir())


def test_the_oldest_are_pruned_and_the_rest_still_verify(tmp_path):
    written(tmp_path, 2, 4, 6, 8)
    deleted = prune_step_checkpoints(tmp_path, keep=2, newest="step-8")
    assert [p.name for p in deleted] == ["step-2", "step-4"]
    assert names(tmp_path) == ["step-6", "step-8"]
    for name in names(tmp_path):
        verify_checkpoint(tmp_path / name)
    assert prune_step_checkpoints(tmp_path, keep=2, newest="step-8") == []  # nothing more


def test_a_resumed_run_keeps_what_it_wrote_last_not_the_highest_steps(tmp_path):
    """Resumed from step-4, the run rewrites step-6: the abandoned step-8 is the older one."""
    written(tmp_path, 4, 8, 6)
    prune_step_checkpoints(tmp_path, keep=2, newest="step-6")
    assert names(tmp_path) == ["step-6", "step-8"]
    prune_step_checkpoints(tmp_path, keep=1, newest="step-6")
    assert names(tmp_path) == ["step-6"]


def test_writes_in_progress_and_incomplete_directories_are_left_alone(tmp_path):
    written(tmp_path, 2, 4)
    shutil.copytree(tmp_path / "step-2", tmp_path / ".step-6.tmp-abc")  # a write in progress
    shutil.copytree(tmp_path / "step-2", tmp_path / ".step-4.old")  # a swap in progress
    (tmp_path / "step-9").mkdir()  # no manifest: not a checkpoint, not ours to delete
    (tmp_path / "last").mkdir()
    prune_step_checkpoints(tmp_path, keep=1, newest="step-4")
    assert names(tmp_path) == [".step-4.old", ".step-6.tmp-abc", "last", "step-4", "step-9"]


def test_a_prune_interrupted_mid_delete_leaves_nothing_that_looks_complete(tmp_path):
    written(tmp_path, 2, 4)
    os.replace(tmp_path / "step-2", tmp_path / ".step-2.pruning")  # killed after the rename
    (tmp_path / ".step-2.pruning" / "model.safetensors").unlink()  # ... and half the delete
    prune_step_checkpoints(tmp_path, keep=1, newest="step-4")
    assert names(tmp_path) == ["step-4"]
