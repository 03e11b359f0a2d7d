"""Bad shapes fail at construction with one ValueError that names the field."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from checkpoints.hf import GPT2_ARCHITECTURE
from model import GPT, GPTConfig
from model.gpt import MAX_MLP_RATIO, MAX_SIZES
from tests.conftest import PRESETS, load_preset, tiny_config


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
        (dict(pos_embedding="alibi"), "pos_embedding"),
        (dict(pos_embedding=None), "pos_embedding"),
        (dict(norm="batchnorm"), "norm"),
        (dict(mlp="geglu"), "mlp"),
        (dict(mlp="GELU"), "mlp"),
        (dict(qk_norm="yes"), "qk_norm"),
        (dict(qk_norm=1), "qk_norm"),
        (dict(zero_init_proj="false"), "zero_init_proj"),
        (dict(zero_init_proj=None), "zero_init_proj"),
        (dict(rope_base=0), "rope_base"),
        (dict(rope_base=-10000.0), "rope_base"),
        (dict(rope_base=math.nan), "rope_base"),
        (dict(rope_base=math.inf), "rope_base"),
        (dict(rope_base=True), "rope_base"),
        (dict(rope_base="10000"), "rope_base"),
        (dict(mlp_ratio=0), "mlp_ratio"),
        (dict(mlp_ratio=-4), "mlp_ratio"),
        (dict(mlp_ratio=math.nan), "mlp_ratio"),
        (dict(mlp_ratio=math.inf), "mlp_ratio"),
        (dict(mlp_ratio=None), "mlp_ratio"),
        (dict(mlp_ratio=0.01), "mlp_ratio"),  # round(0.01 * 16) = 0 hidden units
        (dict(mlp_ratio=0.01, mlp="swiglu"), "mlp_ratio"),
        (dict(logit_softcap=0), "logit_softcap"),
        (dict(logit_softcap=-30.0), "logit_softcap"),
        (dict(logit_softcap=math.nan), "logit_softcap"),
        (dict(logit_softcap=math.inf), "logit_softcap"),
        (dict(logit_softcap=False), "logit_softcap"),
        (dict(logit_softcap="30"), "logit_softcap"),
        (dict(pos_embedding="rope", n_embd=18, n_head=2), "pos_embedding"),  # head size 9
        # sizes beyond any model: a typo, or a hand-edited checkpoint asking for terabytes
        (dict(n_embd=4_000_000, n_head=1), "n_embd"),
        (dict(block_size=1 << 17), "block_size"),
        (dict(n_layer=1025), "n_layer"),
        (dict(vocab_size=1 << 22), "vocab_size"),
        (dict(flash_block_q=1 << 17), "flash_block_q"),
        (dict(mlp_ratio=65), "mlp_ratio"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    """One ValueError, on one line (trainer/config.py prints it as `error: <message>`)."""
    with pytest.raises(ValueError, match=rf"model\.{field}") as error:
        tiny_config(**overrides)
    assert "\n" not in str(error.value)


def test_the_largest_sizes_are_accepted():
    """Negative control for the bounds above: the limits themselves are valid."""
    config = GPTConfig(**{**MAX_SIZES, "n_head": 1024, "mlp_ratio": MAX_MLP_RATIO})
    assert config.n_embd == 1 << 16 and config.block_size == 1 << 16


@pytest.mark.parametrize(
    "field, choices",
    [
        ("attention", "['manual', 'sdpa', 'flash', 'triton']"),
        ("pos_embedding", "['learned', 'rope']"),
        ("norm", "['layernorm', 'rmsnorm']"),
        ("mlp", "['gelu', 'relu2', 'swiglu']"),
    ],
)
def test_unknown_choice_lists_the_known_ones(field, choices):
    with pytest.raises(ValueError) as error:
        tiny_config(**{field: "bogus"})
    assert str(error.value) == f"model.{field} must be one of {choices}, got 'bogus'"


def test_rope_with_an_odd_head_size_says_why():
    with pytest.raises(ValueError, match=r"n_embd / n_head = 9 must be even"):
        tiny_config(pos_embedding="rope", n_embd=18, n_head=2)
    tiny_config(n_embd=18, n_head=2)  # learned positions have no such constraint


def test_good_option_values_are_accepted():
    config = tiny_config(rope_base=500, mlp_ratio=8 / 3, logit_softcap=15, pos_embedding="rope")
    assert config.mlp_hidden == round(8 / 3 * 16) == 43
    assert tiny_config(logit_softcap=None).logit_softcap is None


@pytest.mark.parametrize(
    "n_embd, mlp, mlp_ratio, hidden",
    [
        (768, "gelu", 4, 3072),
        (768, "relu2", 4, 3072),
        (768, "swiglu", 4, 2048),  # 2/3 of 3072, already a multiple of 8
        (16, "swiglu", 4, 48),  # 2/3 of 64 = 42.7, rounded up to a multiple of 8
        (160, "swiglu", 4, 432),  # 2/3 of 640 = 426.7 -> 432
        (16, "gelu", 2.5, 40),
        (16, "swiglu", 0.05, 8),  # round(0.8) = 1 unit -> at least one multiple of 8
    ],
)
def test_mlp_hidden_follows_its_docstring(n_embd, mlp, mlp_ratio, hidden):
    config = tiny_config(n_embd=n_embd, mlp=mlp, mlp_ratio=mlp_ratio)
    assert config.mlp_hidden == hidden
    if mlp == "swiglu":
        assert hidden % 8 == 0 and 0 <= hidden - 2 / 3 * round(mlp_ratio * n_embd) < 8


@pytest.mark.parametrize("n_embd", [16, 48, 160, 768])
def test_swiglu_has_the_parameters_of_gelu_to_within_its_rounding(n_embd):
    """mlp_hidden's docstring: three matrices of 2/3 the width hold as many weights as gelu's
    two, to within 8 * 3 * n_embd (the rounding up to a multiple of 8)."""

    def mlp_params(mlp: str) -> int:
        config = tiny_config(n_embd=n_embd, mlp=mlp, bias=False)
        return sum(p.numel() for p in GPT(config).transformer.h[0].mlp.parameters())

    gelu, swiglu = mlp_params("gelu"), mlp_params("swiglu")
    assert gelu == 2 * n_embd * 4 * n_embd
    assert swiglu == 3 * n_embd * tiny_config(n_embd=n_embd, mlp="swiglu").mlp_hidden
    assert 0 <= swiglu - gelu < 8 * 3 * n_embd


def test_an_unknown_key_is_named():
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig.from_dict({"n_layers": 2})


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


def test_every_preset_builds_a_valid_config_that_keeps_its_values():
    """Construction validates (a bad preset raises); every value the YAML gives is the config's."""
    for name in PRESETS:
        preset = load_preset(name) | {"vocab_size": 50257}
        config = GPTConfig.from_dict(preset)
        assert {key: getattr(config, key) for key in preset} == preset


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_lists_every_field(name):
    """Hydra refuses to override a key its config does not have (`model.mlp=swiglu`: "Key 'mlp'
    is not in struct"), so every field must be in every preset for the command line to set it;
    and the presets' values of the architecture options are GPT-2's, the defaults."""
    preset = load_preset(name)
    assert set(preset) == {f.name for f in dataclasses.fields(GPTConfig)}
    config = GPTConfig.from_dict(preset | {"vocab_size": 50257})
    for field in GPT2_ARCHITECTURE:
        assert getattr(config, field) == getattr(GPTConfig(), field), field


def test_flops_per_token_counts_swiglus_doubled_c_fc():
    """6 per matmul weight (c_fc of swiglu is (2 * hidden, C): W_1 and W_3) plus 12 * L * T * C
    for the attention scores, by hand."""
    C, L, V, T = 16, 2, 101, 16
    for mlp in ("gelu", "swiglu"):
        config = tiny_config(mlp=mlp)
        h = config.mlp_hidden
        fc = 2 * h if mlp == "swiglu" else h
        per_layer = 3 * C * C + C * C + fc * C + h * C  # c_attn, attn.c_proj, c_fc, mlp.c_proj
        expected = 6 * (L * per_layer + V * C) + 12 * L * T * C
        assert GPT(config).flops_per_token() == expected, mlp
    swiglu = GPT(tiny_config(mlp="swiglu"))
    assert swiglu.transformer.h[0].mlp.c_fc.weight.shape == (2 * 48, C)
