"""Checkpoints load only what they should, and detect damage."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from checkpoints.store import (
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from model import GPT
from tests.checkpoints.conftest import save
from tests.conftest import tiny_config


def test_round_trip_keeps_weights_config_and_trainer_state(tmp_path):
    torch.manual_seed(3)
    model = GPT(tiny_config(attention="sdpa"))
    save_checkpoint(tmp_path / "c", model, {"x": 1}, {"step": 7}, {"step": 7})
    ckpt = load_checkpoint(tmp_path / "c", with_trainer_state=True)
    assert ckpt.model.config == model.config and ckpt.run_config == {"x": 1}
    assert ckpt.meta == {"step": 7} and ckpt.trainer_state == {"step": 7}
    for (k, a), (_, b) in zip(
        model.state_dict().items(), ckpt.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k
    assert ckpt.model.lm_head.weight is ckpt.model.transformer.wte.weight  # still tied


@pytest.mark.parametrize(
    "options",
    [
        dict(pos_embedding="rope", rope_base=500.0, norm="rmsnorm", qk_norm=True, mlp="swiglu"),
        dict(mlp="relu2", mlp_ratio=2, logit_softcap=15.0, zero_init_proj=True, bias=False),
    ],
)
def test_architecture_options_round_trip(tmp_path, options):
    """The options are in the saved config, so the loaded model has the same modules, weights
    and logits (rope's tables are rebuilt from the config, not stored)."""
    torch.manual_seed(3)
    model = GPT(tiny_config(**options)).eval()
    save_checkpoint(tmp_path / "c", model, {"x": 1}, {"step": 1}, {"step": 1})
    loaded = load_checkpoint(tmp_path / "c").model.eval()
    assert loaded.config == model.config
    assert model.state_dict().keys() == loaded.state_dict().keys()
    idx = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], model(idx)[0], atol=0, rtol=0)


def test_untied_head_round_trips(tmp_path):
    save(tmp_path / "c", tie_embeddings=False)
    model = load_checkpoint(tmp_path / "c").model
    assert model.lm_head.weight is not model.transformer.wte.weight


def test_saving_again_replaces_the_checkpoint_and_leaves_no_debris(tmp_path):
    save(tmp_path / "last", step=1)
    save(tmp_path / "last", step=2)
    assert load_checkpoint(tmp_path / "last").meta["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["last"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_files_are_detected(tmp_path, damage):
    path = save(tmp_path / "c")
    weights = path / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
        match = "truncated"
    elif damage == "flip":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 1
        weights.write_bytes(bytes(data))
        match = "sha256"
    else:
        weights.unlink()
        match = "missing"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_crafted_pickle_never_executes(tmp_path):
    path = save(tmp_path / "c")
    marker = tmp_path / "pwned"
    (path / "trainer.pt").write_bytes(pickle.dumps({"step": _Exploit(marker)}))
    # Even with a manifest that vouches for it, loading refuses and runs nothing.
    import hashlib
    import json

    manifest = json.loads((path / "manifest.json").read_text())
    blob = (path / "trainer.pt").read_bytes()
    manifest["trainer.pt"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="safely"):
        load_checkpoint(path, with_trainer_state=True)
    assert not marker.exists()


def test_missing_checkpoint_says_where_it_looked(tmp_path):
    with pytest.raises(CheckpointError, match=str(tmp_path / "run" / "checkpoints" / "best")):
        resolve_checkpoint(tmp_path / "run")


def test_run_dir_resolves_to_best_then_last(tmp_path):
    save(tmp_path / "run" / "checkpoints" / "last")
    assert resolve_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "last"
    save(tmp_path / "run" / "checkpoints" / "best")
    assert resolve_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "best"
    assert resolve_checkpoint(tmp_path / "run", prefer="last").name == "last"


def test_crash_between_the_two_renames_is_recovered(tmp_path):
    save(tmp_path / "last", step=5)
    os.replace(tmp_path / "last", tmp_path / ".last.old")  # as if the process died right here
    assert load_checkpoint(tmp_path / "last").meta["step"] == 5


def test_no_checkpoint_means_the_newest_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="python train.py"):
        find_checkpoint()
    save(tmp_path / "outputs" / "a" / "checkpoints" / "best", step=1)
    newer = Path("outputs") / "b" / "checkpoints" / "best"
    save(newer, step=2)
    os.utime(newer / "manifest.json", (2e9, 2e9))
    assert find_checkpoint() == newer


@pytest.mark.parametrize(
    "umask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)]
)
def test_a_checkpoint_follows_the_umask(tmp_path, umask, dir_mode, file_mode):
    """A teammate in the group can read a checkpoint when the umask says so (mkdtemp made every
    checkpoint 0700 whatever the umask); the 0o077 case is the control."""
    old = os.umask(umask)
    try:
        path = save(tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == dir_mode
    assert {f.stat().st_mode & 0o777 for f in path.iterdir()} == {file_mode}
