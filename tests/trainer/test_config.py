"""Every run-config key is validated up front, with errors that name the key."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import compose_run
from trainer.config import ConfigError, RunConfig


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.batch_size=abc", "train.batch_size"),
        ("train.batch_size=0", "train.batch_size"),
        ("train.max_steps=-5", "train.max_steps"),
        ("train.max_seconds=0", "train.max_seconds"),
        ("train.max_seconds=inf", "train.max_seconds"),
        ("train.on_nan=ignore", "train.on_nan"),
        ("optim.lr=-1", "optim.lr"),
        ("optim.lr=nan", "optim.lr"),
        ("optim.schedule=linear", "optim.schedule"),
        ("optim.betas=[0.9]", "optim.betas"),
        ("optim.grad_clip=-1", "optim.grad_clip"),
        ("wandb.mode=maybe", "wandb.mode"),
        ("device=tpu", "device"),
        ("dtype=int8", "dtype"),
        ("compile=yes", "compile"),
    ],
)
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key} "):
        compose_run([], override)


def test_unknown_section_key_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown config key train.bogus; known keys: .*batch"):
        RunConfig.from_dict({"model": {}, "data": {}, "train": {"bogus": 1}})


def test_the_default_config_is_valid():
    settings, resolved = compose_run([])
    assert settings.train.resume is None and settings.optim.schedule == "cosine"
    assert resolved["data"]["name"] == "shakespeare"
