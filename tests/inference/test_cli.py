"""`python sample.py`: samples from a checkpoint; user mistakes are one `error:` line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from base.files import sha256_file
from checkpoints.store import (
    MANIFEST_FILE,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from inference.cli import SEPARATOR, main, run
from inference.generate import decode_escapes
from model import GPT, GPTConfig
from tests.conftest import HANG_SECONDS

SAMPLE_PY = Path(__file__).resolve().parents[2] / "sample.py"


def sample_py(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python sample.py <args>` from `cwd`, with every Python warning shown (once)."""
    return subprocess.run(
        [sys.executable, str(SAMPLE_PY), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONWARNINGS": "default"},
        capture_output=True,
        text=True,
        timeout=HANG_SECONDS,
    )


def test_sample_py_runs_from_another_directory_and_prints_the_continued_prompt(run_dir, tmp_path):
    result = sample_py(
        f"checkpoint={run_dir}",
        "prompt='Hello world'",
        "max_new_tokens=5",
        "temperature=0",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello world")
    assert len(result.stdout.splitlines()[0]) > len("Hello world")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # Hydra wrote nothing
    assert "Warning" not in result.stderr  # no Python warning (DeprecationWarning, ...)


def test_sample_py_reports_a_bad_value_in_one_line_and_exits_2(run_dir, tmp_path):
    result = sample_py(f"checkpoint={run_dir}", "top_p=1.5", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: top_p must be in (0, 1]")
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_greedy_sampling_is_deterministic_and_sampling_follows_the_seed(run_dir, sample_cfg):
    def completions(*overrides: str) -> list[str]:
        return run(sample_cfg(f"checkpoint={run_dir}", "max_new_tokens=12", *overrides))

    assert completions("temperature=0", "seed=1") == completions("temperature=0", "seed=2")
    assert completions("seed=5", "num_samples=3") == completions("seed=5", "num_samples=3")
    assert completions("seed=5", "num_samples=3") != completions("seed=6", "num_samples=3")


def test_a_stop_string_ends_the_sample_before_it(run_dir, sample_cfg, capsys):
    cfg = sample_cfg(f"checkpoint={run_dir}", "max_new_tokens=20", "temperature=0")
    (full,) = run(cfg)
    stop = full[5:8]  # a piece of what greedy decoding will produce
    (stopped,) = run(
        sample_cfg(
            f"checkpoint={run_dir}",
            "max_new_tokens=20",
            "temperature=0",
            f"stop=[{json.dumps(stop)}]",
        )
    )
    assert stopped == full[: full.index(stop)]
    # A plain string is one stop string, not one per character.
    cfg["stop"] = stop
    assert run(cfg) == [stopped]


@pytest.mark.parametrize(
    "key, value, message",
    [("stop", 5, "stop must be a string or a list"), ("stream", "maybe", "stream must be true")],
)
def test_stop_and_stream_values_are_checked(run_dir, sample_cfg, key, value, message):
    cfg = sample_cfg(f"checkpoint={run_dir}")
    cfg[key] = value
    with pytest.raises(ValueError, match=message):
        run(cfg)


def test_the_readmes_blank_line_stop_ends_the_sample_at_the_first_blank_line(
    blank_line_run, tmp_path
):
    """`'stop=["\\n\\n"]'` as the README writes it: the shell passes backslash-n, which is
    decoded. The control, without the stop, shows that the model does write blank lines."""
    args = [f"checkpoint={blank_line_run}", "prompt=two", "max_new_tokens=8", "temperature=0"]
    control = sample_py(*args, cwd=tmp_path)
    assert control.returncode == 0, control.stderr
    assert control.stdout.startswith("two one\n\ntwo one\n\ntwo")

    stopped = sample_py(*args, r'stop=["\n\n"]', cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == "two one\n" + SEPARATOR + "\n"


def test_escapes_in_stop_strings_are_decoded_and_other_backslashes_kept():
    assert decode_escapes(r"\n\n") == "\n\n"
    assert decode_escapes(r"\t|\r|\u00e9") == "\t|\r|\u00e9"
    assert decode_escapes(r"a\\nb") == "a\\nb"  # an escaped backslash, then n
    assert decode_escapes(r"C:\data \d") == r"C:\data \d"
    assert decode_escapes("é\n") == "é\n"  # already decoded text is unchanged


def test_an_empty_prompt_starts_from_end_of_text_and_streams(run_dir, sample_cfg, capsys):
    (text,) = run(
        sample_cfg(
            f"checkpoint={run_dir}", "prompt=''", "max_new_tokens=4", "temperature=0", "stream=true"
        )
    )
    assert capsys.readouterr().out == text + "\n"  # streamed: no separator


def test_a_prompt_longer_than_block_size_is_cropped_with_a_warning(run_dir, sample_cfg, capsys):
    run(sample_cfg(f"checkpoint={run_dir}", f"prompt='{' word' * 40}'", "max_new_tokens=2"))
    assert "warning: the prompt has 40 tokens, more than block_size=32" in capsys.readouterr().err


def test_the_attention_plot_is_written(run_dir, sample_cfg, tmp_path):
    plot = tmp_path / "attention.png"
    run(
        sample_cfg(
            f"checkpoint={run_dir}", "prompt='a b c'", "max_new_tokens=0", f"attention_plot={plot}"
        )
    )
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_the_formula_figure_is_written_and_one_querys_computation_printed(
    run_dir, sample_cfg, tmp_path, capsys
):
    figure = tmp_path / "formula.png"
    args = ["prompt='a b c'", "max_new_tokens=0", f"formula={figure}", "attention_layer=-1"]
    run(sample_cfg(f"checkpoint={run_dir}", *args, "formula_head=1", "formula_row=1"))
    assert figure.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("layer 1, head 1, query 1 ('␣b') over keys 'a' '␣b'")
    assert lines[1].startswith("q_1 . k_j ") and len(lines[1].split()) == 3 + 2  # two keys
    assert lines[-1] == f"wrote {figure}"


def test_true_names_the_figures_and_a_one_token_formula_says_why_no_variance(
    run_dir, sample_cfg, tmp_path, monkeypatch, capsys
):
    """Issue 55 items 2 and 3: formula=true and attention_plot=true write formula.png and
    attention_plot.png here (they were tracebacks); a one-token text's formula prints why it has
    no score variance instead of nan."""
    monkeypatch.chdir(tmp_path)
    args = ["prompt=Hello", "max_new_tokens=0", "formula=true", "attention_plot=true"]
    run(sample_cfg(f"checkpoint={run_dir}", *args))
    for name in ("formula.png", "attention_plot.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    err = capsys.readouterr().err
    assert "why / sqrt(d_k): one token has one score, and a variance needs two" in err
    assert "nan" not in err and "wrote formula.png" in err


def errors_of(cfg, capsys) -> str:
    """Run main(cfg); assert it failed as a user mistake; return the error line."""
    with pytest.raises(SystemExit) as exited:
        main(cfg)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    return err


def test_a_missing_checkpoint_says_where_it_looked(sample_cfg, tmp_path, capsys):
    err = errors_of(sample_cfg(f"checkpoint={tmp_path / 'nope'}"), capsys)
    assert str(tmp_path / "nope" / "checkpoints" / "best") in err


def test_without_a_checkpoint_it_looks_in_outputs(sample_cfg, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = errors_of(sample_cfg(), capsys)
    assert f"no checkpoint found under {tmp_path / 'outputs'}" in err


def test_the_newest_run_in_outputs_is_the_default(run_dir, sample_cfg, tmp_path, monkeypatch):
    outputs = tmp_path / "work" / "outputs" / "2025-01-01"
    outputs.mkdir(parents=True)
    run_dir.rename(outputs / "12-00-00")
    monkeypatch.chdir(tmp_path / "work")
    assert len(run(sample_cfg("max_new_tokens=1"))) == 1


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_checkpoint_is_refused(run_dir, sample_cfg, capsys, damage):
    weights = run_dir / "checkpoints" / "best" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 2 :]
    weights.write_bytes(bytes(data))
    err = errors_of(sample_cfg(f"checkpoint={run_dir}"), capsys)
    assert "model.safetensors" in err and ("corrupt" in err or "truncated" in err)


class RunsCode:
    """Unpickling this creates the marker file: proof that loading executed code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def plant(checkpoint: Path, name: str, marker: Path) -> None:
    """Write a malicious pickle as `name` and list it in the manifest with a matching sha256,
    as an attacker who controls the directory would."""
    torch.save(RunsCode(marker), checkpoint / name)
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    manifest[name] = {
        "bytes": (checkpoint / name).stat().st_size,
        "sha256": sha256_file(checkpoint / name),
    }
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_malicious_trainer_state_is_never_unpickled(run_dir, sample_cfg, tmp_path):
    checkpoint = run_dir / "checkpoints" / "best"
    marker = tmp_path / "pwned"
    plant(checkpoint, "trainer.pt", marker)
    assert len(run(sample_cfg(f"checkpoint={run_dir}", "max_new_tokens=1"))) == 1  # ignored
    with pytest.raises(CheckpointError, match="safely"):
        load_checkpoint(checkpoint, with_trainer_state=True)  # refused when asked for
    assert not marker.exists()


def test_malicious_weights_are_refused_without_running_code(run_dir, sample_cfg, tmp_path, capsys):
    marker = tmp_path / "pwned"
    plant(run_dir / "checkpoints" / "best", "model.safetensors", marker)
    err = errors_of(sample_cfg(f"checkpoint={run_dir}"), capsys)
    assert "cannot load the weights" in err
    assert not marker.exists()


def test_a_prompt_file_that_is_not_utf8_is_refused(run_dir, sample_cfg, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes("café".encode("latin-1"))
    err = errors_of(sample_cfg(f"checkpoint={run_dir}", f"prompt_file={prompt}"), capsys)
    assert f"prompt_file {prompt} is not UTF-8 text" in err
    err = errors_of(sample_cfg(f"checkpoint={run_dir}", f"prompt_file={tmp_path}"), capsys)
    assert f"prompt_file {tmp_path} is a directory; give a file" in err  # was a bare Errno 21


def test_messages_that_are_not_a_conversation_say_what_one_looks_like(sample_cfg, tmp_path, capsys):
    """Issue 50 item 11: a bare text was "not JSON" and a file that "does not exist", never
    what messages must look like; each wrong form now says it."""
    form = "give a list like 'messages=[{role: user, content: \"Hi\"}]', or a JSON file"
    result = sample_py('messages="What licence does bash use?"', cwd=tmp_path)  # the repro
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: messages 'What licence does bash use?' is not a file")
    assert form in result.stderr
    (tmp_path / "text.json").write_text("What licence?")
    (tmp_path / "string.json").write_text('"What licence?"')
    for value in (tmp_path / "text.json", tmp_path / "string.json", "[]"):
        assert form.removeprefix("give ") in errors_of(sample_cfg(f"messages={value}"), capsys)


def test_a_prompt_file_is_read(run_dir, sample_cfg, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time", encoding="utf-8")
    run(sample_cfg(f"checkpoint={run_dir}", f"prompt_file={prompt}", "max_new_tokens=1"))
    assert capsys.readouterr().out.startswith("Once upon a time")


@pytest.mark.parametrize(
    "override, message",
    [
        ("temperature=-1", "temperature must be >= 0"),
        ("top_p=0", "top_p must be in (0, 1]"),
        ("top_p=1.01", "top_p must be in (0, 1]"),
        ("num_samples=0", "num_samples must be a positive integer"),
        ("seed=null", "seed must be a non-negative integer"),
        ("dtype=float64", "dtype must be one of ['auto', 'float32', 'bfloat16', 'float16']"),
        ("device=tpu9", "device must be auto or a device (cpu, cuda, cuda:1, mps), got 'tpu9'"),
        ("prompt_file=/nonexistent/p.txt", "prompt_file /nonexistent/p.txt does not exist"),
        ("attention_plot=x.png attention_layer=7", "attention_layer=7 is out of range"),
        ("formula=x.png formula_head=9", "error: formula_head=9 is out of range: use 0 to 1"),
        ("formula=x.png formula_row=99", "error: formula_row=99 is out of range: the text has 1"),
        ("formula=x.png attention_layer=5", "error: attention_layer=5 is out of range: use 0 to 1"),
        ("formula=5", "formula must be a file name like formula.png, true (for formula.png) or"),
        ("attention_plot=[a]", "attention_plot must be a file name like attention_plot.png"),
        ("attention_plot=/dev/null/a.png", "error: attention_plot: File exists: '/dev/null'"),
        ("formula=/dev/null/f.png", "error: formula: File exists: '/dev/null'"),  # not a folder
        ("compile=maybe", "error: compile must be true, false or auto, got 'maybe'"),
        ("quantize=int2", "error: quantize must be int8, int4, or null: the weights as stored"),
    ],
)
def test_bad_settings_are_one_line_errors(run_dir, sample_cfg, capsys, override, message):
    err = errors_of(sample_cfg(f"checkpoint={run_dir}", *override.split()), capsys)
    assert message in err


def test_the_default_checkpoint_is_named_on_stderr_and_sweeps_are_not_considered(
    run_dir, sample_cfg, tmp_path, monkeypatch, capsys
):
    """The newest run under outputs/ is used and named; a newer one under multirun/ is not."""
    work = tmp_path / "work"
    (work / "outputs" / "2025-01-01").mkdir(parents=True)
    run_dir.rename(work / "outputs" / "2025-01-01" / "12-00-00")
    swept = work / "multirun" / "2025-01-02" / "09-00-00" / "0" / "checkpoints" / "best"
    torch.manual_seed(1)
    save_checkpoint(
        swept,
        GPT(GPTConfig(vocab_size=50257, block_size=8, n_layer=1, n_head=1, n_embd=8)),
        {"data": {"tokenizer": "gpt2"}},
        {},
    )
    monkeypatch.chdir(work)
    run(sample_cfg("max_new_tokens=1"))
    expected = work / "outputs" / "2025-01-01" / "12-00-00" / "checkpoints" / "best"
    assert capsys.readouterr().err.splitlines()[0] == (
        f"checkpoint: {expected} (the newest run under ./outputs)"
    )


@pytest.mark.parametrize("prompt, warned", [("", True), ("Hello", True), ("'a b c'", False)])
def test_an_attention_plot_of_a_one_token_prompt_is_warned_about(
    run_dir, sample_cfg, tmp_path, capsys, prompt, warned
):
    overrides = [
        f"checkpoint={run_dir}",
        "max_new_tokens=0",
        f"attention_plot={tmp_path / 'a.png'}",
    ]
    run(sample_cfg(*overrides, f"prompt={prompt}"))
    assert ("warning: the prompt is one token" in capsys.readouterr().err) is warned
