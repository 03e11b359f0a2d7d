"""The fp16 branch tells gradient overflow (the scaler's business) from divergence (on_nan's)."""

import pytest

from trainer.loop import step_verdict


@pytest.mark.parametrize("scaled", [False, True])
def test_a_non_finite_loss_is_divergence_with_or_without_a_scaler(scaled):
    assert step_verdict(loss_finite=False, grads_finite=False, scaled=scaled) == "diverged"
    assert step_verdict(loss_finite=False, grads_finite=True, scaled=scaled) == "diverged"


def test_overflowing_gradients_with_a_finite_loss_are_the_scalers_to_skip():
    assert step_verdict(loss_finite=True, grads_finite=False, scaled=True) == "scaler_skip"


def test_without_a_scaler_non_finite_gradients_are_divergence():
    assert step_verdict(loss_finite=True, grads_finite=False, scaled=False) == "diverged"


@pytest.mark.parametrize("scaled", [False, True])
def test_finite_steps_are_taken(scaled):
    assert step_verdict(loss_finite=True, grads_finite=True, scaled=scaled) == "step"
