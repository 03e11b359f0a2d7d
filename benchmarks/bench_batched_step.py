"""The server's batched step (inference/batching.py) per batch size: eager in float32, compiled,
and eager from 8- and 4-bit weights (serve.py quantize=); print a markdown table.

The server decodes its rows together, each at its own position, through a RaggedKVCache: one
eager forward a step, from the row-block decoding copy (hardware/device.py). Issue 58 asked for
that step compiled with fixed batch buckets, as sample.py's one-row step is (inference/generate.py,
`compiled_step`); this measures it before building it: the same forward compiled with
`torch.compile(fullgraph=True, dynamic=False)` over a cache of fixed shapes (`RowStepCache`
below: every row writes at its own position `at` and attends over all block_size positions under
the causal mask's row at `at`), as a bucketed server would run it. And the same eager step from
the decoding copy with quantize=int8 and int4.

Rows start at random lengths in [50, 150); every step decodes at the same positions. Timed
alternately, 20 steps a round, best of --rounds, after a warm-up (the compile's time apart).

    python benchmarks/bench_batched_step.py [--shapes 30m 124m] [--rows 1 4 8 16]
"""

from __future__ import annotations

import argparse
import time

import harness
import torch
from bench_llamacpp import SHAPES

from hardware.device import decodes_from_a_copy, decoding_copy
from inference.batching import RaggedKVCache
from model import GPT, GPTConfig


class RowStepCache:
    """A RaggedKVCache's rows as a compiled step sees them: fixed shapes, row r's new token at
    position at[r], its keys after at[r] masked as the future is."""

    def __init__(self, cache: RaggedKVCache, at: torch.Tensor):
        self.k, self.v, self.at = cache.k, cache.v, at  # (R, nh, block_size, hs) per layer; (R,)

    def positions(self, T: int) -> torch.Tensor:
        return self.at[:, None]  # (R, 1)

    def allowed(self, causal_mask: torch.Tensor, T: int) -> torch.Tensor:
        return causal_mask[self.at][:, None, None, :]  # (R, 1, 1, block_size)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        index = self.at.view(-1, 1, 1, 1).expand(-1, k.size(1), 1, k.size(3))  # (R, nh, 1, hs)
        self.k[layer].scatter_(2, index, k)
        self.v[layer].scatter_(2, index, v)
        return self.k[layer], self.v[layer]

    def advance(self, n: int) -> None:
        pass


def one_step(decoder: torch.nn.Module, tokens: torch.Tensor, cache) -> torch.Tensor:
    return decoder(tokens, cache=cache, last_only=True)[0][:, -1]  # (R, V)


def eager_step(decoder: torch.nn.Module, tokens: torch.Tensor, ragged: RaggedKVCache) -> None:
    one_step(decoder, tokens, ragged)
    ragged.lengths -= 1  # the same positions every step, as the compiled step's `at`


def seconds(step, *args, steps: int = 20) -> float:
    """Seconds a call of step(*args), over `steps` calls."""
    started = time.perf_counter()
    for _ in range(steps):
        step(*args)
    return (time.perf_counter() - started) / steps


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{harness.machine()}, {torch.get_num_threads()} threads\n")
    print("| shape | rows | eager tok/s | compiled | int8 | int4 | compile s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    torch._dynamo.config.recompile_limit = 64  # a graph per shape and row count
    compiled = torch.compile(one_step, fullgraph=True, dynamic=False)
    for shape in args.shapes:
        model = GPT(GPTConfig(**SHAPES[shape], vocab_size=50304, dropout=0.0)).eval()
        copies = {q: decoding_copy(model, quantize=q) for q in (None, "int8", "int4")}
        assert decodes_from_a_copy(model)  # the server's float32 decoder on a CPU: copies[None]
        for rows in args.rows:
            ragged = model.new_kv_cache(rows, kind=RaggedKVCache)
            ragged.lengths[:] = torch.randint(50, 150, (rows, 1))
            tokens = torch.randint(0, 50000, (rows, 1))
            fixed = RowStepCache(ragged, ragged.lengths[:, 0].clone())
            started = time.perf_counter()
            compiled(copies[None], tokens, fixed)
            compile_s = time.perf_counter() - started
            steps = {  # name: (function, its arguments)
                "eager": (eager_step, (copies[None], tokens, ragged)),
                "compiled": (compiled, (copies[None], tokens, fixed)),
                "int8": (eager_step, (copies["int8"], tokens, ragged)),
                "int4": (eager_step, (copies["int4"], tokens, ragged)),
            }
            best = dict.fromkeys(steps, float("inf"))
            for _ in range(args.rounds):  # alternated
                for name, (step, step_args) in steps.items():
                    step(*step_args)  # warm
                    best[name] = min(best[name], seconds(step, *step_args))
            eager = rows / best["eager"]
            cells = [f"{eager:.0f}"] + [
                f"{rows / best[name]:.0f} ({best['eager'] / best[name]:.2f}x)"
                for name in ("compiled", "int8", "int4")
            ]
            print(f"| {shape} | {rows} | {' | '.join(cells)} | {compile_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
