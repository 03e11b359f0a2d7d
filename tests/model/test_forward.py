"""The forward pass's inputs: token ids or embeddings; forward is hidden_states then logits;
eval_mode restores the mode."""

from __future__ import annotations

import pytest
import torch

from model import GPT, eval_mode
from tests.conftest import tiny_config


def test_embeddings_in_place_of_ids_give_the_same_logits_and_loss():
    torch.manual_seed(0)
    model = GPT(tiny_config(pos_embedding="rope")).eval()
    idx = torch.randint(0, 101, (2, 16))
    logits, loss = model(idx, idx)
    from_embeddings, loss_e = model(embeddings=model.transformer.wte(idx), targets=idx)
    torch.testing.assert_close(from_embeddings, logits, atol=0, rtol=0)
    torch.testing.assert_close(loss_e, loss, atol=0, rtol=0)
    shifted = model.transformer.wte(idx) + 1.0  # not the ids' embeddings: other logits
    assert not torch.allclose(model(embeddings=shifted)[0], logits)


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
    torch.testing.assert_close(model.logits(x[:, -1:]), model(idx, last_only=True)[0])


def test_eval_mode_restores_the_mode_even_when_the_block_raises():
    model = GPT(tiny_config(dropout=0.5)).train()
    with pytest.raises(RuntimeError), eval_mode(model):
        assert not model.training and not model.transformer.drop.training
        raise RuntimeError
    assert model.training and model.transformer.drop.training
    with eval_mode(model.eval()):
        pass
    assert not model.training  # a model in eval mode stays there
