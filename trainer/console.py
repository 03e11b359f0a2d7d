"""Console output: a progress bar on a terminal, plain log lines otherwise (logs, CI, pipes)."""

from __future__ import annotations

import sys

from tqdm import tqdm

FORMATS = {"tok/s": "{:,.0f}", "mfu": "{:.1%}"}  # the rest: 4 significant digits


def format_metrics(values: dict[str, float]) -> str:
    """`loss 4.795 tok/s 13,960 mfu 46.6%`: tokens per second in whole tokens, MFU in percent."""
    return " ".join(
        f"{k} {FORMATS.get(k, '{:.4g}').format(v)}" if isinstance(v, float) else f"{k} {v}"
        for k, v in values.items()
    )


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


class Progress:
    """Shows training progress; `enabled=False` (non-zero ranks) prints nothing."""

    def __init__(self, total: int | None, initial: int, enabled: bool = True):
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stdout.isatty():
            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, unit="step")

    def update(self, step: int, values: dict[str, float], eta_seconds: float) -> None:
        eta = f"eta {format_seconds(eta_seconds)}"
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(f"{format_metrics(values)} {eta}")
        elif self.enabled:
            print(f"step {step} | {format_metrics(values)} | {eta}", flush=True)

    def message(self, text: str) -> None:
        """A line that stays above the bar."""
        if self.bar is not None:
            self.bar.write(text)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Counter:
    """Progress through `total` units (evaluation's tokens or items), told the count done so
    far: a bar on a terminal, otherwise a line at each tenth (logs, CI, pipes)."""

    def __init__(self, total: int, unit: str):
        self.total, self.unit, self.tenths = max(total, 1), unit, 0
        self.bar = None
        if sys.stdout.isatty():
            self.bar = tqdm(total=total, unit=unit, dynamic_ncols=True, leave=False)

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        elif done * 10 // self.total > self.tenths:
            self.tenths = done * 10 // self.total
            print(f"{done:,} of {self.total:,} {self.unit}s", flush=True)

    def __enter__(self) -> Counter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
