"""No request sees another's data: the page's views, run beside batched decoding through real
HTTP, answer exactly what they answer alone, in float32 and in bfloat16 (where the batcher
decodes from the served model itself, not from a copy). On the device $ISOLATION_DEVICE names
(default cpu): scripts/gpu_check.sh runs it with cuda on a lent GPU."""

from __future__ import annotations

import json
import os
import threading

import pytest

from tests.inference.conftest import request

TEXT = "To be, or not to be, that is the question"
VIEWS = [
    ("/api/formula", {"text": TEXT, "layer": 1, "head": 1}),
    ("/api/attention", {"text": TEXT}),
    ("/api/formula", {"text": TEXT[:12], "layer": 0, "head": 0, "row": 1}),
]
ROUNDS = 8  # of the three views, while completions decode


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_page_views_beside_batched_decoding_answer_as_alone(start_server, dtype):
    url = start_server(f"dtype={dtype}", f"device={os.environ.get('ISOLATION_DEVICE', 'cpu')}")[0]
    alone = [request(url, "POST", path, body) for path, body in VIEWS]
    assert all(status == 200 for status, _, _ in alone), alone
    views_done, decoded = threading.Event(), []

    def decode(seed: int) -> None:
        """Completions one after another until the views are done (at most 50): decoding goes
        on, whatever the machine's speed, for as long as the views run."""
        for i in range(50):
            body = {"prompt": "To be", "max_tokens": 60, "seed": seed * 100 + i}
            status, _, answer = request(url, "POST", "/v1/completions", body)
            assert status == 200, answer
            decoded.append(answer["usage"]["completion_tokens"])
            if views_done.is_set():
                return

    threads = [threading.Thread(target=decode, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(ROUNDS):
            for (path, body), (_, _, expected) in zip(VIEWS, alone, strict=True):
                status, _, view = request(url, "POST", path, body)
                assert status == 200, view
                # ids, shapes and every number: the view alone's, to the last digit sent
                assert json.dumps(view, sort_keys=True) == json.dumps(expected, sort_keys=True)
    finally:
        views_done.set()
        for thread in threads:
            thread.join(timeout=300)
    assert len(decoded) >= len(threads) and all(n == 60 for n in decoded)
