"""train.init_from: a run starts from a source's weights (GPT-2 names, Hugging Face directories,
our checkpoints) with a fresh optimizer and step; the round trips through export.py."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import trainer.loop as trainer_loop
from base.errors import ConfigError
from checkpoints.export import export_checkpoint
from checkpoints.store import load_checkpoint, load_source
from data.tokenizer import get_tokenizer
from evals.loss import evaluate_checkpoint
from inference.cli import run as sample
from tests.conftest import CONFIGS, TINY, compose_run, run_script
from trainer.config import RunConfig, requested_model, run_config
from trainer.loop import Trainer

transformers = pytest.importorskip("transformers")

TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n\nÉtienne paid 1,599 crowns.\n"


def init_trainer(run_dir, corpus, source, *overrides, model=None):
    """A Trainer of the TINY run started from `source`; `model`: the requested model keys (as
    trainer/config.py passes them; default: the run-time ones only)."""
    settings, resolved = compose_run(corpus, f"train.init_from={source}", *overrides)
    resolved["model"] = model or {"block_size": 32, "dropout": 0.0, "attention": "manual"}
    return Trainer(RunConfig.from_dict(resolved), run_dir, resolved)


def assert_same_weights(model, source_model, block_size: int) -> None:
    theirs = source_model.state_dict()
    for name, tensor in model.state_dict().items():
        expected = theirs[name][:block_size] if name.endswith("wpe.weight") else theirs[name]
        assert torch.equal(tensor.cpu(), expected.cpu()), name


def test_a_hugging_face_dir_starts_a_fresh_run(tmp_path, corpus, hf_gpt2_dir):
    trainer = init_trainer(tmp_path / "run", corpus, hf_gpt2_dir)
    assert_same_weights(trainer.model, load_source(hf_gpt2_dir).model, 32)
    assert trainer.model.config.block_size == 32 and trainer.state.step == 0
    assert not trainer.optimizer.state  # fresh optimizer: no moments yet
    # loaded weights cannot be shrunk: the causality guard checked the loaded model itself
    assert trainer.causality["checked"] and trainer.causality["causal"]
    assert trainer.causality["model"].startswith("the loaded model: n_layer=2, n_embd=32")


def test_the_guard_stops_a_loaded_model_that_sees_the_future(
    tmp_path, corpus, hf_gpt2_dir, monkeypatch
):
    real = trainer_loop.pretrained_model

    def leaky(*args, **kwargs):  # the loaded model with its attention mask removed
        model = real(*args, **kwargs)
        for block in model.transformer.h:
            block.attn.causal_mask.fill_(True)
        return model

    monkeypatch.setattr(trainer_loop, "pretrained_model", leaky)
    with pytest.raises(ConfigError, match="leak in the loaded model: .*layer 0 attn"):
        init_trainer(tmp_path / "run", corpus, hf_gpt2_dir)


def test_our_checkpoint_export_init_from_keeps_every_weight(tmp_path, corpus, trained_run):
    best = load_checkpoint(trained_run / "checkpoints" / "best")
    out = export_checkpoint({"checkpoint": str(trained_run), "out": str(tmp_path / "hf")})
    model = {"block_size": 32, "n_layer": best.model.config.n_layer}  # equal to the source: ok
    trainer = init_trainer(tmp_path / "run", corpus, out, model=model)
    assert_same_weights(trainer.model, best.model, 32)
    assert trainer.model.config == best.model.config  # nano, cropped to the same 32


def test_hf_dir_init_from_export_gives_transformers_our_logits_and_ids(
    tmp_path, corpus, hf_gpt2_dir
):
    trainer = init_trainer(tmp_path / "run", corpus, hf_gpt2_dir, "train.max_steps=3")
    assert trainer.run()["step"] == 3
    out = export_checkpoint({"checkpoint": str(tmp_path / "run"), "out": str(tmp_path / "hf")})
    ours = load_checkpoint(tmp_path / "run" / "checkpoints" / "best").model.eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == get_tokenizer("gpt2").encode_ordinary(TEXT)
    idx = torch.tensor([ids[:32]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx)[0], atol=1e-4, rtol=0)
    assert "Initialized from: " + str(hf_gpt2_dir) in (out / "README.md").read_text()
    assert "Steps: 3" in (out / "README.md").read_text()


def test_requested_model_keeps_what_the_run_sets():
    default = {"n_layer": 8, "n_head": 4, "block_size": 128, "dropout": 0.0, "bias": True}
    model = {**default, "n_head": 2, "bias": True}  # n_head from an experiment or preset
    requested = requested_model(model, default, ["train.init_from=gpt2", "model.bias=true"])
    # the default preset's block_size is no request either: a nano source (64) is not cropped
    # to 128, it keeps its own
    assert requested == {"n_head": 2, "bias": True, "dropout": 0.0}


@pytest.mark.parametrize("resume", [[], ["train.resume=auto"]])  # auto: a new run dir
def test_a_requested_key_is_not_checked_against_the_default_presets_other_keys(
    tmp_path, hf_gpt2_dir, resume
):
    """model.n_embd=32 with train.init_from is checked with the source's n_head (by
    pretrained_model), not with GPTConfig's default of 12."""
    overrides = [f"train.init_from={hf_gpt2_dir}", "model.n_embd=32", *resume]
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose("train", overrides=overrides)
        model = run_config(cfg, tmp_path, overrides)[1]["model"]
        assert model["n_embd"] == 32 and "n_layer" not in model  # the preset's: no request


def test_finetune_shakespeare_composes_and_builds(tmp_path, hf_gpt2_dir, shakespeare_cache):
    overrides = [f"train.init_from={hf_gpt2_dir}", f"data.cache_dir={shakespeare_cache}"]
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose("train", overrides=["experiment=finetune_shakespeare", *overrides])
        default = compose("train")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["model"] = requested_model(
        resolved["model"], OmegaConf.to_container(default.model), overrides
    )
    resolved["model"]["block_size"] = 64  # the tiny stand-in has 64 positions, GPT-2 1024
    # Built, never run (and never finished): no wandb run to open.
    resolved["wandb"]["mode"] = "disabled"
    settings = RunConfig.from_dict(resolved)
    assert settings.optim.schedule == "constant" and settings.optim.lr == 3e-5
    assert cfg.model.block_size == 256 and cfg.train.init_from == str(hf_gpt2_dir)
    trainer = Trainer(settings, tmp_path / "run", resolved)
    assert trainer.data.meta["dataset"] == "shakespeare" and trainer.data.tokenizer().name == "gpt2"
    assert_same_weights(trainer.model, load_source(hf_gpt2_dir).model, 64)


@pytest.mark.parametrize(
    "override, model, expected",
    [
        (None, {"n_layer": 3}, "model.n_layer=3 contradicts train.init_from="),
        (None, {"mlp": "swiglu"}, "model.mlp='swiglu' contradicts train.init_from="),
        (None, {"block_size": 65}, "model.block_size=65 cannot crop a model of block_size 64"),
        ("data.tokenizer=bytes", {}, "data.tokenizer=bytes does not match the vocabulary"),
    ],
)
def test_contradicting_overrides_name_the_key(
    tmp_path, corpus, hf_gpt2_dir, override, model, expected
):
    overrides = [override] if override else []
    with pytest.raises(ValueError, match=f"^{expected.replace('.', '[.]')}"):
        init_trainer(tmp_path / "run", corpus, hf_gpt2_dir, *overrides, model=model)


def test_train_py_takes_the_architecture_from_the_source(tmp_path, corpus, hf_gpt2_dir):
    """The default preset (mini) is no request: its 8 layers give way to the source's 2. One
    set on the command line is, and contradicts the source in one line."""
    tiny = [a for a in TINY if a != "model=nano"]
    args = [*tiny, *corpus, f"train.init_from={hf_gpt2_dir}", f"hydra.run.dir={tmp_path / 'a'}"]
    result = run_script("train.py", *args, "model.n_layer=8", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: model.n_layer=8 contradicts train.init_from=")
    assert result.stderr.strip().count("\n") == 0
    args[-1] = f"hydra.run.dir={tmp_path / 'b'}"
    result = run_script(
        "train.py", *args, "train.max_steps=2", "train.eval_interval=0", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["step"] == 2
    assert load_checkpoint(tmp_path / "b" / "checkpoints" / "last").model.config.n_layer == 2


def test_sample_and_evaluate_take_a_gpt2_name(tmp_path, hf_gpt2_dir, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: hf_gpt2_dir)
    (tmp_path / "val.txt").write_text(TEXT * 3)
    texts = sample(
        {
            "checkpoint": "gpt2", "prompt": "ROMEO:", "prompt_file": None, "num_samples": 1,
            "max_new_tokens": 5, "temperature": 0.0, "top_k": None, "top_p": None,
            "min_p": None, "repetition_penalty": 1.0, "stop": [], "seed": 0, "device": "cpu",
            "dtype": "float32", "stream": False, "attention_plot": None, "attention_layer": None,
        },
        out=open(tmp_path / "out.txt", "w"),  # noqa: SIM115 - closed with the test's tmp dir
        err=open(tmp_path / "err.txt", "w"),  # noqa: SIM115
    )  # fmt: skip
    assert len(texts) == 1 and len(get_tokenizer("gpt2").encode_ordinary(texts[0])) >= 1
    result = evaluate_checkpoint(
        {"checkpoint": "gpt2", "text_file": str(tmp_path / "val.txt"), "batch_size": 2,
         "stride": None, "device": "cpu", "dtype": "float32", "task": None, "tasks": [],
         "dataset": None}
    )  # fmt: skip
    assert result["tokens"] == len(get_tokenizer("gpt2").encode_ordinary(TEXT * 3))
    assert 9 < result["loss"] < 12  # a random model over 50257 tokens: about ln(50257) = 10.8


def test_evaluate_py_reports_the_same_loss_for_a_hf_dir_and_its_export(tmp_path, hf_gpt2_dir):
    (tmp_path / "val.txt").write_text(TEXT * 3)
    out = tmp_path / "export"
    result = run_script("export.py", f"checkpoint={hf_gpt2_dir}", f"out={out}", cwd=tmp_path)
    assert result.returncode == 0 and f"wrote {out}" in result.stdout, result.stderr
    args = [f"checkpoint={hf_gpt2_dir}", f"text_file={tmp_path / 'val.txt'}", "device=cpu"]
    result = run_script("evaluate.py", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    cfg = {"checkpoint": str(out), "text_file": str(tmp_path / "val.txt"), "batch_size": 8,
           "stride": None, "device": "cpu", "dtype": "auto", "task": None, "tasks": [],
           "dataset": None}  # fmt: skip
    expected = json.loads(result.stdout.strip().splitlines()[-1])
    assert evaluate_checkpoint(cfg)["loss"] == expected["loss"]
