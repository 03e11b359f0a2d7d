"""The wandb tracker: each Tracker logs to a run of its own."""

from __future__ import annotations

from pathlib import Path

from trainer.config import WandbSettings
from trainer.tracking import Tracker


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
