"""`python train.py` and the run-directory lock (trainer/preflight.py), as a user meets it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from checkpoints.store import load_checkpoint
from tests.conftest import ROOT, TINY, run_script
from tests.trainer.lock_holder import start_holder
from trainer.preflight import LOCK_FILE, acquire_run_lock


def test_a_second_train_on_a_held_run_dir_is_refused_touching_nothing(tmp_path, corpus):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    try:
        result = run_script(
            "train.py",
            *TINY,
            *corpus,
            f"hydra.run.dir={run_dir}",
            "train.resume=auto",
            cwd=tmp_path,
        )
    finally:
        holder.communicate("")
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"error: the run directory {run_dir} is in use by pid {holder.pid} on host "
    )
    assert result.stderr.strip().count("\n") == 0  # one line, no traceback
    for ours in ("checkpoints", "wandb"):  # .hydra/ is Hydra's, written before train.py runs
        assert not (run_dir / ours).exists()


def test_the_resume_command_works_verbatim_after_kill_9(tmp_path, corpus):
    run_dir = tmp_path / "run"
    args = [*TINY, *corpus, "train.ckpt_interval=2", "train.eval_interval=0",
            f"hydra.run.dir={run_dir}", "train.resume=auto"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args, "train.max_steps=100000"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    started = []
    for line in proc.stdout:  # after step 5, step 4's checkpoint is complete
        started.append(line)
        if line.startswith("step 5 "):
            break
    # nothing to resume yet, and said so: a new run, not a resumed one
    assert f"train.resume=auto: no checkpoint in {run_dir} yet, so from step 0\n" in started
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == proc.pid  # left behind
    step = load_checkpoint(run_dir / "checkpoints" / "last").meta["step"]
    assert step >= 4

    result = run_script("train.py", *args, f"train.max_steps={step + 2}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'last'} at step {step}" in result.stdout
    acquire_run_lock(run_dir)  # and free once it has ended
