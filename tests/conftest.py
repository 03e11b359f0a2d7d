"""Shared fixtures: small models built from the real presets, one Shakespeare preparation."""

from __future__ import annotations

import os

# Tests never touch the network: set before `datasets` is first imported (it reads them once).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
# dtype=auto on a CPU follows a per-machine probe (hardware/device.py); the suite's figures
# (bit-exact resume, tolerances) are float32's on every CPU. tests/hardware/test_device.py tests
# the probe itself.
os.environ["CAUSALGPT_CPU_AUTO_DTYPE"] = "float32"

import pytest  # noqa: E402
import torch  # noqa: E402

from checkpoints.store import save_checkpoint  # noqa: E402
from data.pipeline import PreparedData, prepare_data  # noqa: E402
from data.tokenizer import get_tokenizer, parse_tokenizer, train_bpe  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

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
