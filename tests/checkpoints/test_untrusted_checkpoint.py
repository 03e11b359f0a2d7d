"""A checkpoint someone else made: nothing it says is believed before it is checked.

An attacker (or a careless hand edit) controls every byte of the directory, the manifest
included, so each case below re-signs the manifest to match what it changed. Every refusal is
one `error:` line with exit code 2 at the entry points, and costs no memory for what the
checkpoint merely claims.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import base.files
import checkpoints.store as checkpoint_module
from base.files import sha256_file
from checkpoints.store import (
    CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from data.tokenizer import TOKENIZER_FILE
from inference.cli import main as sample_main
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
# Measures the peak resident memory of the command in its argv: the wrapper is a fresh process,
# so RUSAGE_CHILDREN holds that one child only (pytest's own children would count otherwise).
PEAK_RSS = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[2:]).returncode
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(code)
"""


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A real checkpoint with GPT-2's vocabulary (so sample.py can encode a prompt)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=16))
    return save_checkpoint(tmp_path / "ckpt", model, {"data": {"tokenizer": "gpt2"}}, {"step": 1})


def resign(path: Path) -> None:
    """Rewrite the manifest so that it vouches for every file it lists, as it is now."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    for name in manifest:
        manifest[name] = {"bytes": (path / name).stat().st_size, "sha256": sha256_file(path / name)}
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def edit_config(path: Path, fields: dict | None = None, **sections) -> None:
    """Change fields of config.json's "model" section, or replace whole sections."""
    config = json.loads((path / CONFIG_FILE).read_text())
    config["model"].update(fields or {})
    config.update(sections)
    (path / CONFIG_FILE).write_text(json.dumps(config))
    resign(path)


def sample_error(path: Path, capsys: pytest.CaptureFixture) -> str:
    """sample.py's whole body on `checkpoint=path`: exit code 2 and one `error:` line."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("sample", overrides=[f"checkpoint={path}", "max_new_tokens=1"])
    with pytest.raises(SystemExit) as exited:
        sample_main(cfg)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err


def run_script(script: str, *args: str, cwd: Path, peak_file: Path | None = None):
    """`python <script> <args>` (measuring its peak memory into peak_file if given)."""
    command = [sys.executable, str(ROOT / script), *args]
    if peak_file is not None:
        command = [sys.executable, "-c", PEAK_RSS, str(peak_file), *command]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def assert_one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    return result.stderr


# ----- the two cases of the issue: a claimed model far larger than its weights ---------------


@pytest.mark.parametrize(
    "claim, message",
    [
        (
            dict(n_embd=8192, n_layer=24, n_head=16),  # a 20 GB model, 24 GB resident before
            "model.n_embd=8192 disagrees with the weights in model.safetensors, which give "
            "n_embd=16",
        ),
        (dict(n_embd=4_000_000), "model.n_embd must be at most 65,536, got 4000000"),  # 804 GB
    ],
)
def test_a_claimed_huge_model_is_refused_under_1_gb(ckpt, tmp_path, claim, message):
    edit_config(ckpt, claim)
    peak = tmp_path / "peak"
    result = run_script("sample.py", f"checkpoint={ckpt}", cwd=tmp_path, peak_file=peak)
    assert message in assert_one_error_line(result)
    assert int(peak.read_text()) < GIB


def test_the_peak_memory_measurement_sees_an_allocation(tmp_path):
    """Negative control for the test above: a child that fills 1.2 GB is measured above
    1 GB, so a loader that built the claimed model would fail it."""
    peak = tmp_path / "peak"
    allocate = "b = b'x' * 1_200_000_000"  # 1.2 GB, every page written
    subprocess.run([sys.executable, "-c", PEAK_RSS, str(peak), sys.executable, "-c", allocate])
    assert int(peak.read_text()) > GIB


def test_no_model_is_built_before_the_config_matches_the_weights(ckpt, monkeypatch):
    """The check uses the header and a meta-device model: the real GPT(...) in the loader is
    never reached (and is reached for a checkpoint that is fine: the negative control)."""

    def refuse(config):
        raise AssertionError(f"a model was allocated for {config}")

    refuse.stored_shapes = GPT.stored_shapes  # the check's own, on the meta device
    monkeypatch.setattr(checkpoint_module, "GPT", refuse)
    with pytest.raises(AssertionError, match="allocated"):
        load_checkpoint(ckpt)
    edit_config(ckpt, dict(n_layer=24))
    with pytest.raises(CheckpointError, match="model.n_layer=24 disagrees .* n_layer=2"):
        load_checkpoint(ckpt)


# ----- manifest names: plain files inside the checkpoint, nothing else is opened ------------


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A 3-byte file outside the checkpoint, as /etc/hostname was in the issue."""
    secret = tmp_path / "secret"
    secret.write_text("abc")
    return secret


class Touched:
    """Every path stat'ed or opened while active (os.stat, os.lstat, os.open, open), made
    absolute but not resolved (resolving would stat them again)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.paths: list[str] = []
        for module, name in [(os, "stat"), (os, "lstat"), (os, "open"), (builtins, "open")]:
            monkeypatch.setattr(module, name, self._spy(getattr(module, name)))
        monkeypatch.setattr(io, "open", builtins.open)

    def _spy(self, real):
        def spy(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)):
                self.paths.append(os.path.abspath(file))
            return real(file, *args, **kwargs)

        return spy


@pytest.mark.parametrize(
    "name",
    ["../secret", "../../secret", "/ABS/secret", "sub/../../secret", "..", ".", "", "a\\..\\b"],
)
def test_a_manifest_name_outside_the_checkpoint_opens_nothing(ckpt, outside, monkeypatch, name):
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    name = name.replace("/ABS", str(outside.parent))
    manifest[name] = {"bytes": 1, "sha256": "0" * 64}  # the "expected 1"
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    touched = Touched(monkeypatch)
    with pytest.raises(CheckpointError, match="not a plain file name") as e:
        verify_checkpoint(ckpt)
    monkeypatch.undo()
    assert "\n" not in str(e.value) and "3 bytes" not in str(e.value)
    touched = {os.path.realpath(p) for p in touched.paths}
    assert os.path.realpath(outside) not in touched
    assert os.path.realpath(ckpt / MANIFEST_FILE) in touched  # the spy sees what is opened
    assert os.path.realpath(ckpt / MODEL_FILE) not in touched  # refused before measuring any


def test_a_manifest_name_outside_is_one_error_line_from_evaluate_py(ckpt, outside, tmp_path):
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["../secret"] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    err = assert_one_error_line(run_script("evaluate.py", f"checkpoint={ckpt}", cwd=tmp_path))
    assert "'../secret', which is not a plain file name" in err and "3 bytes" not in err


@pytest.mark.parametrize(
    "entry", [[1, 2], {"bytes": "1", "sha256": "0" * 64}, {"bytes": 1, "sha256": "x"}, {}]
)
def test_a_malformed_manifest_entry_is_one_error(ckpt, capsys, entry):
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest[MODEL_FILE] = entry
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert "the entry for 'model.safetensors' is not" in sample_error(ckpt, capsys)


def test_an_oversized_manifest_is_refused_before_it_is_read(ckpt, capsys, monkeypatch):
    """A checkpoint cannot make the loader read gigabytes of JSON: past MAX_JSON_BYTES (here
    lowered to a size the real manifest exceeds) the file is refused without being opened."""
    size = (ckpt / MANIFEST_FILE).stat().st_size
    monkeypatch.setattr(base.files, "MAX_JSON_BYTES", size - 1)
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("the manifest was read"))
    assert f"has {size:,} bytes: too large to be a model's" in sample_error(ckpt, capsys)


def test_a_symlinked_file_leading_out_is_refused(ckpt, tmp_path, capsys):
    """The weights replaced by a link to an identical copy outside: the manifest's sizes and
    sha256 match, the link is still refused."""
    copy = tmp_path / "elsewhere.safetensors"
    copy.write_bytes((ckpt / MODEL_FILE).read_bytes())
    (ckpt / MODEL_FILE).unlink()
    (ckpt / MODEL_FILE).symlink_to(copy)
    err = sample_error(ckpt, capsys)
    assert f"{ckpt / MODEL_FILE} is a symlink leading out of {ckpt}" in err


def test_a_symlink_inside_the_checkpoint_loads(ckpt):
    """Negative control: a link to a file in the same directory points at nothing outside."""
    os.replace(ckpt / MODEL_FILE, ckpt / "weights.bin")
    (ckpt / MODEL_FILE).symlink_to("weights.bin")
    assert load_checkpoint(ckpt).model.config.n_embd == 16


def test_an_unlisted_file_the_loader_would_read_is_refused(ckpt, outside, capsys):
    """tokenizer.json is read by the loader: one that the manifest does not vouch for (here a
    link to a file outside) is refused, not read."""
    (ckpt / TOKENIZER_FILE).symlink_to(outside)
    err = sample_error(ckpt, capsys)
    assert f"{ckpt / TOKENIZER_FILE} is not listed in" in err


def test_a_manifest_without_the_weights_is_refused(ckpt):
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    del manifest[MODEL_FILE]
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="model.safetensors is not listed"):
        load_checkpoint(ckpt)


# ----- config.json: every field checked like a command-line value -----------------------------


@pytest.mark.parametrize(
    "model, sections, message",
    [
        (dict(n_embd="16"), {}, "model.n_embd must be a positive integer, got '16'"),
        (dict(n_embd=16.0), {}, "model.n_embd must be a positive integer, got 16.0"),
        (dict(dropout=[0.1]), {}, "model.dropout must be in [0, 1)"),
        (dict(bias="false"), {}, "model.bias must be true or false, got 'false'"),
        (
            dict(attention="fast"),
            {},
            "model.attention must be one of ['manual', 'sdpa', 'flash', 'triton']",
        ),
        (dict(n_embedding=16), {}, "unknown model config key(s) ['n_embedding']"),
        (dict(block_size=1 << 20), {}, "model.block_size must be at most 65,536"),
        ({}, dict(model=[16]), "model must be a JSON object"),
        ({}, dict(extra={}), "unknown key(s) ['extra']; known: model, run, meta"),
        ({}, dict(run={"data": "shakespeare"}), "run.data must be a JSON object"),
        ({}, dict(meta={"tokenizer": 2}), "meta.tokenizer must be a string, got 2"),
        ({}, dict(meta={"chat_template": "{{ evil }}"}), "meta.chat_template must be 'chatml'"),
    ],
)
def test_a_bad_config_field_is_one_error_line_naming_it(ckpt, capsys, model, sections, message):
    edit_config(ckpt, model, **sections)
    err = sample_error(ckpt, capsys)
    assert f"{ckpt / CONFIG_FILE}: " in err and message in err


@pytest.mark.parametrize("text", ["{'model': {}}", "[" * 100_000 + "]" * 100_000])
def test_a_config_that_is_not_json_is_one_error(ckpt, capsys, text):
    (ckpt / CONFIG_FILE).write_text(text)  # single quotes; nesting deeper than Python recurses
    resign(ckpt)
    assert "config.json is corrupt" in sample_error(ckpt, capsys)


def test_a_checkpoint_without_its_dataset_asks_for_a_text_file(ckpt, tmp_path):
    """evaluate.py reads run.data only when no text_file is given: a foreign checkpoint
    without it is one line, not a KeyError."""
    edit_config(ckpt, run={})
    err = assert_one_error_line(run_script("evaluate.py", f"checkpoint={ckpt}", cwd=tmp_path))
    assert "no run.data" in err and "text_file=" in err
