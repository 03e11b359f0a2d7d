"""The chat template and conversation data (data/chat.py): the ids every tokenizer gives, the
assistant mask the loss uses, the plays' conversations, and prepared chat splits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch

from data.chat import CHAT_TEMPLATE, IM_END, IM_START, chat_tokenizer, play_conversations, render
from data.loader import _windows
from data.pipeline import MIN_DOCS_PER_PROC, prepare_data
from data.sources import VAL_PLAYS, load_chat_plays, play_files
from data.tokenizer import get_tokenizer, train_bpe
from model import GPT
from tests.conftest import ROOT, TEXT, TRICKY, tiny_config

CONVERSATION = [
    {"role": "system", "content": "You are HAMLET, answering HORATIO."},
    {"role": "user", "content": "Hail to your lordship! Καλημέρα, 世界"},
    {
        "role": "assistant",
        "content": "I am glad to see you well:\nHoratio,--or I do forget myself.",
    },
    {"role": "user", "content": " émigré 🎭 naïve?"},
    {"role": "assistant", "content": "  The same, my lord, and your poor servant ever."},
]


def base_tokenizer(name: str):
    if name == "bpe-300":
        return train_bpe([TEXT, *TRICKY], 300)[0].encoding()
    return get_tokenizer(name)


@pytest.mark.parametrize("name", ["gpt2", "bytes", "bpe-300"])
def test_template_ids_are_the_rendered_text_encoded(name: str) -> None:
    base = base_tokenizer(name)
    tokenizer = chat_tokenizer(base)
    start, end = tokenizer.encode_single_token(IM_START), tokenizer.encode_single_token(IM_END)
    assert (start, end, tokenizer.n_vocab) == (base.n_vocab, base.n_vocab + 1, base.n_vocab + 2)
    assert tokenizer.encode_ordinary(TEXT) == base.encode_ordinary(TEXT)  # text encodes as before
    for prompt in (False, True):
        ids, _ = render(CONVERSATION, tokenizer, generation_prompt=prompt)
        text = jinja2.Template(CHAT_TEMPLATE).render(
            messages=CONVERSATION, add_generation_prompt=prompt
        )
        assert text.startswith("<|im_start|>system\nYou are HAMLET")
        assert text.endswith("<|im_start|>assistant\n" if prompt else "ever.<|im_end|>\n")
        assert tokenizer.decode(ids) == text
        assert ids == tokenizer.encode(text, allowed_special={IM_START, IM_END})


@pytest.mark.parametrize("name", ["gpt2", "bytes", "bpe-300"])
def test_the_mask_holds_the_replies_and_their_ends_alone(name: str) -> None:
    tokenizer = chat_tokenizer(base_tokenizer(name))
    ids, mask = render(CONVERSATION, tokenizer, generation_prompt=False)
    picked = [token for token, counted in zip(ids, mask, strict=True) if counted]
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert tokenizer.decode(picked) == "".join(f"{reply}{IM_END}" for reply in replies)


def test_only_assistant_targets_change_the_loss() -> None:
    tokenizer = chat_tokenizer(get_tokenizer("bytes"))
    ids, mask = render(CONVERSATION, tokenizer, generation_prompt=False)
    tokens, mask = np.array(ids), np.array(mask, dtype=np.uint8)
    starts, length = np.array([0]), len(ids) - 1
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=tokenizer.n_vocab, block_size=length))
    x, y = _windows(tokens, starts, length, mask)
    _, loss = model(x, y)

    def loss_with(targets_changed_at: np.ndarray) -> torch.Tensor:
        other = tokens.copy()
        other[targets_changed_at] = (other[targets_changed_at] + 1) % 256
        return model(x, _windows(other, starts, length, mask)[1])[1]  # the same inputs x

    positions = np.arange(1, len(ids))
    context = positions[mask[1:] == 0]  # system, user, headers, line breaks
    assert torch.equal(loss_with(context), loss)
    assert not torch.equal(loss_with(positions[mask[1:] == 1][:1]), loss)


def test_play_conversations_are_replies_within_a_scene() -> None:
    macbeth = play_files()["macbeth"].read_text(encoding="utf-8")
    first = next(play_conversations(macbeth))
    assert [m["role"] for m in first] == ["system", "user", "assistant"]
    assert [m["content"] for m in first] == [
        "This is Macbeth. You are Second Witch, answering First Witch.",
        "When shall we three meet again\nIn thunder, lightning, or in rain?",
        "When the hurlyburly's done,\nWhen the battle's lost and won.",
    ]
    lines = [
        line for c in play_conversations(macbeth) for m in c for line in m["content"].split("\n")
    ]
    assert lines and not [line for line in lines if line.startswith("_") or line.endswith("_")]


def test_chat_plays_hold_out_whole_plays() -> None:
    splits = load_chat_plays({})
    titles = {p.read_text(encoding="utf-8").split("\n", 1)[0][2:] for n, p in play_files().items()
              if n in VAL_PLAYS}  # fmt: skip
    said_in = {
        split: {c[0]["content"].split(". You are")[0][len("This is ") :] for c in ds["messages"]}
        for split, ds in splits.items()
    }
    assert said_in["val"] == titles and not said_in["train"] & titles
    assert len(splits["train"]) > 20_000


def test_prepared_chat_data_has_the_mask_and_the_template(chat_corpus: list[str]) -> None:
    files = {k.split("=")[0]: k.split("=")[1] for k in chat_corpus}
    data = prepare_data(
        {"name": "chat", "train_files": files["data.train_files"][1:-1],
         "val_files": files["data.val_files"][1:-1], "cache_dir": files["data.cache_dir"]},
        verbose=False,
    )  # fmt: skip
    tokenizer = data.tokenizer()
    assert data.chat_template == "chatml" and data.vocab_size == tokenizer.n_vocab == 50259
    lines = Path(files["data.val_files"][1:-1]).read_text().splitlines()
    conversations = [json.loads(line)["messages"] for line in lines]
    expected = [render(c, tokenizer, generation_prompt=False) for c in conversations]
    assert data.tokens("val").tolist() == [t for ids, _ in expected for t in ids]
    assert data.mask("val").tolist() == [int(m) for _, mask in expected for m in mask]
    replies = [m["content"] for c in conversations for m in c if m["role"] == "assistant"]
    assert data.meta["splits"]["val"]["bytes"] == len("".join(replies).encode())


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def prepare(tmp_path: Path, train: Path, val: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "data.prepare", "data=chat", f"data.train_files=[{train}]",
         f"data.val_files=[{val}]", f"data.cache_dir={tmp_path / 'cache'}"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip


def test_bad_conversations_are_skipped_and_counted(tmp_path: Path) -> None:
    good = {"messages": CONVERSATION}
    bad = [
        {"messages": [{"role": "tool", "content": "x"}, *CONVERSATION[2:3]]},
        {"messages": [{"role": "user", "content": "  "}, *CONVERSATION[2:3]]},
        {"messages": CONVERSATION[:2]},
        {"messages": CONVERSATION[:2]},
        {"messages": [{"role": "user", "content": 5}, *CONVERSATION[2:3]]},  # issue 50 item 13:
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
        {"messages": "a string"},  # stopped the preparation; now skipped as the two above are
    ]
    # OpenAI's newer content, text parts, as the server takes it (issue 55: it was skipped)
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATION]
    enc = chat_tokenizer(get_tokenizer("gpt2"))
    assert render(parts, enc, False) == render(CONVERSATION, enc, False)  # the same tokens
    train = write_jsonl(tmp_path / "train.jsonl", [good, *bad, good, {"messages": parts}])
    proc = prepare(tmp_path, train, write_jsonl(tmp_path / "val.jsonl", [good]))
    assert proc.returncode == 0, proc.stderr
    assert (
        "chat/train: 7 conversations skipped: 1 with a message without a string content (or "
        "text parts), 1 with a role other than system, user, assistant, 1 with an empty "
        "content, 1 with messages that are not a list, 3 with no assistant turn"
    ) in proc.stdout
    assert json.loads(proc.stdout.splitlines()[-1])["train"]["documents"] == 3


def test_a_log_gets_no_map_progress_bar(tmp_path: Path) -> None:
    """Issue 50 item 17: a split of MIN_DOCS_PER_PROC conversations or more is tokenized through
    datasets.map, whose "Map:" bar landed in a log (stderr not a terminal, as here) as one long
    line of carriage returns."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"messages": CONVERSATION}] * MIN_DOCS_PER_PROC)
    proc = prepare(
        tmp_path, train, write_jsonl(tmp_path / "val.jsonl", [{"messages": CONVERSATION}])
    )
    assert proc.returncode == 0, proc.stderr
    assert f'"documents": {MIN_DOCS_PER_PROC}' in proc.stdout and "Map" not in proc.stderr


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["{not json"], "train.jsonl:2: not JSON"),
        ([{"text": "hello"}], 'train.jsonl:2: not {"messages": [{"role": ..., "content": ...}'),
        (["[1, 2]"], "train.jsonl:2: not"),
        ([{"messages": CONVERSATION[:2]}], "no conversations that can be trained on (0 documents; "
         "2 conversations skipped: 2 with no assistant turn)"),
    ],
)  # fmt: skip
def test_bad_conversation_files_are_one_line_and_leave_nothing(tmp_path, rows, message) -> None:
    first = {"messages": CONVERSATION[:2]} if "skipped" in message else {"messages": CONVERSATION}
    train = write_jsonl(tmp_path / "train.jsonl", [first, *rows])
    proc = prepare(
        tmp_path, train, write_jsonl(tmp_path / "val.jsonl", [{"messages": CONVERSATION}])
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cache").exists()  # nothing left, not even an empty folder


def test_the_smol_smoltalk_config_reads_its_columns_from_local_parquet(tmp_path: Path) -> None:
    """configs/data/smol_smoltalk.yaml on local files of the hub dataset's shape (columns
    `messages` and `source`, splits train and test), as a user without the hub would run it."""
    from datasets import Dataset

    files = {}
    for split, n in (("train", 3), ("test", 1)):
        rows = {"messages": [CONVERSATION] * n, "source": ["smol-magpie-ultra"] * n}
        files[split] = str(tmp_path / f"{split}.parquet")
        Dataset.from_dict(rows).to_parquet(files[split])
    cfg = {"name": "smol_smoltalk", "path": "parquet", "data_files": files}
    data = prepare_data({**cfg, "cache_dir": str(tmp_path / "cache")}, verbose=False)
    ids, mask = render(CONVERSATION, data.tokenizer(), generation_prompt=False)
    assert data.tokens("train").tolist() == ids * 3 and data.mask("val").tolist() == mask
    for split in files:  # another dataset's column name: data.messages_field
        Dataset.from_dict({"chat": [CONVERSATION]}).to_parquet(files[split])
    cfg |= {"messages_field": "chat", "cache_dir": str(tmp_path / "cache")}
    assert prepare_data(cfg, verbose=False).tokens("train").tolist() == ids


def test_the_packing_benchmark_measures_padding_and_truncation(chat_corpus, tmp_path) -> None:
    """A row of one token is never padding and cuts every conversation; a row longer than any
    conversation cuts none; the token count is the prepared split's."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_chat_packing.py"), *chat_corpus,
         "--blocks", "1", "100000"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    files = dict(arg.split("=", 1) for arg in chat_corpus[1:])
    cfg = {"name": "chat", "cache_dir": files["data.cache_dir"]}
    cfg |= {key: files[f"data.{key}"][1:-1] for key in ("train_files", "val_files")}
    tokens = len(prepare_data(cfg, verbose=False).tokens("train"))
    assert f"chat/train: 300 conversations, {tokens:,} tokens" in proc.stdout
    assert "| 1 | 0.0% | 100.0% |" in proc.stdout
    assert "| 100000 |" in proc.stdout and proc.stdout.rstrip().endswith("| 0.0% | 0.0% |")


def test_a_damaged_mask_is_never_used(chat_corpus, capsys) -> None:
    """The mask is verified as the token files are: a flipped byte is named, then rebuilt."""
    files = dict(arg.split("=", 1) for arg in chat_corpus[1:])
    cfg = {"name": "chat", "cache_dir": files["data.cache_dir"]}
    cfg |= {key: files[f"data.{key}"][1:-1] for key in ("train_files", "val_files")}
    data = prepare_data(cfg, verbose=False)
    path, good = data.dir / "val.mask.bin", data.mask("val").tolist()
    damaged = bytearray(path.read_bytes())
    damaged[7] ^= 1
    path.write_bytes(bytes(damaged))
    again = prepare_data(cfg, verbose=False)
    assert f"{path} fails its sha256 check" in capsys.readouterr().err
    assert again.mask("val").tolist() == good


@pytest.mark.parametrize("suffix", [".json", ".parquet"])
def test_conversations_in_a_json_list_or_parquet(tmp_path: Path, suffix: str) -> None:
    """data=chat reads a JSON list of {"messages": [...]} or parquet rows as it reads JSON lines;
    without val_files a seeded val_fraction of the conversations is held out."""
    from datasets import Dataset

    rows = [{"messages": CONVERSATION[:3]}] * 9 + [{"messages": CONVERSATION}]
    path = tmp_path / f"chats{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        Dataset.from_list(rows).to_parquet(str(path))
    cfg = {"name": "chat", "train_files": [str(path)], "val_fraction": 0.2}
    data = prepare_data({**cfg, "cache_dir": str(tmp_path / "cache")}, verbose=False)
    splits = data.meta["splits"]
    assert (splits["train"]["documents"], splits["val"]["documents"]) == (8, 2)
    tokenizer = data.tokenizer()
    every = sum(len(render(r["messages"], tokenizer, generation_prompt=False)[0]) for r in rows)
    assert splits["train"]["tokens"] + splits["val"]["tokens"] == every
