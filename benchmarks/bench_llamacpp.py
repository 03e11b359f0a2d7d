"""Benchmark: batch-1 decoding beside llama.cpp on the same weights; print a markdown table.

For each shape (nanoGPT's 30M: 6 x 384, block 256; GPT-2 124M's: 12 x 768, block 1024; both
with a 50,304-token vocabulary, random weights), a checkpoint is saved and exported with
`python export.py format=gguf` (float32, and bfloat16 with gguf.dtype), then quantized to q8_0
and q4_1 by llama.cpp's own llama-quantize (q4_1: a scale and a minimum per 32 weights, as our
int4). Rows, each timed --rounds times, interleaved, best of the rounds:

- llama.cpp: `llama-bench -p 0 -n N -t <threads>` on each file (its tokens/s for N generated
  tokens at batch 1);
- ours: `stream_tokens` greedy from a 1-token prompt, N tokens, as sample.py decodes: eager
  (compile=false) and compiled (compile=true, compiled once before the rounds: its compile time
  is printed apart), with the weights in float32 and bfloat16 (dtype=) and in 8 and 4 bits
  (quantize=int8, quantize=int4).

"vs llama.cpp" is ours over llama.cpp's at the same precision (q8_0 for int8, q4_1 for int4);
"of roofline" the tokens/s over this machine's copy bandwidth divided by the bytes a token reads
(every weight once, with its scales). Run on a quiet machine:
llama.cpp's threads spin, and collapse beside any busy core.

    python benchmarks/bench_llamacpp.py --llama-bin <llama.cpp build>/bin [--shapes 30m 124m]
        [--tokens 200] [--rounds 3] [--threads 2]

Build llama.cpp as scripts/llamacpp_check.sh's header says, with the targets llama-bench and
llama-quantize.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch
from bench_sample import bandwidth
from harness import head, row
from torch._dynamo.utils import counters

from checkpoints.store import save_checkpoint
from hardware.device import decoding_copy
from inference.generate import SamplingParams, stream_tokens
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "30m": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
}
RUN = {"data": {"name": "shakespeare", "tokenizer": "gpt2"}, "train": {"init_from": None}}


# Each precision: our weights' dtype and sample.py's quantize=, and llama.cpp's type of the same
# bits (float32 and bfloat16 from export.py's gguf.dtype, the others from llama-quantize)
PRECISIONS = {
    "float32": (torch.float32, None, "float32"),
    "bfloat16": (torch.bfloat16, None, "bfloat16"),
    "int8": (torch.float32, "int8", "q8_0"),
    "int4": (torch.float32, "int4", "q4_1"),
}


def gguf_files(model: GPT, work: Path, llama_bin: Path) -> dict[str, Path]:
    """The model in each of PRECISIONS' llama.cpp types, one GGUF file each."""
    ckpt = save_checkpoint(work / "ckpt", model, RUN, {"step": 0, "tokenizer": "gpt2"})
    export = [sys.executable, str(ROOT / "export.py"), f"checkpoint={ckpt}", "format=gguf"]
    files = {}
    for precision, (_, quantize, theirs) in PRECISIONS.items():
        files[precision] = work / f"{theirs}.gguf"
        if quantize is None:
            out = [f"out={files[precision]}", f"gguf.dtype={theirs}"]
            subprocess.run([*export, *out], check=True, cwd=ROOT, capture_output=True)
        else:
            command = [
                str(llama_bin / "llama-quantize"),
                str(files["float32"]),
                str(files[precision]),
            ]
            subprocess.run([*command, theirs], check=True, capture_output=True)
    return files


def llama_bench(llama_bin: Path, gguf: Path, tokens: int, threads: int) -> float:
    """llama.cpp's generation tokens/s (llama-bench, one repetition)."""
    command = [str(llama_bin / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(tokens)]
    command += ["-t", str(threads), "-r", "1", "-o", "json"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out)[0]["avg_ts"]


def ours(model: GPT, tokens: int, compiled: bool, quantize: str | None) -> float:
    """Our tokens/s: `tokens` greedy tokens from a 1-token prompt (the first, the prompt's,
    not timed)."""
    steps = stream_tokens(
        model, torch.zeros(1, 1, dtype=torch.long), tokens + 1, SamplingParams(temperature=0),
        compiled=compiled, quantize=quantize,
    )  # fmt: skip
    next(steps)
    start = time.perf_counter()
    for _ in steps:
        pass
    return tokens / (time.perf_counter() - start)


def bytes_per_token(model: GPT, quantize: str | None) -> int:
    """Weight bytes a token reads: every matrix once, its scales with it (positions: one row)."""
    if quantize is None:
        return model.num_params(exclude_positions=True) * model.lm_head.weight.element_size()
    copy = decoding_copy(model, quantize=quantize)
    low_bits = sum(b.numel() * b.element_size() for n, b in copy.named_buffers() if "mask" not in n)
    return low_bits + sum(p.numel() * 4 for n, p in copy.named_parameters() if "ln" in n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = harness.parse_args(parser)  # torch's threads: --threads
    print(f"{harness.machine()}\nbatch 1, greedy, {args.tokens} tokens from a 1-token prompt, "
          f"{args.threads} threads, best of {args.rounds} interleaved rounds\n")  # fmt: skip
    head("shape | precision | decoder | tok/s | vs llama.cpp | of roofline | compile s", "lllrrrr")
    for shape in args.shapes:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SHAPES[shape], vocab_size=50304, dropout=0.0)).eval()
        with tempfile.TemporaryDirectory() as work:
            files = gguf_files(model, Path(work), args.llama_bin)
            compile_s = {}
            models = {dtype: copy.deepcopy(model).to(dtype) for dtype, _, _ in PRECISIONS.values()}
            for precision, (dtype, quantize, _) in PRECISIONS.items():  # compiled before the rounds
                start = time.perf_counter()
                ours(models[dtype], 2, compiled=True, quantize=quantize)
                compile_s[precision] = time.perf_counter() - start
            best: dict[tuple[str, str], float] = {}
            copy_bw = 0.0
            for _ in range(args.rounds):
                copy_bw = max(copy_bw, bandwidth())
                for precision, gguf in files.items():
                    theirs = llama_bench(args.llama_bin, gguf, args.tokens, args.threads)
                    rates = {"llama.cpp": theirs}
                    for compiled in (False, True):
                        name = "ours, compiled" if compiled else "ours, eager"
                        dtype, quantize, _ = PRECISIONS[precision]
                        rates[name] = ours(models[dtype], args.tokens, compiled, quantize)
                    for name, rate in rates.items():
                        best[precision, name] = max(best.get((precision, name), 0.0), rate)
            graphs = counters["stats"]["unique_graphs"]  # 4, or a step recompiled unseen
            print(f"{shape}: {graphs} graphs compiled", file=sys.stderr)
            read = {p: bytes_per_token(models[d], q) for p, (d, q, _) in PRECISIONS.items()}
            for (precision, name), rate in best.items():
                theirs = PRECISIONS[precision][2]
                roofline = copy_bw / read[precision]  # tokens/s
                ratio = rate / best[precision, "llama.cpp"]
                label = theirs if name == "llama.cpp" else precision
                compiled = f"{compile_s[precision]:.1f}" if name == "ours, compiled" else ""
                row([shape, label, name, f"{rate:.1f}", f"{ratio:.2f}x",
                     f"{rate / roofline:.0%}", compiled])  # fmt: skip
        torch._dynamo.reset()  # the next shape compiles its own graphs
        counters.clear()


if __name__ == "__main__":
    main()
