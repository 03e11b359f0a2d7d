"""A run with a tokenizer trained on its data (data.tokenizer=bpe-300): checkpoints carry the
tokenizer, so sampling and evaluation need nothing but the checkpoint."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from base.errors import DataError
from checkpoints.store import MANIFEST_FILE, CheckpointError, load_checkpoint, resolve_checkpoint
from data.tokenizer import BPE, TOKENIZER_FILE
from evals.loss import evaluate_checkpoint
from inference.cli import run as sample
from tests.conftest import CONFIGS, PLAYS, make_trainer


def data_overrides(root: Path) -> list[str]:
    """A ~100 KB train / ~8 KB val text dataset with its own cache, tokenized by bpe-300."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.txt").write_text((PLAYS / "tragedies" / "hamlet.md").read_text()[:100_000])
    (root / "val.txt").write_text((PLAYS / "roman" / "julius-caesar.md").read_text()[:8_000])
    return [
        "data=text",
        f"data.train_files=[{root / 'train.txt'}]",
        f"data.val_files=[{root / 'val.txt'}]",
        f"data.cache_dir={root / 'cache'}",
        "data.tokenizer=bpe-300",
    ]


def config(name: str, *overrides: str) -> dict:
    """The config of `python <name>.py <overrides>`."""
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        return OmegaConf.to_container(compose(name, overrides=list(overrides)))


def evaluate(checkpoint: Path, text_file: Path | None = None) -> dict:
    cfg = config("evaluate", f"checkpoint={checkpoint}", "device=cpu", "dtype=float32")
    cfg = {**cfg, "text_file": text_file and str(text_file)}
    return evaluate_checkpoint(cfg)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("bpe_run")
    data = data_overrides(root / "data")
    trainer = make_trainer(root / "run", data)
    trainer.run()
    return {
        "root": root,
        "run_dir": root / "run",
        "data": data,
        "prepared": trainer.data,
        "samples": trainer._samples(),  # the loop's sample table, decoded by its tokenizer
    }


def test_the_model_and_checkpoints_use_the_trained_tokenizer(run: dict) -> None:
    prepared = run["prepared"]
    assert prepared.vocab_size == 300
    for name in ("last", "best"):
        path = run["run_dir"] / "checkpoints" / name
        ckpt = load_checkpoint(path)
        assert ckpt.model.config.vocab_size == 300  # model.vocab_size: null
        assert ckpt.tokenizer_name == "bpe-300"
        assert (path / TOKENIZER_FILE).read_bytes() == prepared.tokenizer_file.read_bytes()
        assert TOKENIZER_FILE in json.loads((path / MANIFEST_FILE).read_text())
        assert ckpt.tokenizer()._mergeable_ranks == prepared.tokenizer()._mergeable_ranks
    (empty, completion), (opening, _) = run["samples"]
    assert empty == "" and completion and opening.startswith("# Julius Caesar")


def test_sample_and_evaluate_from_the_checkpoint_alone(run: dict, tmp_path: Path) -> None:
    # Nothing but the checkpoint: no data cache, no training or validation text.
    shutil.copytree(run["run_dir"], tmp_path / "run")
    data_dir = run["root"] / "data"
    shutil.move(data_dir, tmp_path / "data")
    try:
        out = io.StringIO()
        cfg = config(
            "sample",
            f"checkpoint={tmp_path / 'run'}",
            "prompt='HAMLET: To be'",
            "max_new_tokens=20",
            "device=cpu",
            "stream=false",
        )
        (completion,) = sample(cfg, out=out, err=io.StringIO())
        assert out.getvalue().startswith("HAMLET: To be" + completion)

        text = tmp_path / "speech.txt"
        text.write_text(
            "Friends, Romans, countrymen, lend me your ears; caf\u00e9 \u2014 fin.\n" * 20
        )
        result = evaluate(tmp_path / "run", text)
        tokenizer = load_checkpoint(resolve_checkpoint(tmp_path / "run")).tokenizer()
        assert result["bytes"] == len(text.read_bytes())  # bytes of the raw text
        assert result["tokens"] == len(tokenizer.encode_ordinary(text.read_text()))
        assert result["bpb"] == pytest.approx(
            result["loss"] * result["tokens"] / result["bytes"] / math.log(2), rel=1e-3
        )
    finally:
        shutil.move(tmp_path / "data", data_dir)


def test_the_validation_split_after_the_cache_is_deleted(run: dict) -> None:
    # The data is prepared again (the tokenizer retrained, identically) for the split.
    shutil.rmtree(run["root"] / "data" / "cache")
    result = evaluate(run["run_dir"])
    prepared = run["prepared"]
    assert (
        result["data"] == "text/val"
        and result["bytes"] == (run["root"] / "data" / "val.txt").stat().st_size
    )
    assert result["tokens"] == prepared.meta["splits"]["val"]["tokens"] - 1
    assert (
        prepared.tokenizer_file.read_bytes()
        == (run["run_dir"] / "checkpoints" / "last" / TOKENIZER_FILE).read_bytes()
    )


def test_a_tampered_tokenizer_file_fails_verification(run: dict, tmp_path: Path) -> None:
    ckpt = tmp_path / "last"
    shutil.copytree(run["run_dir"] / "checkpoints" / "last", ckpt)
    file = ckpt / TOKENIZER_FILE
    saved = json.loads(file.read_text())
    merges = saved["merges"]  # swap two consecutive merges of single bytes: ranks change
    i = next(i for i in range(len(merges)) if len("".join(merges[i] + merges[i + 1])) == 8)
    merges[i], merges[i + 1] = merges[i + 1], merges[i]
    file.write_text(BPE.from_json(json.dumps(saved), "bpe-300").to_json())  # still valid
    with pytest.raises(CheckpointError, match=f"{file} fails its sha256 check"):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="sha256"):
        evaluate(ckpt)


def test_resuming_on_retrained_data_is_refused(run: dict, tmp_path: Path) -> None:
    data = data_overrides(tmp_path / "data")
    (tmp_path / "data" / "train.txt").write_text(
        (PLAYS / "tragedies" / "othello.md").read_text()[:100_000]
    )
    last = run["run_dir"] / "checkpoints" / "last"
    with pytest.raises(CheckpointError, match="another bpe-300 tokenizer"):
        make_trainer(tmp_path / "run", data, f"train.resume={last}")


def test_evaluating_on_retrained_data_is_refused(run: dict) -> None:
    train = run["root"] / "data" / "train.txt"
    original = train.read_text()
    train.write_text((PLAYS / "tragedies" / "othello.md").read_text()[:100_000])
    try:
        with pytest.raises(DataError, match="another bpe-300 than the checkpoint"):
            evaluate(run["run_dir"])
    finally:
        train.write_text(original)
