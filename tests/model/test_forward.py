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


@pytest.mark.parametrize("tied", [True, False])
def test_add_tokens_grows_the_embedding_and_head_by_mean_rows(tied):
    """A chat template's two tokens on a model with 101 rows: 103 rows in the embedding and the
    head (tied or not), the old ones unchanged, each new one the mean of the old ones."""
    torch.manual_seed(0)
    model = GPT(tiny_config(tie_embeddings=tied))
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.add_tokens(range(101, 103), mean_of=101)
    assert model.config.vocab_size == 103
    for name in ("transformer.wte.weight", *([] if tied else ["lm_head.weight"])):
        new, mean = dict(model.named_parameters())[name], old[name].mean(dim=0)
        assert new.shape == (103, 16) and torch.equal(new[:101], old[name])
        assert torch.allclose(new[101], mean) and torch.allclose(new[102], mean)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    assert model(torch.tensor([[102, 5]]))[0].shape == (1, 2, 103)
