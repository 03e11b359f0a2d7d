"""Benchmark: serve.py under concurrent clients, batched against one completion at a time.

The `mini` preset (8 layers x 160, block 128, GPT-2's vocabulary; randomly initialised: speed
does not depend on the weights) is served in float32 twice by `python serve.py` on a free local
port: with max_batch 16 (the requests decode together) and with max_batch 1 (the same requests,
served one at a time: each waits in the queue for the one before it). For 1, 4, 8 and 16
concurrent clients, --requests streamed completions of --tokens tokens each (temperature 0.8,
top_k 200, their own seeds) are split among the clients, each sending its next when its last one
ends. Aggregate tokens/s is every completion token over the wall time; time to first token is
from a request's send to its first event. A second table shows where a step's time goes at each
batch size, in this process: the forward over the batch, and the sampling of each row's token.
Run from anywhere: ``python benchmarks/bench_serve.py [--requests N] [--tokens N]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import harness
import torch
from harness import head, row

from base.errors import yaml_config
from checkpoints.store import save_checkpoint
from data.tokenizer import get_tokenizer
from inference.batching import Batcher, Job
from inference.generate import SamplingParams, TextStream
from model import GPT, GPTConfig

CLIENTS = (1, 4, 8, 16)
SERVE_PY = Path(__file__).resolve().parents[1] / "serve.py"
JSON = {"Content-Type": "application/json"}
PARAMS = dict(temperature=0.8, top_k=200)


def mini() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**yaml_config("model/mini.yaml"), "vocab_size": 50257})).eval()


def completion(url: str, i: int, tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens received) of one streamed completion."""
    body = dict(prompt=f"Request {i}:", max_tokens=tokens, seed=i, stream=True, **PARAMS)
    connection = http.client.HTTPConnection(urlsplit(url).netloc, timeout=600)
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", json.dumps(body).encode(), JSON)
    first, received = None, 0
    for line in connection.getresponse():
        if line.startswith(b"data: {"):
            first = first or time.perf_counter() - start
            received += 1
    connection.close()
    return first, received


def load(url: str, clients: int, requests: int, tokens: int) -> tuple[float, list[float]]:
    """(aggregate tokens/s, times to first token) of `requests` completions from `clients`."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda i: completion(url, i, tokens), range(requests)))
    seconds = time.perf_counter() - start
    return sum(n for _, n in done) / seconds, [t for t, _ in done]


def serve(run: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    args = [
        f"checkpoint={run}",
        "port=0",
        f"max_batch={max_batch}",
        "max_queue=64",
        "dtype=float32",
    ]
    server = subprocess.Popen(
        [sys.executable, str(SERVE_PY), *args], stdout=subprocess.PIPE, text=True
    )
    return server, server.stdout.readline().split(" on ")[1].split()[0]


def percentile(values: list[float], q: int) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


@torch.inference_mode()
def step_times(batch: int, steps: int = 30) -> tuple[float, float]:
    """(ms of a whole Batcher step, ms of its forward alone) with `batch` jobs decoding, the
    medians over `steps` (a shared machine's other work lands in a few of them)."""
    model, tokenizer = mini(), get_tokenizer("gpt2")
    batcher = Batcher(model, tokenizer.eot_token, tokenizer.n_vocab, batch, 0)
    params = SamplingParams(**PARAMS)
    batcher.submit(
        [
            Job(
                [i + 1] * 16,
                params,
                10**6,
                torch.Generator().manual_seed(i),
                TextStream(tokenizer),
                lambda *_: None,
            )
            for i in range(batch)
        ]
    )
    batcher.step()  # the prompts
    newest = torch.cat([job.seq[:, -1:] for job in batcher.active])
    steps_ms, forwards_ms = [], []
    for _ in range(steps):  # a step, then its forward alone (the cache put back after it)
        start = time.perf_counter()
        batcher.step()
        middle = time.perf_counter()
        batcher.decoder(newest, cache=batcher.cache, last_only=True)
        batcher.cache.length -= 1
        steps_ms.append(1000 * (middle - start))
        forwards_ms.append(1000 * (time.perf_counter() - middle))
    return statistics.median(steps_ms), statistics.median(forwards_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=32, help="completions per row")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    args = harness.parse_args(parser)
    print(f"{harness.machine()}\nmini (8x160, block 128, vocab 50,257), {args.requests} streamed "
          f"completions of {args.tokens} tokens a row, temperature 0.8, top_k 200\n")  # fmt: skip
    head(
        "clients | batched tok/s | one at a time tok/s | speedup | batched TTFT p50 / p95 (s) "
        "| one at a time TTFT p50 / p95 (s)",
        "rrrrrr",
    )
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "mini"
        save_checkpoint(run / "checkpoints" / "best", mini(), {"data": {"tokenizer": "gpt2"}}, {})
        servers = {size: serve(run, size) for size in (16, 1)}
        try:
            for clients in CLIENTS:
                cells = {
                    size: load(url, clients, args.requests, args.tokens)
                    for size, (_, url) in servers.items()
                }
                (fast, ttft), (slow, ttft1) = cells[16], cells[1]
                row([str(clients), f"{fast:.0f}", f"{slow:.0f}", f"{fast / slow:.2f}x",
                     f"{percentile(ttft, 50):.2f} / {percentile(ttft, 95):.2f}",
                     f"{percentile(ttft1, 50):.2f} / {percentile(ttft1, 95):.2f}"])  # fmt: skip
        finally:
            for server, _ in servers.values():
                server.terminate()
    print("\nWhere a decoding step's time goes (this process, no HTTP):\n")
    head("batch | step ms | forward ms | sampling and the rest ms | tok/s of the steps", "rrrrr")
    for batch in CLIENTS:
        step, forward = step_times(batch)
        row(
            [
                str(batch),
                f"{step:.2f}",
                f"{forward:.2f}",
                f"{step - forward:.2f}",
                f"{1000 * batch / step:.0f}",
            ]
        )


if __name__ == "__main__":
    main()
