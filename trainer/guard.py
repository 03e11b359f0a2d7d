"""The causality guard: before the model is built, `train.py` checks a shrunk copy of the
configured architecture (same options and code path, tiny sizes: well under a second) with
model/causality.py, and refuses to train a model that can see the future. Loaded weights
(train.init_from) cannot be shrunk: the loaded model itself is checked, on a short sequence.

A leak stops the run with one `error:` line and exit code 2, as every other problem found
before training starts. `train.check_causality=false` turns the guard off.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from base.errors import ConfigError
from model import GPT
from model.causality import check_causality, shrunk_config
from trainer.config import RunConfig

# The shrunk copy keeps at most 2 layers, as the test suite does: a leak in code that every
# layer runs shows in layer 0, and layer 1 covers one that reaches the logits through a later
# layer; gpt2-xl's 48 layers would cost seconds at every start.
GUARD_LAYERS = 2


def causality_guard(
    cfg: RunConfig, verbose: bool = True, model: GPT | None = None
) -> dict[str, Any]:
    """The guard's record, kept in every checkpoint's metadata under "causality"; raises
    ConfigError naming where the leak enters. model: a loaded model to check as it is, with its
    own attention implementation."""
    if not cfg.train.check_causality:
        return {"checked": False, "reason": "train.check_causality=false"}
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # the run's random stream stays as it was
        if model is None:
            torch.manual_seed(0)
            model = GPT(shrunk_config(cfg.model, GUARD_LAYERS))
            what, label = "a shrunk copy of this model", "a shrunk copy (same options)"
        else:
            what = label = "the loaded model"
        report = check_causality(model, attention=(model.config.attention,))
    if not report.causal:
        raise ConfigError(
            f"the causality guard found a leak in {what}: "
            f"{report.failures()[0]}. For the full report run `python check_causality.py` "
            "with the same model overrides; to train anyway set train.check_causality=false"
        )
    seconds = round(time.perf_counter() - start, 3)
    if verbose:
        print(f"causality guard: passed ({len(report.checks)} checks in {seconds} s)")
    c = model.config
    sizes = f"n_layer={c.n_layer}, n_embd={c.n_embd}, vocab_size={c.vocab_size}"
    return {"checked": True, **report.summary(), "model": f"{label}: {sizes}", "seconds": seconds}
