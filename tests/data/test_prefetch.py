"""The background batch reader yields exactly the sampler's batches and resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.loader import BatchSampler, PrefetchingSampler


def _sampler(rank: int = 0) -> BatchSampler:
    tokens = np.arange(1000, dtype=np.uint16) * 7 % 503
    return BatchSampler(tokens, block_size=16, batch_size=4, seed=3, rank=rank, world_size=2)


def _same(a, b) -> bool:
    return all(torch.equal(s, t) for s, t in zip(a, b, strict=True))


@pytest.mark.parametrize("rank", [0, 1])
def test_prefetched_batches_are_the_samplers_and_resume_at_the_batch_handed_out(rank):
    plain, ahead = _sampler(rank), PrefetchingSampler(_sampler(rank), depth=3)
    expected = [plain.next_batch() for _ in range(10)]
    got = [ahead.next_batch() for _ in range(4)]
    state = ahead.state_dict()  # the reader is up to 3 batches further: not counted
    assert state == {"seed": 3, "step": 4}
    got += [ahead.next_batch() for _ in range(2)]
    ahead.close()
    assert all(_same(g, e) for g, e in zip(got, expected, strict=False))

    resumed = PrefetchingSampler(_sampler(rank), depth=3)
    resumed.load_state_dict(state)
    rest = [resumed.next_batch() for _ in range(6)]
    resumed.load_state_dict(state)  # reloading while reading ahead restarts from `state`
    assert _same(resumed.next_batch(), expected[4])
    resumed.close()
    assert all(_same(r, e) for r, e in zip(rest, expected[4:], strict=True))


def test_a_reader_failure_is_raised_where_the_batch_is_taken():
    sampler = _sampler()

    def broken(step):
        raise OSError("disk gone")

    sampler.batch_at = broken
    ahead = PrefetchingSampler(sampler)
    with pytest.raises(OSError, match="disk gone"):
        ahead.next_batch()
    ahead.close()
