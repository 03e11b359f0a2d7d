"""Downstream tasks: items built and tokenized as lm-evaluation-harness builds them, scores equal
to a direct forward of each whole sequence, metrics as the harness aggregates them, and one
`error:` line for every kind of bad task input."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from base.errors import ConfigError, DataError
from data.tokenizer import get_tokenizer
from evals.tasks import (
    encode_pair,
    load_task,
    requested_tasks,
    score_choices,
    score_task,
    task_config,
)
from model import GPT
from tests.conftest import (
    ARC,
    CPU,
    GPT2,
    HELLASWAG,
    LAMBADA,
    TASKS,
    TINY,
    local_task,
    make_trainer,
    model_for,
    run_script,
    write_jsonl,
)
from trainer.reporting import METRICS_FILE, read_metrics


def test_items_are_the_harness_prompts(tmp_path):
    hellaswag = load_task(local_task(tmp_path, "hellaswag"), GPT2, 64)
    arc = load_task(local_task(tmp_path, "arc_easy"), GPT2, 64)
    lambada = load_task(local_task(tmp_path, "lambada"), GPT2, 64)
    decode = GPT2.decode
    # "<activity_label>: <ctx_a> <Ctx_b>"; WikiHow's " [title]" becomes ". ", other brackets go.
    assert (
        decode(hellaswag.items[0].context) == "Roof shingle removal: A man is sitting on a roof. He"
    )
    assert decode(hellaswag.items[1].context) == (
        "Personal Care and Style: How to dye your hair with kool aid. Choose a color."
    )
    # An ending that starts with a bracket keeps the space after it (the harness's quirk).
    assert [decode(c) for c in hellaswag.items[1].choices] == [
        "  Kool aid comes in many flavors and colors.",
        "  Wash your hair the night before.",
        " You can buy kool aid at any store.",
        "  Pick a bright shade.",
    ]
    assert [i.gold for i in hellaswag.items] == [3, 0, 3]
    assert decode(arc.items[0].context).endswith("increase in rotation?\nAnswer:")
    assert decode(arc.items[0].context).startswith("Question: An astronomer")
    assert [i.gold for i in arc.items] == [2, 0]
    assert len(arc.items[1].choices) == 3
    assert decode(lambada.items[0].choices[0]) == " signs"  # the last word, after its space
    assert decode(lambada.items[1].context).endswith("leading her to the")
    # acc_norm divides by the choice's characters, without the delimiter
    assert arc.items[1].chars == [len("cellular telephone"), len("television"), len("refrigerator")]


def test_pairs_are_encoded_whole_and_split_where_the_context_ends():
    # Trailing spaces move to the continuation: the whole pair's tokens after the context's.
    assert encode_pair(GPT2, "Answer: ", "yes") == (GPT2.encode("Answer:"), GPT2.encode("  yes"))
    assert encode_pair(GPT2, "", "yes") == ([GPT2.eot_token], GPT2.encode(" yes"))
    ctx, cont = encode_pair(GPT2, "It was 19", "99")  # the digits would merge: split after ctx
    assert ctx == GPT2.encode("It was 19") and ctx + cont == GPT2.encode("It was 19 99")


def direct_scores(model: GPT, item) -> tuple[list[float], list[bool]]:
    """Each choice scored by one plain forward of its whole sequence, cut to block_size + 1."""
    lls, greedy = [], []
    for c in item.choices:
        seq = torch.tensor((item.context + c)[-(model.config.block_size + 1) :])
        logits, _ = model(seq[None, :-1])
        logprobs = F.log_softmax(logits[0, -len(c) :], dim=-1)
        lls.append(logprobs.gather(1, torch.tensor(c)[:, None]).sum().item())
        greedy.append(logprobs.argmax(-1).tolist() == c)
    return lls, greedy


# The smaller blocks cut the contexts, each choice's differently.
@pytest.mark.parametrize("tokenizer, block_size", [("gpt2", 64), ("gpt2", 20), ("bytes", 64)])
@pytest.mark.parametrize("options", [{}, {"pos_embedding": "rope", "attention": "sdpa"}])
@pytest.mark.parametrize("name", list(TASKS))
def test_scores_equal_a_direct_forward_of_each_whole_sequence(
    tmp_path, name, tokenizer, block_size, options
):
    model = model_for(block_size, get_tokenizer(tokenizer), **options)
    task = load_task(local_task(tmp_path, name), get_tokenizer(tokenizer), block_size)
    expected = {"acc": 0.0, "acc_norm": 0.0, "ll": 0.0}
    for item in task.items:
        lls, greedy = score_choices(model, item, CPU)
        want_lls, want_greedy = direct_scores(model, item)
        assert lls == pytest.approx(want_lls, abs=1e-4)
        assert greedy == want_greedy
        norm = [ll / n for ll, n in zip(want_lls, item.chars, strict=True)]
        hit = want_greedy[0] if name == "lambada" else want_lls.index(max(want_lls)) == item.gold
        expected["acc"] += hit / len(task.items)
        expected["acc_norm"] += (norm.index(max(norm)) == item.gold) / len(task.items)
        expected["ll"] += want_lls[item.gold] / len(task.items)
    metrics = score_task(model, task, CPU)
    assert metrics["items"] == len(task.items)
    assert metrics["acc"] == pytest.approx(expected["acc"])
    p, n = expected["acc"], len(task.items)
    assert metrics["acc_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))
    if name == "lambada":
        assert metrics["perplexity"] == pytest.approx(math.exp(-expected["ll"]), rel=1e-4)
    else:
        assert metrics["acc_norm"] == pytest.approx(expected["acc_norm"])


def test_a_trained_preference_is_found(tmp_path):
    """A model that always predicts token t: the one choice made of t alone wins acc and acc."""
    model = model_for()
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[GPT2.encode(" the")[0]] = 1.0
        model.transformer.ln_f.weight.fill_(0.0)
        model.transformer.ln_f.bias.fill_(1.0)  # every position's hidden state is all ones
    rows = [{**ARC[1], "choices": {"text": ["cat", "the", "dog"], "label": ["1", "2", "3"]},
             "answerKey": "2"}]  # fmt: skip
    metrics = score_task(model, load_task(local_task(tmp_path, "arc_easy", rows), GPT2, 64), CPU)
    assert metrics["acc"] == 1.0 and metrics["acc_norm"] == 1.0


def test_limit_and_the_task_list():
    cfgs = requested_tasks({"limit": 7}, ["arc_easy", "lambada"])
    assert [c["name"] for c in cfgs] == ["arc_easy", "lambada"]
    assert all(c["limit"] == 7 for c in cfgs)
    one = {**task_config("hellaswag"), "limit": 3}
    assert requested_tasks(one, []) == [one]


@pytest.mark.parametrize(
    "name, rows, message",
    [
        ("hellaswag", [{**HELLASWAG[0], "endings": None}], "item 0 is malformed"),
        ("arc_easy", [{k: v for k, v in ARC[0].items() if k != "question"}], "no field question"),
        ("hellaswag", [{**HELLASWAG[0], "label": "4"}], "label 4, out of range for 4 choices"),
        ("hellaswag", [{**HELLASWAG[0], "label": ""}], "item 0 is malformed"),
        ("arc_easy", [{**ARC[0], "answerKey": "E"}], "item 0 is malformed"),
    ],
)  # fmt: skip
def test_bad_items_are_named(tmp_path, name, rows, message):
    with pytest.raises(DataError, match=message):
        load_task(local_task(tmp_path, name, rows), GPT2, 64)


def test_a_bad_limit_and_an_empty_or_unknown_file_are_one_line_each(tmp_path):
    task = local_task(tmp_path, "hellaswag")
    for limit in (0, -1, "abc"):  # 0 items once crashed the scoring (IndexError)
        with pytest.raises(ValueError, match="task.limit must be a positive integer"):
            load_task({**task, "limit": limit}, GPT2, 64)
    (tmp_path / "items.txt").write_text("x")  # once looked up on the hub as a dataset "txt"
    with pytest.raises(DataError, match="items.txt is not a .jsonl, .json or .parquet file"):
        load_task({**task, "data_files": str(tmp_path / "items.txt")}, GPT2, 64)


def test_a_choice_longer_than_the_block_is_refused(tmp_path):
    with pytest.raises(
        DataError, match="item 0 has a choice of 11 tokens, more than the model.s block_size 8"
    ):
        load_task(local_task(tmp_path, "hellaswag"), GPT2, 8)


def test_an_unknown_task_names_the_known_ones():
    with pytest.raises(ConfigError, match="unknown task 'hellaswagg'; choose one of: arc_easy"):
        task_config("hellaswagg")


def test_a_task_the_hub_cannot_give_says_how_to_use_a_local_copy():
    """The suite runs with the hub offline (tests/conftest.py), as a machine without it."""
    with pytest.raises(DataError) as caught:
        load_task(task_config("hellaswag"), GPT2, 64)
    message = str(caught.value)
    assert message.startswith("task hellaswag: could not load 'Rowan/hellaswag'")
    assert "without the network, score a local copy of the items: task.data_files=<file>" in message
    assert "docs/evaluation.md" in message and "data.path" not in message  # train.py's hint: not


def test_evaluate_py_scores_a_task(tmp_path, hf_gpt2_dir):
    file = write_jsonl(tmp_path / "hs.jsonl", HELLASWAG)
    args = [
        f"checkpoint={hf_gpt2_dir}",
        "task=hellaswag",
        f"task.data_files={file}",
        "task.limit=2",
    ]
    done = run_script("evaluate.py", *args, "device=cpu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"hellaswag: 2 items from {file}"  # the plan, before the work
    assert "2 of 2 items" in lines  # progress as plain lines off a terminal
    assert lines[-2].startswith("hellaswag: acc ") and "±" in lines[-2]
    assert lines[-2].endswith("(2 items)")
    result = json.loads(lines[-1])["tasks"]["hellaswag"]
    assert result["items"] == 2 and set(result) >= {"acc", "acc_stderr", "acc_norm"}
    one = run_script("evaluate.py", *args[:-1], "task.limit=1", "device=cpu", cwd=tmp_path)
    assert one.stdout.splitlines()[-2].endswith("(1 item)")  # no "± nan" with a single item
    summary = one.stdout.splitlines()[-1]
    assert "NaN" not in summary  # strict JSON parsers reject NaN
    assert json.loads(summary)["tasks"]["hellaswag"]["acc_stderr"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["task=nope"], "task=nope is not in configs/task/"),
        (["tasks=[nope]"], "unknown task 'nope'"),
        (["tasks=[nope.yaml]"], "task file nope.yaml not found"),
        (["task=arc_easy", "task.data_files={bad}"], "the items have no field question"),
    ],
)
def test_evaluate_py_refuses_bad_tasks_in_one_line(tmp_path, hf_gpt2_dir, args, message):
    bad = write_jsonl(tmp_path / "bad.jsonl", LAMBADA)
    args = [a.format(bad=bad) for a in args]
    done = run_script("evaluate.py", f"checkpoint={hf_gpt2_dir}", *args, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("error:") == 1 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing written


def test_training_scores_its_tasks_at_each_evaluation(tmp_path, corpus, capsys):
    items = write_jsonl(tmp_path / "hs.jsonl", HELLASWAG)
    task = tmp_path / "hs.yaml"  # a task file of one's own: hellaswag's on a local file
    task.write_text(json.dumps({**task_config("hellaswag"), "data_files": str(items)}))
    trainer = make_trainer(
        tmp_path / "run", corpus, f"train.eval_tasks=[{task}]", "train.eval_task_items=2"
    )
    trainer.run()
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / METRICS_FILE)}
    evaluated = [step for step, row in rows.items() if "val_loss" in row]
    assert evaluated == [6, 12]
    for step in evaluated:  # the same 2 items each time, so the accuracies are k / 2
        assert rows[step]["hellaswag_acc"] in (0.0, 0.5, 1.0)
        assert set(rows[step]) >= {"hellaswag_acc_norm", "hellaswag_acc_stderr"}
    assert "step 6 | hellaswag: acc " in capsys.readouterr().out


def test_an_unknown_training_task_fails_before_the_run_dir(tmp_path, corpus):
    done = run_script("train.py", *TINY, *corpus, "train.eval_tasks=[hellaswagg]", cwd=tmp_path)
    assert done.returncode == 2 and "unknown task 'hellaswagg'" in done.stderr, done.stderr
    assert not (tmp_path / "outputs").exists()
