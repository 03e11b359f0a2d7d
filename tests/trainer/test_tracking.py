"""The wandb tracker: each Tracker logs to a run of its own."""

from __future__ import annotations

from pathlib import Path

from trainer.config import WandbSettings
from trainer.reporting import Tracker


def test_a_second_tracker_gets_its_own_run_while_the_first_is_still_open(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = WandbSettings(mode="offline")
    first = Tracker(settings, tmp_path / "a", {"run": "a"})  # never finished, as after a crash
    second = Tracker(settings, tmp_path / "b", {"run": "b"})
    try:
        assert second.run is not first.run and second.run_id != first.run_id
        assert tmp_path / "b" in Path(second.run.dir).parents
        assert dict(second.run.config) == {"run": "b"}
    finally:
        second.finish()
        first.finish()


class RecordingRun:
    def __init__(self):
        self.rows: list[tuple[dict, int]] = []

    def log(self, row, step):
        self.rows.append((dict(row), step))

    def finish(self, exit_code):
        self.rows.append(("finished", exit_code))


def test_the_metrics_of_a_step_reach_wandb_as_one_row_when_the_next_step_begins(tmp_path):
    tracker = Tracker(WandbSettings(mode="disabled"), tmp_path, {})
    run = tracker.run = RecordingRun()  # as wandb.init would give
    tracker.log({"train/loss": 3.0}, 1)
    tracker.log({"train/loss": 2.0}, 2)
    tracker.log({"val/loss": 2.5}, 2)  # the evaluation of step 2
    assert run.rows == [({"train/loss": 3.0}, 1)]
    tracker.log({"train/loss": 1.0}, 3)
    tracker.finish(exit_code=0)
    assert run.rows == [
        ({"train/loss": 3.0}, 1),
        ({"train/loss": 2.0, "val/loss": 2.5}, 2),
        ({"train/loss": 1.0}, 3),
        ("finished", 0),
    ]
