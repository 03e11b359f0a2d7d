"""Multi-process training with torchrun on CPU (gloo, 2 ranks). DDP: the same arithmetic as one
process with the same global batch, rank 0 alone speaks, resume is exact, a dead rank ends the
job promptly and leaves the last checkpoint intact. FSDP: resumes from and saves ordinary
checkpoints that a single process loads, and trains like DDP."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints.store import load_checkpoint
from evals.tasks import load_task, score_task, task_config
from tests.conftest import (
    CPU,
    GPT2,
    HANG_SECONDS,
    HELLASWAG,
    ROOT,
    TINY,
    make_trainer,
    model_for,
    write_jsonl,
)
from tests.parallel.worker import PROBE
from trainer.reporting import METRICS_FILE, read_metrics

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("worker.py")
TASK_WORKER = Path(__file__).with_name("task_worker.py")
# 2 ranks x 2 windows: the global batch of the single-process reference's 4 windows.
RUN = [
    *TINY,
    "train.batch_size=2",
    "train.max_steps=4",
    "train.eval_interval=2",
    "train.ckpt_interval=2",
    "device=cpu",
    "parallel.timeout_s=30",
    "optim.eps=1e-6",  # see test_ddp_equals_one_process_with_the_same_global_batch
]


def torchrun(
    script: Path, *args: str, cwd: Path, timeout: float = HANG_SECONDS, restarts: int = 0, **env
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 --max-restarts=<restarts> script args`, one
    thread per rank, `env` added to the environment. On timeout the whole process group goes
    (the workers too, not only torchrun) and the test fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **env}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd.append(f"--max-restarts={restarts}")
    with subprocess.Popen(
        [*cmd, str(script), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / "last").model.state_dict()


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, corpus) -> tuple[Path, subprocess.CompletedProcess]:
    """`torchrun ... train.py`: 4 DDP steps of 2 x 2 windows."""
    tmp = tmp_path_factory.mktemp("ddp")
    result = torchrun(ROOT / "train.py", *RUN, *corpus, f"hydra.run.dir={tmp / 'run'}", cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run", result


@pytest.fixture(scope="module")
def died_run(tmp_path_factory, corpus) -> tuple[Path, subprocess.CompletedProcess]:
    """The same run, but rank 1 dies as step 3 begins (the last checkpoint is step 2's), and a
    collective waits up to an hour: a job that ends before the hang guard (HANG_SECONDS) ended
    because the rank died, not because the healthy rank waited out its collective. (Measured
    by an event, the job's end, not by the clock: a start-up slowed by load cannot fail it.)"""
    tmp = tmp_path_factory.mktemp("died")
    args = [*RUN, *corpus, "parallel.timeout_s=3600"]
    result = torchrun(WORKER, str(tmp / "run"), "--die-at-step=3", *args, cwd=tmp)
    return tmp / "run", result


def log_lines(stdout: str) -> list[str]:
    """Each step's logged loss, lr and gradient norm (4 significant digits), without timings."""
    return [line.split(" tok/s")[0] for line in stdout.splitlines() if " | loss " in line]


def test_ddp_equals_one_process_with_the_same_global_batch(ddp_run, tmp_path, corpus, capsys):
    run_dir, result = ddp_run
    single = make_trainer(tmp_path, corpus, *RUN, "train.batch_size=4")
    summary = single.run()
    # The loss is averaged over ranks and the gradients too (a sum would double the norm).
    assert log_lines(result.stdout) == log_lines(capsys.readouterr().out)
    # The two runs differ only in how the 4 windows' gradients are summed (two halves averaged
    # by the all-reduce, or one mean): float32 rounding. Adam divides each gradient by its RMS,
    # so where a gradient nearly cancels the rounding reaches the update; with optim.eps=1e-6
    # the largest difference seen after 4 steps is ~9e-7. 1e-5 is ~1/1000 of 4 steps at lr 3e-3,
    # the scale a wrong or repeated window moves the weights by.
    reference = single.model.state_dict()
    for name, tensor in weights(run_dir).items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-5)
    # Evaluation is reduced over ranks: the whole split, each token once, the same mean loss.
    ddp_summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert ddp_summary["val_tokens"] == summary["val_tokens"]
    assert ddp_summary["val_loss"] == pytest.approx(summary["val_loss"], abs=2e-4)


def test_ddp_chat_sft_equals_one_process(tmp_path, chat_corpus, trained_run, capsys):
    """Chat fine-tuning a base run on 2 ranks: the ranks' windows hold different numbers of
    assistant tokens, and the step is still the one process's mean over all of them."""
    sft = [*RUN, *chat_corpus, "experiment=chat_sft", f"train.init_from={trained_run}"]
    single = make_trainer(tmp_path / "single", chat_corpus, *sft, "train.batch_size=4")
    halves = [single.sampler.batch_at(step)[1].split(2) for step in range(4)]
    assert any(int((a != -1).sum()) != int((b != -1).sum()) for a, b in halves)  # teeth
    single.run()
    result = torchrun(ROOT / "train.py", *sft, f"hydra.run.dir={tmp_path / 'ddp'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert log_lines(result.stdout) == log_lines(capsys.readouterr().out)
    reference = single.model.state_dict()
    for name, tensor in weights(tmp_path / "ddp").items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-5)


def test_only_rank_0_prints(ddp_run):
    _, result = ddp_run
    out = result.stdout
    assert out.count("run dir:") == 1 and out.count("step 4 | loss") == 1, out
    assert sum(line.startswith("{") for line in out.splitlines()) == 1, out


def test_a_dead_rank_ends_the_job_promptly_and_keeps_the_last_checkpoint(died_run):
    run_dir, result = died_run  # it ended: the healthy rank did not wait out its collective
    assert result.returncode != 0
    assert load_checkpoint(run_dir / "checkpoints" / "last").meta["step"] == 2


def test_ddp_resume_repeats_the_uninterrupted_run_exactly(ddp_run, died_run, tmp_path, corpus):
    straight_dir, _ = ddp_run
    died_dir, _ = died_run
    run_dir = tmp_path / "run"
    shutil.copytree(died_dir, run_dir)  # the FSDP test resumes from the original
    args = [*RUN, *corpus, f"hydra.run.dir={run_dir}", "train.resume=auto"]
    result = torchrun(ROOT / "train.py", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 2" in result.stdout
    straight = weights(straight_dir)
    for name, tensor in weights(run_dir).items():
        assert torch.equal(tensor, straight[name]), name


SEPARATE_STORES = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see the test after the next


@pytest.mark.parametrize(
    "death, resumed",
    [
        ("--die-at-step=1", "no checkpoint yet, so from step 0"),  # rank 1, before step 2's
        ("--die-at-step=3", "resumed from "),  # rank 1, after step 2's checkpoint
        # rank 0, inside step 4's write of `last`, step 2's moved aside: nothing at its path
        ("--fault=checkpoint.swap:1", "resumed from "),
    ],
)
def test_torchrun_restarts_a_dead_rank_and_the_run_ends_bit_identical(
    ddp_run, tmp_path, corpus, death, resumed
):
    """With --max-restarts=1, a rank dying in the first attempt does not end the job: torchrun
    restarts both workers, train.resume=auto takes them on from the last complete checkpoint
    (or from step 0), and the job ends with the uninterrupted run's weights, bit for bit.
    (Without restarts the same death ends the job: the test above.)"""
    args = [*RUN, *corpus, "train.resume=auto", death]
    result = torchrun(
        WORKER, str(tmp_path / "run"), *args, cwd=tmp_path, restarts=1, **SEPARATE_STORES
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"torchrun restart 1: {resumed}" in result.stdout
    assert resumed.startswith("no") or "last at step 2" in result.stdout
    start = 0 if resumed.startswith("no") else 2
    rows = [r for r in read_metrics(tmp_path / "run" / METRICS_FILE) if "restart" in r]
    repeated = {"--die-at-step=1": 0, "--die-at-step=3": 0}.get(death, 1)  # swap: step 3's row
    assert [(r["step"], r["restart"], r["restart_repeated_steps"]) for r in rows] == [
        (start + 1, 1, repeated)
    ]
    assert f"torchrun restart 1: {repeated} logged steps to do again; " in result.stdout
    straight = weights(ddp_run[0])
    for name, tensor in weights(tmp_path / "run").items():
        assert torch.equal(tensor, straight[name]), name


def test_a_rank_that_keeps_dying_ends_the_job_after_its_restarts_and_torchrun_names_it(
    tmp_path, corpus
):
    """Rank 1 dies as step 3 begins in every attempt; with --max-restarts=1 the job restarts
    once (from step 2's checkpoint), then ends non-zero. torchrun's closing summary names the
    rank and its exit code (its "Root Cause" block: the workers are gone, nothing of ours is
    left to print it)."""
    args = [*RUN, *corpus, "train.resume=auto", "--die-at-step=3", "--every-attempt"]
    result = torchrun(
        WORKER, str(tmp_path / "run"), *args, cwd=tmp_path, restarts=1, **SEPARATE_STORES
    )
    assert result.returncode != 0
    assert result.stdout.count("torchrun restart 1: resumed from ") == 1, result.stdout
    assert "torchrun restart 2" not in result.stdout
    root_cause = result.stderr[result.stderr.index("Root Cause") :]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: 1 ", root_cause), root_cause


def test_a_stop_asked_of_torchrun_is_not_restarted_and_resumes_bit_identical(
    ddp_run, tmp_path, corpus
):
    """SIGTERM to torchrun (what Ctrl-C, kill and scancel send) as step 2 begins, with
    --max-restarts=1: torchrun passes it to the workers, which stop together after a step and
    save `last`; the job ends non-zero and is not restarted. The command it prints, run under
    torchrun, ends with the uninterrupted run's weights, bit for bit."""
    run = tmp_path / "run"
    args = [*RUN, *corpus, "train.resume=auto"]
    result = torchrun(
        WORKER, str(run), *args, "--stop-at-step=2", cwd=tmp_path, restarts=1, **SEPARATE_STORES
    )
    assert result.returncode != 0 and "torchrun restart" not in result.stdout + result.stderr
    stopped = load_checkpoint(run / "checkpoints" / "last").meta["step"]
    assert 2 <= stopped < 4, stopped
    assert f"stopped by SIGTERM at step {stopped}; checkpoint saved to " in result.stderr
    assert f"Resume with: torchrun <flags> {ROOT / 'train.py'} hydra.run.dir={run} " in (
        result.stderr
    )
    resumed = torchrun(WORKER, str(run), *args, cwd=tmp_path)
    assert resumed.returncode == 0 and f"at step {stopped}" in resumed.stdout, resumed.stderr
    straight = weights(ddp_run[0])
    for name, tensor in weights(run).items():
        assert torch.equal(tensor, straight[name]), name


def test_restarts_in_the_store_torchrun_shares_are_refused_before_training(tmp_path, corpus):
    """Restarted workers that rendezvous through the TCP store torchrun shares with them read
    their peers' addresses from the attempt before and fail to connect (gloo's "Connection
    refused"; pytorch issue 135712): every attempt stops at once, saying how to run it."""
    run_dir = tmp_path / "run"
    args = [*RUN, *corpus, f"hydra.run.dir={run_dir}"]
    result = torchrun(ROOT / "train.py", *args, cwd=tmp_path, restarts=1)
    assert result.returncode != 0
    needs = "error: torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    assert result.stderr.count(needs) >= 2  # each attempt: the rank that ended it (the other
    # says it too, unless torchrun stops it first)
    assert not (run_dir / "checkpoints").exists()  # stopped before training


def test_fsdp_resumes_trains_like_ddp_and_saves_a_checkpoint_one_process_loads(
    ddp_run, died_run, tmp_path, corpus
):
    straight_dir, _ = ddp_run
    died_dir, _ = died_run  # its `last` checkpoint: step 2, written by DDP
    logits_file = tmp_path / "logits.pt"
    args = [*RUN, *corpus, "parallel.strategy=fsdp", f"train.resume={died_dir}"]
    result = torchrun(WORKER, str(tmp_path / "run"), f"--logits={logits_file}", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]

    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints" / "last", with_trainer_state=True)
    assert ckpt.meta["step"] == 4
    with torch.no_grad():
        logits = ckpt.model(PROBE)[0]
    torch.testing.assert_close(logits, torch.load(logits_file), rtol=0, atol=1e-6)

    # Sharded steps 3-4 match DDP's (see the DDP test's tolerance), and the optimizer state,
    # gathered from the shards, is numbered as a single process numbers it.
    straight = load_checkpoint(straight_dir / "checkpoints" / "last", with_trainer_state=True)
    reference = straight.model.state_dict()
    for name, tensor in ckpt.model.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-5)
    ours, theirs = ckpt.trainer_state["optimizer"], straight.trainer_state["optimizer"]
    assert [g["params"] for g in ours["param_groups"]] == [
        g["params"] for g in theirs["param_groups"]
    ]
    for i, state in theirs["state"].items():
        assert torch.equal(ours["state"][i]["step"], state["step"])
        for key in ("exp_avg", "exp_avg_sq"):  # ~1e-4 of the largest entry apart, seen
            scale = state[key].abs().max().item()
            torch.testing.assert_close(ours["state"][i][key], state[key], rtol=0, atol=1e-3 * scale)


def test_only_logged_steps_run_collectives_and_each_step_reads_the_host_once(tmp_path, corpus):
    """DDP on gloo, logging every 3rd step: steps 1, 2, 4 and 5 run no Python-level collective
    (the gradient all-reduce is DDP's own) and read one tensor on the host (the step's health,
    for train.on_nan), never a tensor's truth value; logged step 3 agrees on stopping and
    averages the loss over ranks (the control: the counting sees collectives)."""
    counts_file = tmp_path / "syncs.json"
    no_eval = ["train.max_steps=6", "train.log_interval=3", "train.eval_interval=0"]
    args = [*RUN, *corpus, *no_eval, "train.ckpt_interval=0", f"--count-syncs={counts_file}"]
    result = torchrun(WORKER, str(tmp_path / "run"), *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(counts_file.read_text())
    for step in ("1", "2", "4", "5"):
        assert counts[step] == {"tolist": 1}, (step, counts)
    assert counts["3"]["all_reduce"] == 2, counts  # the stop flags and the loss mean


@pytest.mark.parametrize("strategy", ["plain", "fsdp"])
def test_two_ranks_score_a_task_as_one_process(tmp_path, strategy):
    """3 items on 2 ranks: rank 0 scores two, rank 1 one (then a filler under FSDP, whose every
    forward is a collective); the summed counts are one process's."""
    items = write_jsonl(tmp_path / "hs.jsonl", HELLASWAG)
    result = torchrun(TASK_WORKER, str(items), strategy, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    two_ranks = json.loads(result.stdout.strip().splitlines()[-1])
    task = load_task({**task_config("hellaswag"), "data_files": str(items)}, GPT2, 64)
    one = score_task(model_for(), task, CPU)
    assert two_ranks["items"] == one["items"] == 3
    assert two_ranks == pytest.approx(one, rel=1e-9)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ddp_and_fsdp_train_through_the_triton_kernel_as_through_manual(
    ddp_run, tmp_path, corpus, strategy
):
    """attention=triton is a torch custom operator, so DDP's hooks and FSDP2's gathered
    parameters see ordinary tensors. Under Triton's interpreter (tests/conftest.py, inherited by
    the ranks) its 4 steps end at the weights of the manual-attention DDP run, as FSDP's do."""
    pytest.importorskip("triton", reason="attention=triton needs the triton package (Linux only)")
    run = tmp_path / "run"
    args = [*RUN, *corpus, f"parallel.strategy={strategy}", "model.attention=triton"]
    args.append("train.final_eval=periodic")  # skips a 35 s pass; same weights
    if strategy == "fsdp":  # the guard on the kernel, 12 s interpreted, once (the ddp case)
        args.append("train.check_causality=false")
    result = torchrun(ROOT / "train.py", *args, f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_checkpoint(run / "checkpoints" / "last").model.config.attention == "triton"
    reference = weights(ddp_run[0])
    for name, tensor in weights(run).items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-5, msg=name)


LEAVE = """
import os, torch
from hardware import distributed
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
distributed.init_distributed(distributed.DistInfo.from_env(), torch.device("cpu"), 30)
distributed.barrier(slow=True)  # both groups used: the default and the slow one
distributed.all_reduce_max([1.0], torch.device("cpu"))
distributed.destroy()
with open(f"threads.{os.environ['RANK']}", "w") as f:  # the ranks' prints would interleave
    f.write(f"{before} {threads()}")
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_leaving_the_process_groups_leaves_no_gloo_thread_behind(tmp_path):
    """A gloo group still held after destroy_process_group keeps its worker threads, and their
    teardown at interpreter exit aborted a finished FSDP run once in CI ("terminate called
    without an active exception", pytorch issue 190489): after `destroy`, each rank has the
    threads it had before `init_distributed`."""
    (tmp_path / "leave.py").write_text(LEAVE)
    result = torchrun(tmp_path / "leave.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    counts = [(tmp_path / f"threads.{rank}").read_text().split() for rank in (0, 1)]
    assert all(before == after for before, after in counts), counts
