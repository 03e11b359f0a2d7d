"""Benchmark: an innocent client's latency beside a client that hogs the server.

Issue 56's two hogs, each within every limit of its day: one request of 8 prompts x n 8 x 1,024
tokens (64 completions), and two requests of 5 prompts x n 8 x 300 tokens (80 completions, the
whole batch and queue). While the hog decodes (0.5 s after /api/info shows its completions
active), 12 innocent requests (16 tokens each, other connections, 127.0.0.2 as their address)
are sent at once; the table gives their answers and the latency of those answered 200. Each hog
is cancelled (its connection closed) once the innocents are done.

Servers, `mini` (random weights, float32), default limits: this checkout's serve.py with its
defaults (max_request_tokens refuses both hogs), the same with max_request_tokens lifted (the
fair scheduling alone), and with ``--before DIR`` another checkout's serve.py (e.g. a worktree
of the commit before fairness). Run: ``python benchmarks/bench_fairness.py [--before DIR]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import harness
from bench_serve import mini
from harness import head, row

from checkpoints.store import save_checkpoint

HOGS = {
    "8 prompts x n 8 x 1,024 tokens": [dict(prompt=["x"] * 8, n=8, max_tokens=1024)],
    "2 x (5 prompts x n 8 x 300 tokens)": [dict(prompt=["x"] * 5, n=8, max_tokens=300)] * 2,
}
INNOCENTS = 12
JSON = {"Content-Type": "application/json"}


def serve(serve_py: Path, run: Path, *args: str) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, str(serve_py), f"checkpoint={run}", "port=0", "dtype=float32"]
    server = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, text=True)
    return server, server.stdout.readline().split(" on ")[1].split()[0]


def post(url: str, body: dict, source: str = "127.0.0.1", hold: list | None = None) -> int:
    """The status of one completion request (from address `source`); its connection goes into
    `hold` while it waits, for the caller to close (a hang-up cancels the request)."""
    connection = http.client.HTTPConnection(
        urlsplit(url).netloc, timeout=600, source_address=(source, 0)
    )
    if hold is not None:
        hold.append(connection)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body).encode(), JSON)
        response = connection.getresponse()
        response.read()
        return response.status
    except OSError:  # closed by the caller
        return 0


def active(url: str) -> int:
    connection = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
    connection.request("GET", "/api/info")
    return json.loads(connection.getresponse().read())["active"]


def innocent(url: str) -> tuple[int, float]:
    start = time.perf_counter()
    status = post(url, dict(prompt="Hi", max_tokens=16), source="127.0.0.2")
    return status, time.perf_counter() - start


def beside(url: str, hog: list[dict]) -> tuple[list[int], list[tuple[int, float]]]:
    """(the hog's statuses, the innocents' (status, seconds)) with the hog decoding."""
    held, statuses = [], []
    threads = [threading.Thread(target=lambda b=b: statuses.append(post(url, b, hold=held)))
               for b in hog]  # fmt: skip
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while active(url) == 0 and len(statuses) < len(hog) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    with ThreadPoolExecutor(INNOCENTS) as pool:
        answers = list(pool.map(lambda _: innocent(url), range(INNOCENTS)))
    for connection in held:  # a hang-up: wakes the hog's thread, and cancels its jobs
        connection.sock.shutdown(socket.SHUT_RDWR)
    for thread in threads:
        thread.join()
    while active(url):  # the cancelled jobs leave at the next step
        time.sleep(0.05)
    return statuses, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", type=Path, help="another checkout, to measure its serve.py")
    args = harness.parse_args(parser)
    print(f"{harness.machine()}\nmini (8x160, block 128), float32, max_batch 16, max_queue 64; "
          f"{INNOCENTS} innocent requests of 16 tokens sent at once beside the hog\n")  # fmt: skip
    head("hog | server | hog's answers | innocents' answers | innocent latency p50 / max (s)",
         "llllr")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "mini"
        save_checkpoint(run / "checkpoints" / "best", mini(), {"data": {"tokenizer": "gpt2"}}, {})
        here = Path(__file__).resolve().parents[1] / "serve.py"
        servers = {"this checkout": serve(here, run)}
        servers["this checkout, max_request_tokens=100000"] = serve(
            here, run, "max_request_tokens=100000"
        )
        if args.before:
            servers[f"{args.before.name} (before)"] = serve(args.before / "serve.py", run)
        try:
            for hog_name, hog in HOGS.items():
                for name, (_, url) in servers.items():
                    statuses, answers = beside(url, hog)
                    times = [s for status, s in answers if status == 200]
                    codes = [status for status, _ in answers]
                    latency = f"{statistics.median(times):.2f} / {max(times):.2f}" if times else "-"
                    row([hog_name, name, " ".join(map(str, statuses)),
                         ", ".join(f"{codes.count(c)} x {c}" for c in sorted(set(codes))),
                         latency])  # fmt: skip
        finally:
            for server, _ in servers.values():
                server.terminate()


if __name__ == "__main__":
    main()
