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

from base.errors import ConfigError, DataError
from checkpoints.store import MANIFEST_FILE, CheckpointError, load_checkpoint, resolve_checkpoint
from data.tokenizer import BPE, TOKENIZER_FILE
from evals.loss import evaluate_checkpoint
from inference.cli import run as sample
from tests.conftest import CONFIGS, PLAYS, TINY, make_trainer
from trainer.config import run_config
from trainer.loop import Trainer


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


def chat_run_config(run: dict, run_dir: Path, chat_corpus: list[str], *overrides: str):
    """run_config of `train.py experiment=chat_sft train.init_from=<the bpe-300 run> <chat>`."""
    args = [*TINY, "experiment=chat_sft", f"train.init_from={run['run_dir']}", *chat_corpus]
    args += ["model.block_size=32", "train.max_steps=2", "wandb.mode=disabled", *overrides]
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        return run_config(compose("train", overrides=args), run_dir, args)


@pytest.mark.parametrize("named", [[], ["data.tokenizer=bpe-300"]])
def test_a_chat_fine_tune_reuses_its_base_models_trained_tokenizer(
    run: dict, tmp_path: Path, chat_corpus: list[str], named: list[str], capsys
) -> None:
    """With nothing said (data=chat defaults to gpt2) or the source's own name (which once
    trained a new bpe-300 on the conversations), the conversations are tokenized with the
    checkpoint's tokenizer.json, copied, not trained; the run says so; it trains and evaluates."""
    cache = f"data.cache_dir={tmp_path / 'cache'}"  # prepared here, not reused
    settings, resolved = chat_run_config(run, tmp_path / "run", chat_corpus, cache, *named)
    source = resolve_checkpoint(run["run_dir"])
    assert resolved["data"]["tokenizer_dir"] == str(source)
    trainer = Trainer(settings, tmp_path / "run", resolved)
    data = trainer.data
    assert (data.tokenizer_name, data.vocab_size) == ("bpe-300", 302)  # + the template's two
    assert data.tokenizer_file.read_bytes() == (source / TOKENIZER_FILE).read_bytes()
    assert "tokenizer_training" not in data.meta
    out = capsys.readouterr().out
    assert f"bpe-300 from {source / TOKENIZER_FILE} (data.tokenizer_dir), not trained" in out
    assert f"tokenizer bpe-300 (its tokenizer.json in {source}): train.init_from=" in out
    summary = trainer.run()
    assert load_checkpoint(summary["checkpoint"]).tokenizer().n_vocab == 302
    # the "before" score: the base model on the conversations, tokenized with its own tokenizer
    chat = [o for o in chat_corpus if o != "data=chat"] + [cache]
    before = evaluate_checkpoint(config("evaluate", f"checkpoint={run['run_dir']}", "data=chat",
                                        *chat, "device=cpu", "dtype=float32"))  # fmt: skip
    after = evaluate_checkpoint(config("evaluate", f"checkpoint={summary['checkpoint']}",
                                       "device=cpu", "dtype=float32"))  # fmt: skip
    assert before["tokens"] == after["tokens"] == summary["val_tokens"] > 0
    assert math.isfinite(before["loss"]) and after["loss"] == pytest.approx(
        summary["val_loss"], abs=2e-4
    )


def test_a_chat_fine_tune_naming_another_tokenizer_is_refused(
    run: dict, tmp_path: Path, chat_corpus: list[str]
) -> None:
    settings, resolved = chat_run_config(run, tmp_path / "run", chat_corpus, "data.tokenizer=bytes")
    assert resolved["data"]["tokenizer_dir"] is None
    with pytest.raises(ConfigError, match="^data.tokenizer=bytes does not match .* drop data.tok"):
        Trainer(settings, tmp_path / "run", resolved)


def test_a_tokenizer_dir_without_a_trained_tokenizer_is_named(run: dict, tmp_path: Path) -> None:
    data = [*data_overrides(tmp_path / "data"), f"data.tokenizer_dir={tmp_path}"]
    with pytest.raises(DataError, match=f"^data.tokenizer_dir={tmp_path} holds no tokenizer.json"):
        make_trainer(tmp_path / "run", data)
    data[-2:] = ["data.tokenizer=gpt2", f"data.tokenizer_dir={run['run_dir']}"]
    with pytest.raises(DataError, match="data.tokenizer=gpt2 is built in: drop data.tokenizer_dir"):
        make_trainer(tmp_path / "run", data)
