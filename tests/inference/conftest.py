"""A small saved checkpoint, the sample.py config as the command line would compose it, and
serve.py servers on free local ports."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
import uvicorn
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from checkpoints.store import save_checkpoint
from inference.server import Server, uvicorn_config
from model import GPT, GPTConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=16))
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints" / "best", model, {"data": {"tokenizer": "gpt2"}}, {})
    return run


@pytest.fixture
def sample_cfg() -> Callable[..., DictConfig]:
    """sample_cfg("key=value", ...) -> the composed config of `python sample.py key=value ...`."""

    def make(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
            return compose("sample", overrides=list(overrides))

    return make


@pytest.fixture
def blank_line_run(tmp_path: Path) -> Path:
    """A run whose model continues greedily "two" -> " one" -> "\\n\\n" -> "two" -> ...: output
    that contains blank lines for certain. Blocks are zeroed (each adds nothing to the
    residual stream), so the logits are a bigram table: token t's embedding is a one-hot slot
    that the head maps to the next token of the cycle."""
    from data.tokenizer import get_tokenizer

    enc = get_tokenizer("gpt2")
    cycle = [enc.encode_single_token(t) for t in ("two", " one", "\n\n")]
    config = GPTConfig(
        vocab_size=enc.n_vocab, block_size=32, n_layer=1, n_head=1, n_embd=8, tie_embeddings=False
    )
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.ln_f.weight.fill_(1.0)
        for slot, (token, following) in enumerate(zip(cycle, cycle[1:] + cycle[:1], strict=True)):
            model.transformer.wte.weight[token, slot] = 1.0
            model.lm_head.weight[following, slot] = 10.0
    run = tmp_path / "blank_line_run"
    save_checkpoint(run / "checkpoints" / "best", model, {"data": {"tokenizer": "gpt2"}}, {})
    return run


SERVE_PY = Path(__file__).resolve().parents[2] / "serve.py"


@pytest.fixture(scope="session")
def serve_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random GPT-2-vocabulary model with a 32-token window (long completions restart
    it), saved as a run."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=16))
    run = tmp_path_factory.mktemp("serve") / "run"
    save_checkpoint(run / "checkpoints" / "best", model, {"data": {"tokenizer": "gpt2"}}, {})
    return run


@pytest.fixture(scope="session")
def start_server(serve_checkpoint: Path) -> Iterator[Callable[..., tuple[str, int]]]:
    """start_server("key=value", ..., env={...}) -> (base URL, pid) of `python serve.py` on a
    free local port, serving serve_checkpoint; ready when it prints the line that names its
    address (read as it comes: no sleeps). Every server stops at the end of the session."""
    servers: list[subprocess.Popen] = []

    def start(*overrides: str, env: dict | None = None) -> tuple[str, int]:
        args = [sys.executable, str(SERVE_PY), f"checkpoint={serve_checkpoint}", "port=0"]
        server = subprocess.Popen(
            [*args, *overrides],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        servers.append(server)
        line = server.stdout.readline()  # "serving <name> on http://127.0.0.1:<port> (...)"
        assert " on http://" in line, f"the server did not start: {line!r}"
        return line.split(" on ")[1].split()[0], server.pid

    yield start
    for server in servers:
        server.terminate()
        server.wait(timeout=60)


@pytest.fixture(scope="session")
def server(start_server) -> str:
    """The base URL of a server with the default limits and no API key."""
    return start_server()[0]


JSON = {"Content-Type": "application/json"}  # what the API accepts


def request(url: str, method: str, path: str, body=None, headers=None, parse=json.loads):
    """(status, headers, parsed JSON) of one raw HTTP request; body: bytes, or JSON-able, sent
    as application/json unless `headers` say otherwise."""
    connection = http.client.HTTPConnection(urlsplit(url).netloc, timeout=120)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(method, path, data, {**JSON, **(headers or {})})
    response = connection.getresponse()
    answer = (response.status, response.headers, parse(response.read()))
    connection.close()
    return answer


def wait_until_idle(url: str) -> dict:
    """/api/info once no job decodes or waits (polled; the deadline only ends a hung test)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        info = request(url, "GET", "/api/info")[2]
        if info["active"] == info["waiting"] == 0:
            return info
        time.sleep(0.02)
    raise AssertionError(f"the server still holds jobs: {info}")


@pytest.fixture
def serve_in_process() -> Iterator[Callable[..., str]]:
    """serve_in_process(server, **settings) -> the base URL of create_app(server), served by
    uvicorn as serve.py serves it (uvicorn.Config's `settings` changed), on a thread of this
    process (so a test can reach into the Server) on a free local port; stopped at the test's
    end. The socket listens before the thread starts: no
    wait for readiness."""
    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(server: Server, **settings: Any) -> str:
        sock = socket.create_server(("127.0.0.1", 0))
        config = uvicorn_config(server)
        for name, value in settings.items():
            setattr(config, name, value)
        served = uvicorn.Server(config)
        thread = threading.Thread(target=served.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        running.append((served, thread))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for served, thread in running:
        served.should_exit = True
        thread.join(timeout=60)
