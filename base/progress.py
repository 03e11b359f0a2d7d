"""Progress, as every long job shows it: a bar on a terminal, plain lines otherwise (logs, CI,
pipes), so that nothing is silent for minutes and no log fills with bar redraws."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """Progress through `total` units (training's steps, evaluation's tokens or task items;
    None: no known end), told the count done so far. Off a terminal, `update` prints a line when
    it is given a status (training's logged steps) or once per tenth of the total (evaluation).
    `enabled=False` (every rank but the first) shows nothing. Use as a context manager, or
    `start` and `close`; `message` prints a line that stays above the bar."""

    def __init__(self, total: int | None, unit: str, enabled: bool = True):
        self.total, self.unit, self.enabled, self.tenths = total, unit, enabled, 0
        self.bar = None  # from `start` on, on a terminal; messages before it are plain lines

    def start(self, done: int = 0) -> Progress:
        if self.enabled and sys.stdout.isatty():
            self.bar = tqdm(
                total=self.total, initial=done, unit=self.unit, dynamic_ncols=True, leave=False
            )
        return self

    def update(self, done: int, status: str = "") -> None:
        tenths = done * 10 // self.total if self.total else 0
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(status) if status else self.bar.refresh()
        elif self.enabled and status:
            print(f"{self.unit} {done} | {status}", flush=True)
        elif self.enabled and tenths > self.tenths:
            print(f"{done:,} of {self.total:,} {self.unit}s", flush=True)
        self.tenths = max(self.tenths, tenths)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
