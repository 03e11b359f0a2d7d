"""A tiny saved checkpoint, for the checkpoint tests."""

from __future__ import annotations

import torch

from checkpoints.store import save_checkpoint
from model import GPT
from tests.conftest import tiny_config


def save(path, step=0, **kw):
    torch.manual_seed(step)
    return save_checkpoint(
        path,
        GPT(tiny_config(**kw)),
        {"data": {"tokenizer": "gpt2"}},
        {"step": step},
        {"step": step, "rng": torch.get_rng_state()},
    )
