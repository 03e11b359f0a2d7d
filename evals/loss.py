"""Validation loss and bits per byte over non-overlapping (or sliding) windows of a token split or
a text file: what training reports at each evaluation and what `python evaluate.py` prints, with
the progress both show (`Progress`: a bar on a terminal, plain lines otherwise (logs, CI, pipes),
so that nothing is silent for minutes and no log fills with bar redraws). Downstream tasks are
evals/tasks.py's."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken
import torch
from tqdm import tqdm

from base.errors import ConfigError, DataError, check, is_int, positive_int
from base.files import read_utf8
from checkpoints.store import (
    Checkpoint,
    add_template_tokens,
    find_checkpoint,
    load_source,
    source_tokenizer,
)
from data.loader import bits_per_byte, iter_eval_batches
from data.pipeline import prepare_data
from hardware.device import (
    Precision,
    configure_backends,
    decoding_copy,
    quantize_setting,
    resolve_device,
    resolve_precision,
)
from hardware.distributed import all_reduce_sum, in_lockstep
from model import GPT, eval_mode
from model.gpt import unavailable_attention


class Progress:
    """Progress through `total` units (training's steps, evaluation's tokens or task items;
    None: no known end), told the count done so far. Off a terminal, `update` prints a line when
    it is given a status (training's logged steps) or once per tenth of the total (evaluation).
    `enabled=False` (every rank but the first) shows nothing. Use as a context manager, or
    `start` and `close`; `message` prints a line that stays above the bar."""

    def __init__(self, total: int | None, unit: str, enabled: bool = True):
        self.total, self.unit, self.enabled, self.tenths = total, unit, enabled, 0
        self.bar = None  # from `start` on, on a terminal; messages before it are plain lines

    def start(self, done: int = 0) -> Progress:
        if self.enabled and sys.stdout.isatty():
            self.bar = tqdm(
                total=self.total, initial=done, unit=self.unit, dynamic_ncols=True, leave=False
            )
        return self

    def update(self, done: int, status: str = "") -> None:
        tenths = done * 10 // self.total if self.total else 0
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(status) if status else self.bar.refresh()
        elif self.enabled and status:
            print(f"{self.unit} {done} | {status}", flush=True)
        elif self.enabled and tenths > self.tenths:
            print(f"{done:,} of {self.total:,} {self.unit}s", flush=True)
        self.tenths = max(self.tenths, tenths)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# A forward's loss needs its (rows * block_size, vocab) logits in float32 at once: evaluation
# forwards as many windows as keep them under this many (1 GB), whatever the batch size.
MAX_LOGITS = 2**28


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy, nats per predicted token
    bpb: float  # bits per UTF-8 byte: loss / ln 2 / (bytes per token of the split)
    tokens: int  # tokens predicted
    stderr: float  # standard error of `loss` across batches: differences below ~2x are noise

    def metrics(self, prefix: str) -> dict[str, float]:
        values = dict(loss=self.loss, bpb=self.bpb, loss_stderr=self.stderr)
        return {f"{prefix}/{name}": value for name, value in values.items()}


def sliding_windows(
    tokens: np.ndarray, block_size: int, stride: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) batches of windows every `stride` tokens; y is -1 (ignored) except on the last
    `stride` positions of each window (all of the first), so every token after the first is
    scored exactly once, with at least block_size - stride tokens of context once past the start.
    """
    n = len(tokens) - 1  # tokens that can be predicted
    width = min(block_size, n)
    starts = list(range(0, n - width + 1, stride))
    if starts[-1] + width < n:  # a final window flush with the end
        starts.append(n - width)
    starts = np.array(starts)
    # How many of its first positions the window before has already scored.
    seen = np.maximum(np.concatenate(([0], starts[:-1] + width)) - starts, 0)
    for i in range(0, len(starts), batch_size):
        rows = starts[i : i + batch_size, None] + np.arange(width)  # token indices of each window
        x = torch.from_numpy(tokens[rows].astype(np.int64))
        y = torch.from_numpy(tokens[rows + 1].astype(np.int64))
        y[torch.from_numpy(np.arange(width) < seen[i : i + batch_size, None])] = -1
        yield x, y


@torch.no_grad()
def evaluate(
    model: GPT,
    tokens: np.ndarray,
    nbytes: int,
    batch_size: int,
    precision: Precision,
    max_batches: int | None = None,
    stride: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    progress: Callable[[int], None] | None = None,
    mask: np.ndarray | None = None,
) -> EvalResult:
    """Loss and bits per byte over `tokens`, the encoding of `nbytes` UTF-8 bytes that starts
    with an <|endoftext|> (no bytes: every other token is predicted, and they span the bytes),
    in windows of block_size: by default non-overlapping windows (see
    `data.loader.iter_eval_batches`) over the whole split, or with max_batches the same evenly
    spaced subset on every call, so successive periodic evaluations are comparable. With `stride`,
    sliding windows (see `sliding_windows`): more context per token, block_size / stride times
    the compute. Under torchrun (world_size > 1, non-overlapping windows only) each rank scores
    its share of the windows and every rank returns the totals over all ranks. `progress(n)` is
    told the number of tokens this rank has scored after each batch. A chat split's `mask`
    scores assistant tokens alone, and `nbytes` is then the bytes of the assistant turns."""
    block_size = model.config.block_size
    rows = max(1, min(batch_size, MAX_LOGITS // (block_size * model.config.vocab_size)))
    if stride is None:
        windows = None if max_batches is None else max_batches * batch_size
        batches = iter_eval_batches(tokens, block_size, rows, windows, rank, world_size, mask)
    else:
        if mask is not None:
            raise DataError("stride (sliding windows) scores text, not a conversation dataset")
        batches = sliding_windows(tokens, block_size, stride, rows)
    # Under FSDP every forward is a collective: a rank out of windows runs an unscored filler.
    window = torch.from_numpy(tokens[None, :block_size].astype(np.int64))
    stats = torch.zeros(5, dtype=torch.float64)  # nats, tokens, batches, sum and sum of squares
    with eval_mode(model):
        for (x, y), scores in in_lockstep(batches, (window, window), precision.device):
            x, y = x.to(precision.device), y.to(precision.device)
            with precision.autocast():
                _, loss = model(x, y, loss_reduction="sum")
            scored = int((y != -1).sum())
            if not scores or not scored:  # a filler, or a chat window without a reply token
                continue
            nats, batch_loss = loss.item(), loss.item() / scored
            stats += torch.tensor([nats, scored, 1, batch_loss, batch_loss**2])
            if progress is not None:
                progress(int(stats[1]))
    nats, scored, n, loss_sum, loss_sq_sum = all_reduce_sum(stats.tolist(), precision.device)
    mean = nats / scored
    variance = (loss_sq_sum - loss_sum**2 / n) / (n - 1) if n > 1 else float("nan")
    targets = len(tokens) - 1 if mask is None else int(mask[1:].sum())  # what nbytes spans
    bpb = bits_per_byte(mean, scored, scored * nbytes / targets)
    return EvalResult(mean, bpb, tokens=int(scored), stderr=math.sqrt(max(variance, 0.0) / n))


def text_file_tokens(path: str, tokenizer: tiktoken.Encoding) -> tuple[np.ndarray, int, str]:
    """evaluate.py text_file=: the tokens of any UTF-8 file (after an <|endoftext|>), its bytes
    and its name."""
    file = Path(path).expanduser()
    text = read_utf8(file, "text_file")
    if not text:
        raise DataError(f"text_file {file} is empty: there is nothing to score")
    tokens = np.array([tokenizer.eot_token, *tokenizer.encode_ordinary(text)], dtype=np.int64)
    return tokens, len(text.encode("utf-8")), str(file)


def load_evaluated(
    cfg: Mapping[str, Any], say: Callable[[str], None]
) -> tuple[Checkpoint, Precision]:
    """The model `python evaluate.py` scores (checkpoint=, null: the newest run's) on its
    device, and the precision: a triton model without its GPU through sdpa, the same function."""
    quantize = quantize_setting(cfg.get("quantize"))  # .get: callers' dicts from before the key
    device = resolve_device(cfg["device"])
    configure_backends(device)
    precision = resolve_precision(device, cfg["dtype"])
    source = find_checkpoint() if cfg["checkpoint"] is None else cfg["checkpoint"]
    ckpt = load_source(source, device)
    if why := unavailable_attention(device).get(ckpt.model.config.attention):  # triton, no GPU
        say(f"{why.split(';')[0]}; scoring through model.attention=sdpa, the same function")
        model = GPT(dataclasses.replace(ckpt.model.config, attention="sdpa")).to(device)
        model.load_state_dict(ckpt.model.state_dict())  # the weights loaded and verified once
        ckpt.model = model
    if quantize:
        ckpt.model = decoding_copy(ckpt.model, quantize=quantize)
        say(f"quantize={quantize}: every Linear's weights in {quantize[3:]} bits")
    return ckpt, precision


def scored_text(
    cfg: Mapping[str, Any], ckpt: Checkpoint
) -> tuple[np.ndarray, np.ndarray | None, int, str]:
    """(tokens, loss mask or None, bytes, its name) of what `python evaluate.py` scores:
    `text_file`, else the validation split of dataset=/data=, else of the checkpoint's own
    dataset, tokenized as the model's own text was."""
    tokenizer = ckpt.tokenizer()  # from the checkpoint alone: the data cache may be gone
    if cfg["text_file"]:
        tokens, nbytes, source = text_file_tokens(cfg["text_file"], tokenizer)
        return tokens, None, nbytes, source
    named = {"name": cfg["dataset"]} if cfg["dataset"] else cfg.get("data")
    if named:  # tokenized as the model's own text was, whatever the dataset's default
        named = {**named, **source_tokenizer(ckpt.path)}
    data_cfg = named or ckpt.run_config.get("data")
    if data_cfg is None:
        raise DataError(
            f"the checkpoint {ckpt.path} does not record the dataset it was trained on "
            "(no run.data in its config.json); evaluate with dataset=<name> or text_file=<path>"
        )
    if data_cfg.get("val_files") and not data_cfg.get("train_files"):  # val alone is scored
        data_cfg = {**data_cfg, "train_files": data_cfg["val_files"]}
    data = prepare_data(data_cfg, verbose=False)
    if not ckpt.same_tokenizer(data):
        name, theirs = data.tokenizer_name, ckpt.tokenizer_name
        why = f"with {name}, the checkpoint {ckpt.path} with {theirs}"
        if name == theirs:
            why = f"with another {name} than the checkpoint {ckpt.path} (its text changed)"
        raise DataError(
            f"{data.dir} is tokenized {why}; evaluate with data=<name> or dataset=<name> "
            "(tokenized with the checkpoint's own) or text_file=<path>"
        )
    add_template_tokens(ckpt, data)  # a base model scored on conversations
    source, nbytes = f"{data.meta['dataset']}/val", data.meta["splits"]["val"]["bytes"]
    return data.tokens("val"), data.mask("val"), nbytes, source


def evaluate_checkpoint(
    cfg: Mapping[str, Any], say: Callable[[str], None] = print
) -> dict[str, Any]:
    """`python evaluate.py`: a checkpoint's loss and bits per byte on its dataset's validation
    split or on any UTF-8 `text_file` (downstream tasks: evals/tasks.py's `evaluate_tasks`).
    See configs/evaluate.yaml for the keys; `say` shows the plan."""
    batch_size = positive_int("batch_size", cfg["batch_size"])
    if cfg["dataset"] and cfg.get("data"):  # data=: train.py's group, its data.* keys too
        raise ConfigError("give dataset=<name> or data=<name> (with its data.* keys), not both")
    ckpt, precision = load_evaluated(cfg, say)
    tokens, mask, nbytes, source = scored_text(cfg, ckpt)
    stride, block_size = cfg["stride"], ckpt.model.config.block_size
    ok = stride is None or (is_int(stride, 1) and stride <= block_size)
    check("stride", stride, ok, "null or an integer in [1, block_size]")
    method = f"sliding windows, stride {stride}" if stride else "non-overlapping windows"
    say(f"{source}: {len(tokens) - 1:,} tokens, {nbytes:,} bytes, {method} of {block_size}")
    scored = len(tokens) - 1 if mask is None else int(mask[1:].sum())
    with Progress(scored, "token") as progress:
        result = evaluate(
            ckpt.model, tokens, nbytes, batch_size, precision,
            stride=stride, progress=progress.update, mask=mask,
        )  # fmt: skip
    return {
        "checkpoint": str(ckpt.path),
        "data": source,
        "loss": round(result.loss, 5),
        "bpb": round(result.bpb, 5),
        "tokens": result.tokens,
        "bytes": nbytes,
        "block_size": block_size,
        "method": method,
    }
