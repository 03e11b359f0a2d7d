"""`python check_causality.py`: every preset and shipped experiment (composed by Hydra as the
command does, shrunk), trained checkpoints and Hugging Face GPT-2 directories, and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import check_causality
from checkpoints.store import save_checkpoint
from model import GPT
from tests.conftest import PRESETS, ROOT, run_script, save_tiny_checkpoint, tiny_config

EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))


def command_config(*overrides: str) -> dict:
    """The config `python check_causality.py <overrides>` runs with."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return OmegaConf.to_container(compose("check_causality", list(overrides)), resolve=True)


def run_command(capsys: pytest.CaptureFixture, *overrides: str) -> tuple[int, list[str], dict]:
    code = check_causality.run(command_config(*overrides))
    lines = capsys.readouterr().out.splitlines()
    return code, lines, json.loads(lines[-1])


@pytest.fixture(autouse=True)
def no_triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a CPU without TRITON_INTERPRET: attention=all skips triton, saying so (its
    interpreter takes 5-60 s a model; test_triton_is_checked_where_it_runs brings it back)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_experiments_are_all_covered():
    assert {"speedrun_cpu", "gpt2_124m_fineweb"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_is_causal(preset, capsys):
    """Each preset's options and head count at tiny width; 2 layers (depth repeats the same
    code; the experiments below keep theirs)."""
    code, lines, summary = run_command(capsys, f"model={preset}", "model.n_layer=2")
    assert code == 0 and summary["causal"] and summary["first_leak"] is None
    assert lines[0].startswith("causal: all 15 checks passed on the config's model, shrunk to ")
    assert len(summary["checks"]) == 15 and sum(": pass" in line for line in lines) == 15


def test_triton_is_checked_where_it_runs_and_named_where_it_does_not(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton's and our jit functions are defined
    # under it (it is read at definition), whichever test imports them first
    pytest.importorskip("triton", reason="attention=triton needs the triton package (Linux only)")
    monkeypatch.delenv("TRITON_INTERPRET")
    code, lines, summary = run_command(capsys, "model=nano")
    assert code == 0 and not any(name.startswith("triton") for name in summary["checks"])
    assert lines[1] == (
        "not checked here: model.attention=triton runs its kernel on a CUDA GPU, not on cpu: use "
        "a GPU, or set TRITON_INTERPRET=1 to run it (slowly) under Triton's interpreter; or use "
        "model.attention=sdpa, flash or manual"
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code, lines, summary = run_command(capsys, "model=nano", "attention=triton")
    assert code == 0 and list(summary["checks"])[0] == "triton perturbation (eval)"
    assert len(summary["checks"]) == 5 and "not checked here" not in "\n".join(lines)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_shipped_experiment_is_causal_as_shipped(experiment, capsys):
    """Every option and layer of the experiment, at the shrunk width and vocabulary."""
    cfg = command_config(f"experiment={experiment}")
    code, lines, summary = run_command(capsys, f"experiment={experiment}")
    assert code == 0 and summary["causal"]
    assert lines[0].startswith("causal: all ")
    assert f"shrunk to n_layer={cfg['model']['n_layer']}," in lines[0]
    own = cfg["model"]["attention"]
    assert next(iter(summary["checks"])) == f"{own} perturbation (eval)"


def test_a_trained_checkpoint_and_its_run_dir(tmp_path, capsys):
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=1))
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoints" / "last", model, {}, {"step": 1})
    for source in (ckpt, tmp_path / "run"):
        code, lines, summary = run_command(capsys, f"checkpoint={source}", "attention=sdpa")
        assert code == 0 and lines[0] == f"causal: all 5 checks passed on checkpoint {ckpt}"
        assert list(summary["checks"])[0] == "sdpa perturbation (eval)"
        assert len(summary["checks"]) == 5


def test_a_hugging_face_gpt2_directory(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")  # a dev dependency; CI installs it
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, attn_implementation="eager"
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    code, lines, summary = run_command(capsys, f"checkpoint={tmp_path / 'hf'}", "attention=manual")
    source = f"Hugging Face GPT-2 weights from {tmp_path / 'hf'}"
    assert code == 0 and lines[0] == f"causal: all 5 checks passed on {source}"
    assert summary["causal"]


def test_full_size_builds_the_configs_model(capsys):
    code, lines, _ = run_command(capsys, "model=nano", "shrink=false", "attention=manual")
    assert code == 0 and "passed on the config's model, full size" in lines[0]
    assert "n_embd=32" in lines[0] and "vocab_size=50257" in lines[0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("checkpoint=/no/such/run", "error: no checkpoint found at /no/such/run"),
        (
            "model.mlp=bogus",
            "error: model.mlp must be one of ['gelu', 'relu2', 'swiglu'], got 'bogus'",
        ),
        ("seq_len=1", "error: seq_len must be an integer >= 2, got 1"),
        ("attention=fast", "error: attention must be all or one of"),
        ("attention=triton", "error: model.attention=triton "),  # no GPU, or no triton package
    ],
)
def test_user_errors_are_one_line_and_exit_2(override, message, tmp_path):
    result = run_script("check_causality.py", override, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith(message)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_the_command_as_a_user_runs_it_writes_nothing(tmp_path: Path):
    result = run_script("check_causality.py", "model=nano", "attention=flash", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["causal"] is True
    assert list(tmp_path.iterdir()) == []  # no outputs/ dir, no logs


def test_model_keys_beside_a_checkpoint_are_refused_not_ignored(tmp_path):
    """With checkpoint=, the model checked is the checkpoint's: model.n_layer=3 would change
    nothing, so it is one error line, not silently dropped."""
    path, _ = save_tiny_checkpoint(tmp_path)
    result = run_script("check_causality.py", f"checkpoint={path}", "model.n_layer=3", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: model.n_layer=3 changes nothing with checkpoint=...")
    ok = run_script("check_causality.py", f"checkpoint={path}", "attention=manual", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr  # its own keys still apply
