"""Causal self-attention follows the formula: S = softmax(mask(QK^T / sqrt(d_k))), output S V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import GPT
from model.gpt import causal_attention
from model.inspection import attention_probs
from tests.conftest import tiny_config
from tests.model.conftest import ARCHITECTURES


@pytest.mark.parametrize("options", ["gpt2", "pos_embedding=rope", "all"])
def test_attention_rows_are_distributions_with_nothing_above_the_diagonal(options):
    torch.manual_seed(0)
    model = GPT(tiny_config(**ARCHITECTURES[options])).eval()
    idx = torch.randint(0, 101, (3, 16))
    S = attention_probs(model, idx)  # (n_layer, B, nh, T, T)
    assert S.shape == (2, 3, 2, 16, 16)
    torch.testing.assert_close(S.sum(-1), torch.ones(2, 3, 2, 16), atol=1e-6, rtol=0)
    above = torch.ones(16, 16, dtype=torch.bool).triu(diagonal=1)
    assert (S[..., above] == 0).all()  # exactly zero, not merely small
    assert (S[..., ~above] > 0).all()  # every allowed key gets some weight


def test_attention_probs_refuse_dropout_and_never_switch_the_mode():
    """Inspection switches no mode (another thread may be using the model): a model in train
    mode with dropout is refused and left in train mode; in eval mode S is the same each time."""
    torch.manual_seed(0)
    model = GPT(tiny_config(dropout=0.5)).train()
    idx = torch.randint(0, 101, (2, 16))
    with pytest.raises(ValueError, match="model.eval()"):
        attention_probs(model, idx)
    assert model.training and model.transformer.drop.training
    model.eval()
    torch.testing.assert_close(attention_probs(model, idx), attention_probs(model, idx))
    assert not model.training


@pytest.mark.parametrize("B,H,T,dk", [(1, 1, 1, 8), (2, 3, 1, 16), (2, 4, 7, 8), (3, 2, 64, 32)])
def test_manual_attention_equals_sdpa(B, H, T, dk):
    q, k, v = (torch.randn(B, H, T, dk) for _ in range(3))
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    ours = causal_attention(q, k, v, allowed)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("options", ARCHITECTURES)
def test_manual_and_sdpa_models_agree_on_the_same_weights(options):
    torch.manual_seed(0)
    manual = GPT(tiny_config(attention="manual", **ARCHITECTURES[options])).eval()
    sdpa = GPT(tiny_config(attention="sdpa", **ARCHITECTURES[options])).eval()
    sdpa.load_state_dict(manual.state_dict())
    idx = torch.randint(0, 101, (2, 16))
    torch.testing.assert_close(manual(idx)[0], sdpa(idx)[0], atol=1e-5, rtol=0)


def test_dividing_by_sqrt_dk_keeps_score_variance_near_one():
    torch.manual_seed(0)
    dk = 256
    q, k = torch.randn(4096, dk), torch.randn(4096, dk)
    raw = (q * k).sum(-1)  # 4096 independent dot products
    assert raw.var().item() == pytest.approx(dk, rel=0.1)  # unscaled: variance d_k
    assert (raw / dk**0.5).var().item() == pytest.approx(1.0, rel=0.1)  # scaled: about 1
