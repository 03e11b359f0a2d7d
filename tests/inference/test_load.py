"""A bounded load test on localhost: 200 requests from 16 concurrent clients, a quarter of them
streaming and a tenth hanging up early. No 5xx, no completion lost or given to another request,
and the server's memory back to its level before the load (within 25%: see the bound) once it
is idle."""

from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.inference.conftest import JSON, wait_until_idle

REQUESTS, CLIENTS = 200, 16


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def send(url: str, i: int) -> tuple[int, str | None]:
    """Request i: (status, its text; None for a client that hung up). Requests i and i + 100
    are the same request (prompt, seed, length, streaming or not), so their texts must match."""
    k = i % 100
    stream, hang_up = i % 4 == 0, i % 10 == 0  # hang-ups: half streaming, half not
    body = dict(prompt=f"Request {k}:", max_tokens=8 + k % 24, seed=k, echo=True, stream=stream)
    connection = http.client.HTTPConnection(urlsplit(url).netloc, timeout=300)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body).encode(), JSON)
        if hang_up and not stream:
            return 0, None  # gone before the answer
        response = connection.getresponse()
        if not stream:
            answer = json.loads(response.read())
            return response.status, answer["choices"][0]["text"] if response.status == 200 else None
        text = ""
        for line in response:
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                if hang_up:
                    return response.status, None
            elif line.startswith(b"data: [DONE]"):
                return response.status, text
        raise AssertionError(f"request {i}: the stream ended without [DONE]")
    finally:
        connection.close()


@pytest.mark.slow
def test_200_requests_from_16_clients(start_server, capsys):
    url, pid = start_server()
    with ThreadPoolExecutor(CLIENTS) as pool:  # warm up: the allocator's and torch's caches,
        list(pool.map(lambda i: send(url, i), range(REQUESTS)))  # the threads the load starts
    wait_until_idle(url)
    before = resident_mib(pid)
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda i: send(url, i), range(REQUESTS)))
    wait_until_idle(url)
    after = resident_mib(pid)
    statuses = [status for status, _ in results]
    assert all(status in (0, 200) for status in statuses), statuses  # no 4xx, no 5xx
    hung_up = [i for i in range(REQUESTS) if i % 10 == 0]
    assert [i for i, (_, text) in enumerate(results) if text is None] == hung_up
    for i, (_, text) in enumerate(results):
        if text is not None:
            assert text.startswith(f"Request {i % 100}:") and len(text) > len(f"Request {i % 100}:")
            assert text == results[(i + 100) % REQUESTS][1]  # its twin: the same completion
    with capsys.disabled():
        print(f"\nload test: server resident memory {before:.1f} MiB before, {after:.1f} after")
    # Resident memory is a noisy witness: after a full warm-up round, rounds of 200 moved it
    # from -25 to +40 MiB around ~410 MiB with no trend (12 rounds, 2-core AMD EPYC; with a
    # 32-request warm-up one round reached +55). The bound catches a leak of that order per
    # round or worse (e.g. 0.5 MiB kept per request) and never the allocator's noise.
    assert after - before < 0.25 * before
