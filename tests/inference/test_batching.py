"""Jobs decoded together give each job's own single-sequence logits and tokens (generate.py's)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from data.tokenizer import get_tokenizer
from hardware.device import cpu_threads
from inference import batching
from inference.batching import Batcher, Job, RaggedKVCache
from inference.generate import SamplingParams, TextStream, TokenContext, next_token, stream_tokens
from model import GPT, GPTConfig
from model.causality import CausalityError, assert_causal, audit_function
from tests.conftest import tiny_config
from tests.model.conftest import ARCHITECTURES, random_projections

SETTINGS = [  # (prompt length, max_tokens, params, seed): windows restart past 16 tokens
    (5, 30, SamplingParams(temperature=0), 0),
    (1, 20, SamplingParams(temperature=0.9, top_k=50), 1),
    (12, 25, SamplingParams(temperature=1.2, top_p=0.9, repetition_penalty=1.3), 2),
    (16, 7, SamplingParams(temperature=0.7, min_p=0.05), 3),
]


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50304, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return GPT(config).eval()


def _jobs(model: GPT) -> list[Job]:
    tokenizer = get_tokenizer("gpt2")
    torch.manual_seed(1)
    return [
        Job(
            ids=torch.randint(0, 50257, (n,)).tolist(),
            params=params,
            max_tokens=max_tokens,
            generator=torch.Generator().manual_seed(seed),
            text=TextStream(tokenizer),
            emit=lambda *args: None,
        )
        for n, max_tokens, params, seed in SETTINGS
    ]


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_each_row_has_its_single_sequence_logits_and_tokens(model, quantize):
    """Jobs join at different steps (one after three steps) and leave at different steps; at
    every step each row's logits are TokenContext's for that job's tokens (within 1e-5), and
    each job's tokens are stream_tokens' for its settings and seed: with the weights in float32,
    and in 8 and 4 bits as sample.py's quantize= decodes them. On one thread: the 8- and 4-bit
    kernels' sums depend on the thread count, which stream_tokens' ThreadChoice varies."""
    with cpu_threads(1):
        batcher = Batcher(
            model, 50256, vocab_size=50257, max_batch=3, max_waiting=8, quantize=quantize
        )
        jobs = _jobs(model)
        assert batcher.submit(jobs[:3])
        contexts = {
            id(j): TokenContext(model, torch.tensor([j.ids]), vocab_size=50257, quantize=quantize)
            for j in jobs
        }
        for step in range(60):
            if step == 3:
                assert batcher.submit(jobs[3:])  # waits for a free row: max_batch is 3
            logits = batcher.step()
            if logits is None:
                break
            rows = list(batcher.active)
            assert 0 < len(rows) <= 3
            for row, job in enumerate(rows):
                context = contexts[id(job)]
                with torch.inference_mode():
                    expected = context.logits()[0]
                torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=0)
                context.append(torch.tensor(job.tokens[-1:]))
        assert batcher.step() is None and not batcher.active and not batcher.waiting
        for job, (_, max_tokens, params, seed) in zip(jobs, SETTINGS, strict=True):
            generator = torch.Generator().manual_seed(seed)
            steps = stream_tokens(
                model, torch.tensor([job.ids]), max_tokens, params, generator, vocab_size=50257,
                quantize=quantize,
            )  # fmt: skip
            assert job.tokens == [int(t) for t in steps]


def test_a_cancelled_job_leaves_and_a_full_batcher_refuses(model):
    batcher = Batcher(model, eot=50256, vocab_size=50257, max_batch=2, max_waiting=1)
    jobs = _jobs(model)
    assert batcher.submit(jobs[:3])
    assert not batcher.submit(jobs[3:])  # 2 decoding + 1 waiting: full
    batcher.step()
    assert batcher.counts() == {"active": 2, "waiting": 1}
    jobs[0].cancelled = True
    batcher.step()
    assert batcher.active == [jobs[1], jobs[2]]  # the last row moved up; the joiner came last


def _watched(jobs: list[Job], broken: set[int]) -> tuple[list[Job], dict, dict]:
    """The jobs with callbacks recording each one's finish reasons and ending event; job i in
    `broken` has a callback that raises on every token (a bug in its own handling)."""
    reasons = {i: [] for i in range(len(jobs))}
    ended = {i: threading.Event() for i in range(len(jobs))}

    def emit(which: int, job: Job, text: str, token: int, reason: str | None, logits) -> None:
        if which in broken and reason != "error":
            raise RuntimeError("a bug in a callback")
        if reason is not None:
            reasons[which].append(reason)
            ended[which].set()

    watched = [dataclasses.replace(j, emit=functools.partial(emit, i)) for i, j in enumerate(jobs)]
    return watched, reasons, ended


def test_a_failing_job_ends_alone_and_its_neighbours_decode_on(model):
    """A job whose own handling raises (its callback, here) ends with finish_reason "error";
    the job beside it in the batch decodes all its tokens, stream_tokens' for its seed."""
    batcher = Batcher(model, eot=50256, vocab_size=50257, max_batch=2, max_waiting=2)
    batcher.start()
    (broken, good), reasons, ended = _watched(_jobs(model)[:2], broken={0})
    assert batcher.submit([broken, good])
    assert ended[0].wait(120) and ended[1].wait(120)
    assert reasons == {0: ["error"], 1: ["length"]}
    _, max_tokens, params, seed = SETTINGS[1]
    steps = stream_tokens(
        model, torch.tensor([good.ids]), max_tokens, params, torch.Generator().manual_seed(seed)
    )
    assert good.tokens == [int(t) for t in steps]


def test_a_failing_forward_ends_its_jobs_and_the_worker_serves_on(model, monkeypatch):
    """A failure in the forward all rows share ends every job it held with "error"; the worker
    thread lives on and decodes the next job."""
    batcher = Batcher(model, eot=50256, vocab_size=50257, max_batch=2, max_waiting=2)
    (first, second, later), reasons, ended = _watched(_jobs(model)[:3], broken=set())
    forward = batcher.decoder.forward
    calls = iter(range(10**6))

    def fails_once(*args, **kwargs):
        if next(calls) == 1:  # the first step's forward (call 0: job 0's fill; job 1 needs none)
            raise RuntimeError("a failing forward")
        return forward(*args, **kwargs)

    monkeypatch.setattr(batcher.decoder, "forward", fails_once)
    assert batcher.submit([first, second])
    batcher.start()
    assert ended[0].wait(120) and ended[1].wait(120)
    assert reasons[0] == reasons[1] == ["error"]
    assert batcher.submit([later])
    assert ended[2].wait(120) and reasons[2] == ["length"] and len(later.tokens) == later.max_tokens


EXTREMES = dict(  # every setting in range, at its edges and past them (top_k past int64)
    temperature=st.one_of(st.floats(0, 2), st.sampled_from([1e-320, 1e-40, 1e6])),
    top_k=st.one_of(
        st.none(), st.integers(1, 60_000), st.sampled_from([50257, 2**63 - 1, 2**63, 2**80])
    ),
    top_p=st.one_of(st.none(), st.floats(0, 1, exclude_min=True), st.just(1e-46)),
    min_p=st.one_of(st.none(), st.floats(0, 1)),
    repetition_penalty=st.one_of(st.floats(1e-3, 10), st.sampled_from([1e-320, 1e-40, 1e300])),
)
NEIGHBOUR = st.tuples(  # (settings, seed, whether its draw raises: a bug, simulated)
    st.builds(SamplingParams, **EXTREMES), st.integers(0, 2**64 - 1), st.booleans()
)


@pytest.fixture(scope="module")
def small_model() -> GPT:
    """A 512-token vocabulary (GPT-2's first ids): many draws a second on a busy CPU."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=512, block_size=16, n_layer=1, n_head=1, n_embd=8)).eval()


@settings(max_examples=20, deadline=None, database=None)
@given(st.lists(NEIGHBOUR, min_size=1, max_size=3))
def test_no_row_fails_another(small_model, neighbours):
    """Beside up to three rows with any settings, and rows whose draw raises: the innocent job
    gets every token it draws alone; a row whose draw raises ends alone with "error", every
    other with its tokens. A batch whose one-pass draw fails (a top_k past int64 beside another
    top_k) draws row by row."""
    tokenizer, innocent = get_tokenizer("gpt2"), SamplingParams(temperature=0.9, top_k=50)
    rows = [(innocent, 1, False), *neighbours]
    jobs, reasons, _ = _watched(
        [
            Job(
                [1, 2, 3],
                params,
                8,
                torch.Generator().manual_seed(seed),
                TextStream(tokenizer),
                emit=lambda *args: None,
            )
            for params, seed, _ in rows
        ],  # fmt: skip
        broken=set(),
    )
    raising = {id(job.params) for job, (*_, raises) in zip(jobs, rows, strict=True) if raises}

    def draw(logits, context, params, generator):
        if raising & {id(p) for p in (params if isinstance(params, list) else [params])}:
            raise RuntimeError("a bug in one row's draw")
        return next_token(logits, context, params, generator)

    batcher = Batcher(small_model, eot=50256, vocab_size=512, max_batch=4, max_waiting=0)
    assert batcher.submit(jobs)
    with mock.patch.object(batching, "next_token", draw):
        while batcher.step() is not None:
            pass
    ids, generator = torch.tensor([[1, 2, 3]]), torch.Generator().manual_seed(1)
    alone = [int(t) for t in stream_tokens(small_model, ids, 8, innocent, generator)]
    assert jobs[0].tokens == alone and reasons[0] == ["length"]
    for job, (*_, raises), ended in zip(jobs, rows, reasons.values(), strict=True):
        assert ended == ["error"] if raises else ended in (["stop"], ["length"]), ended
        assert raises or len(job.tokens) <= 8


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
        cache = model.new_kv_cache(batch_size=4, kind=RaggedKVCache)
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


def ragged_decoding(model: GPT, ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """The server's batched decoding as a function of padded ids (B, T) -> logits (B, T, V),
    for the audit's padding check: each row's tokens (mask 1) in a row of one RaggedKVCache,
    the first half prefilled alone, then every unfinished row decoded together, one token a
    step, each at its own position (longest first: the unfinished rows stay a prefix)."""
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    rows = [ids[b][mask[b].bool()] for b in range(len(ids))]
    order = sorted(range(len(rows)), key=lambda b: -len(rows[b]))
    done = [(len(row) + 1) // 2 for row in rows]  # each row's prompt: half of it
    cache = model.new_kv_cache(batch_size=len(rows), kind=RaggedKVCache)
    out: list[list[torch.Tensor]] = [[] for _ in rows]
    for i, b in enumerate(order):
        cache.rows = slice(i, i + 1)
        out[b].append(model(rows[b][None, : done[b]], cache=cache)[0][0])  # (prompt, V)
    while live := [b for b in order if done[b] < len(rows[b])]:
        cache.rows = slice(0, len(live))
        step = model(torch.stack([rows[b][done[b] : done[b] + 1] for b in live]), cache=cache)
        for i, b in enumerate(live):
            out[b].append(step[0][i])  # (1, V)
            done[b] += 1
    logits = torch.zeros(*ids.shape, out[0][0].size(-1))
    for b, row in enumerate(out):
        logits[b, mask[b].bool()] = torch.cat(row)
    return logits


def test_ragged_batches_pass_the_audits_padding_check_and_a_late_mask_fails_it(monkeypatch):
    """Issue 57 item 3: our server's batched decoding through the same padding check as a
    transformers model's, rows of two lengths padded left and right. Each row gets what it gets
    alone; a RaggedKVCache whose mask follows the longest row (shorter rows see the empty keys
    past their end) fails it, at the first position that moves."""
    torch.manual_seed(0)
    model = random_projections(GPT(tiny_config(attention="sdpa"))).eval()
    decode = functools.partial(ragged_decoding, model)
    report = audit_function(decode, vocab_size=101, attention_mask=True, seq_len=12)
    assert report.causal and report.checks[1].name == "padding", str(report)
    assert report.checks[1].largest < 1e-5, str(report)

    def longest_rows_mask(self, causal_mask, T):
        positions = self.lengths[self.rows].max() + torch.arange(T)  # every row at the longest
        return causal_mask[positions, : int(positions.max()) + 1][None, None]

    monkeypatch.setattr(RaggedKVCache, "allowed", longest_rows_mask)
    with pytest.raises(CausalityError, match="padding: leak: logits: left-padded row 1's output"):
        assert_causal(decode, vocab_size=101, attention_mask=True, seq_len=12)


def test_batched_decoding_refuses_flash_attention():
    """flash's tiles take every row's queries to be its last keys: a ragged cache would be
    silently wrong, so the batcher refuses it."""
    with pytest.raises(ValueError, match="attention=manual or sdpa, not flash"):
        Batcher(GPT(tiny_config(attention="flash")), 0, 101, max_batch=2, max_waiting=0)


def test_rows_are_shared_fairly_and_a_paused_job_draws_its_own_tokens(model):
    """Issue 56 item 5: client A's four jobs hold every row of a batch of 4 (its fifth waits);
    B's job, sent later, gets a row at the next step, given back by A (over its share, 2 of 4),
    and the paused job rejoins before A's fifth; each job's tokens are still the ones it draws
    alone (stream_tokens), the paused one's included; a client holding no job queues past a
    queue that A filled (among max_batch kept past it), A itself does not."""
    batcher = Batcher(model, eot=50256, vocab_size=50257, max_batch=4, max_waiting=1)
    hog = [dataclasses.replace(job, client="A") for job in _jobs(model) + _jobs(model)[:1]]
    hog[4].generator = torch.Generator().manual_seed(9)
    assert batcher.submit(hog)
    batcher.step()
    batcher.step()
    assert batcher.active == hog[:4] and batcher.waiting == [hog[4]]
    innocent = dataclasses.replace(_jobs(model)[1], client="B")
    assert not batcher.submit([dataclasses.replace(_jobs(model)[0], client="A")])  # A is full
    assert batcher.submit([innocent])  # B holds at most max_batch: a place past the full queue
    batcher.step()
    assert innocent in batcher.active and sum(job.client == "A" for job in batcher.active) == 3
    paused = next(job for job in hog[:4] if job not in batcher.active)
    assert batcher.waiting[:2] == [paused, hog[4]] and len(paused.tokens) == 2
    while batcher.step() is not None:
        pass
    for job, seed in zip(hog + [innocent], [0, 1, 2, 3, 9, 1], strict=True):
        generator = torch.Generator().manual_seed(seed)
        alone = stream_tokens(
            model, torch.tensor([job.ids]), job.max_tokens, job.params, generator, vocab_size=50257
        )
        assert job.tokens == [int(t) for t in alone]


@given(st.lists(st.sampled_from("ABC"), min_size=1, max_size=12))
@settings(max_examples=40, deadline=None, database=None)
def test_no_client_holds_more_than_its_share_while_another_waits(small_model, clients):
    """Jobs of random clients, submitted one at a time with a step between: after every step,
    a client with a waiting job holds at least its share of the rows (max_batch over the
    clients with jobs, at least 1), or no client holds more than that share."""
    batcher = Batcher(small_model, eot=0, vocab_size=512, max_batch=3, max_waiting=20)
    for client in clients:
        text, greedy = TextStream(get_tokenizer("gpt2")), SamplingParams(temperature=0)
        job = Job([1, 2], greedy, 6, torch.Generator(), text, lambda *args: None, client=client)
        assert batcher.submit([job])
        batcher.step()
        held = {c: sum(j.client == c for j in batcher.active) for c in "ABC"}
        waiting = {j.client for j in batcher.waiting}
        share = max(1, 3 // len(waiting | {j.client for j in batcher.active}))
        assert len(batcher.active) == 3 or not waiting  # no row idle while a job waits
        for client_waiting in waiting:
            assert held[client_waiting] >= share or max(held.values()) <= share


def test_bfloat16_rows_batched_differ_from_alone_by_no_more_than_bfloat16_itself(model):
    """Issue 56 item 6, as docs/serving.md says it: in bfloat16 a row's logits batched are not
    its logits alone (a matrix product rounds its sums in an order set by the batch's shape),
    but they differ by no more than twice what bfloat16 alone differs from float32; in float32
    they agree within 1e-5 (the first test of this file). The draw after them is float32."""
    half = copy.deepcopy(model).to(torch.bfloat16)
    batcher = Batcher(half, eot=50256, vocab_size=50257, max_batch=4, max_waiting=0)
    jobs = _jobs(model)
    assert batcher.submit(jobs)
    alone = {id(j): TokenContext(half, torch.tensor([j.ids]), vocab_size=50257) for j in jobs}
    exact = {id(j): TokenContext(model, torch.tensor([j.ids]), vocab_size=50257) for j in jobs}
    batched_gap = bfloat16_gap = 0.0
    for _ in range(12):
        logits = batcher.step()
        for row, job in enumerate(batcher.active):
            with torch.inference_mode():
                own, full = alone[id(job)].logits()[0].float(), exact[id(job)].logits()[0]
            batched_gap = max(batched_gap, (logits[row].float() - own)[:50257].abs().max().item())
            bfloat16_gap = max(bfloat16_gap, (own - full)[:50257].abs().max().item())
            for context in (alone[id(job)], exact[id(job)]):
                context.append(torch.tensor(job.tokens[-1:]))
    assert bfloat16_gap > 0 and batched_gap <= 2 * bfloat16_gap
