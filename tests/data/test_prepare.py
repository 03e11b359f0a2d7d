"""Cache reuse and rebuild, integrity checks (size, sha256), atomicity under SIGKILL, the CLI,
and bad input."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data.pipeline
from base.errors import DataError
from data.pipeline import InvalidCache, PreparedData, known_datasets, prepare_data, verify_prepared
from data.sources import tail_split
from data.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def text_cfg(tmp_path: Path, **overrides) -> dict:
    return {"name": "text", "cache_dir": str(tmp_path / "cache"), **overrides}


def write_docs(directory: Path, n: int = 5) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = directory / f"doc{i}.txt"
        path.write_text(
            f"Document number {i}. " * 50 + "caf\u00e9 \u65e5\u672c\n", encoding="utf-8"
        )
        paths.append(path)
    return paths


def own_copy(shakespeare: PreparedData, tmp_path: Path) -> tuple[dict, Path]:
    """A private copy of the session's Shakespeare preparation: the cfg that reuses it, its dir."""
    out = tmp_path / "shakespeare" / shakespeare.dir.name
    shutil.copytree(shakespeare.dir, out)
    return {"name": "shakespeare", "cache_dir": str(tmp_path)}, out


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


def fail_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("rebuilt although a valid cache exists")

    monkeypatch.setattr(data.pipeline, "write_split", refuse)


def test_known_datasets_have_configs() -> None:
    assert {"shakespeare", "tinystories", "fineweb_edu", "openwebtext", "text"} <= set(
        known_datasets()
    )


def test_cache_is_reused(shakespeare: PreparedData, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_builds(monkeypatch)
    cache_dir = shakespeare.dir.parents[1]
    again = prepare_data({"name": "shakespeare", "cache_dir": str(cache_dir)}, verbose=False)
    assert again.dir == shakespeare.dir and again.meta == shakespeare.meta


def test_text_files_rebuild_on_change_and_tokenizer(tmp_path: Path, capsys) -> None:
    train = write_docs(tmp_path / "docs")
    val = tmp_path / "val.txt"
    val.write_text("held out text\n", encoding="utf-8")
    cfg = text_cfg(tmp_path, train_files=[str(tmp_path / "docs" / "*.txt")], val_files=[str(val)])
    first = prepare_data(cfg, verbose=True)
    printed = capsys.readouterr().out
    assert f"/train: {len(train)} documents, " in printed and "/val: 1 document, " in printed
    enc = get_tokenizer("gpt2")
    assert enc.decode(first.tokens("val").tolist()) == "<|endoftext|>held out text\n"
    assert first.meta["splits"]["train"]["documents"] == len(train)
    assert prepare_data(cfg, verbose=False).dir == first.dir
    train[0].write_text("changed\n", encoding="utf-8")
    second = prepare_data(cfg, verbose=False)
    assert second.dir != first.dir
    assert "changed" in enc.decode(second.tokens("train").tolist())


def test_a_cache_dir_that_cannot_be_written_is_named_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("in the way")
    cache = tmp_path / "file" / "cache"
    with pytest.raises(
        DataError,
        match=f"cannot write the prepared data to {cache}/shakespeare: .*"
        r"set data.cache_dir \(or \$CAUSALGPT_CACHE\) to a writable directory",
    ):
        prepare_data({"name": "shakespeare", "cache_dir": str(cache)}, verbose=False)


def test_val_fraction_is_the_last_part_of_the_text_cut_at_a_line_boundary(tmp_path: Path) -> None:
    write_docs(tmp_path / "docs", n=10)
    cfg = text_cfg(tmp_path, train_files=[str(tmp_path / "docs") + "/*.txt"], val_fraction=0.2)
    prepared = prepare_data(cfg, verbose=False)
    splits = prepared.meta["splits"]
    assert splits["val"]["documents"] == 2 and splits["train"]["documents"] == 8
    enc = get_tokenizer("gpt2")
    assert enc.decode(prepared.tokens("val").tolist()).startswith("<|endoftext|>Document number 8.")


@pytest.mark.parametrize("tokenizer", ["gpt2", "bytes", "bpe-300"])
def test_one_file_trains_with_its_last_tenth_as_validation(tmp_path: Path, tokenizer: str) -> None:
    """nanoGPT's input.txt: one file, the last 10% of its characters (to the nearest line
    start) is val; the same text for every tokenizer."""
    lines = [f"line {i:03d} " + "x" * (i % 7) + "\n" for i in range(200)]
    text = "".join(lines)
    doc = tmp_path / "input.txt"
    doc.write_text(text, encoding="utf-8")
    prepared = prepare_data(text_cfg(tmp_path, train_files=[str(doc)], tokenizer=tokenizer))
    enc = prepared.tokenizer()
    train = enc.decode(prepared.tokens("train").tolist()).removeprefix("<|endoftext|>")
    val = enc.decode(prepared.tokens("val").tolist()).removeprefix("<|endoftext|>")
    assert train + val == text and train.endswith("\n") and val.startswith("line ")
    cut = len(text) - round(len(text) * 0.1)
    longest_line = max(map(len, lines))
    assert abs(len(train) - cut) <= longest_line / 2  # the nearest line boundary
    assert prepared.meta["splits"]["train"]["documents"] == 1


def test_tail_split_cuts_across_files_at_the_nearest_line_start() -> None:
    texts = ["a\nbb\n", "ccc\ndddd\n", "e\n"]  # 5 + 9 + 2 = 16 characters
    # 10% -> val should start at 14.4 -> 14: the start of the third file
    assert tail_split(texts, 0.1) == (["a\nbb\n", "ccc\ndddd\n"], ["e\n"])
    # 50% -> 8 is inside "ccc\ndddd\n" at offset 3; line starts at 0 and 4: 4 is nearer
    assert tail_split(texts, 0.5) == (["a\nbb\n", "ccc\n"], ["dddd\n", "e\n"])


@pytest.mark.parametrize(
    ("texts", "fraction"), [(["no line breaks at all"], 0.1), (["a\nb\n"], 0.01)]
)
def test_a_text_that_cannot_be_cut_is_a_clear_error(texts: list[str], fraction: float) -> None:
    with pytest.raises(DataError, match="one side would be empty.*val_files"):
        tail_split(texts, fraction)


def test_meta_records_the_sha256_of_each_token_file(shakespeare: PreparedData) -> None:
    on_disk = json.loads((shakespeare.dir / "meta.json").read_text())
    for split in ("train", "val"):
        expected = hashlib.sha256((shakespeare.dir / f"{split}.bin").read_bytes()).hexdigest()
        assert on_disk["splits"][split]["sha256"] == expected
        assert shakespeare.meta["splits"][split]["sha256"] == expected


def test_a_flipped_byte_is_detected_and_rebuilt(
    shakespeare: PreparedData, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, out = own_copy(shakespeare, tmp_path)
    path = out / "train.bin"
    size = path.stat().st_size
    flip_byte(path, size // 2)  # same size: only the sha256 can tell
    assert path.stat().st_size == size
    with pytest.raises(InvalidCache, match=rf"^{re.escape(str(path))} fails its sha256 check"):
        verify_prepared(out, shakespeare.meta["fingerprint"])
    rebuilt = prepare_data(cfg, verbose=False)
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("shakespeare:")]
    assert line.startswith(f"shakespeare: {path} fails its sha256 check")
    assert line.endswith("rebuilding the prepared data from its sources")
    assert rebuilt.dir == out
    for split in ("train", "val"):
        assert np.array_equal(rebuilt.tokens(split), shakespeare.tokens(split))
        ours, original = rebuilt.meta["splits"][split], shakespeare.meta["splits"][split]
        assert ours["sha256"] == original["sha256"]


def test_a_truncated_token_file_is_detected_and_rebuilt(
    shakespeare: PreparedData, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, out = own_copy(shakespeare, tmp_path)
    path = out / "val.bin"
    with open(path, "r+b") as f:
        f.truncate(100)
    recorded = shakespeare.meta["splits"]["val"]["tokens"] * 2  # uint16
    message = f"{path} has 100 bytes but meta.json records {recorded:,} (truncated or overwritten)"
    with pytest.raises(InvalidCache, match=f"^{re.escape(message)}$"):
        verify_prepared(out, shakespeare.meta["fingerprint"])
    assert np.array_equal(prepare_data(cfg, verbose=False).tokens("val"), shakespeare.tokens("val"))
    assert f"shakespeare: {message}; rebuilding" in capsys.readouterr().err


def test_a_missing_token_file_is_named(shakespeare: PreparedData, tmp_path: Path) -> None:
    _, out = own_copy(shakespeare, tmp_path)
    (out / "val.bin").unlink()
    with pytest.raises(InvalidCache, match=f"^{re.escape(str(out / 'val.bin'))} is missing"):
        verify_prepared(out, shakespeare.meta["fingerprint"])


def test_meta_without_sha256_is_not_trusted(shakespeare: PreparedData, tmp_path: Path) -> None:
    """As written before token files were hashed (FORMAT_VERSION 1, which has other
    fingerprints now): such a directory is rebuilt, not used unverified."""
    _, out = own_copy(shakespeare, tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    del meta["splits"]["train"]["sha256"]
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(InvalidCache, match=r"meta\.json is unreadable or incomplete.*'sha256'"):
        verify_prepared(out, shakespeare.meta["fingerprint"])


def test_a_big_verification_is_announced(
    shakespeare: PreparedData,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg, out = own_copy(shakespeare, tmp_path)
    fail_builds(monkeypatch)
    reuse = f"shakespeare: reusing prepared data in {out} (verified in "
    prepare_data(cfg)  # 3.6 MB: verified without a word (0.0 GB when announced, below)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(reuse)
    monkeypatch.setattr(data.pipeline, "ANNOUNCE_BYTES", 3_000_000)
    prepare_data(cfg)
    first, second = capsys.readouterr().out.splitlines()
    assert first == (
        f"shakespeare: verifying the sha256 of 0.0 GB of prepared data in {out} "
        "(every byte is read and hashed, at about 0.7-2 GB/s)"
    )
    assert second.startswith(reuse)


# Prepares Shakespeare, killing itself with SIGKILL where it would rename <argv[2]> into place:
# that file is complete under its temporary name, and each file before it is in place.
PREPARE = """
import os, signal, sys
from pathlib import Path
from data.pipeline import prepare_data
real = os.replace
def replace(src, dst):
    if Path(dst).name == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)
os.replace = replace
prepare_data({"name": "shakespeare", "cache_dir": sys.argv[1]}, verbose=False)
"""


@pytest.mark.slow
@pytest.mark.parametrize("killed_in", ["train.bin", "val.bin", "meta.json"])
def test_killed_preparation_is_never_used(
    shakespeare: PreparedData, tmp_path: Path, killed_in: str
) -> None:
    """SIGKILL at an exact point: each file of the preparation written under its temporary
    name, before its rename."""
    proc = subprocess.run(
        [sys.executable, "-c", PREPARE, str(tmp_path), killed_in],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -9, proc.stderr
    out = tmp_path / "shakespeare" / shakespeare.dir.name
    order = ["train.bin", "val.bin", "meta.json"]
    names = sorted(p.name for p in out.iterdir())
    assert [n.split(".tmp-")[0] for n in names if ".tmp-" in n] == [f".{killed_in}"]
    assert [n for n in names if not n.startswith(".")] == order[: order.index(killed_in)]
    with pytest.raises(FileNotFoundError):  # no meta.json: never used
        verify_prepared(out, shakespeare.meta["fingerprint"])
    rebuilt = prepare_data({"name": "shakespeare", "cache_dir": str(tmp_path)}, verbose=False)
    for split in ("train", "val"):
        assert np.array_equal(rebuilt.tokens(split), shakespeare.tokens(split))


def test_failure_mid_write_leaves_no_token_file(tmp_path: Path, monkeypatch) -> None:
    real = data.pipeline.write_split

    def write_then_fail(docs, path, *args, **kwargs):
        real(docs, path, *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(data.pipeline, "write_split", write_then_fail)
    cfg = {"name": "shakespeare", "cache_dir": str(tmp_path)}
    with pytest.raises(OSError, match="disk full"):
        prepare_data(cfg, verbose=False)
    assert list(tmp_path.iterdir()) == []  # no token file, nor the folders it made


def test_cli_prints_summary_json(shakespeare: PreparedData) -> None:
    cache_dir = shakespeare.dir.parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "data.prepare", "data=shakespeare", f"data.cache_dir={cache_dir}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["dataset"] == "shakespeare"
    for split in ("train", "val"):
        assert summary[split]["tokens"] == shakespeare.meta["splits"][split]["tokens"]
        assert summary[split]["bytes"] == shakespeare.meta["splits"][split]["bytes"]
        assert summary[split]["documents"] == shakespeare.meta["splits"][split]["documents"]
    train, val = (shakespeare.meta["splits"][s]["tokens"] for s in ("train", "val"))
    assert f"splits: train {train:,} tokens" in proc.stdout and f"val {val:,} tokens" in proc.stdout
    assert summary["seconds"] >= 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data=nope"], "known datasets: chat, chat_plays, fineweb_edu"),
        (["data=text"], "train_files"),
        (["data=text", "data.train_files=[/no/such/file.txt]"], "does not exist"),
        (["data.tokenizer=bpe-100"], "bpe-<N> needs a whole number N >= 257"),
    ],
)
def test_cli_user_errors_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "data.prepare", *args, f"data.cache_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_one_file_given_as_a_string_is_a_one_file_list(tmp_path: Path) -> None:
    """Issue 50 item 12: data.train_files=input.txt (no brackets) is the same dataset as
    'data.train_files=[input.txt]', prepared into the same directory."""
    text = tmp_path / "input.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 50)
    dirs = []
    for files in (text, f"[{text}]"):
        proc = subprocess.run(
            [sys.executable, "-m", "data.prepare", "data=text", f"data.train_files={files}",
             "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}"],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        dirs.append(json.loads(proc.stdout.strip().splitlines()[-1])["dir"])
    assert dirs[0] == dirs[1]


def test_unknown_dataset_lists_known(tmp_path: Path) -> None:
    with pytest.raises(
        DataError,
        match="known: chat, chat_plays, fineweb_edu, openwebtext, shakespeare, smol_smoltalk",
    ):
        prepare_data({"name": "nope", "cache_dir": str(tmp_path)})


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("*.missing", None, "matches no files"),
        ("absent.txt", None, "does not exist"),
        ("empty.txt", b"", "is empty"),
        ("bad.txt", b"ok \xff\xfe bad", "not valid UTF-8"),
    ],
)
def test_bad_text_files(tmp_path: Path, name: str, content: bytes | None, message: str) -> None:
    if content is not None:
        (tmp_path / name).write_bytes(content)
    files = [str(tmp_path / name)]
    with pytest.raises(DataError, match=message):
        prepare_data(text_cfg(tmp_path, train_files=files, val_files=files), verbose=False)


def test_undecodable_bytes_can_be_replaced(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff bad")
    cfg = text_cfg(
        tmp_path, train_files=[str(bad)], val_files=[str(bad)], encoding_errors="replace"
    )
    text = get_tokenizer("gpt2").decode(prepare_data(cfg, verbose=False).tokens("train").tolist())
    assert text == "<|endoftext|>ok \ufffd bad"
