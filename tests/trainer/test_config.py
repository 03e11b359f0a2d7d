"""Every run-config key is validated up front, with errors that name the key."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from base.errors import positive_int, setting
from model import GPTConfig
from tests.conftest import CONFIGS, ROOT, compose_run
from trainer.config import (
    RESUMABLE,
    ConfigError,
    OptimSettings,
    RunConfig,
    TrainSettings,
    resumable_keys,
)


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


def full_run(*overrides: str) -> tuple[RunConfig, dict]:
    """The run config of `python train.py <overrides>`, not shrunk (compose_run's TINY
    overrides would win over an experiment's values)."""
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose("train", overrides=list(overrides))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return RunConfig.from_dict(resolved), resolved


@pytest.mark.parametrize(
    "name", sorted(p.stem for p in (ROOT / "configs/experiment").glob("*.yaml"))
)
def test_every_experiment_composes_into_a_valid_run(name):
    """An experiment is a recipe users run by name: it must compose over the defaults, pass
    validation, and actually change the run (a misplaced `# @package` would change nothing)."""
    settings, resolved = full_run(f"experiment={name}")
    default, _ = full_run()
    assert settings.train != default.train
    GPTConfig.from_dict({**resolved["model"], "vocab_size": 50257})  # the model config is valid


def test_the_speedruns_reference_is_nanogpts_char_recipe_on_the_same_clock():
    """experiment=nanogpt_char_cpu, the README's reference figure: nanoGPT's
    train_shakespeare_char with its CPU overrides, GPT-2's architecture, on the speedrun's data,
    time budget and scoring."""
    ref, resolved = full_run("experiment=nanogpt_char_cpu")
    speedrun, speedrun_resolved = full_run("experiment=speedrun_cpu")
    model = resolved["model"]
    assert (model["n_layer"], model["n_head"], model["n_embd"], model["block_size"]) == (
        4,
        4,
        128,
        64,
    )
    assert model["pos_embedding"] == "learned" and model["norm"] == "layernorm"
    assert model["mlp"] == "gelu" and model["tie_embeddings"] and model["dropout"] == 0.0
    assert resolved["data"]["tokenizer"] == "bytes" and ref.train.batch_size == 12
    assert ref.optim.name == "adamw" and ref.optim.schedule == "cosine"
    assert (ref.optim.lr, ref.optim.min_lr, ref.optim.betas) == (1e-3, 1e-4, (0.9, 0.99))
    assert ref.optim.warmup_steps == 100 and ref.optim.embed_lr is None
    assert resolved["data"]["name"] == speedrun_resolved["data"]["name"] == "shakespeare"
    assert ref.train.max_seconds == speedrun.train.max_seconds == 300
    assert ref.train.final_eval == speedrun.train.final_eval == "whole"
    # the speedrun's own rules: our attention, and the precision the machine's probe picks
    assert speedrun_resolved["model"]["attention"] == "manual"
    assert speedrun_resolved["dtype"] == resolved["dtype"] == "auto"


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_the_settings_default_to_what_the_yaml_says(optim):
    """The defaults are written once, in configs/: building settings in code (no Hydra) gives
    `python train.py`'s run. Only train.yaml's own optim.warmup_steps overrides the group."""
    settings, resolved = full_run(f"optim={optim}")
    built = RunConfig(model=resolved["model"], data=resolved["data"])
    assert built.train == settings.train and built.wandb == settings.wandb
    assert built.parallel == settings.parallel
    assert (built.seed, built.device, built.dtype, built.compile) == (
        settings.seed, settings.device, settings.dtype, settings.compile
    )  # fmt: skip
    named = OptimSettings(name=optim, warmup_steps=settings.optim.warmup_steps)
    assert named == settings.optim
    assert built.train.batch_size == 8 and built.train.max_steps == 250  # configs/train.yaml


def test_flash_with_dropout_is_refused_under_compile_only():
    with pytest.raises(ConfigError, match=r"^compile=true with model.attention=flash"):
        compose_run([], "compile=true", "model.attention=flash", "model.dropout=0.1")
    compose_run([], "compile=true", "model.attention=flash")  # no dropout: one graph
    compose_run([], "compile=true", "model.attention=sdpa", "model.dropout=0.1")
    compose_run([], "model.attention=flash", "model.dropout=0.1")  # eager: fine


def test_the_gpt2_presets_train_fast_by_default():
    """model=gpt2 alone: its own 1024 context, sdpa, the vocabulary padded to 50304."""
    for preset in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        settings, _ = full_run(f"model={preset}")
        model = settings.model
        assert (model["block_size"], model["attention"], model["vocab_size"]) == (
            1024,
            "sdpa",
            50304,
        )
    settings, _ = full_run("experiment=gpt2_124m_fineweb")
    assert settings.model["vocab_size"] == 50304 and settings.model["attention"] == "sdpa"
    assert full_run()[0].model["block_size"] == 128  # the default run is unchanged


def test_a_new_key_cannot_miss_its_check_or_its_resume_decision():
    """A key is declared once (type, check, resumable); one added without `setting` fails at
    the first config built, and one added with it is checked and in RESUMABLE, or not."""

    @dataclasses.dataclass
    class Undeclared(TrainSettings):
        new_key: int = 3

    with pytest.raises(TypeError, match=r"train.new_key is declared without setting\(...\)"):
        Undeclared()

    @dataclasses.dataclass
    class Declared(TrainSettings):
        new_key: int = setting(positive_int, resumable=True, default=3)
        fixed_key: Literal["a", "b"] = setting(resumable=False, default="a")

    with pytest.raises(ConfigError, match="^train.new_key must be a positive integer, got 0"):
        Declared(new_key=0)
    with pytest.raises(ConfigError, match=r"^train.fixed_key must be one of \['a', 'b'\]"):
        Declared(fixed_key="c")

    @dataclasses.dataclass
    class Wider(RunConfig):
        train: Declared = setting(resumable=False, default_factory=Declared)

    keys = resumable_keys(Wider)
    assert "train.new_key" in keys and "train.fixed_key" not in keys
    assert set(resumable_keys()) - {"train.new_key"} == set(RESUMABLE)
