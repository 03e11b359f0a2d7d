"""`python train.py` as a user runs it: from another directory, in a subprocess."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from core.checkpoint import load_checkpoint
from tests.trainer.conftest import PLAYS
from tests.trainer.helpers import ROOT, TINY, run_script


def test_a_short_run_prints_where_the_checkpoint_went_and_nothing_noisy(tmp_path, corpus):
    run_dir = tmp_path / "run"
    result = run_script("train.py", *TINY, *corpus, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["step"] == 12 and summary["checkpoint"] == str(run_dir / "checkpoints" / "last")
    assert f"checkpoint: {run_dir / 'checkpoints' / 'last'}" in result.stdout
    assert load_checkpoint(run_dir / "checkpoints" / "best").meta["step"] in (6, 12)
    assert "warn" not in (result.stdout + result.stderr).lower()
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.batch_size=abc", "error: train.batch_size must be a positive integer"),
        ("optim.lr=-1", "error: optim.lr must be"),
        ("train.resume=/no/such/run", "error: no checkpoint found at /no/such/run"),
        ("data=nonesuch", "nonesuch"),
        ("train.bogus=1", "bogus"),
        ("model.mlp=bogus", "error: model.mlp='bogus' is unknown; choose one of"),
    ],
)
def test_bad_input_is_one_clear_error_without_traceback(tmp_path, corpus, override, expected):
    result = run_script("train.py", *TINY, *corpus, override, cwd=tmp_path)
    assert result.returncode != 0
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    if expected.startswith("error:"):  # our own validation: exactly one line, exit code 2
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0


def test_sigterm_saves_a_checkpoint_that_resumes(tmp_path, corpus):
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        *corpus,
        "train.max_steps=100000",
        "train.ckpt_interval=0",
        "train.eval_interval=0",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**__import__("os").environ, "WANDB_MODE": "disabled"},
    )
    deadline = time.time() + 120
    for line in proc.stdout:  # wait until training is under way
        if line.startswith("step 3 ") or time.time() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "Resume with: python train.py" in err and "Traceback" not in err
    step = load_checkpoint(run_dir / "checkpoints" / "last", with_trainer_state=True).meta["step"]
    assert step >= 3

    resumed = run_script(
        "train.py", *args, "train.resume=auto", f"train.max_steps={step + 2}", cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'last'} at step {step}" in resumed.stdout
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["step"] == step + 2


def test_a_sweep_runs_each_value_in_its_own_directory(tmp_path, corpus):
    sweep_dir = tmp_path / "sweep"
    result = run_script(
        "train.py",
        "-m",
        *TINY,
        *corpus,
        "train.max_steps=2",
        "train.eval_interval=0",
        "optim.lr=1e-3,3e-3",
        f"hydra.sweep.dir={sweep_dir}",
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    lrs = sorted(
        load_checkpoint(sweep_dir / str(i) / "checkpoints" / "last").run_config["optim"]["lr"]
        for i in (0, 1)
    )
    assert lrs == [1e-3, 3e-3]
    table = result.stdout[result.stdout.index(f"sweep: {sweep_dir}") :].splitlines()[1:]
    assert table[0] == "| run | optim.lr | step | val loss | val bpb |"
    for n, lr in enumerate(["0.001", "0.003"]):  # as Hydra records the swept values
        final = json.loads((sweep_dir / str(n) / "metrics.jsonl").read_text().splitlines()[-1])
        loss, bpb = final["final_val_loss"], final["final_val_bpb"]
        assert table[2 + n] == f"| {n} | {lr} | 2 | {loss:.4f} | {bpb:.4f} |"


def test_one_text_file_trains_as_in_nanogpt(tmp_path):
    """`python train.py data=text 'data.train_files=[input.txt]'`: the last 10% of the file is
    the validation split (it once needed two documents)."""
    (tmp_path / "input.txt").write_text((PLAYS / "tragedies" / "hamlet.md").read_text()[:30_000])
    run_dir = tmp_path / "run"
    result = run_script(
        "train.py",
        *TINY,
        "data=text",
        "data.train_files=[input.txt]",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.max_steps=2",
        "train.eval_interval=0",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    sizes = re.search(r"data: text \(gpt2\), ([\d,]+) train / ([\d,]+) val", result.stdout)
    train, val = sizes.groups()
    assert 0.05 < int(val.replace(",", "")) / int(train.replace(",", "")) < 0.15
    assert json.loads(result.stdout.strip().splitlines()[-1])["step"] == 2


def test_final_eval_none_skips_it_and_the_printed_sample_command_works_from_anywhere(
    tmp_path, corpus
):
    run_dir = tmp_path / "run"
    result = run_script(
        "train.py",
        *TINY,
        *corpus,
        "train.max_steps=2",
        "train.final_eval=none",
        "hydra.run.dir=run",  # relative: the printed command must not be
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["val_loss"] is None and summary["final_eval"] == "none"
    assert "no final evaluation" in result.stdout
    assert not any("final_val_loss" in line for line in (run_dir / "metrics.jsonl").open())
    (command,) = [line for line in result.stdout.splitlines() if line.startswith("sample: ")]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    argv = shlex.split(command.removeprefix("sample: "))
    assert argv[0] == "python"
    sampled = subprocess.run(
        [sys.executable, *argv[1:], "max_new_tokens=3", "prompt=Hi"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("Hi")
