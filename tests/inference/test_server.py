"""`python serve.py` against real clients: OpenAI's own Python package, and raw HTTP for what a
client library never sends (malformed JSON, hang-ups, oversized bodies)."""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from urllib.parse import urlsplit

import hypothesis
import openai
import pytest
import torch
from hypothesis import strategies as st

from checkpoints.store import load_source
from data.chat import chat_tokenizer
from data.tokenizer import get_tokenizer
from hardware.device import cpu_threads
from inference.cli import run
from inference.generate import TokenContext, next_token
from inference.server import ApiError, CompletionRequest, Reply, Server
from model import GPT, GPTConfig
from tests.inference.conftest import JSON, SERVE_PY, request, wait_until_idle


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def complete(url: str, **fields) -> openai.types.Completion:
    return client(url).completions.create(model="causalgpt", **fields)


def test_a_completion_through_the_openai_client(server):
    done = complete(server, prompt="To be, or not", max_tokens=8, temperature=0)
    (choice,) = done.choices
    assert done.object == "text_completion" and choice.index == 0 and choice.text
    assert choice.finish_reason == "length"
    assert done.usage.completion_tokens == 8
    assert done.usage.prompt_tokens == 5 and done.usage.total_tokens == 13  # To, be, ",", or, not
    models = client(server).models.list()
    assert [m.id for m in models.data] == [done.model] == ["run"]  # the run directory's name


def test_the_same_tokens_as_sample_py(server, serve_checkpoint, sample_cfg):
    """For the same seed and settings (sample.py's defaults: temperature 0.8, top_k 200), and
    greedy; 40 tokens run past the 32-token window, which restarts."""
    for settings in (["temperature=0.8", "top_k=200"], ["temperature=0", "top_k=null"]):
        cfg = sample_cfg(
            f"checkpoint={serve_checkpoint}",
            "prompt='Hello there'",
            "max_new_tokens=40",
            "seed=7",
            "stream=false",
            *settings,
        )
        (expected,) = run(cfg, out=io.StringIO(), err=io.StringIO())
        extra = {"top_k": cfg.top_k} if cfg.top_k else {}
        done = complete(
            server,
            prompt="Hello there",
            max_tokens=40,
            seed=7,
            temperature=cfg.temperature,
            extra_body=extra,
        )
        assert done.choices[0].text == expected


def test_quantized_serving_decodes_as_sample_py_does(start_server, serve_checkpoint, sample_cfg):
    """quantize=int8: the same text as `sample.py quantize=int8` for the same seed, and logprobs
    from the 8-bit weights, not the float32 ones (both on one thread: the 8-bit kernel's sums
    change with the thread count)."""
    url = start_server("quantize=int8", env={"OMP_NUM_THREADS": "1"})[0]
    assert request(url, "GET", "/api/info")[2]["quantize"] == "int8"
    cfg = sample_cfg(
        f"checkpoint={serve_checkpoint}", "prompt='Hello there'", "max_new_tokens=40", "seed=7",
        "stream=false", "quantize=int8",
    )  # fmt: skip
    with cpu_threads(1):
        (expected,) = run(cfg, out=io.StringIO(), err=io.StringIO())
        model = load_source(serve_checkpoint).model.eval()
        ids = torch.tensor([get_tokenizer("gpt2").encode("Hello there")])
        with torch.inference_mode():
            first = {
                q: TokenContext(model, ids, vocab_size=50257, quantize=q).logits()[0]
                for q in (None, "int8")
            }
    done = complete(url, prompt="Hello there", max_tokens=40, seed=7, temperature=0.8, logprobs=1,
                    extra_body={"top_k": 200})  # fmt: skip
    assert done.choices[0].text == expected
    token = get_tokenizer("gpt2").encode(done.choices[0].logprobs.tokens[0])[0]
    logprob = {q: float(logits.log_softmax(-1)[token]) for q, logits in first.items()}
    assert abs(done.choices[0].logprobs.token_logprobs[0] - logprob["int8"]) < 1e-5
    assert abs(logprob["int8"] - logprob[None]) > 1e-4  # the test tells the weights apart


def test_streaming_gives_the_same_text_in_chunks_and_ends_with_done(server):
    fields = dict(prompt="Hello", max_tokens=12, seed=3, temperature=1.0)
    whole = complete(server, **fields).choices[0].text
    chunks = list(complete(server, stream=True, **fields))
    assert len(chunks) == 12  # one per token; the client consumed `data: [DONE]` to stop
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert [c.choices[0].finish_reason for c in chunks] == [None] * 11 + ["length"]


def test_a_stop_string_ends_the_text_before_it(server):
    text = complete(server, prompt="Hello", max_tokens=20, temperature=0).choices[0].text
    stop = text[6:9]
    done = complete(server, prompt="Hello", max_tokens=20, temperature=0, stop=[stop, "zzzz"])
    assert done.choices[0].text == text[: text.index(stop)]
    assert done.choices[0].finish_reason == "stop"


def test_n_choices_and_seeds_reproduce(server):
    """Choice i of n draws from seed + i: the same request twice gives the same texts, and each
    choice is the single completion of its seed."""
    fields = dict(prompt=["Once", "Twice"], max_tokens=10, temperature=1.0, seed=11)
    first = complete(server, n=3, **fields)
    assert [c.index for c in first.choices] == list(range(6))
    assert complete(server, n=3, **fields).choices == first.choices
    single = complete(server, prompt="Twice", max_tokens=10, temperature=1.0, seed=11 + 4)
    assert single.choices[0].text == first.choices[4].text
    texts = {c.text for c in first.choices}
    assert len(texts) == 6  # different seeds: different texts
    echoed = complete(server, prompt="Once", max_tokens=3, echo=True, seed=11, logprobs=2)
    assert (
        echoed.choices[0].text == "Once" + first.choices[0].text[: len(echoed.choices[0].text) - 4]
    )
    logprobs = echoed.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 3
    assert all(len(top) == 2 and max(top.values()) <= 0 for top in logprobs.top_logprobs)


def test_concurrent_requests_give_their_one_at_a_time_texts(server):
    requests = [
        dict(
            prompt="Hello " * (i % 5 + 1),
            max_tokens=20 + 3 * i,
            seed=i,
            temperature=0.2 * (i % 4),
            top_p=1.0 if i % 3 else 0.9,
            extra_body={"repetition_penalty": 1.0 + 0.1 * (i % 2)},
        )
        for i in range(10)
    ]
    alone = [complete(server, **r).choices[0].text for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: complete(server, **r).choices[0].text, requests))
    assert together == alone


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_frees_its_place(server, stream):
    """A client asks for 1000 tokens and hangs up (streaming: after the first event): its job
    leaves the batch, and the server answers the next request."""
    connection = http.client.HTTPConnection(urlsplit(server).netloc, timeout=120)
    body = {"prompt": "Hello", "max_tokens": 1000, "stream": stream}
    connection.request("POST", "/v1/completions", json.dumps(body).encode(), JSON)
    if stream:
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: {")
    else:  # wait until the job decodes, then hang up without reading
        deadline = time.monotonic() + 60
        while request(server, "GET", "/api/info")[2]["active"] == 0:
            assert time.monotonic() < deadline
    connection.sock.close()
    connection.close()
    wait_until_idle(server)
    assert complete(server, prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"


def test_a_whole_reply_whose_client_hangs_up_cancels_its_jobs():
    """The non-streamed answer: the client's hang-up ends the wait for pieces and cancels every
    job, so the batcher drops them at its next step, not after their max_tokens (the test
    above cannot tell: a job that runs out frees its place too)."""

    class HungUp:
        async def receive(self) -> dict:
            return {"type": "http.disconnect"}

    jobs = [SimpleNamespace(cancelled=False, ids=[1, 2], tokens=[]) for _ in range(2)]
    answer = asyncio.run(
        Reply({"id": "cmpl-1"}, jobs, asyncio.Queue(), 2, False, []).whole(HungUp())
    )
    assert all(job.cancelled for job in jobs)
    assert [c["finish_reason"] for c in answer["choices"]] == [None, None]


TOO_LONG = "Hello " * 40  # 41 tokens, more than the model's 32-token window


@pytest.mark.parametrize(
    "body, status, param, says",
    [
        (b'{"prompt": "Hi", "max_tokens": ', 400, None, "not JSON"),
        (b"\xff\xfe not utf-8", 400, None, "not UTF-8"),
        (b'["a", "list"]', 400, None, "must be a JSON object, not list"),
        (b"[" * 10_000 + b"]" * 10_000, 400, None, "not JSON"),  # nested past Python's stack
        ({"max_tokens": 5}, 400, "prompt", "Field required"),
        ({"prompt": "x" * (32 * 128 + 1)}, 400, "prompt", "4097 characters, over 32 tokens"),
        ({"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
        ({"prompt": 5}, 400, "prompt", "valid string"),
        ({"prompt": "Hi", "stream": "yes"}, 400, "stream", "valid boolean"),
        ({"prompt": "Hi", "temperature": 3}, 400, "temperature", "less than or equal to 2"),
        ({"prompt": "Hi", "top_p": 0}, 400, "top_p", "greater than 0"),
        ({"prompt": "Hi", "n": 0}, 400, "n", "greater than or equal to 1"),
        ({"prompt": "Hi", "n": 9}, 400, "n", "at most 8"),
        ({"prompt": "Hi", "max_tokens": 5000}, 400, "max_tokens", "at most 1024"),
        (
            {"prompt": ["x"] * 8, "n": 8, "max_tokens": 1024},  # issue 56's first hog
            400,
            "max_tokens",
            "at most 8192 x n x prompts (max_request_tokens=8192): ask less, got 65536",
        ),
        ({"prompt": "Hi", "frequency_penalty": 1}, 400, "frequency_penalty", "not implemented"),
        ({"prompt": "Hi", "logit_bias": {}}, 400, "logit_bias", "Extra inputs"),
        ({"prompt": "Hi", "bogus": 1}, 400, "bogus", "Extra inputs"),
        ({"prompt": TOO_LONG}, 400, "prompt", "tokens, over the limit of 32"),
        ({"prompt": []}, 400, "prompt", "must not be empty"),
        ({"prompt": "Hi", "stop": ""}, 400, "stop", "must not be empty"),
        ({"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
        ({"prompt": "Hi", "seed": -1}, 400, "seed", "greater than or equal to 0"),
        (b"{" + b" " * 1_000_001 + b"}", 413, None, "over 1000000 bytes"),
    ],
)
def test_a_bad_request_gets_openais_error_shape(server, body, status, param, says):
    code, headers, answer = request(server, "POST", "/v1/completions", body)
    assert headers.get("connection") == ("close" if status == 413 else None)  # the rest unread
    assert code == status
    assert set(answer) == {"error"} and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param
    assert says in answer["error"]["message"]
    assert complete(server, prompt="Hi", max_tokens=1).choices  # still serving


def test_a_lone_surrogate_is_a_400_and_a_pair_is_text(server):
    """Issue 50 item 4: "\\ud800" (as json.dumps escapes it) echoed was a 500; so was issue
    56's, the surrogate encoded straight into the bytes; UTF-16 and UTF-32 bodies (which
    json.loads takes) are not UTF-8. A pair, as json.dumps escapes an emoji, is that emoji."""
    fields = {"max_tokens": 2, "echo": True}
    status, _, answer = request(server, "POST", "/v1/completions", {"prompt": "\ud800", **fields})
    assert status == 400 and "lone surrogate" in answer["error"]["message"]
    assert answer["error"]["param"] == "prompt"
    raw = json.dumps({"prompt": "a\ud800", **fields}, ensure_ascii=False)
    for body, says in [
        (raw.encode("utf-8", "surrogatepass"), "not UTF-8"),  # b'a\xed\xa0\x80'
        (json.dumps({"prompt": "a", **fields}).encode("utf-16"), "not UTF-8"),
        (json.dumps({"prompt": "a", **fields}).encode("utf-32"), "not UTF-8"),
        (json.dumps({"\udc00": 1, "prompt": "a"}).encode(), "lone surrogate"),  # in a name
    ]:
        status, _, answer = request(server, "POST", "/v1/completions", body)
        assert status == 400 and says in answer["error"]["message"], (body, answer)
    status, _, answer = request(server, "POST", "/v1/completions", {"prompt": "🎭", **fields})
    assert status == 200 and answer["choices"][0]["text"].startswith("🎭")


def test_the_openai_client_sees_a_bad_request_as_one(server):
    with pytest.raises(openai.BadRequestError) as raised:
        complete(server, prompt="Hi", max_tokens=0)
    assert raised.value.status_code == 400 and raised.value.param == "max_tokens"


def test_nothing_is_served_but_the_page_and_the_api(server):
    status, headers, page = request(server, "GET", "/", parse=bytes.decode)
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "<h1>causalgpt</h1>" in page and "://" not in page  # nothing from elsewhere
    for path in ("/docs", "/openapi.json", "/inference/page.html", "/../serve.py", "/v1/chat"):
        status, _, answer = request(server, "GET", path)
        assert status == 404 and answer["error"]["message"] == "Not Found"
    assert request(server, "GET", "/v1/completions")[0] == 405


def test_the_api_key_is_required_when_set(start_server):
    url, _ = start_server(env={"CAUSALGPT_API_KEY": "s3cret"})
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").completions.create(model="m", prompt="Hi", max_tokens=1)
    for path in ("/v1/models", "/api/info"):
        status, _, answer = request(url, "GET", path)
        assert status == 401 and "API key" in answer["error"]["message"]
    done = client(url, "s3cret").completions.create(model="m", prompt="Hi", max_tokens=1)
    assert done.choices[0].finish_reason == "length"
    assert request(url, "GET", "/", parse=bytes.decode)[0] == 200  # the page holds no data


def test_a_full_queue_answers_429_with_retry_after(start_server):
    """One completion at a time and none waiting: while one streams, the next is refused; a
    request for more completions than the server holds at once is a 400 that says so."""
    url, _ = start_server("max_batch=1", "max_queue=0", "api_key=k", "name=bard")
    key = {"Authorization": "Bearer k"}
    status, _, answer = request(url, "POST", "/v1/completions", {"prompt": "Hi", "n": 2}, key)
    assert status == 400 and answer["error"]["param"] == "n"
    assert (
        "at most 1 completions (n x prompts), max_batch + max_queue" in answer["error"]["message"]
    )
    assert request(url, "GET", "/v1/models", headers=key)[2]["data"][0]["id"] == "bard"
    connection = http.client.HTTPConnection(urlsplit(url).netloc, timeout=120)
    body = json.dumps({"prompt": "Hello", "max_tokens": 1000, "stream": True}).encode()
    connection.request("POST", "/v1/completions", body, {**JSON, "Authorization": "Bearer k"})
    assert connection.getresponse().readline().startswith(b"data: {")
    status, headers, answer = request(
        url, "POST", "/v1/completions", {"prompt": "Hi"}, {"Authorization": "Bearer k"}
    )
    assert status == 429 and headers["Retry-After"] == "1" and "full" in answer["error"]["message"]
    connection.sock.close()
    connection.close()


@pytest.mark.parametrize(
    "args, says",
    [
        (["port=70000"], "error: port must be an integer in [0, 65535], got 70000"),
        (["max_batch=0"], "error: max_batch must be an integer >= 1, got 0"),
        (["body_timeout_s=0"], "error: body_timeout_s must be positive, got 0"),
        (["max_connections=0"], "error: max_connections must be an integer >= 1, got 0"),
        (["allowed_hosts=[]"], "error: allowed_hosts must be a list of host names like"),
        (["allowed_hosts=[5]"], "error: allowed_hosts must be a list of host names like"),
        (["checkpoint=/no/such/run"], "error: "),
        (["host=0.0.0.0", "checkpoint=/no/such/run"], "warning: host=0.0.0.0: anyone who can"),
        (["page_tokens=100000"], "error: page_tokens must be at most the model's block_size, 32"),
        (["max_prompt_tokens=33"], "error: max_prompt_tokens must be at most the model's"),
        (["port=TAKEN"], "error: cannot listen on 127.0.0.1:TAKEN: Address already in use;"),
        (["max_connections_per_client=200"], "error: max_connections_per_client must be at most"),
        (["api_key=k", "api_key_file=keys"], "error: api_key and api_key_file are both set"),
        (["api_key_file=/no/keys"], "error: api_key_file /no/keys does not exist"),
        (["api_key=[k, 5]"], "error: api_key must be a string, a list of strings, or null"),
        (["quantize=int2"], "error: quantize must be int8, int4, or null: the weights as stored"),
    ],
)
def test_a_bad_config_is_one_error_line_and_exit_2(args, says, tmp_path, serve_checkpoint):
    """Issue 50 item 12: page_tokens (and max_prompt_tokens) over the model's block_size were
    cut to it without a word; they are refused."""
    if not any(a.startswith("checkpoint=") for a in args):
        args = [f"checkpoint={serve_checkpoint}", *args]
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a port another program holds
        port = str(taken.getsockname()[1])
        done = subprocess.run(
            [sys.executable, str(SERVE_PY), *(a.replace("TAKEN", port) for a in args)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
    says = says.replace("TAKEN", port)
    assert done.returncode == 2
    assert done.stderr.startswith(says)
    assert done.stderr.strip().splitlines()[-1].startswith("error: ")
    assert len(done.stderr.strip().splitlines()) == 1 + says.startswith("warning")


def test_the_pages_endpoints_are_bounded_and_show_causality(server):
    """/api/attention: S of every head, over at most page_tokens tokens (here the 32 of the
    model's window); /api/causality: replacing token j moves nothing before j."""
    status, _, view = request(server, "POST", "/api/attention", {"text": TOO_LONG})
    assert status == 200 and view["truncated"] and len(view["ids"]) == len(view["tokens"]) == 32
    heads = view["heads"]  # (n_layer, n_head, T, T)
    assert (len(heads), len(heads[0]), len(heads[0][0])) == (2, 2, 32)
    for S in (S for layer in heads for S in layer):
        assert all(S[i][j] == 0 for i in range(32) for j in range(i + 1, 32))
        assert all(abs(sum(row) - 1) < 1e-4 for row in S)
    edit = {"ids": view["ids"][:20], "position": 7, "replacement": " cat"}
    status, _, result = request(server, "POST", "/api/causality", edit)
    assert status == 200 and result["ids"][7] != view["ids"][7]
    assert result["before"] == 0.0 and result["differences"][:7] == [0.0] * 7
    assert result["from"] > 0 and result["differences"][7] > 0
    for bad, param in [
        ({**edit, "replacement": " cat dog"}, "replacement"),
        ({**edit, "position": 20}, "position"),
        ({**edit, "ids": [50257]}, "ids"),
        ({**edit, "ids": view["ids"] * 2}, "ids"),
        ({"text": 5}, "text"),
    ]:
        path = "/api/attention" if "text" in bad else "/api/causality"
        status, _, answer = request(server, "POST", path, bad)
        assert status == 400 and answer["error"]["param"] == param, answer


def test_the_formula_view_shows_the_attention_views_s_step_by_step(server):
    """/api/formula: one layer and head of the formula over the attention view's tokens, its S
    the attention view's, the masked triangle null, the chosen row's computation; a layer,
    head or row out of range is a 400 naming it."""
    _, _, attention = request(server, "POST", "/api/attention", {"text": TOO_LONG})
    body = {"ids": attention["ids"], "layer": 1, "head": 1, "row": 5}  # as the page sends it
    status, _, view = request(server, "POST", "/api/formula", body)
    assert (
        status == 200 and view["ids"] == attention["ids"] and view["tokens"] == attention["tokens"]
    )
    assert view["steps"]["S"] == attention["heads"][1][1]  # the same S, step by step
    assert view["steps"]["masked"][5][6] is None and view["steps"]["masked"][5][5] is not None
    assert view["row"]["i"] == 5 and len(view["row"]["weights"]) == 6
    assert abs(sum(view["row"]["weights"]) - 1) < 1e-6 and len(view["heads"]["shares"]) == 2
    for bad, param in [({"layer": 2}, "layer"), ({"head": 2}, "head"), ({"row": 32}, "row")]:
        status, _, answer = request(server, "POST", "/api/formula", {**body, **bad})
        assert status == 400 and answer["error"]["param"] == param, answer
        assert "is out of range: " in answer["error"]["message"]
    status, _, answer = request(server, "POST", "/api/formula", {**body, "layer": -1})
    assert status == 400 and answer["error"]["param"] == "layer"  # the schema's ge=0
    # a text over the cap is refused with the fix, not cut; one that fits is the same view
    status, _, answer = request(server, "POST", "/api/formula", {"text": TOO_LONG})
    assert status == 400 and answer["error"]["message"].startswith("text is over page_tokens=32")
    text = "".join(attention["tokens"][:6]).replace("␣", " ")
    status, _, short = request(server, "POST", "/api/formula", {"text": text, "row": 3})
    assert status == 200 and short["ids"] == attention["ids"][:6] and not short["truncated"]
    for bad in ({**body, "text": "a"}, {**body, "ids": attention["ids"] * 2}, {"ids": [50257]}):
        status, _, answer = request(server, "POST", "/api/formula", bad)
        assert status == 400 and answer["error"]["param"] == "ids", answer
    status, _, answer = request(server, "POST", "/api/formula", {"messages": []})
    assert status == 400 and answer["error"]["param"] == "messages"  # an empty conversation


def test_extreme_settings_end_their_own_request_and_spare_the_others(server):
    """Valid settings that leave no distribution (temperature, penalty or top_p near 0) draw
    the greedy token; a stream decoding beside them ends with all its tokens and no error."""
    connection = http.client.HTTPConnection(urlsplit(server).netloc, timeout=120)
    body = {"prompt": "Hello", "max_tokens": 300, "stream": True, "seed": 1}
    connection.request("POST", "/v1/completions", json.dumps(body).encode(), JSON)
    response = connection.getresponse()
    events = [response.readline()]  # the stream decodes from here on
    greedy = complete(server, prompt="x", max_tokens=4, temperature=0).choices[0]
    for extreme in (
        {"temperature": 1e-40},
        {"top_p": 1e-46},
        {"extra_body": {"repetition_penalty": 1e-40}},
    ):
        done = complete(server, prompt="x", max_tokens=4, **extreme).choices[0]
        assert done.finish_reason == "length"
        if "extra_body" not in extreme:  # the penalty changes which token is greedy
            assert done.text == greedy.text
    events += [line for line in response if line.startswith(b"data: ")]
    connection.close()
    assert events[-1] == b"data: [DONE]\n" and len(events) == 300 + 1
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not [c for c in chunks if "error" in c]  # the sampled text itself may say "error"


@pytest.mark.parametrize(
    "path, headers, status, says",
    [
        ("/v1/models", {"Host": "evil.example"}, 400, "answers to"),  # DNS rebinding
        ("/", {"Host": "evil.example:80"}, 400, "answers to"),
        ("/v1/models", {"Origin": "http://evil.example"}, 403, "other origins"),
        ("/v1/models", {"Origin": "null"}, 403, "other origins"),
        ("/v1/models/", {}, 404, "Not Found"),  # no redirect (it would name the Host)
    ],
)
def test_only_the_servers_own_address_and_origin_are_answered(server, path, headers, status, says):
    code, answer_headers, answer = request(server, "GET", path, headers=headers)
    assert code == status and says in answer["error"]["message"]
    assert "location" not in answer_headers


@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_a_body_not_sent_as_json_is_refused(server, media):
    """What a cross-site form can send without the browser asking first is refused."""
    body = {"prompt": "Hi", "max_tokens": 1}
    status, _, answer = request(server, "POST", "/v1/completions", body, {"Content-Type": media})
    assert status == 415 and "application/json" in answer["error"]["message"]


def test_the_same_origin_and_the_loopback_names_are_answered(server):
    netloc = urlsplit(server).netloc
    port = netloc.rsplit(":", 1)[1]
    for headers in ({"Origin": server}, {"Host": f"localhost:{port}"}, {"Host": netloc}):
        assert request(server, "GET", "/v1/models", headers=headers)[0] == 200
    body = {"prompt": "Hi", "max_tokens": 1}
    charset = {"Content-Type": "Application/JSON; charset=utf-8", "Origin": server}
    assert request(server, "POST", "/v1/completions", body, charset)[0] == 200


def test_allowed_hosts_names_the_hosts_a_wildcard_bind_answers_to(start_server):
    """Issue 50 item 6: bound to 0.0.0.0, any Host was accepted and the Origin check compared
    with it; allowed_hosts names the hosts (each with the port), and Origin must be one."""
    url, _ = start_server("host=0.0.0.0", "allowed_hosts=[myhost.lan, 10.0.0.5]")
    port = urlsplit(url).port
    for headers in (
        {"Host": f"myhost.lan:{port}"},
        {"Host": f"10.0.0.5:{port}", "Origin": f"http://10.0.0.5:{port}"},
    ):
        assert request(url, "GET", "/v1/models", headers=headers)[0] == 200
    for headers, status, says in [
        ({"Host": f"evil.example:{port}"}, 400, f"answers to 10.0.0.5:{port}, not 'evil.example"),
        ({"Host": f"0.0.0.0:{port}"}, 400, "answers to"),
        ({"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}, 400, "answers"),
        ({"Host": f"myhost.lan:{port}", "Origin": f"http://evil.example:{port}"}, 403, "origins"),
    ]:
        code, _, answer = request(url, "GET", "/v1/models", headers=headers)
        assert code == status and says in answer["error"]["message"]


def test_a_413_and_unfinished_headers_close_the_connection(server):
    """A body past the limit is answered and its connection closed (the rest is never read);
    headers that never finish are cut off after timeout_keep_alive (uvicorn's 5 s), not kept."""
    address = urlsplit(server).hostname, urlsplit(server).port
    with socket.create_connection(address, timeout=60) as sock:
        body = b"{" + b" " * 1_000_001 + b"}"
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n"
        sock.sendall(f"{head}Content-Type: application/json\r\n".encode())
        sock.sendall(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        answer = b"".join(iter(lambda: sock.recv(65536), b""))  # to the server's close
    assert answer.startswith(b"HTTP/1.1 413") and b"over 1000000 bytes" in answer
    with socket.create_connection(address, timeout=60) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and no end
        assert sock.recv(1) == b""  # closed by the server; a timeout (60 s) fails the test


def small_server(**limits) -> Server:
    """A Server of a one-layer GPT-2-vocabulary model in this process, its batcher not started;
    `limits` over small ones."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=1, n_embd=8))
    values = dict(max_batch=4, max_queue=4, max_tokens=300, max_n=4, max_body_bytes=10_000)
    values |= dict(page_tokens=8, max_prompt_tokens=32, api_keys=[], body_timeout_s=60)
    values |= dict(max_connections=64, max_connections_per_client=64, max_request_tokens=8192)
    values |= limits
    return Server(model.eval(), get_tokenizer("gpt2"), "m", values, hosts=None)


@pytest.mark.parametrize("view", ["attention", "formula"])
def test_page_views_wait_in_a_bounded_queue_and_leave_with_their_client(serve_in_process, view):
    """One view runs at a time (here held at an exact point); past max_queue waiting, a 429
    with Retry-After; a waiting view whose client hangs up leaves the queue and never runs."""
    server = small_server(max_batch=1, max_queue=1, max_tokens=8, max_n=1)
    entered, release, shown = threading.Event(), threading.Event(), []

    def held_view(req):  # the view, stopped where it starts until the test releases it
        shown.append(req.text)
        entered.set()
        assert release.wait(60)
        return {"text": req.text}

    setattr(server, view, held_view)
    url = serve_in_process(server)

    def views() -> int:
        return request(url, "GET", "/api/info")[2]["views"]

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(request, url, "POST", f"/api/{view}", {"text": "a"})
        assert entered.wait(60)  # "a" runs
        waiting = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
        waiting.request("POST", f"/api/{view}", json.dumps({"text": "b"}).encode(), JSON)
        while views() < 2:  # "b" is queued
            time.sleep(0.01)
        status, headers, answer = request(url, "POST", f"/api/{view}", {"text": "c"})
        assert (
            status == 429 and headers["Retry-After"] == "1" and "busy" in answer["error"]["message"]
        )
        waiting.sock.close()  # "b"'s client hangs up
        while views() > 1:  # "b" left the queue
            time.sleep(0.01)
        release.set()
        assert first.result()[:3:2] == (200, {"text": "a"})
    assert request(url, "POST", f"/api/{view}", {"text": "d"})[2] == {"text": "d"}
    assert shown == ["a", "d"]  # "b" never ran, "c" was refused


def test_a_stalled_body_gets_408_and_connections_past_the_cap_503(serve_in_process, capfd):
    """Issue 50 item 3: connections that sent headers and one body byte held a server for ever
    (58 of them filled its open files). A body has body_timeout_s after its headers (then 408,
    the connection closed); a request that finds max_connections others open gets a 503, which
    the log does not repeat; with the stalled ones gone, a request is answered. The deadline
    has only to outlast sending the third request once the two are reading their bodies."""
    server, reading = small_server(body_timeout_s=5, max_connections=2), threading.Semaphore(0)
    body = server.body

    async def counted(request):  # a request past the cap's check, reading its body
        reading.release()
        return await body(request)

    server.body = counted
    url = serve_in_process(server)
    address = urlsplit(url).hostname, urlsplit(url).port
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n"
    head += "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"  # 1 byte of 100
    stalled = [socket.create_connection(address, timeout=60) for _ in range(2)]
    for sock in stalled:
        sock.sendall(head.encode())
        assert reading.acquire(timeout=60)
    status, _, answer = request(url, "GET", "/v1/models", parse=bytes.decode)
    assert status == 503 and answer == "Service Unavailable"
    for sock in stalled:
        with sock, sock.makefile("rb") as answers:
            answer = answers.read()  # to the server's close
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout_s=5 seconds" in answer
    server.batcher.start()
    assert request(url, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})[0] == 200
    assert "limit" not in capfd.readouterr().err  # uvicorn's "Exceeded concurrency limit."


SAMPLING_FIELDS = st.fixed_dictionaries(  # each valid field in range or at its extremes
    {},
    optional=dict(
        temperature=st.one_of(st.floats(0, 2), st.sampled_from([1e-320, 1e-40])),
        top_k=st.one_of(st.integers(1, 60_000), st.sampled_from([2**63 - 1, 2**63, 2**80])),
        top_p=st.one_of(st.floats(0, 1, exclude_min=True), st.just(1e-46)),
        min_p=st.one_of(st.floats(0, 1), st.just(1e-46)),
        repetition_penalty=st.one_of(st.floats(1e-3, 10), st.sampled_from([1e-320, 1e-40, 1e300])),
        seed=st.one_of(st.integers(0, 2**63), st.just(2**63)),
        n=st.integers(1, 4),
        stop=st.lists(st.text(max_size=3), max_size=5),  # "" or 5 strings: a 400
        logprobs=st.integers(0, 5),
    ),
)


@pytest.fixture(scope="module")
def admitting() -> Server:
    return small_server()


@hypothesis.settings(max_examples=30, deadline=None, database=None)
@hypothesis.given(st.lists(SAMPLING_FIELDS, min_size=1, max_size=3))
def test_admitted_settings_draw_together_as_alone(admitting, requests):
    """Requests with random mixes of every sampling field, in range and extreme, beside an
    innocent one ({}: the defaults): each is a 400 (its stop strings) or its completions join
    one batched draw that cannot overflow (a top_k of 2**63 is clamped to the vocabulary), in
    which every row draws the token it draws alone, and its logprobs follow."""
    jobs, tops = [], []
    for fields in [{}, *requests]:
        try:
            req = CompletionRequest.model_validate({"prompt": "x", **fields})
            admitted = admitting.jobs(req, [req.prompt], emit=None)
        except ApiError:  # answered 400
            continue
        jobs += admitted
        tops += [req.logprobs] * len(admitted)
    logits = torch.randn(len(jobs), 50257, generator=torch.Generator().manual_seed(0))
    contexts = [torch.tensor([job.ids]) for job in jobs]
    states = [job.generator.get_state() for job in jobs]
    together = next_token(
        logits, contexts, [job.params for job in jobs], [job.generator for job in jobs]
    )
    for row, (job, state, top) in enumerate(zip(jobs, states, tops, strict=True)):
        generator = torch.Generator().set_state(state)
        alone = int(next_token(logits[row, None], contexts[row], job.params, generator)[0])
        assert together[row] == alone
        if top is not None:
            assert len(admitting.logprobs(alone, logits[row], top, False)["tokens"]) == 1


def test_a_huge_top_k_beside_a_stream_spares_it(serve_in_process):
    """Issue 50's repro: a stream in flight, then {"top_k": 2**63} (another top_k than the
    stream's, in one batch): the stream ends with all its tokens and [DONE], the other request
    with its 5. The stream's second step waits until the other is queued: they decode together."""
    server, queued = small_server(), threading.Event()
    submit, step = server.batcher.submit, server.batcher.step

    def submit_and_tell(jobs: list) -> bool:
        accepted = submit(jobs)
        queued.set() if jobs[0].params.top_k else None  # the huge top_k's (the stream: none)
        return accepted

    def step_together():
        if server.batcher.active:  # the stream drew a token: the other is queued before more
            assert queued.wait(60)
        return step()

    server.batcher.submit, server.batcher.step = submit_and_tell, step_together
    server.batcher.start()
    url = serve_in_process(server)
    connection = http.client.HTTPConnection(urlsplit(url).netloc, timeout=120)
    body = {"prompt": "Hello", "max_tokens": 200, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body).encode(), JSON)
    response = connection.getresponse()
    events = [response.readline()]
    huge = {"prompt": "x", "max_tokens": 5, "top_k": 2**63}
    status, _, answer = request(url, "POST", "/v1/completions", huge)
    assert status == 200 and answer["usage"]["completion_tokens"] == 5
    events += [line for line in response if line.startswith(b"data: ")]
    connection.close()
    assert events[-1] == b"data: [DONE]\n" and len(events) == 200 + 1
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not [c for c in chunks if "error" in c]  # the sampled text itself may say "error"


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)  # st.characters' own range drops them
TEXT = st.text(st.characters() | SURROGATES, max_size=12)  # lone surrogates, often
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}
    ),
    min_size=1,
    max_size=3,
)
SMALL = st.integers(0, 3)
REQUESTS = {  # each route's valid body, every string in it random text
    "/v1/completions": st.fixed_dictionaries(
        {
            "prompt": TEXT | st.lists(TEXT, min_size=1, max_size=2),
            "max_tokens": st.integers(1, 3),
            "echo": st.booleans(),
            "stream": st.booleans(),
        },
        optional=dict(stop=TEXT, user=TEXT, logprobs=SMALL),
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": MESSAGES, "max_tokens": st.integers(1, 3)},
        optional=dict(
            stream=st.booleans(), stop=st.lists(TEXT, max_size=2), logprobs=st.booleans()
        ),
    ),
    "/api/attention": st.fixed_dictionaries({}, optional=dict(text=TEXT, messages=MESSAGES)),
    "/api/formula": st.fixed_dictionaries({"text": TEXT}, optional=dict(layer=SMALL, row=SMALL)),
    "/api/causality": st.fixed_dictionaries(
        {"ids": st.lists(st.integers(0, 50258), min_size=1, max_size=4), "replacement": TEXT},
        optional=dict(position=SMALL),
    ),
}
ENCODINGS = ["ascii-escapes", "utf-8", "utf-8", "utf-16", "utf-32"]


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(route, body): a route's valid body with random text, perhaps one field made any JSON
    value, encoded in one of the encodings; or random bytes; or any JSON."""
    route = draw(st.sampled_from(list(REQUESTS)))
    kind = draw(st.sampled_from(["valid", "valid", "one field", "bytes", "any JSON"]))
    if kind == "bytes":
        return route, draw(st.binary(max_size=200))
    fields = draw(REQUESTS[route] if kind != "any JSON" else JSON_VALUES)
    if kind == "one field" and fields:
        fields[draw(st.sampled_from(sorted(fields)))] = draw(JSON_VALUES)
    return route, encoded(fields, draw(st.sampled_from(ENCODINGS)))


def encoded(fields: dict, encoding: str) -> bytes:
    """The fields as JSON in `encoding`: JSON's own escapes, or the characters themselves, a
    lone surrogate written into the bytes as such."""
    if encoding == "ascii-escapes":
        return json.dumps(fields).encode()
    return json.dumps(fields, ensure_ascii=False).encode(encoding, "surrogatepass")


@pytest.fixture
def chat_url(serve_in_process) -> str:
    """A chat model's server in this process (every route parses), its batcher running."""
    torch.manual_seed(0)
    enc = chat_tokenizer(get_tokenizer("gpt2"))
    model = GPT(GPTConfig(vocab_size=enc.n_vocab, block_size=32, n_layer=1, n_head=1, n_embd=8))
    values = dict(max_batch=4, max_queue=4, max_tokens=8, max_n=2, max_body_bytes=10_000)
    values |= dict(page_tokens=8, max_prompt_tokens=32, api_keys=[], body_timeout_s=60)
    values |= dict(max_connections=64, max_connections_per_client=64, max_request_tokens=8192)
    server = Server(model.eval(), enc, "m", values, hosts=None)
    server.batcher.start()
    return serve_in_process(server)


@hypothesis.seed(56)
@hypothesis.settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(bodies())
def test_no_bytes_a_client_sends_are_a_5xx_or_a_traceback(chat_url, capfd, sent):
    """Issue 56 item 2: random bytes, random JSON, and random text (lone surrogates included,
    escaped or in the bytes, in UTF-8, 16 or 32) in every field of every route: never a 5xx,
    never a traceback in the log, and an innocent request beside it answered."""
    route, body = sent
    status, _, answer = request(chat_url, "POST", route, body, parse=bytes)
    assert status < 500, (body, answer)
    innocent = {"prompt": "Hi", "max_tokens": 1}
    assert request(chat_url, "POST", "/v1/completions", innocent)[0] == 200
    assert "Traceback" not in capfd.readouterr().err


def test_pipelined_requests_are_answered_in_order(serve_in_process, capfd):
    """Issue 56 item 3: `GET /api/info` and a completion sent in one write on a keep-alive
    connection both get their answers, in order, the completion taking longer than
    timeout_keep_alive (the header deadline, armed as the first answer ended, used to cut it).
    The batcher starts only after every timer armed before the completion was queued has had
    its turn on the event loop: a callback on the same loop, due later than the deadline."""
    server, keep_alive = small_server(), 0.2
    submit = server.batcher.submit

    def submit_then_decode_late(jobs: list) -> bool:  # on the event loop, as the route calls it
        loop = asyncio.get_running_loop()
        loop.call_later(2 * keep_alive, server.batcher.start)  # after any deadline armed by now
        return submit(jobs)

    server.batcher.submit = submit_then_decode_late
    url = serve_in_process(server, timeout_keep_alive=keep_alive)
    host = urlsplit(url).netloc
    body = json.dumps({"prompt": "Hi", "max_tokens": 3}).encode()
    info = f"GET /api/info HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    completion = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
    completion += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((urlsplit(url).hostname, urlsplit(url).port), timeout=60) as sock:
        sock.sendall(info + completion.encode() + body)
        stream, answers = sock.makefile("rb"), []
        for _ in range(2):  # status line, headers, then Content-Length bytes of JSON
            status = int(stream.readline().split()[1])
            lines = iter(lambda: stream.readline().strip(), b"")
            headers = dict(line.lower().split(b": ", 1) for line in lines)
            answers.append((status, json.loads(stream.read(int(headers[b"content-length"])))))
    assert answers[0][0] == 200 and answers[0][1]["model"] == "m"
    assert answers[1][0] == 200 and answers[1][1]["usage"]["completion_tokens"] == 3
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_is_its_key_or_its_address(serve_in_process, tmp_path):
    """Issue 56: each API key names a client (two keys from one address are two clients for
    the fair share); without keys the peer address does. Keys stay out of /api/info."""
    server, clients = small_server(api_keys=["k1", "k2"]), []
    submit = server.batcher.submit
    server.batcher.submit = lambda jobs: clients.append(jobs[0].client) or submit(jobs)
    server.batcher.start()
    url = serve_in_process(server)
    for key in ("k1", "k2", "k1"):
        auth = {"Authorization": f"Bearer {key}"}
        body = {"prompt": "Hi", "max_tokens": 1}
        assert request(url, "POST", "/v1/completions", body, auth)[0] == 200
    assert request(url, "POST", "/v1/completions", body, {"Authorization": "Bearer k3"})[0] == 401
    assert clients == ["key 0", "key 1", "key 0"]
    info = json.dumps(request(url, "GET", "/api/info", headers=auth)[2])
    assert "k1" not in info and "k2" not in info
    keyless = small_server()
    submit = keyless.batcher.submit
    keyless.batcher.submit = lambda jobs: clients.append(jobs[0].client) or submit(jobs)
    keyless.batcher.start()
    assert request(serve_in_process(keyless), "POST", "/v1/completions", body)[0] == 200
    assert clients[-1] == "127.0.0.1"


def test_one_address_cannot_hold_every_connection(serve_in_process, capfd):
    """Issue 56 item 4: 40 connections from 127.0.0.2 that send headers and never finish (each
    refused one reconnects) hold at most max_connections_per_client of the 16 places: each past
    it is answered 503 as it opens; a client at 127.0.0.1 is answered all the while. The
    negative control: with the per-address cap at the global one, the same flood locks it out."""
    for per_client, locked_out in [(4, False), (16, True)]:
        server = small_server(max_connections=16, max_connections_per_client=per_client)
        server.batcher.start()
        url = serve_in_process(server)
        address = urlsplit(url).hostname, urlsplit(url).port
        head = f"GET /v1/models HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n".encode()
        held, refused = [], 0
        for _ in range(40):
            sock = socket.create_connection(address, timeout=60, source_address=("127.0.0.2", 0))
            sock.sendall(head)  # and never the blank line that ends the headers
            if len(held) < per_client:
                held.append(sock)
                continue
            with sock, sock.makefile("rb") as answer:
                refused += answer.read().startswith(b"HTTP/1.1 503")  # to the server's close
        assert refused == 40 - per_client
        status, _, answer = request(url, "GET", "/v1/models", parse=bytes)
        assert (status == 503) == locked_out, answer
        for sock in held:
            sock.close()
    assert "Traceback" not in capfd.readouterr().err


def test_an_innocent_client_is_answered_while_a_hog_decodes(serve_in_process):
    """Issue 56 item 5 through HTTP: a client's 4 completions of 300 tokens fill both rows and
    wait for more; another client's 16 tokens, sent once the hog decodes (the batcher's second
    step waits for it to be queued), are answered while every hog completion is still short
    of its 300 (first come, first served answered it after the hog's first two)."""
    server, queued, hog_jobs = small_server(max_batch=2, max_queue=8), threading.Event(), []
    submit, step = server.batcher.submit, server.batcher.step

    def recording(jobs: list) -> bool:
        accepted = submit(jobs)
        queued.set() if jobs[0].client == "127.0.0.2" else hog_jobs.extend(jobs)
        return accepted

    def step_once_the_innocent_waits():
        if server.batcher.active:
            assert queued.wait(60)
        return step()

    server.batcher.submit, server.batcher.step = recording, step_once_the_innocent_waits
    server.batcher.start()
    url = serve_in_process(server)
    netloc, body = urlsplit(url).netloc, {"prompt": "x", "n": 4, "max_tokens": 300}
    hog = http.client.HTTPConnection(netloc, timeout=120)
    hog.request("POST", "/v1/completions", json.dumps(body).encode(), JSON)
    innocent = http.client.HTTPConnection(netloc, timeout=120, source_address=("127.0.0.2", 0))
    innocent.request("POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 16}', JSON)
    answer = innocent.getresponse()
    assert answer.status == 200 and json.loads(answer.read())["usage"]["completion_tokens"] == 16
    assert len(hog_jobs) == 4 and all(len(job.tokens) < 300 for job in hog_jobs)
    assert hog.getresponse().status == 200  # and the hog is answered in full after it


def test_an_api_key_file_gives_one_key_per_client(start_server, tmp_path):
    """api_key_file: one key a line, blank lines and # comments skipped; each key is let in,
    any other refused."""
    keys = tmp_path / "keys"
    keys.write_text("# one key per client\nalpha\n\nbeta\n", encoding="utf-8")
    url, _ = start_server(f"api_key_file={keys}")
    for key, status in (("alpha", 200), ("beta", 200), ("# one key per client", 401), ("", 401)):
        assert (
            request(url, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})[0]
            == status
        )
