"""What to do with an optimizer step whose loss or gradients are not finite.

Two different events look alike: float16 gradients overflowing (routine under a gradient scaler:
the scaler lowers its scale and skips the step) and the run diverging (the loss itself is NaN or
inf: train.on_nan decides). Only non-finite gradients with a finite loss are the scaler's
business; a non-finite loss is divergence whatever the precision, or a diverged float16 run
would keep halving its scale forever and never reach train.on_nan.
"""

from __future__ import annotations

from typing import Literal

Verdict = Literal["step", "scaler_skip", "diverged"]


def step_verdict(loss_finite: bool, grads_finite: bool, scaled: bool) -> Verdict:
    """ "step": apply the update. "scaler_skip": float16 overflow, the scaler skips and backs off
    (only with a gradient scaler, `scaled`). "diverged": the train.on_nan path."""
    if loss_finite and grads_finite:
        return "step"
    return "scaler_skip" if loss_finite and scaled else "diverged"
