"""Evaluation scores every token exactly once and reports loss in nats and bits per byte."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evals import loss as eval_loss
from evals.loss import evaluate, sliding_windows
from hardware.device import Precision
from model import GPT
from tests.conftest import run_script, save_tiny_checkpoint, tiny_config
from trainer.reporting import METRICS_FILE, read_metrics

CPU = Precision(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("n, block, stride", [(23, 8, 3), (40, 8, 8), (9, 8, 1), (5, 8, 4)])
def test_sliding_windows_score_each_token_once_with_the_right_target(n, block, stride):
    tokens = np.arange(n)  # token value == position: a target is right iff it is x + 1
    scored = []
    for x, y in sliding_windows(tokens, block, stride, batch_size=3):
        keep = y != -1
        assert torch.equal(y[keep], x[keep] + 1)
        scored += y[keep].tolist()
    assert sorted(scored) == list(range(1, n))


def test_loss_is_the_mean_over_every_token_and_bpb_follows():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    tokens = np.random.default_rng(0).integers(0, 101, 70)
    result = evaluate(model, tokens, nbytes=2 * 69, batch_size=2, precision=CPU)
    with torch.no_grad():
        losses = []
        for start in range(0, 69, 16):  # non-overlapping windows, the last one short
            x = torch.tensor(tokens[start : min(start + 16, 69)])[None]
            y = torch.tensor(tokens[start + 1 : min(start + 17, 70)])[None]
            losses.append(F.cross_entropy(model(x)[0][0], y[0], reduction="none"))
    expected = torch.cat(losses).mean().item()
    assert result.tokens == 69
    assert result.loss == pytest.approx(expected, rel=1e-6)
    # the first token (<|endoftext|>: no bytes) is never predicted: 69 tokens span the bytes
    assert result.bpb == pytest.approx(expected / math.log(2) / 2, rel=1e-6)


def test_a_split_shorter_than_one_window_is_scored_whole_and_as_a_subset():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()  # block_size 16
    tokens = np.random.default_rng(3).integers(0, 101, 10)
    with torch.no_grad():
        x, y = torch.tensor(tokens[None, :-1]), torch.tensor(tokens[1:])
        expected = F.cross_entropy(model(x)[0][0], y).item()
    for result in (evaluate(model, tokens, 9, 4, CPU), evaluate(model, tokens, 9, 4, CPU, 1)):
        assert result.tokens == 9
        assert result.loss == pytest.approx(expected, rel=1e-6)
        assert result.bpb == pytest.approx(expected / math.log(2), rel=1e-6)  # a byte a token


def test_the_loss_is_the_same_whatever_the_windows_per_forward(monkeypatch):
    """Evaluation caps the logits of a forward (MAX_LOGITS): one window per forward (the cap
    below one window's logits) scores what the whole batch in one forward scores."""
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    tokens = np.random.default_rng(2).integers(0, 101, 97)
    whole = evaluate(model, tokens, 96, 4, CPU, max_batches=1)
    monkeypatch.setattr(eval_loss, "MAX_LOGITS", 1)
    assert evaluate(model, tokens, 96, 4, CPU, max_batches=1).loss == pytest.approx(whole.loss)
    assert whole.tokens == 4 * 16  # max_batches counts batches of batch_size windows


def test_stride_equal_to_block_size_is_the_non_overlapping_method():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    tokens = np.random.default_rng(1).integers(0, 101, 97)
    plain = evaluate(model, tokens, 96, 4, CPU)
    strided = evaluate(model, tokens, 96, 4, CPU, stride=16)
    assert strided.tokens == plain.tokens == 96
    assert strided.loss == pytest.approx(plain.loss, rel=1e-6)


def test_evaluate_py_prints_one_json_line(trained_run, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Friends, Romans, countrymen, lend me your ears. " * 20)
    result = run_script(
        "evaluate.py", f"checkpoint={trained_run}", f"text_file={text}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr  # no Python warning (run_script shows them all)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["bytes"] == len(text.read_bytes()) and out["tokens"] > 100
    assert out["method"] == "non-overlapping windows"
    assert out["bpb"] == pytest.approx(
        out["loss"] * out["tokens"] / out["bytes"] / math.log(2), rel=1e-3
    )


def test_evaluate_py_on_the_validation_split(trained_run, tmp_path):
    result = run_script("evaluate.py", f"checkpoint={trained_run}", "stride=16", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["data"] == "text/val" and out["method"] == "sliding windows, stride 16"


def test_evaluate_py_gives_the_runs_own_final_bits_per_byte(trained_run, tmp_path):
    """The same number for the same checkpoint and split, whoever computes it (they once
    differed by N / (N - 1): training divided the split's bytes by all its tokens)."""
    result = run_script("evaluate.py", f"checkpoint={trained_run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    final = read_metrics(trained_run / METRICS_FILE)[-1]
    assert out["loss"] == pytest.approx(final["final_val_loss"], abs=1e-5)
    assert out["bpb"] == pytest.approx(final["final_val_bpb"], abs=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["checkpoint=/no/such/run"], "error: no checkpoint found at /no/such/run"),
        (["text_file=bad.txt"], "error: text_file bad.txt is not UTF-8"),
        (["stride=0"], "error: stride must be"),
        (["text_file=empty.txt"], "error: text_file empty.txt is empty"),
        (["batch_size=0"], "error: batch_size must be a positive integer, got 0"),  # was run
    ],
)
def test_evaluate_py_bad_input(trained_run, tmp_path, args, message):
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe not utf-8")
    (tmp_path / "empty.txt").write_bytes(b"")
    if not args[0].startswith("checkpoint"):
        args.append(f"checkpoint={trained_run}")
    result = run_script("evaluate.py", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(message) and "Traceback" not in result.stderr


def test_a_chat_split_scores_its_assistant_tokens_alone():
    """With a mask, only assistant targets count, each once, with its window's context; windows
    without one (here most) add nothing, not a NaN; bpb spreads nbytes over the scored tokens."""
    torch.manual_seed(0)
    model = GPT(tiny_config(block_size=8)).eval()
    tokens = np.arange(41) % 101
    mask = np.zeros(41, dtype=np.uint8)
    mask[[3, 4, 5, 30, 31, 40]] = 1
    result = evaluate(model, tokens, 60, batch_size=2, precision=CPU, mask=mask)
    nats = 0.0
    with torch.no_grad():
        for t in np.flatnonzero(mask):  # target t, predicted from its window's start to t - 1
            start = (t - 1) // 8 * 8
            logits = model(torch.from_numpy(tokens[None, start:t]))[0][0, -1]
            nats -= F.log_softmax(logits, -1)[tokens[t]].item()
    assert result.tokens == 6 and result.loss == pytest.approx(nats / 6, rel=1e-5)
    assert result.bpb == pytest.approx(nats / (60 * math.log(2)), rel=1e-5)


def test_evaluate_py_scores_a_base_and_a_chat_checkpoint_on_ones_own_conversations(
    tmp_path, chat_corpus
):
    """Issue 50 item 10: dataset=chat needed data.train_files, which evaluate.py refused (no
    data.* keys); `data=chat data.val_files=[...]` scores the file's assistant tokens, before
    chat fine-tuning (a base model, given the template's tokens) and after."""
    _, val_files, cache_dir = chat_corpus[1:]
    lines = Path(val_files.removeprefix("data.val_files=[")[:-1]).read_text().splitlines()
    conversations = [json.loads(line)["messages"] for line in lines]
    replies = [m["content"] for c in conversations for m in c if m["role"] == "assistant"]
    base, _ = save_tiny_checkpoint(tmp_path / "base")
    chat, _ = save_tiny_checkpoint(
        tmp_path / "chat", meta={"chat_template": "chatml"}, vocab_size=50259
    )
    for checkpoint in (base, chat):
        args = "data=chat", val_files, cache_dir  # no data.train_files: the val split alone
        result = run_script("evaluate.py", f"checkpoint={checkpoint}", *args, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout.strip().splitlines()[-1])
        assert out["data"] == "chat/val" and out["bytes"] == len("".join(replies).encode())
        assert out["tokens"] >= len(replies) and math.isfinite(out["bpb"])
    both = run_script("evaluate.py", f"checkpoint={chat}", "dataset=chat", *args, cwd=tmp_path)
    assert both.returncode == 2 and both.stderr.startswith("error: give dataset=<name> or data=")
