"""Feeding tokens one at a time through the KV cache gives the logits of a full forward pass."""

from __future__ import annotations

import pytest
import torch

from model import ATTENTION_IMPLS, GPT
from tests.conftest import tiny_config


@pytest.mark.parametrize("attention", ATTENTION_IMPLS)
def test_cached_steps_match_the_full_forward(attention):
    torch.manual_seed(0)
    model = GPT(tiny_config(attention=attention)).eval()
    idx = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_kv_cache(batch_size=2)
        prefill, _ = model(idx[:, :5], cache=cache)  # a prompt of 5 tokens at once ...
        steps = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(5, 16)]  # ... then 1 by 1
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 16


def test_cache_cannot_grow_past_block_size(tiny_model):
    cache = tiny_model.new_kv_cache(batch_size=1)
    tiny_model(torch.zeros(1, 16, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="block_size"):
        tiny_model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
