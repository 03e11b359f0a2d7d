"""train.py's causality guard: once the data is prepared (its mistakes are reported first) and
before the model is built, it checks a shrunk copy of the configured architecture, records the
result in every checkpoint, and stops a leaky model with one `error:` line (the leaky models
themselves: tests/model/test_causality_controls.py)."""

from __future__ import annotations

import torch

import trainer.loop
from checkpoints.store import load_checkpoint
from model.gpt import CausalSelfAttention
from tests.conftest import ROOT, TINY, compose_run, make_trainer, run_script
from trainer.preflight import causality_guard


def test_the_guard_runs_after_the_data_and_its_record_is_in_every_checkpoint(
    tmp_path, corpus, monkeypatch
):
    order = []
    for name, label in (("prepare_data", "data"), ("causality_guard", "guard")):
        original = getattr(trainer.loop, name)

        def recorded(*args, _original=original, _label=label, **kwargs):
            order.append(_label)
            return _original(*args, **kwargs)

        monkeypatch.setattr(trainer.loop, name, recorded)
    run = make_trainer(tmp_path, corpus, "train.max_steps=2", "train.eval_interval=0")
    assert order == ["data", "guard"]
    run.run()
    record = load_checkpoint(tmp_path / "checkpoints" / "last").meta["causality"]
    assert record["checked"] is True and record["causal"] is True
    assert record["first_leak"] is None and len(record["checks"]) == 5
    assert record["model"].startswith("a shrunk copy (same options): n_layer=2, n_embd=8")


def test_the_guard_leaves_the_random_stream_alone(corpus):
    settings, _ = compose_run(corpus)
    torch.manual_seed(0)
    causality_guard(settings, verbose=False)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after)


def test_turned_off_it_checks_nothing_and_says_so(corpus, monkeypatch):
    monkeypatch.setattr(CausalSelfAttention, "forward", None)  # any check would crash
    settings, _ = compose_run(corpus, "train.check_causality=false")
    assert causality_guard(settings) == {"checked": False, "reason": "train.check_causality=false"}


def test_a_leak_stops_train_py_with_one_error_line(tmp_path, corpus, monkeypatch):
    """A leaky attention, as a user's edit would be: a sitecustomize module patches the mask
    in the train.py process. Exit 2, nothing prepared or written."""
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(
        "import torch\n"
        "from model.gpt import CausalSelfAttention\n"
        "init = CausalSelfAttention.__init__\n"
        "def leaky(self, *a, **k):\n"
        "    init(self, *a, **k)\n"
        "    self.causal_mask = torch.ones_like(self.causal_mask).tril(1)\n"
        "CausalSelfAttention.__init__ = leaky\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{patch}:{ROOT}")
    run_dir = tmp_path / "run"
    result = run_script("train.py", *TINY, *corpus, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "error: the causality guard found a leak in a shrunk copy of this model: "
        "manual perturbation (eval): leak: layer 0 attn: output at t="
    )
    assert "train.check_causality=false" in result.stderr and result.stderr.count("\n") == 1
    assert not (run_dir / "checkpoints").exists()
