"""forward's logits and loss; eval_mode restores the mode; add_tokens grows by mean rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import GPT, eval_mode
from tests.conftest import tiny_config


@pytest.mark.parametrize(
    "options",
    [{}, {"tie_embeddings": False}, {"logit_softcap": 0.05}],
    ids=["tied", "untied", "softcap"],
)
def test_the_loss_is_the_logits_cross_entropy_over_the_targets_not_minus_one(options):
    """forward(idx) gives the logits, forward(idx, targets) the mean cross-entropy of those same
    logits over the targets other than -1 (no logits kept), and with loss_reduction="sum" their
    total; softcapped logits stay inside (-cap, cap)."""
    torch.manual_seed(0)
    model = GPT(tiny_config(**options)).eval()
    idx, targets = torch.randint(0, 101, (2, 16)), torch.randint(0, 101, (2, 16))
    targets[0, :5] = -1
    logits, none = model(idx)
    assert logits.shape == (2, 16, 101) and none is None
    expected = F.cross_entropy(logits.reshape(-1, 101), targets.reshape(-1), ignore_index=-1)
    none, loss = model(idx, targets)
    assert none is None
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)
    _, total = model(idx, targets, loss_reduction="sum")
    torch.testing.assert_close(total, expected * 27, rtol=1e-6, atol=0)  # 32 targets, 5 ignored
    if cap := options.get("logit_softcap"):
        assert logits.abs().max() < cap


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
