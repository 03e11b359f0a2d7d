"""`python serve.py` against real clients: OpenAI's own Python package, and raw HTTP for what a
client library never sends (malformed JSON, hang-ups, oversized bodies)."""

from __future__ import annotations

import http.client
import io
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest

from inference.cli import run
from tests.inference.conftest import SERVE_PY, request, wait_until_idle


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
    assert [m.id for m in models.data] == [done.model]


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
    connection.request("POST", "/v1/completions", json.dumps(body).encode())
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


TOO_LONG = "Hello " * 40  # 41 tokens, more than the model's 32-token window


@pytest.mark.parametrize(
    "body, status, param, says",
    [
        (b'{"prompt": "Hi", "max_tokens": ', 400, None, "not JSON"),
        (b"\xff\xfe not utf-8", 400, None, "not JSON"),
        (b'["a", "list"]', 400, None, "valid dictionary"),
        ({"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
        ({"prompt": 5}, 400, "prompt", "valid string"),
        ({"prompt": "Hi", "stream": "yes"}, 400, "stream", "valid boolean"),
        ({"prompt": "Hi", "temperature": 3}, 400, "temperature", "less than or equal to 2"),
        ({"prompt": "Hi", "top_p": 0}, 400, "top_p", "greater than 0"),
        ({"prompt": "Hi", "n": 0}, 400, "n", "greater than or equal to 1"),
        ({"prompt": "Hi", "n": 9}, 400, "n", "at most 8"),
        ({"prompt": "Hi", "max_tokens": 5000}, 400, "max_tokens", "at most 1024"),
        ({"prompt": "Hi", "frequency_penalty": 1}, 400, "frequency_penalty", "Extra inputs"),
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
    code, _, answer = request(server, "POST", "/v1/completions", body)
    assert code == status
    assert set(answer) == {"error"} and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param
    assert says in answer["error"]["message"]
    assert complete(server, prompt="Hi", max_tokens=1).choices  # still serving


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
    """One completion at a time and none waiting: while one streams, the next is refused."""
    url, _ = start_server("max_batch=1", "max_queue=0", "api_key=k")
    connection = http.client.HTTPConnection(urlsplit(url).netloc, timeout=120)
    body = json.dumps({"prompt": "Hello", "max_tokens": 1000, "stream": True}).encode()
    connection.request("POST", "/v1/completions", body, {"Authorization": "Bearer k"})
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
        (["checkpoint=/no/such/run"], "error: "),
        (["host=0.0.0.0", "checkpoint=/no/such/run"], "warning: host=0.0.0.0: anyone who can"),
    ],
)
def test_a_bad_config_is_one_error_line_and_exit_2(args, says, tmp_path):
    done = subprocess.run(
        [sys.executable, str(SERVE_PY), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
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
