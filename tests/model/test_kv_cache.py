"""Feeding tokens one at a time through the KV cache gives the logits of a full forward pass,
for every attention implementation and architecture option."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import GPT, gpt
from tests.conftest import tiny_config
from tests.model.conftest import ARCHITECTURES, TRITON_OPTIONS, matrix, random_projections


def _cached_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """A prompt of 5 tokens at once, then a chunk of 4 over the cache, then the rest 1 by 1."""
    cache = model.new_kv_cache(batch_size=idx.size(0))
    with torch.no_grad():
        prefill, _ = model(idx[:, :5], cache=cache)
        chunk, _ = model(idx[:, 5:9], cache=cache)
        steps = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(9, idx.size(1))]
    assert cache.length == idx.size(1)
    return torch.cat([prefill, chunk, *steps], dim=1)


@pytest.mark.parametrize("options,attention", matrix(list(ARCHITECTURES), TRITON_OPTIONS))
def test_cached_steps_match_the_full_forward(attention, options):
    """rope: the new positions are rotated by their place after the cached ones (start > 0),
    in every implementation's path (sdpa's explicit mask, flash's offset diagonal)."""
    torch.manual_seed(0)
    config = tiny_config(attention=attention, flash_block_q=3, flash_block_k=2)
    model = random_projections(GPT(dataclasses.replace(config, **ARCHITECTURES[options]))).eval()
    idx = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        full, _ = model(idx)
    torch.testing.assert_close(_cached_logits(model, idx), full, atol=1e-5, rtol=0)


def test_equivalence_catches_rope_positions_that_restart_with_each_call(monkeypatch):
    """Negative control: rotating each call's tokens from position 0, ignoring the cache's
    length, gives the same full forward but different cached logits."""
    torch.manual_seed(0)
    model = GPT(tiny_config(pos_embedding="rope")).eval()
    idx = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        full, _ = model(idx)
    tables = gpt.rope_tables
    restart = lambda pos, *rest: tables(pos - pos.min(), *rest)  # noqa: E731
    monkeypatch.setattr(gpt, "rope_tables", restart)
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], full)
    cached = _cached_logits(model, idx)
    torch.testing.assert_close(cached[:, :5], full[:, :5], atol=1e-5, rtol=0)
    with pytest.raises(AssertionError):  # what test_cached_steps_match_the_full_forward asks
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)
    assert (cached[:, 5:] - full[:, 5:]).abs().max() > 5e-5  # 2e-4 at init: not rounding


def test_cache_cannot_grow_past_block_size(tiny_model):
    cache = tiny_model.new_kv_cache(batch_size=1)
    tiny_model(torch.zeros(1, 16, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="block_size"):
        tiny_model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
