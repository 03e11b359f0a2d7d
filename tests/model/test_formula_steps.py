"""formula_steps (model/inspection.py): every step of the attention formula, from the model's own
lines, recomposes the layer's attention output in the forward pass, for every implementation and
option set; a step computed with a mask one position late fails the same check."""

from __future__ import annotations

import math

import pytest
import torch

from model import GPT, gpt
from model.inspection import attention_probs, formula_steps
from tests.conftest import tiny_config
from tests.model.conftest import ARCHITECTURES, TRITON_OPTIONS, matrix, random_projections

LAYER, T = 1, 12


def steps_of(options: str, attention: str) -> tuple[GPT, torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = random_projections(GPT(tiny_config(attention=attention, **ARCHITECTURES[options])))
    idx = torch.randint(0, 101, (1, T))
    return model, idx, formula_steps(model, idx, LAYER)


def recomposed(model: GPT, steps: dict[str, torch.Tensor]) -> torch.Tensor:
    """Y = concat_h(S_h V_h) W_O, from the returned steps alone: (T, C)."""
    heads = (steps["S"] @ steps["V"]).transpose(0, 1).reshape(T, -1)  # (T, nh * hs)
    return model.transformer.h[LAYER].attn.c_proj(heads)


@pytest.mark.parametrize("options,attention", matrix(list(ARCHITECTURES), TRITON_OPTIONS))
def test_the_steps_recompose_the_forward_and_follow_the_formula(options, attention):
    model, idx, steps = steps_of(options, attention)
    c = model.config
    with torch.no_grad():
        torch.testing.assert_close(recomposed(model, steps), steps["forward"], atol=1e-6, rtol=0)
    torch.testing.assert_close(steps["S"], attention_probs(model, idx)[LAYER, 0], atol=0, rtol=0)
    # each option is its own step where it is on, and absent where it is off
    assert ("Q_norm" in steps) == c.qk_norm and ("Q_rope" in steps) == (c.pos_embedding == "rope")
    q = steps.get("Q_rope", steps.get("Q_norm", steps["Q"]))  # what the scores are made of
    k = steps.get("K_rope", steps.get("K_norm", steps["K"]))
    torch.testing.assert_close(steps["QK"], q @ k.transpose(-2, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(steps["scaled"], steps["QK"] / math.sqrt(c.head_size))
    future = ~torch.ones(T, T, dtype=torch.bool).tril()
    assert steps["masked"][:, future].eq(float("-inf")).all()  # masked, not merely small
    assert torch.equal(steps["masked"][:, ~future], steps["scaled"][:, ~future])
    torch.testing.assert_close(steps["masked"].softmax(-1), steps["S"], atol=0, rtol=0)
    assert steps["S"][:, future].eq(0).all() and steps["X"].shape == (T, c.n_embd)


def test_a_step_with_a_mask_one_position_late_fails_the_check(monkeypatch):
    """Negative control: the steps computed with each query seeing one key too many (the
    forward, sdpa's own kernel, unchanged) no longer recompose the forward's output."""
    formula = gpt.causal_attention

    def one_late(q, k, v, allowed, *args, **kwargs):
        return formula(q, k, v, allowed | allowed.roll(1, dims=-1), *args, **kwargs)

    monkeypatch.setattr(gpt, "causal_attention", one_late)
    model, _, steps = steps_of("gpt2", "sdpa")
    with torch.no_grad(), pytest.raises(AssertionError):
        torch.testing.assert_close(recomposed(model, steps), steps["forward"], atol=1e-6, rtol=0)
    assert (steps["S"][:, 0, 1] > 0).all()  # the first query saw the second key
