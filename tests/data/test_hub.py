"""The hub code path, run offline on local parquet and json files through the same functions."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, IterableDataset

from base.errors import DataError
from data.pipeline import prepare_data
from data.sources import load_split
from data.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[2]

DOCS = [f"Story {i}: once upon a time there was a caf\u00e9 number {i}." for i in range(40)]


def parquet_cfg(tmp_path: Path, **overrides) -> dict:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"content": DOCS, "id": list(range(len(DOCS)))}), path)
    return {
        "name": "local_parquet",
        "source": "hub",
        "path": "parquet",
        "data_files": {"train": str(path)},
        "text_field": "content",
        "val_split": None,
        "val_fraction": 0.25,
        "seed": 0,
        "cache_dir": str(tmp_path / "cache"),
        "num_proc": 2,
        **overrides,
    }


def decoded_documents(prepared, split: str) -> list[str]:
    text = get_tokenizer("gpt2").decode(prepared.tokens(split).tolist())
    return text.split("<|endoftext|>")[1:]


@pytest.mark.parametrize("streaming", [False, True])
def test_load_split_yields_one_text_column(tmp_path: Path, streaming: bool) -> None:
    ds = load_split(parquet_cfg(tmp_path, streaming=streaming), "train")
    assert isinstance(ds, IterableDataset if streaming else Dataset)
    assert [row["text"] for row in ds] == DOCS
    assert list(next(iter(ds))) == ["text"]


@pytest.mark.parametrize("streaming", [False, True])
def test_seeded_hold_out_of_whole_documents(tmp_path: Path, streaming: bool) -> None:
    prepared = prepare_data(parquet_cfg(tmp_path, streaming=streaming), verbose=False)
    train, val = decoded_documents(prepared, "train"), decoded_documents(prepared, "val")
    assert val and train and not set(train) & set(val)
    assert sorted(train + val) == sorted(DOCS)
    assert prepared.meta["splits"]["val"]["documents"] == len(val)


def test_own_validation_split_from_json(tmp_path: Path) -> None:
    for split, docs in (("train", DOCS[:30]), ("validation", DOCS[30:])):
        lines = "".join(json.dumps({"text": d, "meta": 1}) + "\n" for d in docs)
        (tmp_path / f"{split}.jsonl").write_text(lines, encoding="utf-8")
    cfg = {
        "name": "local_json",
        "source": "hub",
        "path": "json",
        "data_files": {s: str(tmp_path / f"{s}.jsonl") for s in ("train", "validation")},
        "val_split": "validation",
        "cache_dir": str(tmp_path / "cache"),
    }
    prepared = prepare_data(cfg, verbose=False)
    assert decoded_documents(prepared, "train") == DOCS[:30]
    assert decoded_documents(prepared, "val") == DOCS[30:]


def test_caps_on_documents_and_train_tokens(tmp_path: Path) -> None:
    prepared = prepare_data(
        parquet_cfg(tmp_path, streaming=True, max_documents=20, max_train_tokens=50), verbose=False
    )
    splits = prepared.meta["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] <= 20
    assert 50 <= splits["train"]["tokens"] < 50 + 30  # stops after the document that reaches it


def test_wrong_text_field_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no column 'body'"):
        prepare_data(parquet_cfg(tmp_path, text_field="body"), verbose=False)


def test_zero_tokens_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": ["", "", ""]}), path)
    cfg = parquet_cfg(tmp_path, data_files={"train": str(path)}, text_field="text")
    with pytest.raises(DataError, match="has no text"):
        prepare_data(cfg, verbose=False)


def test_hub_configs_name_the_loader_arguments() -> None:
    from data.pipeline import resolve_config

    cfg = resolve_config({"name": "tinystories"})
    assert (cfg["path"], cfg["val_split"], cfg["streaming"]) == (
        "roneneldan/TinyStories", "validation", False,
    )  # fmt: skip
    fineweb = resolve_config({"name": "fineweb_edu"})
    assert (fineweb["subset"], fineweb["streaming"]) == ("sample-10BT", True)
    assert resolve_config({"name": "openwebtext"})["val_fraction"] > 0


def test_an_unreachable_hub_is_one_line_at_once_naming_the_local_recipe(tmp_path: Path) -> None:
    """Online mode with the hub unreachable (its endpoint a closed local port): one `error:`
    line that says how to train without the network, not half a minute of retries."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # closed when the block ends: connections are refused
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "CAUSALGPT_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "data.prepare", "data=tinystories"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: could not load 'roneneldan/TinyStories': the Hugging ")
    assert f"(127.0.0.1:{port}) is unreachable; without the network" in done.stderr
    assert "data.data_files=" in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "raised, user_error",
    [
        (FileNotFoundError("no such repo"), True),  # what the hub and the file readers raise
        (ValueError("BuilderConfig 'x' not found"), True),
        (KeyError("a bug"), False),  # anything else is a bug: it keeps its type and traceback
        (MemoryError(), False),
    ],
)
def test_only_what_the_hub_raises_becomes_one_line(monkeypatch, raised, user_error):
    import datasets
    import tiktoken

    from data import sources

    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(datasets, "load_dataset", fail)
    monkeypatch.setattr(tiktoken, "get_encoding", fail)
    expected = DataError if user_error else type(raised)
    with pytest.raises(expected):
        sources.load_dataset("json", None, "train", data_files="x.jsonl")
    with pytest.raises(expected):
        get_tokenizer("cl100k_base")
