"""A chat model's exports: transformers' apply_chat_template gives our ids and its greedy
generate our reply; the GGUF carries the template and the special tokens."""

from __future__ import annotations

import gguf
import pytest

from checkpoints.store import load_checkpoint
from data.chat import CHAT_TEMPLATE, IM_END, IM_START, generation_prompt, render
from data.tokenizer import load_tokenizer, parse_tokenizer
from tests.checkpoints.test_llamacpp import export_gguf, field
from tests.conftest import TEXT, TRICKY, save_tiny_checkpoint
from tests.data.test_chat import CONVERSATION
from tests.inference.test_chat import MESSAGES, as_file, sample_chat, save_chat_model

transformers = pytest.importorskip("transformers")


def export(tmp_path, path):
    from checkpoints.export import export_checkpoint

    return export_checkpoint({"checkpoint": str(path), "out": str(tmp_path / "out")})


def chat_checkpoint(tmp_path, name: str):
    vocab = parse_tokenizer(name) or load_tokenizer(name).n_vocab
    meta = {"chat_template": "chatml"}
    return save_tiny_checkpoint(tmp_path, meta, tokenizer=name, vocab_size=vocab + 2)[0]


@pytest.mark.parametrize("name", ["gpt2", "bytes", "bpe-300"])
def test_apply_chat_template_gives_our_ids(tmp_path, name):
    path = chat_checkpoint(tmp_path, name)
    theirs = transformers.AutoTokenizer.from_pretrained(export(tmp_path, path))
    ours = load_checkpoint(path).tokenizer()
    for prompt in (False, True):
        ids = theirs.apply_chat_template(CONVERSATION, add_generation_prompt=prompt, tokenize=False)
        assert ids == render_text(prompt)
        encoded = theirs.apply_chat_template(
            CONVERSATION, add_generation_prompt=prompt, tokenize=True, return_dict=True
        )["input_ids"]
        assert encoded == render(CONVERSATION, ours, generation_prompt=prompt)[0]
    assert theirs.convert_tokens_to_ids([IM_START, IM_END]) == [ours.n_vocab - 2, ours.n_vocab - 1]
    for text in [TEXT, *TRICKY]:  # plain text encodes as before
        assert theirs(text)["input_ids"] == ours.encode_ordinary(text), text


def render_text(prompt: bool) -> str:
    import jinja2

    return jinja2.Template(CHAT_TEMPLATE).render(
        messages=CONVERSATION, add_generation_prompt=prompt
    )


@pytest.mark.parametrize("ends_at_once", [False, True])
def test_greedy_generate_gives_our_reply(tmp_path, ends_at_once):
    run = save_chat_model(tmp_path / "run", ends_at_once=ends_at_once)
    out = export(tmp_path, run / "checkpoints" / "best")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    ours = load_checkpoint(run / "checkpoints" / "best").tokenizer()
    assert ids[0].tolist() == generation_prompt(MESSAGES, ours)
    new = model.generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1] :]
    reply = tokenizer.decode(new, skip_special_tokens=True)
    assert reply + "\n" == sample_chat(run, tmp_path, as_file(tmp_path, MESSAGES))
    assert (new[-1].item() == 50258) == ends_at_once  # stopped at <|im_end|>


def test_the_gguf_carries_the_template_and_its_tokens(tmp_path):
    reader = export_gguf(tmp_path, chat_checkpoint(tmp_path, "gpt2"))
    tokens, types = (
        field(reader, "tokenizer.ggml.tokens"),
        field(reader, "tokenizer.ggml.token_type"),
    )
    assert field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE
    assert tokens[50256:] == ["<|endoftext|>", IM_START, IM_END]
    assert types[50256:] == [gguf.TokenType.CONTROL] * 3 and types[50255] == gguf.TokenType.NORMAL
    assert field(reader, "tokenizer.ggml.eot_token_id") == 50258
    assert field(reader, "tokenizer.ggml.eos_token_id") == 50256
