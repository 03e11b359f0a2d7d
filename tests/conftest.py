"""Shared fixtures: small models built from the real presets."""

from __future__ import annotations

import pytest
import torch

from model import GPT, GPTConfig


def tiny_config(**overrides) -> GPTConfig:
    values = dict(vocab_size=101, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    values.update(overrides)
    return GPTConfig(**values)


@pytest.fixture
def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_config()).eval()
