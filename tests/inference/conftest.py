"""A small saved checkpoint and the sample.py config, as the command line would compose it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from core.checkpoint import save_checkpoint
from model import GPT, GPTConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=16))
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints" / "best", model, {"data": {"tokenizer": "gpt2"}}, {})
    return run


@pytest.fixture
def sample_cfg() -> Callable[..., DictConfig]:
    """sample_cfg("key=value", ...) -> the composed config of `python sample.py key=value ...`."""

    def make(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
            return compose("sample", overrides=list(overrides))

    return make
