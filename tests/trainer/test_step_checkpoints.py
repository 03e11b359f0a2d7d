"""train.keep_checkpoints: a run keeps its N most recent step checkpoints, and any of them
resumes the run exactly."""

from __future__ import annotations

import torch

from checkpoints import store
from checkpoints.store import load_checkpoint
from tests.conftest import losses, make_trainer

EVERY_2 = ("train.ckpt_interval=2", "model.dropout=0.1")  # dropout: the RNG state counts too


def test_a_run_keeps_the_n_most_recent_step_checkpoints(tmp_path, corpus, capsys, monkeypatch):
    """Each step checkpoint is `last`'s files, linked: the state is written once a save."""
    written = []
    save = store.save_checkpoint
    monkeypatch.setattr(
        store,
        "save_checkpoint",
        lambda path, *a, **k: written.append(path.name) or save(path, *a, **k),
    )
    make_trainer(tmp_path, corpus, *EVERY_2, "train.keep_checkpoints=2").run()
    assert not [name for name in written if name.startswith("step-")] and "last" in written
    ckpt_dir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["best", "last", "step-10", "step-12"]
    for step in (10, 12):
        ckpt = load_checkpoint(ckpt_dir / f"step-{step}", with_trainer_state=True)
        assert ckpt.meta["step"] == ckpt.trainer_state["train_state"]["step"] == step
    out = capsys.readouterr().out
    assert out.count("checkpoints: ") == 1  # the disk use, once, at the first checkpoint
    assert "last + 2 step checkpoints (train.keep_checkpoints) + best's weights: about" in out


def test_keep_checkpoints_0_keeps_only_last_and_best(tmp_path, corpus):
    make_trainer(tmp_path, corpus, *EVERY_2, "train.keep_checkpoints=0").run()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best", "last"]


def test_resuming_from_a_step_checkpoint_repeats_the_run_from_there(tmp_path, corpus):
    straight = make_trainer(tmp_path / "a", corpus, *EVERY_2, "train.keep_checkpoints=10")
    straight.run()
    step_6 = tmp_path / "a" / "checkpoints" / "step-6"
    resumed = make_trainer(tmp_path / "b", corpus, *EVERY_2, f"train.resume={step_6}")
    assert resumed.state.step == 6
    resumed.run()
    assert {s: losses(resumed)[s] for s in range(7, 13)} == {
        s: losses(straight)[s] for s in range(7, 13)
    }  # bit-identical: weights, optimizer, RNG and data position all came from step-6
    for (name, a), (_, b) in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
