"""Batches: targets are inputs shifted by one, determinism, resume, per-rank disjointness, eval."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from base.errors import DataError
from data.loader import BatchSampler, bits_per_byte, eval_tokens, iter_eval_batches
from data.pipeline import PreparedData

TOKENS = np.arange(10_000, dtype=np.uint16)  # token value == position: windows are checkable


def test_targets_are_inputs_shifted_by_one() -> None:
    sampler = BatchSampler(TOKENS, block_size=32, batch_size=8, seed=0)
    for _ in range(20):
        x, y = sampler.next_batch()
        assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert torch.equal(y, x + 1)  # contiguous windows of block_size + 1 tokens
        assert int(y.max()) < len(TOKENS)


def test_real_data_windows_are_shifted(shakespeare: PreparedData) -> None:
    tokens = shakespeare.tokens("train")
    sampler = BatchSampler(tokens, block_size=64, batch_size=16, seed=1)
    for _ in range(10):
        x, y = sampler.next_batch()
        assert torch.equal(y[:, :-1], x[:, 1:])


def test_deterministic_and_resumable() -> None:
    a = BatchSampler(TOKENS, block_size=16, batch_size=4, seed=7)
    b = BatchSampler(TOKENS, block_size=16, batch_size=4, seed=7)
    for _ in range(3):
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch(), strict=True))
    state = json.loads(json.dumps(a.state_dict()))  # plain ints survive JSON
    expected = [a.next_batch() for _ in range(5)]
    resumed = BatchSampler(TOKENS, block_size=16, batch_size=4, seed=0)
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    other_seed = BatchSampler(TOKENS, block_size=16, batch_size=4, seed=8).next_batch()[0]
    assert not torch.equal(other_seed, BatchSampler(TOKENS, 16, 4, seed=7).next_batch()[0])


def test_state_dict_loads_with_weights_only(tmp_path) -> None:
    sampler = BatchSampler(TOKENS, block_size=16, batch_size=4, seed=3)
    sampler.next_batch()
    torch.save({"sampler": sampler.state_dict()}, tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt", weights_only=True)["sampler"] == {"seed": 3, "step": 1}


def test_ranks_draw_disjoint_windows() -> None:
    world = 4
    samplers = [BatchSampler(TOKENS, 16, 8, seed=5, rank=r, world_size=world) for r in range(world)]
    for _ in range(10):
        starts = [s.next_batch()[0][:, 0].tolist() for s in samplers]
        flat = [v for rank_starts in starts for v in rank_starts]
        assert len(set(flat)) == len(flat) == world * 8


def test_a_train_split_shorter_than_a_window_is_an_error() -> None:
    with pytest.raises(DataError, match="the train split has 16 tokens: 0 windows of model"):
        BatchSampler(TOKENS[:16], block_size=16, batch_size=1, seed=0)
    BatchSampler(TOKENS[:17], block_size=16, batch_size=1, seed=0).next_batch()


def test_an_eval_split_shorter_than_a_window_is_one_partial_window() -> None:
    """Evaluation needs no full window (evaluate.py scores a short text; a short val split
    must not fail a run after it trained): whole or as a subset, the split is one window."""
    for max_windows in (None, 2):
        batches = list(iter_eval_batches(TOKENS[:10], 16, 4, max_windows))
        assert [(x.tolist(), y.tolist()) for x, y in batches] == [
            ([[*range(9)]], [[*range(1, 10)]])
        ]


@pytest.mark.parametrize("n", [5, 17, 100, 161, 1000])
@pytest.mark.parametrize("world", [1, 3])
def test_eval_predicts_every_token_once(n: int, world: int) -> None:
    tokens = TOKENS[:n]
    predicted = []
    for rank in range(world):
        mine = len(predicted)
        for x, y in iter_eval_batches(tokens, 16, 4, rank=rank, world_size=world):
            assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, x + 1)
            predicted += y.flatten().tolist()
        assert len(predicted) - mine == eval_tokens(n, 16, rank, world)  # what progress counts
    assert sorted(predicted) == list(range(1, n))


def test_eval_subset_is_fixed_and_evenly_spaced() -> None:
    first = [x[:, 0].tolist() for x, _ in iter_eval_batches(TOKENS, 16, 4, max_windows=12)]
    again = [x[:, 0].tolist() for x, _ in iter_eval_batches(TOKENS, 16, 4, max_windows=12)]
    assert first == again and len(first) == 3
    starts = [s for batch in first for s in batch]
    assert starts[0] == 0 and starts[-1] > len(TOKENS) * 0.9
    assert len(set(np.diff(starts) // 16)) <= 2  # evenly spaced up to rounding


def test_bits_per_byte() -> None:
    assert bits_per_byte(math.log(2), tokens=100, nbytes=100) == pytest.approx(1.0)
    assert bits_per_byte(2.0, tokens=250, nbytes=1000) == pytest.approx(0.5 / math.log(2))
