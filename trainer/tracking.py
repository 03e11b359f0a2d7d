"""Weights & Biases tracking: the resolved config, metrics, and sample generations.

`mode=auto` logs online when credentials are present and offline otherwise; an offline run lives
in `<run_dir>/wandb/` and can be uploaded later with `wandb sync <that dir>`.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from trainer.config import WandbSettings
from trainer.metrics_log import StepRows


def resolve_mode(mode: str) -> str:
    """`auto` -> $WANDB_MODE if it names a mode, else online if logged in (API key in env,
    settings or .netrc), else offline."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return os.environ["WANDB_MODE"]
    # Before wandb's first call: wandb ignores (and warns about) env changes after it.
    os.environ.setdefault("WANDB_SILENT", "true")  # our console shows where the run went
    import wandb

    return "online" if wandb.login(prompt=False, verify=False) else "offline"


class Tracker:
    """A thin wrapper so the training loop never checks whether tracking is on."""

    def __init__(
        self,
        settings: WandbSettings,
        run_dir: Path,
        config: dict[str, Any],
        resume_id: str | None = None,
        enabled: bool = True,
    ):
        self.run = None
        # The metrics of the current step, sent as one row.
        self._pending = StepRows(lambda step, row: self.run.log(row, step=step))
        self.mode = resolve_mode(settings.mode) if enabled else "disabled"
        if self.mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")  # our console shows where the run went
        import wandb

        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name,
            tags=settings.tags,
            config=config,
            dir=str(run_dir),
            mode=self.mode,
            id=resume_id,
            resume="allow" if resume_id else None,
            # A run of its own even when the process has another open (a Trainer that raised,
            # a notebook's run): wandb's default outside notebooks hands that one back.
            reinit="create_new",
            # System-stats sampling and console capture run in wandb's service process and cost
            # a large share of a small CPU machine; training metrics are all logged explicitly.
            settings=wandb.Settings(x_disable_stats=True, console="off"),
        )
        self._wandb = wandb

    @property
    def run_id(self) -> str | None:
        return self.run.id if self.run else None

    @property
    def location(self) -> str:
        """One line for the console: where the run can be seen or how to upload it."""
        if self.run is None:
            return "wandb: disabled"
        if self.mode == "offline":  # an absolute path: the command works from any directory
            run = Path(self.run.dir).resolve().parent  # .../wandb/offline-run-<time>-<id>
            return f"wandb: offline run in {run} (upload: wandb sync {shlex.quote(str(run))})"
        return f"wandb: {self.run.url}"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Metrics of one step may come in several calls; they reach wandb as one history row
        when the step changes or the run finishes."""
        if self.run is not None:
            self._pending.add(metrics, step)

    def log_samples(self, samples: list[tuple[str, str]], step: int) -> None:
        """A table of (prompt, completion) rows."""
        if self.run and samples:
            rows = [[step, prompt, completion] for prompt, completion in samples]
            table = self._wandb.Table(columns=["step", "prompt", "completion"], data=rows)
            self.log({"samples": table}, step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run:
            self.run.summary.update(values)

    def finish(self, exit_code: int = 0) -> None:
        if self.run:
            self._pending.flush()
            self.run.finish(exit_code=exit_code)
            self.run = None
