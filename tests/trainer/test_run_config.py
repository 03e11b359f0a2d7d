"""A resume takes the resumed run's saved config (trainer/config.py); only RESUMABLE keys change."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import base.files
from base.errors import ConfigError
from checkpoints.store import MODEL_FILE, resume_source
from tests.conftest import (
    CONFIGS,
    TINY,
    compose_run,
    load_preset,
    make_trainer,
    save_tiny_checkpoint,
)
from trainer.config import refuse_replacing_a_run, resumed_config, run_config, saved_config
from trainer.loop import Trainer


def config(*overrides: str) -> dict:
    return compose_run([], *overrides)[1]


SAVED = config("model.n_layer=3", "data.tokenizer=bytes", "train.max_steps=20")
DEFAULTS = config()


def resume_with(*overrides: str) -> dict:
    """What `python train.py train.resume=auto <overrides>` (after TINY) continues."""
    composed = config("train.resume=auto", *overrides)
    keys = ["train.resume", *(o.split("=")[0] for o in overrides)]
    return resumed_config(SAVED, composed, DEFAULTS, keys, "auto")


def test_the_saved_config_is_kept_where_the_command_changes_nothing():
    resumed = resume_with()
    assert resumed == {**SAVED, "train": {**SAVED["train"], "resume": "auto"}}
    assert resumed["model"]["n_layer"] == 3 and resumed["data"]["tokenizer"] == "bytes"


def test_overrides_of_resumable_keys_apply():
    resumed = resume_with("train.max_steps=40", "train.eval_interval=5", "wandb.mode=offline")
    assert resumed["train"]["max_steps"] == 40 and resumed["train"]["eval_interval"] == 5
    assert resumed["wandb"]["mode"] == "offline"
    assert resumed["model"] == SAVED["model"]


def test_an_override_equal_to_the_saved_value_is_accepted():
    assert resume_with("model.n_layer=3", "data.tokenizer=bytes")["model"]["n_layer"] == 3


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.n_layer=2", "model.n_layer"),
        ("optim.lr=0.01", "optim.lr"),
        ("train.batch_size=2", "train.batch_size"),
        ("seed=1", "seed"),
        ("data.tokenizer=gpt2", "data.tokenizer"),  # the default value: still a change
        ("optim=muon", "optim.muon_lr"),  # a group: every key it changes is checked
    ],
)
def test_changes_to_the_model_data_or_optimizer_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^cannot resume with {key}=.* the run resumed"):
        resume_with(override)


def test_a_key_changed_through_a_group_names_the_group():
    refused = r"^cannot resume with optim.muon_lr=.* \(set by the optim=\.\.\. override\): "
    with pytest.raises(ConfigError, match=refused):
        resume_with("optim=muon")


def test_a_recipe_that_changes_the_model_is_refused():
    composed = config("train.resume=auto", "experiment=speedrun_cpu")
    with pytest.raises(ConfigError, match=r"cannot resume with data.tokenizer='bpe-2048'"):
        resumed_config(SAVED, composed, DEFAULTS, ["train.resume", "experiment"], "auto")


def test_a_run_stopped_before_its_first_checkpoint_resumes_its_hydra_config(tmp_path):
    assert saved_config(None, tmp_path) is None  # a new run dir: nothing to restore
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(SAVED, tmp_path / ".hydra" / "config.yaml")
    assert saved_config(None, tmp_path) == SAVED  # auto, with no checkpoint yet


def test_the_run_config_holds_absolute_data_paths(tmp_path, monkeypatch):
    """A relative data file or cache dir is made absolute against the directory the run starts
    in, so that the printed resume command, sample.py and evaluate.py work from any other."""
    monkeypatch.chdir(tmp_path)
    data = ["data=text", "data.train_files=[a.txt,'texts/*.txt']", "data.val_files=b.txt"]
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose("train", overrides=[*TINY, *data, "data.cache_dir='~/c'"])
    section = run_config(cfg, tmp_path / "run", [])[1]["data"]
    assert section["train_files"] == [str(tmp_path / "a.txt"), str(tmp_path / "texts" / "*.txt")]
    assert section["val_files"] == str(tmp_path / "b.txt")
    assert section["cache_dir"] == str(Path.home() / "c")


def test_a_resume_hashes_its_checkpoint_once(tmp_path, corpus, monkeypatch):
    """The Hydra callback and train.py each read the resumed run's config (no hashing); the
    Trainer's load verifies every file of it, once; `best`'s loss is read, not verified."""
    make_trainer(tmp_path, corpus, "train.max_steps=2").run()
    hashed = []
    original = base.files.sha256_file
    monkeypatch.setattr(
        base.files, "sha256_file", lambda file: hashed.append(file) or original(file)
    )
    overrides = [*TINY, *corpus, "train.resume=auto"]
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose("train", overrides=overrides)
        run_config(cfg, tmp_path, overrides)  # the callback, before Hydra makes the run dir
        settings, resolved = run_config(cfg, tmp_path, overrides)  # train.py's main
    trainer = Trainer(settings, tmp_path, resolved)
    assert trainer.state.step == 2
    weights = [f for f in hashed if f.name == MODEL_FILE]
    assert weights == [tmp_path / "checkpoints" / "last" / MODEL_FILE]


@pytest.mark.parametrize("preset", ["nano", "mini", "gpt2"])
def test_train_py_trains_each_preset_at_its_own_context(preset):
    """configs/train.yaml sets no block_size over the preset's (it once made nano 128, not 64)."""
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        trained = compose("train", overrides=[f"model={preset}"])
    assert trained.model.block_size == load_preset(preset)["block_size"]


def test_a_run_dir_holding_checkpoints_is_continued_or_rolled_back_never_replaced(
    trained_run, tmp_path
):
    """A new run, or a resume of another run's checkpoint, in a run dir that holds checkpoints
    would write over them: refused. Its own run continues (auto) or rolls back (its step or best
    checkpoint); an empty or new dir takes any run."""
    other, _ = save_tiny_checkpoint(tmp_path)

    def refuse(run_dir, resume):  # as run_config calls it
        refuse_replacing_a_run(run_dir, resume, resume_source(resume, run_dir))

    for resume in (None, str(other)):
        with pytest.raises(ConfigError, match=r"already holds a run's checkpoints \(best, last\)"):
            refuse(trained_run, resume)
    for resume in ("auto", str(trained_run / "checkpoints" / "best"), str(trained_run)):
        refuse(trained_run, resume)
    (tmp_path / "new" / "checkpoints").mkdir(parents=True)
    for resume in (None, str(other)):
        refuse(tmp_path / "new", resume)
        refuse(tmp_path / "absent", resume)
