"""metrics.jsonl and loss.png: a record of every run that needs no wandb account."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import make_trainer
from trainer.reporting import METRICS_FILE, PLOT_FILE, MetricsLog, draw, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Step 2's row as log_steps logs it (100 tokens per step): training values and its evaluation.
STEP_2_ROW = {
    "step": 2,
    "tokens": 200,
    "train_loss": 8.0,
    "train_lr": 1e-3,
    "val_loss": 9.0,
    "val_bpb": 3.0,
}


def log_steps(log: MetricsLog, steps: range) -> None:
    for step in steps:
        log.log({"train/loss": 10.0 - step, "train/lr": 1e-3}, step)
        if step % 2 == 0:
            log.log({"val/loss": 11.0 - step, "val/bpb": 3.0}, step)


def test_one_row_per_step_with_its_evaluation_written_when_the_next_step_begins(tmp_path):
    log = MetricsLog(tmp_path, tokens_per_step=100, step=0)
    log_steps(log, range(1, 5))
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3]
    log.close()
    rows = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1] == STEP_2_ROW
    assert "val_loss" not in rows[2]


def test_a_torn_last_line_is_ignored_and_a_resume_continues_without_repeating_steps(tmp_path):
    log = MetricsLog(tmp_path, tokens_per_step=100, step=0)
    log_steps(log, range(1, 9))  # killed: no close(); rows 1..7 are on disk
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 8, "train_lo')  # a kill in the middle of writing a row
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == list(range(1, 8))

    resumed = MetricsLog(tmp_path, tokens_per_step=100, step=4)  # the checkpoint was at step 4
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3, 4]
    log_steps(resumed, range(5, 11))
    resumed.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 11))  # all parse


def test_the_plot_is_a_png_replaced_atomically(tmp_path):
    log = MetricsLog(tmp_path, tokens_per_step=100, step=0)
    log_steps(log, range(1, 7))
    log.log({"final_val/loss": 5.0, "final_val/bpb": 2.5}, 6)
    log.plot()
    png = (tmp_path / PLOT_FILE).read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    log.plot()
    assert {p.name for p in tmp_path.iterdir()} == {METRICS_FILE, PLOT_FILE}  # no temp file


def test_a_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path, tokens_per_step=100, step=0, enabled=False)
    log_steps(log, range(1, 4))
    log.plot()
    log.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_the_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        log = MetricsLog(tmp_path, tokens_per_step=1, step=0)
        log_steps(log, range(1, 3))
        log.plot()
        log.close()
    finally:
        os.umask(old)
    for name in (METRICS_FILE, PLOT_FILE):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode


def test_a_run_records_every_logged_step_and_a_resume_continues_the_file(tmp_path, corpus):
    """12 steps, evaluations at 6 and 12, a crash at step 9 (checkpoint at 6), a resume."""
    trainer = make_trainer(tmp_path, corpus)
    original = trainer.train_step

    def crash_at_9():
        if trainer.state.step == 8:
            raise KeyboardInterrupt  # a process dying: the loop's finally still runs
        return original()

    trainer.train_step = crash_at_9
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == list(range(1, 9))
    assert (tmp_path / PLOT_FILE).read_bytes().startswith(PNG_MAGIC)  # drawn at step 6

    summary = make_trainer(tmp_path, corpus, "train.resume=auto").run()
    rows = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in rows] == list(range(1, 13))
    tokens_per_step = 4 * 32  # train.batch_size x model.block_size of the TINY run
    assert all(r["tokens"] == r["step"] * tokens_per_step for r in rows)
    assert all({"train_loss", "train_lr", "train_tokens_per_s"} <= r.keys() for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [6, 12]
    assert rows[-1]["final_val_loss"] == pytest.approx(summary["val_loss"], abs=1e-4)
    assert rows[-1]["final_val_bpb"] == pytest.approx(summary["val_bpb"], abs=1e-4)


def test_the_plot_includes_the_pending_row(tmp_path, monkeypatch):
    drawn = []

    def draw(rows, path, title):
        drawn.append(rows)
        path.write_bytes(PNG_MAGIC)

    monkeypatch.setattr("trainer.reporting.draw", draw)
    log = MetricsLog(tmp_path, tokens_per_step=100, step=0)
    log_steps(log, range(1, 3))  # step 2 (with its evaluation) is not written yet
    log.plot()
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1]
    (rows,) = drawn
    assert rows[-1] == STEP_2_ROW


def test_task_accuracies_get_a_panel_of_their_own(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: figures.append(fig))
    tasks = {"hellaswag_acc": 0.25, "hellaswag_acc_norm": 0.5, "hellaswag_acc_stderr": 0.1}
    draw([STEP_2_ROW], tmp_path / "plain.png")
    draw([{**STEP_2_ROW, **tasks}], tmp_path / "tasks.png")
    plain, with_tasks = figures
    assert len(plain.axes) == 2  # loss, and bpb on its twin
    panel = with_tasks.axes[-1]
    assert len(with_tasks.axes) == 3
    assert [line.get_label() for line in panel.get_lines()] == [
        "hellaswag acc",
        "hellaswag acc_norm",
    ]
