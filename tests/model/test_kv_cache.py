"""Feeding tokens one at a time through the KV cache gives the logits of a full forward pass,
for every attention implementation and architecture option."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import ATTENTION_IMPLS, GPT
from model.gpt import RotaryTables
from tests.conftest import tiny_config
from tests.model.conftest import ARCHITECTURES, random_projections


def _cached_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """A prompt of 5 tokens at once, then a chunk of 4 over the cache, then the rest 1 by 1."""
    cache = model.new_kv_cache(batch_size=idx.size(0))
    with torch.no_grad():
        prefill, _ = model(idx[:, :5], cache=cache)
        chunk, _ = model(idx[:, 5:9], cache=cache)
        steps = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(9, idx.size(1))]
    assert cache.length == idx.size(1)
    return torch.cat([prefill, chunk, *steps], dim=1)


@pytest.mark.parametrize("options", ARCHITECTURES)
@pytest.mark.parametrize("attention", ATTENTION_IMPLS)
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
    forward = RotaryTables.forward
    monkeypatch.setattr(RotaryTables, "forward", lambda self, start, T: forward(self, 0, T))
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


@pytest.mark.parametrize("options", ["gpt2", "pos_embedding=rope", "all"])
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_ragged_rows_each_match_their_own_full_forward(attention, options):
    """Three sequences of different lengths in one RaggedKVCache: each prefilled alone in its
    row, then decoded together one token a step, each at its own position; a finished row is
    replaced by the last one (`move`). Every row's logits are its own full forward's."""
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_config(attention=attention), **ARCHITECTURES[options])
    model = random_projections(GPT(config)).eval()
    seqs = [torch.randint(0, 101, (1, n)) for n in (16, 9, 12)]
    with torch.no_grad():
        full = [model(s)[0][0] for s in seqs]
        cache = model.new_kv_cache(batch_size=4, ragged=True)
        for row, (s, prompt) in enumerate(zip(seqs, (3, 1, 6), strict=True)):
            cache.rows = slice(row, row + 1)
            model(s[:, :prompt], cache=cache)
        rows, t = [0, 1, 2], {0: 3, 1: 1, 2: 6}
        while rows:
            cache.rows = slice(0, len(rows))
            idx = torch.cat([seqs[r][:, t[r] : t[r] + 1] for r in rows])
            logits = model(idx, cache=cache)[0][:, -1]
            for i, r in enumerate(rows):
                torch.testing.assert_close(logits[i], full[r][t[r]], atol=1e-5, rtol=0)
                t[r] += 1
            for i in reversed(range(len(rows))):
                if t[rows[i]] == seqs[rows[i]].size(1):  # finished: the last row moves here
                    cache.move(len(rows) - 1, i)
                    rows[i] = rows[-1]
                    rows.pop()


def test_a_ragged_cache_refuses_flash_attention():
    """flash's tiles take every row's queries to be its last keys: a ragged cache would be
    silently wrong, so it is refused where it is made."""
    with pytest.raises(ValueError, match="attention=manual or sdpa, not flash"):
        GPT(tiny_config(attention="flash")).new_kv_cache(2, ragged=True)
