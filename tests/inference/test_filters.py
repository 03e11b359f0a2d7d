"""Each logit filter keeps exactly the tokens its definition says, and nothing else."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.generate import apply_repetition_penalty, min_p_filter, top_k_filter, top_p_filter


def log_probs(*probs: float) -> torch.Tensor:
    """Logits (1, V) whose softmax is exactly `probs`."""
    return torch.tensor([[math.log(p) for p in probs]])


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_highest_logits_unchanged():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = top_k_filter(logits, 2)
    assert kept(out) == [1, 3]
    assert out[0, 1] == 5.0 and out[0, 3] == 4.0


def test_top_k_larger_than_the_vocabulary_keeps_everything():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(top_k_filter(logits, 10), logits)


def test_top_k_keeps_exactly_k_even_with_ties_the_lowest_indices_of_them():
    assert kept(top_k_filter(torch.zeros(1, 6), 3)) == [0, 1, 2]
    assert kept(top_k_filter(torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0]]), 3)) == [0, 1, 4]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(-3, 3), min_size=12, max_size=12), min_size=1, max_size=5),
    st.data(),
)
def test_a_row_keeps_in_a_batch_exactly_what_it_keeps_alone(values, data):
    """Logits with many ties (as bfloat16's are), each row its own k: the batch's filter keeps,
    in each row, the logits that row's own filter keeps, k of them (at most the vocabulary)."""
    logits = torch.tensor(values, dtype=torch.float32)
    k = torch.tensor([[data.draw(st.integers(1, 14))] for _ in values])
    batched = top_k_filter(logits, k)
    for row in range(len(values)):
        alone = top_k_filter(logits[row : row + 1], int(k[row]))
        assert torch.equal(batched[row : row + 1], alone)
        assert len(kept(alone)) == min(int(k[row]), 12)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = log_probs(0.1, 0.5, 0.3, 0.06, 0.04)  # sorted: 0.5, 0.3, 0.1, 0.06, 0.04
    assert kept(top_p_filter(logits, 0.5)) == [1]  # 0.5 alone reaches 0.5
    assert kept(top_p_filter(logits, 0.6)) == [1, 2]  # 0.5 + 0.3 = 0.8 >= 0.6
    assert kept(top_p_filter(logits, 0.85)) == [0, 1, 2]  # + 0.1 = 0.9 >= 0.85
    assert kept(top_p_filter(logits, 0.95)) == [0, 1, 2, 3]  # + 0.06 = 0.96 >= 0.95


def test_top_p_always_keeps_the_most_likely_token():
    assert kept(top_p_filter(log_probs(0.7, 0.2, 0.1), 0.01)) == [0]


def test_top_p_of_one_keeps_everything():
    assert kept(top_p_filter(log_probs(0.7, 0.2, 0.1), 1.0)) == [0, 1, 2]


def test_min_p_keeps_tokens_at_least_p_times_the_top_probability():
    logits = log_probs(0.5, 0.3, 0.15, 0.05)  # threshold 0.4 * 0.5 = 0.2
    assert kept(min_p_filter(logits, 0.4)) == [0, 1]
    assert kept(min_p_filter(logits, 0.0)) == [0, 1, 2, 3]
    assert kept(min_p_filter(logits, 1.0)) == [0]


def test_filters_work_row_by_row():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    out = top_k_filter(logits, 1)
    assert torch.isfinite(out).tolist() == [[False, False, True], [True, False, False]]


def test_repetition_penalty_lowers_every_seen_token_and_nothing_else():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    context = torch.tensor([[0, 1, 1]])  # tokens 0 and 1 were seen (1 twice: penalised once)
    out = apply_repetition_penalty(logits, context, 2.0)
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_repetition_penalty_below_one_favours_seen_tokens():
    out = apply_repetition_penalty(torch.tensor([[2.0, -2.0]]), torch.tensor([[0, 1]]), 0.5)
    assert out.tolist() == [[4.0, -1.0]]


def test_top_k_keeps_each_rows_own_k_in_a_batch():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]]).repeat(2, 1)
    out = top_k_filter(logits, torch.tensor([[1], [3]]))  # a server's rows: k of their own
    assert kept(out[:1]) == [1] and kept(out[1:]) == [1, 2, 3]
    assert out[1, 1] == 5.0 and out[1, 2] == 3.0  # kept logits unchanged
