"""The causality guard: before any data is prepared, `train.py` checks a shrunk copy of the
configured architecture (same options and code path, tiny sizes: well under a second) with
model/causality.py, and refuses to train a model that can see the future. Loaded weights
(train.init_from) cannot be shrunk: the loaded model itself is checked, on a short sequence.

A leak stops the run with one `error:` line and exit code 2, as every other problem found
before training starts. `train.check_causality=false` turns the guard off.
"""

from __future__ import annotations

from typing import Any

from base.errors import ConfigError
from model import GPT
from model.causality import guard_report, loaded_model_report
from trainer.config import RunConfig


def causality_guard(
    cfg: RunConfig, verbose: bool = True, model: GPT | None = None
) -> dict[str, Any]:
    """The guard's record, kept in every checkpoint's metadata under "causality"; raises
    ConfigError naming where the leak enters. model: a loaded model to check as it is."""
    if not cfg.train.check_causality:
        return {"checked": False, "reason": "train.check_causality=false"}
    report, record = guard_report(cfg.model) if model is None else loaded_model_report(model)
    if not report.causal:
        what = "a shrunk copy of this model" if model is None else "the loaded model"
        raise ConfigError(
            f"the causality guard found a leak in {what}: "
            f"{report.failures()[0]}. For the full report run `python check_causality.py` "
            "with the same model overrides; to train anyway set train.check_causality=false"
        )
    if verbose:
        print(f"causality guard: passed ({len(report.checks)} checks in {record['seconds']} s)")
    return {"checked": True, **record}
