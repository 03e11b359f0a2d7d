"""What a run reports, and where: the console (a bar on a terminal, plain lines in logs), a record
that needs no account (`metrics.jsonl` and `loss.png` in the run dir), Weights & Biases, and the
table a `-m` sweep ends with.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from base.files import write_atomic
from trainer.config import WandbSettings

# ----- the console -------------------------------------------------------------------------------

# Console output: a progress bar on a terminal, plain log lines otherwise (logs, CI, pipes).

FORMATS = {"tok/s": "{:,.0f}", "mfu": "{:.1%}"}  # the rest: 4 significant digits


def format_metrics(values: dict[str, float]) -> str:
    """`loss 4.795 tok/s 13,960 mfu 46.6%`: tokens per second in whole tokens, MFU in percent."""
    return " ".join(f"{k} {FORMATS.get(k, '{:.4g}').format(v)}" for k, v in values.items())


def format_seconds(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; powers of 1024, as memory and disk sizes are read."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ----- metrics.jsonl and loss.png ----------------------------------------------------------------

# A record of the run that needs no account: `<run_dir>/metrics.jsonl` and `<run_dir>/loss.png`.
#
# metrics.jsonl holds one JSON object per logged step: `step`, `tokens` (seen so far), the
# training values (`train_loss`, `train_lr`, `train_tokens_per_s`, ...) and, at evaluations,
# `val_loss`, `val_bpb`, `val_loss_stderr` (and `final_val_*` on the last row). A step's values
# can arrive in several calls (training, then its evaluation); its row is written, flushed and
# fsynced once the next step begins or the run ends, so a kill loses at most that last row. A line
# torn by a kill is ignored when the file is read, and a resumed run drops the rows after its
# checkpoint's step (it will log them again): the file never holds a step twice. A run torchrun
# restarted says so in the first row after the resume: `restart` (its count),
# `restart_repeated_steps` (logged before the failure, done again) and
# `restart_seconds_since_last_row` (the failure, the start-up and the load together).
#
# loss.png plots train and val loss against tokens seen, with val bpb on a second axis, and the
# accuracies of train.eval_tasks in a panel below; it is redrawn at each evaluation and at the
# end, and replaced atomically (base.files.write_atomic).

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
        # What a resume repeats: the steps logged past `step`, and the seconds since the last
        # row (a restarted run says both).
        self.repeated, self.quiet_for = 0, 0.0
        if not enabled:
            return
        rows = read_metrics(self.path)
        if rows:
            self.repeated = max(0, max(r["step"] for r in rows) - step)
            self.quiet_for = time.time() - self.path.stat().st_mtime
        # Drop a torn line and the steps a resume will repeat.
        text = "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step)
        if self.path.exists() and self.path.read_text(encoding="utf-8") != text:
            write_atomic(self.path, text)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Add values to `step`'s row; names like `val/loss` become `val_loss`."""
        if self.enabled:
            self._pending.add({k.replace("/", "_"): v for k, v in metrics.items()}, step)

    def _row(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        return {"step": step, "tokens": step * self.tokens_per_step, **values}

    def _write(self, step: int, values: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(self._row(step, values)) + "\n")
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
    ax.set(xlabel="tokens seen", ylabel="loss (nats/token)")
    bpb.set_ylabel("val bits per byte", color="tab:green")
    handles = ax.get_legend_handles_labels()[0] + bpb.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    ax.set_title(title, fontsize="small")
    ax.grid(alpha=0.3)
    if accuracies:  # downstream tasks (train.eval_tasks) in a panel of their own, below
        tasks = fig.add_subplot(2, 1, 2, sharex=ax)
        for key in accuracies:
            tasks.plot(*series(key), "o-", ms=3, label=key.replace("_acc", " acc"))
        tasks.set(xlabel="tokens seen", ylabel="accuracy")
        tasks.legend(loc="upper left", fontsize="small")
        tasks.grid(alpha=0.3)
    fig.savefig(path, format="png")


# ----- Weights & Biases --------------------------------------------------------------------------

# Weights & Biases tracking: the resolved config, metrics, and sample generations.
#
# `mode=auto` logs online when credentials are present and offline otherwise; an offline run lives
# in `<run_dir>/wandb/` and can be uploaded later with `wandb sync <that dir>`.


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


# ----- the sweep table ---------------------------------------------------------------------------

# The table a `python train.py -m ...` sweep ends with: one row per run, its final validation.
#
# A Hydra callback (configs/train.yaml) that reads what each job left in its run directory
# (`.hydra/overrides.yaml` and `metrics.jsonl`), so it works for any launcher whose jobs write to
# a filesystem the launching process can read.


def _overrides(job_dir: Path) -> dict[str, str]:
    try:
        items = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    except (OSError, yaml.YAMLError):
        return {}
    return dict(str(item).split("=", 1) for item in items if "=" in str(item))


def _result(job_dir: Path) -> list[str]:
    """The cells of a run: its last step and final validation loss and bpb (the last periodic
    one without a final evaluation)."""
    rows = read_metrics(job_dir / METRICS_FILE)
    if not rows:
        return ["failed or no metrics", "-", "-"]
    loss, bpb = rows[-1].get("final_val_loss"), rows[-1].get("final_val_bpb")
    if loss is None:
        evaluated = next((r for r in reversed(rows) if "val_loss" in r), {})
        loss, bpb = evaluated.get("val_loss"), evaluated.get("val_bpb")
    return [str(rows[-1]["step"]), *("-" if v is None else f"{v:.4f}" for v in (loss, bpb))]


def sweep_table(sweep_dir: str | Path) -> str:
    """A markdown table of the runs under `sweep_dir` (`<n>/` each), showing the overrides that
    differ between them, the last step, and the final validation loss and bpb."""
    runs = (p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit())
    jobs = sorted(runs, key=lambda p: int(p.name))
    overrides = {job: _overrides(job) for job in jobs}
    keys = sorted({k for o in overrides.values() for k in o})
    varied = [k for k in keys if len({o.get(k) for o in overrides.values()}) > 1]
    header = " | ".join([*varied, "step", "val loss", "val bpb"])
    lines = [f"| run | {header} |", "|" + " --- |" * (len(varied) + 4)]
    for job in jobs:
        cells = [overrides[job].get(k, "") for k in varied] + _result(job)
        lines.append(f"| {job.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


class SweepTable(Callback):
    """Print the sweep's table when all its runs are done."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).absolute()
        if sweep_dir.is_dir():
            print(f"\nsweep: {sweep_dir}\n{sweep_table(sweep_dir)}", flush=True)
