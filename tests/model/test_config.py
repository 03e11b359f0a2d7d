"""Bad shapes fail at construction with one ValueError that names the field."""

from __future__ import annotations

import pytest
import torch

from model import GPT, GPTConfig, load_preset, preset_names
from tests.conftest import tiny_config


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(n_embd=30, n_head=4), "n_embd"),
        (dict(n_layer=0), "n_layer"),
        (dict(n_head=-2), "n_head"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(block_size=0), "block_size"),
        (dict(n_embd=2.5), "n_embd"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout=-0.1), "dropout"),
        (dict(attention="flashy"), "attention"),
        (dict(bias="yes"), "bias"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"model\.{field}"):
        tiny_config(**overrides)


def test_unknown_attention_lists_the_known_ones():
    with pytest.raises(ValueError, match="manual.*sdpa"):
        tiny_config(attention="flashy")


def test_unknown_key_and_unknown_preset_are_named():
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig.from_dict({"n_layers": 2})
    with pytest.raises(ValueError, match="gpt5.*known presets"):
        load_preset("gpt5")


def test_input_longer_than_block_size_is_refused(tiny_model):
    with pytest.raises(ValueError, match="block_size=16"):
        tiny_model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "name, params_millions",
    [("gpt2", 124), ("gpt2-medium", 355), ("gpt2-large", 774), ("gpt2-xl", 1558), ("mini", 10)],
)
def test_presets_have_their_advertised_size(name, params_millions):
    preset = load_preset(name) | {"vocab_size": 50257}
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(GPTConfig.from_dict(preset))
    millions = model.num_params(exclude_positions=False) / 1e6
    assert millions == pytest.approx(params_millions, rel=0.06)


def test_every_preset_builds_a_valid_config():
    for name in preset_names():
        config = GPTConfig.from_dict(load_preset(name) | {"vocab_size": 50257})
        assert config.n_embd % config.n_head == 0
