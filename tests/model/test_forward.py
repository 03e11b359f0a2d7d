"""forward is hidden_states then logits; eval_mode restores the mode."""

from __future__ import annotations

import pytest
import torch

from model import GPT, eval_mode
from tests.conftest import tiny_config


@pytest.mark.parametrize(
    "options",
    [{}, {"tie_embeddings": False}, {"logit_softcap": 0.05}],
    ids=["tied", "untied", "softcap"],
)
def test_forward_is_hidden_states_then_logits(options):
    torch.manual_seed(0)
    model = GPT(tiny_config(**options)).eval()
    idx = torch.randint(0, 101, (2, 16))
    logits, _ = model(idx)
    x = model.hidden_states(idx)  # (B, T, C)
    torch.testing.assert_close(model.logits(x), logits, atol=0, rtol=0)


def test_eval_mode_restores_the_mode_even_when_the_block_raises():
    model = GPT(tiny_config(dropout=0.5)).train()
    with pytest.raises(RuntimeError), eval_mode(model):
        assert not model.training and not model.transformer.drop.training
        raise RuntimeError
    assert model.training and model.transformer.drop.training
    with eval_mode(model.eval()):
        pass
    assert not model.training  # a model in eval mode stays there
