"""Generation: the KV cache changes the speed, never the tokens; sampling is seeded and filtered."""

from __future__ import annotations

import pytest
import torch

from inference import SamplingParams, TokenContext, generate, next_token, stream_tokens
from model import GPT
from tests.conftest import tiny_config

BLOCK = 16  # tiny_config's block_size


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_config()).eval()


def reference_logits(model: GPT, seq: torch.Tensor) -> torch.Tensor:
    """The definition the cached path must reproduce."""
    return model(seq[:, -BLOCK:])[0][:, -1]


def test_cached_logits_match_a_full_forward_at_every_step_including_past_block_size(model):
    torch.manual_seed(1)
    seq = torch.randint(0, 101, (2, 3 * BLOCK))
    context = TokenContext(model, seq[:, :5], use_cache=True)
    with torch.no_grad():
        for t in range(5, seq.size(1)):
            expected = reference_logits(model, seq[:, :t])
            torch.testing.assert_close(context.logits(), expected, atol=1e-5, rtol=0)
            context.append(seq[:, t])


def test_greedy_generation_with_the_cache_equals_generation_without_it(model):
    prompt = torch.tensor([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]])
    greedy = SamplingParams(temperature=0)
    cached = generate(model, prompt, 3 * BLOCK, greedy, use_cache=True)
    uncached = generate(model, prompt, 3 * BLOCK, greedy, use_cache=False)
    assert cached.shape == (2, 5 + 3 * BLOCK)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, :5], prompt)


def test_greedy_generation_picks_the_argmax_of_the_reference_logits(model):
    out = generate(model, torch.tensor([[3]]), 2 * BLOCK, SamplingParams(temperature=0))
    with torch.no_grad():
        for t in range(1, out.size(1)):
            assert out[0, t] == reference_logits(model, out[:, :t]).argmax()


def test_the_prompt_is_processed_once_then_one_token_per_step_until_the_window_slides(model):
    seen_lengths = []
    model.transformer.wte.register_forward_hook(
        lambda m, args, out: seen_lengths.append(out.size(1))
    )
    list(stream_tokens(model, torch.zeros(1, 5, dtype=torch.long), BLOCK, SamplingParams(0)))
    # 16 steps: the 5-token prompt, then 1 token while the sequence grows from 6 to 16 tokens,
    # then the full window of 16 for sequences of 17 to 20 tokens
    assert seen_lengths == [5] + [1] * (BLOCK - 5) + [BLOCK] * 4


def test_a_prompt_longer_than_block_size_continues_its_last_block_size_tokens(model):
    prompt = torch.randint(0, 101, (1, BLOCK + 7))
    out = generate(model, prompt, 4, SamplingParams(temperature=0))
    cropped = generate(model, prompt[:, -BLOCK:], 4, SamplingParams(temperature=0))
    assert torch.equal(out[:, -4:], cropped[:, -4:])


def test_seeded_sampling_is_reproducible_and_the_seed_matters(model):
    prompt = torch.zeros(3, 1, dtype=torch.long)

    def sample(seed: int) -> torch.Tensor:
        return generate(
            model,
            prompt,
            20,
            SamplingParams(temperature=2.0),
            generator=torch.Generator().manual_seed(seed),
        )

    assert torch.equal(sample(7), sample(7))
    assert not torch.equal(sample(7), sample(8))


def test_rows_that_reach_end_of_text_stay_there_and_the_stream_ends_when_all_have(model):
    prompt = torch.tensor([[1], [2]])
    first = generate(model, prompt, 1, SamplingParams(temperature=0))[:, -1]
    assert first[0] != first[1]
    eot = int(first[0])  # row 0 ends at once, row 1 goes on
    steps = list(stream_tokens(model, prompt, 6, SamplingParams(temperature=0), eot_token=eot))
    assert len(steps) == 6
    assert all(step[0] == eot for step in steps)
    all_done = list(
        stream_tokens(model, torch.tensor([[1], [1]]), 6, SamplingParams(0), eot_token=eot)
    )
    assert len(all_done) == 1


def test_zero_new_tokens_returns_the_prompt(model):
    prompt = torch.tensor([[1, 2]])
    assert torch.equal(generate(model, prompt, 0), prompt)


def test_an_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="end-of-text"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)


def test_sampling_draws_only_tokens_that_survive_the_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(500, 1)
    context = torch.zeros(500, 1, dtype=torch.long)
    drawn = next_token(logits, context, SamplingParams(top_k=2), torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {0, 1}


def test_temperature_zero_is_greedy_and_the_repetition_penalty_applies_before_it():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    context = torch.tensor([[0]])
    assert next_token(logits, context, SamplingParams(temperature=0)).tolist() == [0]
    penalised = SamplingParams(temperature=0, repetition_penalty=2.0)  # 2.0 -> 1.0 < 1.5
    assert next_token(logits, context, penalised).tolist() == [1]


def test_low_temperature_concentrates_on_the_most_likely_token():
    logits = torch.tensor([[1.0, 0.9, 0.8]]).repeat(200, 1)
    context = torch.zeros(200, 1, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    assert set(next_token(logits, context, SamplingParams(temperature=1e-3), gen).tolist()) == {0}
    assert set(next_token(logits, context, SamplingParams(temperature=1.0), gen).tolist()) == {
        0,
        1,
        2,
    }


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("top_k", 0),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("temperature", True),
    ],
)
def test_invalid_sampling_params_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_boundary_sampling_params_are_accepted():
    SamplingParams(temperature=0, top_k=1, top_p=1.0, min_p=0.0, repetition_penalty=0.5)
    SamplingParams(min_p=1.0)


def test_padded_vocabulary_rows_are_never_drawn_greedy_or_sampled():
    """A model whose vocabulary is padded past the tokenizer's 40 tokens, its padded rows made
    the most likely: with vocab_size=40 none is ever drawn; without it (the control) they are."""
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=64)).eval()
    with torch.no_grad():
        model.lm_head.weight[40:] = 10 * model.lm_head.weight[40:].sign()
    idx = torch.zeros(4, 1, dtype=torch.long)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0)):
        gen = torch.Generator().manual_seed(0)
        out = generate(model, idx, 20, params, gen, vocab_size=40)
        assert out[:, 1:].max() < 40
        gen = torch.Generator().manual_seed(0)
        assert generate(model, idx, 20, params, gen).max() >= 40  # the control


def test_padded_rows_are_never_trained_toward():
    """Targets are the tokenizer's ids, so the loss gradient on every padded logit is its
    probability (> 0): training only lowers them; a real target's is negative."""
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=64))
    idx = torch.randint(0, 40, (2, 8))
    logits, loss = model(idx, torch.randint(0, 40, (2, 8)))
    (grad,) = torch.autograd.grad(loss, logits)
    assert (grad[..., 40:] > 0).all()
    assert (grad[..., :40] < 0).any()
