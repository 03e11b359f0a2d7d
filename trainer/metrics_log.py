"""A record of the run that needs no account: `<run_dir>/metrics.jsonl` and `<run_dir>/loss.png`.

metrics.jsonl holds one JSON object per logged step: `step`, `tokens` (seen so far), the
training values (`train_loss`, `train_lr`, `train_tokens_per_s`, ...) and, at evaluations,
`val_loss`, `val_bpb`, `val_loss_stderr` (and `final_val_*` on the last row). A step's values
can arrive in several calls (training, then its evaluation); its row is written, flushed and
fsynced once the next step begins or the run ends, so a kill loses at most that last row. A line
torn by a kill is ignored when the file is read, and a resumed run drops the rows after its
checkpoint's step (it will log them again): the file never holds a step twice.

loss.png plots train and val loss against tokens seen, with val bpb on a second axis, and the
accuracies of train.eval_tasks in a panel below; it is redrawn at each evaluation and at the
end, and replaced atomically (base.files.write_atomic).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from base.files import write_atomic

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The complete rows of a metrics.jsonl; a line torn by a kill (unparseable) is skipped."""
    path = Path(path)
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


class StepRows:
    """Gathers the metrics of one step, which may arrive in several calls, into one row, handed
    to `emit(step, row)` when a call for another step comes or at `flush()`."""

    def __init__(self, emit: Callable[[int, dict[str, Any]], None]):
        self.emit = emit
        self.step: int | None = None  # the step of `row`, None when nothing is pending
        self.row: dict[str, Any] = {}

    def add(self, metrics: dict[str, Any], step: int) -> None:
        if self.step is not None and step != self.step:
            self.flush()
        self.row.update(metrics)
        self.step = step

    def flush(self) -> None:
        """Emit the pending row, if any."""
        if self.step is not None:
            self.emit(self.step, self.row)
        self.step, self.row = None, {}


class MetricsLog:
    """Rank 0's metrics.jsonl and loss.png; a disabled log (other ranks) does nothing."""

    def __init__(self, run_dir: str | Path, tokens_per_step: int, step: int, enabled: bool = True):
        self.path = Path(run_dir) / METRICS_FILE
        self.plot_path = Path(run_dir) / PLOT_FILE
        self.tokens_per_step = tokens_per_step
        self.enabled = enabled
        self._pending = StepRows(self._write)  # the current step's values, not yet written
        if not enabled:
            return
        rows = [r for r in read_metrics(self.path) if r["step"] <= step]
        # Drop a torn line and the steps a resume will repeat.
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if self.path.exists() and self.path.read_text(encoding="utf-8") != text:
            write_atomic(self.path, text)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Add values to `step`'s row; names like `val/loss` become `val_loss`."""
        if self.enabled:
            self._pending.add({k.replace("/", "_"): v for k, v in metrics.items()}, step)

    def _row(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        return {"step": step, "tokens": step * self.tokens_per_step, **values}

    def _write(self, step: int, values: dict[str, Any]) -> None:
        row = self._row(step, values)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        """Write the last row (at the end of the run, or when it stops)."""
        self._pending.flush()

    def plot(self) -> None:
        """Redraw loss.png from every row so far (metrics.jsonl's, and the current step's)."""
        if not self.enabled:
            return
        pending = self._pending
        rows = read_metrics(self.path)
        rows += [] if pending.step is None else [self._row(pending.step, pending.row)]
        write_atomic(self.plot_path, lambda tmp: draw(rows, tmp, self.path.parent.name))


def draw(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Train and val loss against tokens seen, val bpb on a second axis, as a PNG."""
    # matplotlib's first import on a machine builds its font cache and logs it, in the middle
    # of the training log: only its errors are worth a line there
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    from matplotlib.ticker import EngFormatter

    def series(key: str) -> tuple[list[float], list[float]]:
        points = [(r["tokens"], r[key]) for r in rows if r.get(key) is not None]
        return [x for x, _ in points], [y for _, y in points]

    accuracies = sorted({k for r in rows for k in r if k.endswith(("_acc", "_acc_norm"))})
    fig = Figure(figsize=(7, 7 if accuracies else 4), dpi=100, layout="constrained")
    ax = fig.add_subplot(2 if accuracies else 1, 1, 1)
    bpb = ax.twinx()
    styles = [
        (ax, "train_loss", dict(color="tab:blue", lw=1, label="train loss")),
        (ax, "val_loss", dict(fmt="o-", color="tab:orange", ms=4, label="val loss")),
        (ax, "final_val_loss", dict(fmt="*", color="tab:red", ms=11, label="final val loss")),
        (bpb, "val_bpb", dict(fmt="s", color="tab:green", ms=4, mfc="none", label="val bpb")),
    ]
    for axis, key, style in styles:
        x, y = series(key)
        if y:  # a series the run does not have (no final evaluation) gets no legend entry
            axis.plot(x, y, style.pop("fmt", "-"), **style)
    x, y = series("val_bpb")
    if y:
        # up and to the left of the last point, on white: clear of the final star at the same
        # x and legible over the loss curves
        box = dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8)
        label = dict(textcoords="offset points", xytext=(-8, 8), ha="right", bbox=box)
        bpb.annotate(f"{y[-1]:.3f}", (x[-1], y[-1]), color="tab:green", **label)
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    bpb.set_ylabel("val bits per byte", color="tab:green")
    handles = ax.get_legend_handles_labels()[0] + bpb.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    ax.set_title(title, fontsize="small")
    ax.grid(alpha=0.3)
    if accuracies:  # downstream tasks (train.eval_tasks) in a panel of their own, below
        tasks = fig.add_subplot(2, 1, 2, sharex=ax)
        for key in accuracies:
            tasks.plot(*series(key), "o-", ms=3, label=key.replace("_acc", " acc"))
        tasks.set_xlabel("tokens seen")
        tasks.set_ylabel("accuracy")
        tasks.legend(loc="upper left", fontsize="small")
        tasks.grid(alpha=0.3)
    fig.savefig(path, format="png")
