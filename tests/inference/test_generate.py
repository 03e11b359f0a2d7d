"""Generation: the KV cache changes the speed, never the tokens; the window each token sees is
the documented one (half to a full block_size); sampling is seeded, filtered and exact; on a
CPU, decoding runs on the thread count measured faster, with the same logits at either."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hardware import device
from hardware.device import THREAD_TRIALS, cpu_threads
from inference.generate import (
    SamplingParams,
    TokenContext,
    generate,
    next_token,
    stream_tokens,
)
from model import GPT
from tests.conftest import tiny_config
from tests.model.conftest import ARCHITECTURES, TRITON_OPTIONS, matrix

BLOCK = 16  # tiny_config's block_size


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_config()).eval()


def window_start(length: int, start: int, block: int = BLOCK) -> int:
    """The documented window, written out independently of TokenContext: it grows from the
    start until it would hold more than block tokens, then restarts at the last block // 2."""
    return length - block // 2 if length - start > block else start


def reference_logits(model: GPT, seq: torch.Tensor, start: int) -> torch.Tensor:
    """The definition the cached path must reproduce: a fresh forward over the window alone."""
    return model(seq[:, start:])[0][:, -1]


def test_cached_logits_match_a_fresh_forward_over_the_window_at_every_step(model):
    torch.manual_seed(1)
    seq = torch.randint(0, 101, (2, 4 * BLOCK))
    context = TokenContext(model, seq[:, :5], use_cache=True)
    start = 0
    with torch.no_grad():
        for t in range(5, seq.size(1)):
            start = window_start(t, start)
            assert BLOCK // 2 <= t - start <= BLOCK or t - start == t  # half a window to a full one
            torch.testing.assert_close(
                context.logits(), reference_logits(model, seq[:, :t], start), atol=1e-5, rtol=0
            )
            context.append(seq[:, t])
    assert start > 2 * BLOCK  # the window restarted several times


@pytest.mark.parametrize("arch,impl", matrix(list(ARCHITECTURES), TRITON_OPTIONS))
def test_greedy_cached_decoding_equals_a_from_scratch_reference_across_refills(arch, impl):
    torch.manual_seed(0)
    model = GPT(tiny_config(**ARCHITECTURES[arch], attention=impl)).eval()
    prompt = torch.tensor([[1, 2, 3], [7, 5, 3]])
    out = generate(model, prompt, 3 * BLOCK, SamplingParams(temperature=0))
    start = 0
    with torch.no_grad():
        for t in range(prompt.size(1), out.size(1)):
            start = window_start(t, start)
            expected = reference_logits(model, out[:, :t], start).argmax(dim=-1)
            assert torch.equal(out[:, t], expected), f"token {t} differs"
    assert start >= 2 * BLOCK // 2  # at least two refills happened


def test_greedy_generation_with_the_cache_equals_generation_without_it(model):
    prompt = torch.tensor([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]])
    greedy = SamplingParams(temperature=0)
    cached = generate(model, prompt, 3 * BLOCK, greedy, use_cache=True)
    uncached = generate(model, prompt, 3 * BLOCK, greedy, use_cache=False)
    assert cached.shape == (2, 5 + 3 * BLOCK)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, :5], prompt)


def test_the_prompt_is_processed_once_then_one_token_per_step_and_half_a_window_per_refill(
    model,
):
    seen_lengths = []
    model.transformer.wte.register_forward_hook(
        lambda m, args, out: seen_lengths.append(out.size(1))
    )
    list(stream_tokens(model, torch.zeros(1, 5, dtype=torch.long), 24, SamplingParams(0)))
    # 24 steps: the 5-token prompt; 1 token while the sequence grows from 6 to 16 tokens; at 17
    # the window would hold 17: it restarts from the last 8 tokens (one forward over 8); 1 token
    # while it grows back from 9 to 16 (sequences of 18 to 25); at 26 the next restart, over 8
    # again; then 1 token for 27 and 28.
    half = BLOCK // 2
    assert seen_lengths == [5] + [1] * (BLOCK - 5) + [half] + [1] * half + [half] + [1] * 2


def test_the_head_runs_at_the_last_position_only(model):
    seen = []  # the shapes of the logits of each forward (a decoding copy keeps the hook)
    model.register_forward_hook(lambda gpt, args, out: seen.append(tuple(out[0].shape)))
    list(stream_tokens(model, torch.zeros(1, 5, dtype=torch.long), 3 * BLOCK, SamplingParams(0)))
    list(stream_tokens(model, torch.zeros(1, 5, dtype=torch.long), 3 * BLOCK, use_cache=False))
    assert set(seen) == {(1, 1, model.config.vocab_size)}  # one position of one row, every step


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


def test_generation_decodes_on_the_thread_count_measured_faster_with_the_same_logits(monkeypatch):
    """A core busy with other work, injected as a clock on which a step takes 10 s on `slow`
    threads and 1 s on the other count: after its trial steps, generation decodes on the other
    count; torch's count is restored; and every step's logits are the same bits at either count
    (the blocks fix the order of the sums)."""
    torch.manual_seed(0)
    model = GPT(tiny_config(n_embd=64, n_head=4, vocab_size=512)).eval()  # BLAS-sized blocks
    logits, clock, slow, steps = TokenContext.logits, [0.0], 0, []

    def spy(self: TokenContext) -> torch.Tensor:
        threads = torch.get_num_threads()
        clock[0] += 10.0 if threads == slow else 1.0
        steps.append((threads, logits(self)))
        return steps[-1][1]

    monkeypatch.setattr(TokenContext, "logits", spy)
    monkeypatch.setattr(device, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    trials, runs = 1 + 2 * THREAD_TRIALS, {}  # the prompt's step, then the trial steps
    with cpu_threads(2):  # a decoding copy in 2 blocks
        for slow in (2, 1):
            steps = []
            prompt, params = torch.tensor([[1, 2, 3]]), SamplingParams(temperature=0)
            tokens = generate(model, prompt, trials + 4, params)
            fast = steps[9 if slow == 2 else trials :]  # 2 threads twice as slow: 4 trials each
            assert {threads for threads, _ in fast} == {3 - slow}
            assert torch.get_num_threads() == 2
            runs[slow] = tokens, torch.cat([step for _, step in steps])
    assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[2], strict=True))


def chi_square(draws: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs.double() * draws.numel()
    return float(((counts - expected) ** 2 / expected).sum())


PLAIN = SamplingParams(temperature=1.0, top_k=None)  # the softmax itself, no filter


def test_the_sampling_defaults_are_sample_yamls(sample_cfg):
    """Written once, in configs/sample.yaml: what sample.py, the trainer's samples and any
    caller of stream_tokens without params draw with."""
    cfg = sample_cfg()
    assert SamplingParams() == SamplingParams(
        **{f.name: cfg[f.name] for f in dataclasses.fields(SamplingParams)}
    )
    assert SamplingParams().temperature == 0.8 and SamplingParams().top_k == 200


def test_sampling_draws_each_token_with_its_softmax_probability():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    probs = torch.softmax(logits, dim=-1)
    n = 40_000
    drawn = next_token(
        logits.repeat(n, 1),
        torch.zeros(n, 1, dtype=torch.long),
        PLAIN,
        torch.Generator().manual_seed(0),
    )
    # chi-square with 4 degrees of freedom: 18.47 is its 0.999 quantile
    assert chi_square(drawn, probs) < 18.47
    reference = torch.multinomial(
        probs, n, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    assert chi_square(reference, probs) < 18.47  # torch.multinomial passes the same test
    # the control: a draw biased towards the likeliest token (temperature 0.9) fails it
    biased = torch.multinomial(torch.softmax(logits / 0.9, -1), n, replacement=True)
    assert chi_square(biased, probs) > 18.47


def test_sampling_draws_only_tokens_that_survive_the_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(500, 1)
    context = torch.zeros(500, 1, dtype=torch.long)
    drawn = next_token(logits, context, SamplingParams(top_k=2), torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {0, 1}


def test_a_uniform_rounded_up_to_the_total_still_draws_a_token_that_has_probability(
    monkeypatch,
):
    """Inverse-CDF sampling: u * total can round up to the total, past every cumulative sum;
    the draw is then the last token with any probability, never a filtered or padded one."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    context = torch.zeros(1, 1, dtype=torch.long)
    monkeypatch.setattr(
        torch, "rand", lambda *shape, generator, dtype: torch.ones(*shape, dtype=dtype)
    )
    drawn = next_token(logits, context, SamplingParams(top_k=2), torch.Generator())
    assert drawn.tolist() == [1]  # tokens 2-4 have probability 0 after top_k=2
    unfiltered = next_token(logits, context, PLAIN, torch.Generator())
    assert unfiltered.tolist() == [4]  # the control: with no filter the last token is drawable


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
    "params",
    [
        SamplingParams(temperature=1e-40),  # logits / 1e-40 overflow: every probability NaN
        SamplingParams(repetition_penalty=1e-40),  # the seen token's logit overflows to inf
        SamplingParams(top_p=1e-46),  # rounds to 0 in float32: it removed every token
        SamplingParams(temperature=1e-40, top_k=2, top_p=1e-46, min_p=1.0),
    ],
)
def test_settings_near_zero_draw_the_greedy_token_never_one_past_the_vocabulary(params):
    """Valid settings whose arithmetic leaves no distribution draw their limit, the greedy
    token of the (penalised) logits, in every row: never an id past the vocabulary."""
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0], [2.0, 1.0, 0.0, 2.5]])
    context = torch.tensor([[1], [3]])
    greedy = next_token(logits, context, dataclasses.replace(params, temperature=0))
    drawn = next_token(logits, context, params, torch.Generator().manual_seed(0))
    assert drawn.tolist() == greedy.tolist()
    assert greedy.tolist() == [1, 3]


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


def test_boundary_sampling_params_are_accepted_and_draw_their_limit():
    """The limits the checks accept are valid settings: top_k=1 and min_p=1.0 leave only the
    most likely token, whatever the draw (top_p=1.0 and min_p=0.0 filter nothing)."""
    logits, context = torch.tensor([[0.5, 3.0, 1.0, -2.0]]), torch.tensor([[0]])
    generator = torch.Generator().manual_seed(0)
    for params in (
        SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0, repetition_penalty=0.5),
        SamplingParams(temperature=1.0, min_p=1.0),
    ):
        assert [int(next_token(logits, context, params, generator)) for _ in range(20)] == [1] * 20


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
    logits, _ = model(idx)  # the loss forward computes from them (tests/model/test_options.py)
    loss = F.cross_entropy(logits.view(-1, 64), torch.randint(0, 40, (16,)))
    (grad,) = torch.autograd.grad(loss, logits)
    assert (grad[..., 40:] > 0).all()
    assert (grad[..., :40] < 0).any()


MIXED = [  # a server's batch: every row its own settings
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.9, top_k=5, top_p=None),
    SamplingParams(temperature=1.2, top_k=None, top_p=0.8, repetition_penalty=1.3),
    SamplingParams(temperature=0.7, top_k=None, min_p=0.1),
    SamplingParams(temperature=0, repetition_penalty=2.0),
    SamplingParams(),  # sample.yaml's
]


def test_a_batch_of_rows_with_their_own_settings_draws_what_each_row_draws_alone():
    """One pass over rows with their own settings, contexts and generators gives, step after
    step, the tokens each row's own call gives with the same seed."""
    torch.manual_seed(0)
    contexts = [torch.randint(0, 50, (1, n)) for n in (3, 7, 1, 12, 5, 9)]
    alone = [torch.Generator().manual_seed(i) for i in range(len(MIXED))]
    together = [torch.Generator().manual_seed(i) for i in range(len(MIXED))]
    for _ in range(50):
        logits = torch.randn(len(MIXED), 50) * 3
        one_by_one = [
            int(next_token(logits[r : r + 1], contexts[r], MIXED[r], alone[r]))
            for r in range(len(MIXED))
        ]
        assert next_token(logits, contexts, MIXED, together).tolist() == one_by_one
        contexts = [
            torch.cat([c, torch.tensor([[t]])], 1)
            for c, t in zip(contexts, one_by_one, strict=True)
        ]
