"""`python train.py` as a user runs it: from another directory, in a subprocess."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from checkpoints.store import load_checkpoint
from tests.conftest import HANG_SECONDS, PLAYS, ROOT, TINY, run_script


def test_a_short_run_prints_where_the_checkpoint_went_and_nothing_noisy(
    tmp_path, corpus, monkeypatch
):
    # a machine's first plot: matplotlib builds its font cache, and says so in the log
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "matplotlib"))
    run_dir = tmp_path / "run"
    result = run_script("train.py", *TINY, *corpus, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["step"] == 12 and summary["checkpoint"] == str(run_dir / "checkpoints" / "last")
    assert f"checkpoint: {run_dir / 'checkpoints' / 'last'}" in result.stdout
    assert load_checkpoint(run_dir / "checkpoints" / "best").meta["step"] in (6, 12)
    assert "warn" not in (result.stdout + result.stderr).lower()
    assert "font" not in (result.stdout + result.stderr).lower()
    assert "Traceback" not in result.stderr
    # no train.log (the run's record is metrics.jsonl and loss.png); the lock file stays, and
    # with the process gone nobody holds it (tests/trainer/test_run_lock.py)
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == [".hydra", ".run.lock", "checkpoints", "loss.png", "metrics.jsonl"]
    saved = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"))
    assert saved == load_checkpoint(run_dir / "checkpoints" / "last").run_config
    assert list(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")) == [*TINY, *corpus]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.batch_size=abc", "error: train.batch_size must be a positive integer"),
        ("optim.lr=-1", "error: optim.lr must be"),
        ("train.resume=/no/such/run", "error: no checkpoint found at /no/such/run"),
        ("data=nonesuch", "error: data=nonesuch is not in configs/data/; choose one of: "),
        ("train.bogus=1", "error: unknown config key train.bogus; known keys: "),
        ("model.mlp=bogus", "error: model.mlp must be one of ['gelu', 'relu2', 'swiglu'], got"),
    ],
)
def test_bad_input_is_one_clear_error_without_traceback(tmp_path, corpus, override, expected):
    result = run_script("train.py", *TINY, *corpus, override, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith(expected), result.stderr
    assert not (tmp_path / "outputs").exists()  # a failed attempt leaves no run dir


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "/input.txt' does not exist"),  # named absolute: where it was looked for
        (b"", "/input.txt' is empty"),
        (bytes(range(256)), "is not UTF-8 text (byte 128 is not valid UTF-8)"),
    ],
)
def test_a_run_that_fails_on_its_data_leaves_no_run_dir(tmp_path, content, expected):
    """A missing, empty or binary training file fails once Hydra has made the run dir (the data
    is prepared in the run): the dirs made for it are removed."""
    if content is not None:
        (tmp_path / "input.txt").write_bytes(content)
    data = ["data=text", "data.train_files=[input.txt]", f"data.cache_dir={tmp_path / 'cache'}"]
    result = run_script("train.py", *TINY, *data, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: data.train_files") and expected in result.stderr
    assert not (tmp_path / "outputs").exists()


def _files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def _interrupt(args: list[str], cwd: Path) -> tuple[int, str]:
    """Run `python train.py <args>` and send SIGTERM once it prints `step 3`; return its exit
    status and stderr. Its stdout is a pipe of known capacity that is not read after `step 3`
    until the signal is sent: every step prints a line, so the run cannot get more than
    capacity / 55 steps past step 3 before the signal is in (it blocks on the full pipe: a
    progress line, `step 4 | loss 5.55 lr 0.003 grad_norm 2.36 tok/s 130 | eta 0:01`, has more
    than 55 bytes)."""
    read_end, write_end = os.pipe()
    if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux: a one-page pipe keeps the run short
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    with open(cwd / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args],
            cwd=cwd,
            stdout=write_end,
            stderr=err,
            env={**os.environ, "WANDB_MODE": "disabled"},
        )
    os.close(write_end)
    with os.fdopen(read_end) as out:
        for line in out:
            if line.startswith("step 3 "):
                break
        proc.send_signal(signal.SIGTERM)
        out.read()  # let it finish the step, save and exit
    return proc.wait(timeout=300), (cwd / "stderr.txt").read_text()


def _pipe_capacity() -> int:
    return 4096 if hasattr(fcntl, "F_SETPIPE_SZ") else 65536


def test_an_interrupted_run_resumes_verbatim_from_the_printed_command(
    tmp_path, corpus, monkeypatch
):
    """The issue's run: overrides (a byte tokenizer, a tiny model) that the printed resume
    command does not repeat. Run verbatim, it continues the same run and ends exactly where an
    uninterrupted run does; a resume that would change the model is refused, touching nothing.
    Every run uses one thread: the comparison is bit for bit, and how a matmul or reduction is
    split across threads may change its last bits, which is not what this test is about."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    steps = 3 + _pipe_capacity() // 55 + 2  # more than the run can take before the signal is in
    args = [*TINY, *corpus, "data.tokenizer=bytes", f"train.max_steps={steps}"]
    args += ["train.eval_interval=0", "train.ckpt_interval=0"]
    straight = run_script(
        "train.py", *args, f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path, timeout=600
    )
    assert straight.returncode == 0, straight.stderr

    run_dir = tmp_path / "b"
    code, err = _interrupt([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    assert code == 128 + signal.SIGTERM and "Traceback" not in err, err
    stopped = load_checkpoint(run_dir / "checkpoints" / "last").meta["step"]
    assert 3 <= stopped < steps
    command = shlex.split(re.search(r"Resume with: (.+)$", err, re.MULTILINE).group(1))
    assert command[0] == "python" and command[2:] == [
        f"hydra.run.dir={run_dir}",
        "train.resume=auto",
    ]

    before = _files(run_dir)
    refused = run_script(*command[1:], "model.n_layer=3", cwd=ROOT)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: cannot resume with model.n_layer=3: ")
    assert _files(run_dir) == before  # .hydra/, checkpoints: nothing of the run was touched

    resumed = subprocess.run(
        [sys.executable, *command[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'last'} at step {stopped}" in resumed.stdout
    summaries = [json.loads(r.stdout.strip().splitlines()[-1]) for r in (straight, resumed)]
    assert summaries[0]["step"] == summaries[1]["step"] == steps
    assert summaries[0]["val_loss"] == summaries[1]["val_loss"]
    weights = [
        load_checkpoint(d / "checkpoints" / "last").model.state_dict()
        for d in (tmp_path / "a", run_dir)
    ]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    overrides = OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
    assert list(overrides) == [*args, "train.resume=auto"]  # in order, they compose config.yaml


def test_a_sweep_runs_each_value_in_its_own_directory(tmp_path, corpus):
    sweep_dir = tmp_path / "sweep"
    sweep = [
        "-m",
        *TINY,
        *corpus,
        "train.max_steps=2",
        "train.eval_interval=0",
        "optim.lr=1e-3,3e-3",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    result = run_script("train.py", *sweep, cwd=tmp_path)
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
    # the same sweep again would train over both runs: refused before the first job starts
    before = {p: p.read_bytes() for p in sweep_dir.rglob("*") if p.is_file()}
    again = run_script("train.py", *sweep, cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert again.stderr.startswith("error: sweep job 0 (") and "hydra.sweep.dir" in again.stderr
    assert f"the run directory {sweep_dir / '0'} already holds a run's checkpoints" in again.stderr
    assert {p: p.read_bytes() for p in sweep_dir.rglob("*") if p.is_file()} == before


def test_a_sweep_with_a_bad_job_fails_before_the_first_trains(tmp_path, corpus):
    """Every job is validated first: the second job's bad value is one line naming the job,
    and nothing is trained or written (no sweep dir, no first run)."""
    sweep = ["-m", *TINY, *corpus, "train.max_steps=2", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    result = run_script("train.py", *sweep, "optim.lr=1e-3,-1", cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: sweep job 1 (") and "optim.lr=-1" in result.stderr
    assert "optim.lr must be" in result.stderr and result.stdout == ""
    assert not (tmp_path / "sweep").exists()


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
    # no evaluation, so no best checkpoint: none is named
    assert summary["best_checkpoint"] is None and "(best:" not in result.stdout
    assert not (run_dir / "checkpoints" / "best").exists()
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


# Runs an entry point in this interpreter, then prints its exit code and which heavy modules
# it imported.
IMPORTS_PROBE = """
import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python <script>` does
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    heavy = ("torch", "datasets", "torch.distributed.fsdp", "wandb", "matplotlib")
    print(e.code, *[m for m in heavy if m in sys.modules])
"""


@pytest.mark.parametrize(
    "script, override, imported",
    [
        ("train.py", "model=nanoo", ""),  # Hydra's own check: nothing heavy at all
        ("train.py", "trian.max_steps=1", ""),
        ("sample.py", "tempp=1", ""),
        ("evaluate.py", "strid=4", ""),
        ("train.py", "train.batch_size=abc", " torch"),  # the run config checks the model too
    ],
)
def test_a_config_mistake_is_reported_before_the_heavy_imports(
    tmp_path, script, override, imported
):
    """Fail first, start fast: a mistake is one line before torch, datasets, FSDP, wandb or
    matplotlib load (benchmarks/bench_startup.py times it)."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_PROBE, str(ROOT / script), override],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG_SECONDS,
    )
    assert done.stdout.strip() == f"2{imported}", done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1


def test_the_step_profile_splits_a_step_by_its_work(tmp_path, corpus):
    """docs/speedrun.md's `python benchmarks/bench_step_profile.py` on the tiny run: the shares
    add up, the Linear layers' `mm` is counted as matmuls, and the optimizer has its own row."""
    args = [*TINY, *corpus, "--steps", "2", "--warmup", "1", "--top", "40"]
    result = run_script("benchmarks/bench_step_profile.py", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\| ([^|`]+?) \| ([\d.]+) \| (\d+)% \|$", result.stdout, re.M)
    shares = {work: int(share) for work, _, share in rows}
    assert 97 <= sum(shares.values()) <= 103, rows  # rounded to whole percents
    assert shares["matmuls (Linear layers, head)"] > 0 and shares["optimizer (AdamW.step)"] > 0
    assert "data (next_batch)" in shares
    assert "| `aten::mm` | matmuls (Linear layers, head) |" in result.stdout


@pytest.mark.parametrize("how", ["a new run", "a resume of another run"])
def test_a_run_dir_holding_a_run_is_refused_touching_nothing(tmp_path, corpus, trained_run, how):
    """`python train.py hydra.run.dir=<a finished run>` without train.resume=auto once trained
    from scratch over its checkpoints and config: one line, exit 2, every file as it was."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    # trained_run's budget, 12 steps, is spent: a resume of it trains 2 more
    resume = [] if how == "a new run" else [f"train.resume={trained_run}", "train.max_steps=14"]
    result = run_script(
        "train.py", *TINY, *corpus, f"hydra.run.dir={run_dir}", *resume, cwd=tmp_path
    )
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith(
        f"error: the run directory {run_dir} already holds a run's checkpoints (best, last)"
    )
    assert "continue it with train.resume=auto" in result.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
