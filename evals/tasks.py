"""Downstream tasks (HellaSwag, ARC-Easy, LAMBADA) scored as lm-evaluation-harness scores them.

Each item is a context and one or more choices; a choice's score is the sum of its tokens'
log-probabilities after the context, tokenized as the harness's `_encode_pair` does (the pair
encoded whole and split where the context's tokens end; trailing spaces move to the choice).
Multiple choice reports `acc` (the highest sum is the gold choice) and `acc_norm` (the sum divided
by the choice's length in characters); LAMBADA the greedy accuracy of its last word and the
perplexity exp(-mean log-likelihood). Sequences longer than block_size + 1 are cut from the left.

Faster than the harness on the same work: the context runs once, and every choice continues
from a copy of its KV cache in one batch (the causal mask makes this exact).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tiktoken
import torch
import torch.nn.functional as F
import yaml

from base.errors import CONFIG_DIR, ConfigError, DataError, positive_int
from data.sources import FILE_BUILDERS, load_dataset
from evals.loss import Progress, load_evaluated
from hardware.device import Precision
from hardware.distributed import all_reduce_sum, in_lockstep
from model import GPT, eval_mode

TASKS_DIR = CONFIG_DIR / "task"


def task_config(name: str) -> dict[str, Any]:
    """configs/task/<name>.yaml's values, or those of a task file of your own (a .yaml path)."""
    path = Path(name).expanduser() if name.endswith(".yaml") else TASKS_DIR / f"{name}.yaml"
    if not path.is_file() and path.parent != TASKS_DIR:
        raise ConfigError(f"task file {path} not found (a task of your own is a .yaml path)")
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TASKS_DIR.glob("*.yaml")))
        raise ConfigError(f"unknown task {name!r}; choose one of: {known}")
    return yaml.safe_load(path.read_text())


def _clean(text: str) -> str:
    """The harness's HellaSwag preprocessing: WikiHow's bracketed artifacts go."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag(doc: dict[str, Any]) -> tuple[str, list[str], int]:
    ctx = _clean(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
    return ctx, [_clean(e) for e in doc["endings"]], int(doc["label"])


def _arc(doc: dict[str, Any]) -> tuple[str, list[str], int]:
    choices, question = doc["choices"], f"Question: {doc['question']}\nAnswer:"
    return question, choices["text"], choices["label"].index(doc["answerKey"])


def _lambada(doc: dict[str, Any]) -> tuple[str, list[str], int]:
    *context, word = doc["text"].split(" ")
    return " ".join(context), [word], 0


# format: (the fields an item needs, how it becomes (context, choices, gold)); each choice is
# scored as " " + choice, the harness's target delimiter (LAMBADA's target carries the same space).
FORMATS = {
    "hellaswag": (("activity_label", "ctx_a", "ctx_b", "endings", "label"), _hellaswag),
    "arc": (("question", "choices", "answerKey"), _arc),
    "lambada": (("text",), _lambada),
}


@dataclass
class Item:
    context: list[int]  # token ids, shared by every choice
    choices: list[list[int]]  # each choice's token ids
    chars: list[int]  # each choice's length in characters, for acc_norm
    gold: int


@dataclass
class Task:
    name: str
    format: str
    items: list[Item]


def encode_pair(
    tokenizer: tiktoken.Encoding, context: str, choice: str
) -> tuple[list[int], list[int]]:
    """The harness's tokenization of (context, " " + choice): trailing spaces move to the choice,
    and the choice's tokens are the whole pair's after the context's own; an empty context is
    the end-of-text token."""
    cont = " " + choice
    if context == "":
        return [tokenizer.eot_token], tokenizer.encode_ordinary(cont)
    ctx = tokenizer.encode_ordinary(context.rstrip())  # its trailing spaces: the choice's
    return ctx, tokenizer.encode_ordinary(context + cont)[len(ctx) :]


LOCAL_COPY = (
    "; without the network, score a local copy of the items: task.data_files=<file> (in "
    "train.eval_tasks, a task .yaml that sets data_files); docs/evaluation.md says where to get "
    "each task's file"
)


def load_task(cfg: dict[str, Any], tokenizer: tiktoken.Encoding, block_size: int) -> Task:
    """A task's first `limit` items, tokenized. With `data_files`, a local .jsonl, .json or
    .parquet file in the hub dataset's fields goes through the same `datasets.load_dataset`."""
    name, fmt = cfg["name"], cfg["format"]
    if fmt not in FORMATS:
        raise ConfigError(
            f"task {name}: unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}"
        )
    fields, build = FORMATS[fmt]
    path, subset, split, files = cfg["path"], cfg.get("subset"), cfg["split"], cfg.get("data_files")
    if files:  # a local file: its format's builder, no subset
        path = FILE_BUILDERS.get(Path(files).suffix)
        if path is None:
            raise DataError(
                f"task {name}: task.data_files={files} is not a .jsonl, .json or .parquet file"
            )
        subset, files = None, {split: str(Path(files).expanduser())}
    try:
        ds = load_dataset(path, subset, split, LOCAL_COPY, data_files=files)
    except DataError as e:
        if files:
            raise
        raise DataError(f"task {name}: {e}") from e
    if missing := [f for f in fields if f not in ds.column_names]:
        raise DataError(
            f"task {name}: the items have no field {', '.join(missing)} "
            f"(they have: {', '.join(ds.column_names)})"
        )
    if cfg.get("limit") is not None:
        ds = ds.select(range(min(positive_int("task.limit", cfg["limit"]), len(ds))))
    items = []
    for i, doc in enumerate(ds):
        try:
            context, choices, gold = build(doc)
        # the item's fields missing or mistyped for the task's builder
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"task {name}: item {i} is malformed ({type(e).__name__}: {e})") from e
        if not 0 <= gold < len(choices):
            raise DataError(
                f"task {name}: item {i} has label {gold}, out of range for {len(choices)} choices"
            )
        pairs = [encode_pair(tokenizer, context, c) for c in choices]
        if (longest := max(len(c) for _, c in pairs)) > block_size:
            raise DataError(
                f"task {name}: item {i} has a choice of {longest} tokens, more than the model's "
                f"block_size {block_size} can score"
            )
        items.append(Item(pairs[0][0], [c for _, c in pairs], [len(c) for c in choices], gold))
    return Task(name, fmt, items)


def score_choices(model: GPT, item: Item, precision: Precision) -> tuple[list[float], list[bool]]:
    """Each choice's log-likelihood after the context, and whether greedy decoding would have
    produced it. Two forwards whatever the item (so FSDP ranks stay in step): the prefix the
    choices' inputs share, once (or each input's first token where they share none, after a cut),
    then the rest of every input as one padded batch, continuing from the prefix's KV cache."""
    T = model.config.block_size
    seqs = [(item.context + c)[-(T + 1) :] for c in item.choices]  # cut from the left
    inputs, n = [s[:-1] for s in seqs], len(seqs)
    # The prefix the inputs share, up to the first scored position, leaving a token to batch.
    first_scored = min(len(x) - len(c) for x, c in zip(inputs, item.choices, strict=True))
    longest = max(map(len, inputs))
    p = min(len(os.path.commonprefix(inputs)), first_scored + 1, longest - 1)
    shared = p > 0
    prefix = [inputs[0][:p]] if shared else [x[:1] for x in inputs]
    p = max(p, 1)
    device = precision.device
    cache = model.new_kv_cache(len(prefix), longest)
    with precision.autocast():
        first = model(torch.tensor(prefix, device=device), cache=cache, last_only=True)[0]
        first = first.expand(n, -1, -1)  # (n, 1, vocab): predicts each input's position p
        if shared:  # every choice continues from its own copy of the prefix's keys and values
            cache.k, cache.v = ([t.repeat(n, 1, 1, 1) for t in kv] for kv in (cache.k, cache.v))
        rest = torch.tensor([x[p:] + [0] * (longest - len(x)) for x in inputs], device=device)
        logits = torch.cat([first, model(rest, cache=cache)[0]], dim=1)
    logprobs = F.log_softmax(logits.float(), dim=-1)  # (n, longest - p + 1, vocab): targets from p
    lls, greedy = [], []
    for i, (s, c) in enumerate(zip(seqs, item.choices, strict=True)):
        k = len(s) - p  # targets s[p:]; the choice's are the last len(c)
        scored = logprobs[i, k - len(c) : k]  # (len(c), vocab)
        target = torch.tensor(c, device=device)
        lls.append(scored.gather(1, target[:, None]).sum())
        greedy.append((scored.argmax(-1) == target).all())
    return torch.stack(lls).tolist(), torch.stack(greedy).tolist()  # one read of the device each


@torch.no_grad()
def score_task(
    model: GPT,
    task: Task,
    precision: Precision,
    rank: int = 0,
    world_size: int = 1,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """The task's metrics over all its items; under torchrun each rank scores every
    world_size-th item and the counts are summed, so every rank returns the same metrics.
    `progress(k)` is called after each item with the number this rank has scored."""
    totals = torch.zeros(4, dtype=torch.float64)  # items, acc, acc_norm, sum of log-likelihoods
    with eval_mode(model):
        mine = task.items[rank::world_size]
        for k, (item, scores) in enumerate(in_lockstep(mine, task.items[0], precision.device), 1):
            lls, greedy = score_choices(model, item, precision)
            if not scores:
                continue
            norm = [ll / n for ll, n in zip(lls, item.chars, strict=True)]
            best = max(range(len(lls)), key=lls.__getitem__)  # the first of equals, as np.argmax
            best_norm = max(range(len(norm)), key=norm.__getitem__)
            hit = greedy[0] if task.format == "lambada" else best == item.gold
            row = [1, hit, best_norm == item.gold, lls[item.gold]]
            totals += torch.tensor(row, dtype=torch.float64)
            if progress is not None:
                progress(k)
    n, acc, acc_norm, ll = all_reduce_sum(totals.tolist(), precision.device)

    def with_stderr(name: str, hits: float) -> dict[str, float]:
        p = hits / n  # the harness's stderr, the sample std over sqrt(n); JSON null at n = 1
        return {name: p, f"{name}_stderr": math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None}

    if task.format == "lambada":
        return {**with_stderr("acc", acc), "perplexity": math.exp(-ll / n), "items": int(n)}
    return {**with_stderr("acc", acc), **with_stderr("acc_norm", acc_norm), "items": int(n)}


def requested_tasks(task: dict[str, Any] | None, names: list[str]) -> list[dict[str, Any]]:
    """evaluate.py's `task=<name>` (with its task.* overrides) then `tasks=[...]` by name, each
    with task.limit."""
    task = task or {}
    chosen = [task] if "name" in task else []
    return chosen + [{**task_config(n), "limit": task.get("limit")} for n in names]


def evaluate_tasks(cfg: Mapping[str, Any], say: Callable[[str], None] = print) -> dict[str, Any]:
    """`python evaluate.py task=<name>` (or tasks=[...]): the checkpoint's downstream scores,
    each task's plan and result told to `say` as they come, with a progress counter over its
    items."""
    ckpt, precision = load_evaluated(cfg, say)
    model, tokenizer, results = ckpt.model, ckpt.tokenizer(), {}
    for task_cfg in requested_tasks(cfg["task"], cfg["tasks"]):
        task = load_task(task_cfg, tokenizer, model.config.block_size)
        where = task_cfg["data_files"] or task_cfg["path"]
        say(f"{task.name}: {len(task.items):,} items from {where}")
        with Progress(len(task.items), "item") as progress:
            results[task.name] = score_task(model, task, precision, progress=progress.update)
        say(task_line(task.name, results[task.name]))
    return {"checkpoint": str(ckpt.path), "tasks": results}


def task_line(name: str, metrics: dict[str, float]) -> str:
    """'hellaswag: acc 0.2892 ± 0.0045, acc_norm 0.3114 ± 0.0046 (10,042 items)'."""
    parts = [
        f"{k} {metrics[k]:.4f}" + ("" if (e := metrics[f"{k}_stderr"]) is None else f" ± {e:.4f}")
        for k in ("acc", "acc_norm")
        if k in metrics
    ]
    if "perplexity" in metrics:
        parts.append(f"perplexity {metrics['perplexity']:.2f}")
    n = metrics["items"]
    return f"{name}: {', '.join(parts)} ({n:,} item{'s' * (n != 1)})"
