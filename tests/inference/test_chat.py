"""Chat with a chat fine-tuned model: sample.py's one-shot and interactive forms, and the
server's /v1/chat/completions through the real `openai` client, equal to each other at
temperature 0; replies end at <|im_end|>; a base model is refused."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from checkpoints.store import load_source, save_checkpoint
from data.chat import render
from inference.server import Server
from model import GPT, GPTConfig
from tests.conftest import run_script
from tests.inference.conftest import request

MESSAGES = [
    {"role": "system", "content": "You are HAMLET, answering HORATIO."},
    {"role": "user", "content": "Hail to your lordship!"},
    {"role": "assistant", "content": "I am glad to see you well."},
    {"role": "user", "content": "The same, my lord. Καλημέρα 🎭"},
]
CHAT_META = {"tokenizer": "gpt2", "chat_template": "chatml"}


def save_chat_model(path, ends_at_once: bool = False):
    """A random chat model (GPT-2's vocabulary and the template's two tokens); `ends_at_once`:
    its head draws <|im_end|> (id 50258) at every position."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50259, block_size=128, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config.__class__(**{**config.to_dict(), "tie_embeddings": not ends_at_once}))
    if ends_at_once:  # every hidden state is ones after ln_f; only row 50258 sees them
        with torch.no_grad():
            model.transformer.ln_f.weight.zero_()
            model.transformer.ln_f.bias.fill_(1.0)
            model.lm_head.weight.normal_(0, 0.01)
            model.lm_head.weight[50258] = 1.0
    save_checkpoint(
        path / "checkpoints" / "best", model, {"data": {"tokenizer": "gpt2"}}, CHAT_META
    )
    return path


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("chat") / "run")


def serve(serve_in_process, run) -> openai.OpenAI:
    url = serve_url(serve_in_process, run)
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def serve_url(serve_in_process, run) -> str:
    ckpt = load_source(run, "cpu", attention="manual")  # as serve.py loads it
    limits = dict(max_batch=4, max_queue=4, max_tokens=64, max_n=4, max_body_bytes=100_000)
    limits |= dict(page_tokens=128, max_prompt_tokens=128, api_keys=[], max_request_tokens=8192)
    limits |= dict(body_timeout_s=60, max_connections=64, max_connections_per_client=64)
    server = Server(ckpt.model.eval(), ckpt.tokenizer(), "chat", limits, hosts=None)
    server.batcher.start()
    return serve_in_process(server)


def as_file(tmp_path, messages: list[dict]) -> str:
    path = tmp_path / f"messages-{len(list(tmp_path.glob('messages-*')))}.json"
    path.write_text(json.dumps(messages))
    return f"messages={path}"


def sample_chat(run, tmp_path, *args: str, **popen) -> str:
    proc = run_script(
        "sample.py", f"checkpoint={run}", "temperature=0", "max_new_tokens=12", "dtype=float32",
        *args, cwd=tmp_path, **popen,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_openai_client_gets_sample_pys_reply(serve_in_process, chat_run, tmp_path):
    client = serve(serve_in_process, chat_run)
    answer = client.chat.completions.create(
        model="chat", messages=MESSAGES, temperature=0, max_tokens=12
    )
    chunks = client.chat.completions.create(
        model="chat", messages=MESSAGES, temperature=0, max_tokens=12, stream=True
    )
    deltas = [chunk.choices[0].delta for chunk in chunks]
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert answer.object == "chat.completion" and answer.usage.completion_tokens == 12
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == choice.message.content
    reply = sample_chat(chat_run, tmp_path, as_file(tmp_path, MESSAGES))
    assert reply == choice.message.content + "\n"
    typed = sample_chat(chat_run, tmp_path, "'messages=[{role: user, content: Hail}]'".strip("'"))
    assert typed == sample_chat(
        chat_run, tmp_path, as_file(tmp_path, [MESSAGES[1] | {"content": "Hail"}])
    )


def test_choices_seeds_and_logprobs(serve_in_process, chat_run):
    client = serve(serve_in_process, chat_run)
    fields = dict(model="chat", messages=MESSAGES, max_tokens=5, n=2, seed=7, temperature=1.5)
    first = client.chat.completions.create(**fields, logprobs=True, top_logprobs=2)
    again = client.chat.completions.create(**fields)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.choices[0].message.content != first.choices[1].message.content
    for choice in first.choices:
        entries = choice.logprobs.content
        assert "".join(e.token for e in entries) == choice.message.content
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert again.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="needs logprobs: true") as raised:
        client.chat.completions.create(**fields, top_logprobs=2)  # without logprobs: OpenAI's 400
    assert raised.value.body["param"] == "top_logprobs"


def test_todays_openai_fields(serve_in_process, chat_run):
    """Issue 50 item 8, from the openai client: max_completion_tokens, content as text parts and
    a developer message get the reply to the same conversation in the older form; other parts,
    or two different token limits, are 400s that say so."""
    client = serve(serve_in_process, chat_run)
    older = client.chat.completions.create(
        model="chat", messages=MESSAGES, temperature=0, max_tokens=6
    )
    system, user, *rest = MESSAGES
    parts = [{"type": "text", "text": "Hail to your "}, {"type": "text", "text": "lordship!"}]
    newer = client.chat.completions.create(
        model="chat",
        messages=[{**system, "role": "developer"}, {**user, "content": parts}, *rest],
        temperature=0,
        max_completion_tokens=6,
    )
    assert newer.choices[0].message.content == older.choices[0].message.content
    assert newer.usage == older.usage and newer.usage.completion_tokens == 6
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]
    with pytest.raises(openai.BadRequestError, match="only text is supported"):
        client.chat.completions.create(model="chat", messages=[{**user, "content": image}])
    with pytest.raises(openai.BadRequestError, match="differ: give one") as raised:
        client.chat.completions.create(
            model="chat", messages=MESSAGES, max_tokens=5, max_completion_tokens=6
        )
    assert raised.value.body["param"] == "max_completion_tokens"


def test_the_fields_clients_send_at_their_neutral_values(serve_in_process, chat_run):
    """Issue 56 item 7, from the openai client: stream_options.include_usage ends a stream with
    a chunk of no choices and the usage the non-streamed reply has; the penalties at 0 and a
    message's name change nothing; a penalty we do not implement is a 400 that says so."""
    client = serve(serve_in_process, chat_run)
    fields = dict(model="chat", messages=MESSAGES, temperature=0, max_tokens=6)
    plain = client.chat.completions.create(**fields)
    named = [{**m, "name": "horatio"} for m in MESSAGES]
    neutral = dict(presence_penalty=0, frequency_penalty=0)
    same = client.chat.completions.create(**{**fields, "messages": named}, **neutral)
    assert same.choices[0].message.content == plain.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **fields, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in chunks[:-1])
    for field in neutral:
        with pytest.raises(openai.BadRequestError, match="not implemented here") as raised:
            client.chat.completions.create(**fields, **{field: 0.5})
        assert raised.value.body["param"] == field
    with pytest.raises(openai.BadRequestError, match="needs stream: true"):
        client.chat.completions.create(**fields, stream_options={"include_usage": True})


def test_a_reply_ends_at_the_end_of_turn(serve_in_process, tmp_path):
    run = save_chat_model(tmp_path / "run", ends_at_once=True)
    answer = serve(serve_in_process, run).chat.completions.create(
        model="chat", messages=MESSAGES, max_tokens=12
    )
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("", "stop")
    assert sample_chat(run, tmp_path, as_file(tmp_path, MESSAGES)) == "\n"


def test_a_base_model_and_bad_messages_are_400s(serve_in_process, chat_run, tmp_path):
    base = tmp_path / "base"
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=1, n_embd=8))
    save_checkpoint(base / "checkpoints" / "best", model, {"data": {"tokenizer": "gpt2"}}, {})
    with pytest.raises(openai.BadRequestError, match="base model without a chat template"):
        serve(serve_in_process, base).chat.completions.create(model="m", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="messages") as raised:
        bad = [{"role": "tool", "content": "hi"}]
        serve(serve_in_process, chat_run).chat.completions.create(model="chat", messages=bad)
    assert raised.value.body["param"] == "messages"


def test_the_terminal_conversation_keeps_its_history(chat_run, tmp_path):
    """Two turns typed, then an empty line: each reply is the one-shot reply to the
    conversation so far (the first reply is part of the second turn's history)."""
    out = sample_chat(
        chat_run, tmp_path, "chat=true", "system=You are HAMLET.", input="Hi\nAnd?\n\n"
    )
    first, second = out.splitlines()
    history = [
        {"role": "system", "content": "You are HAMLET."},
        {"role": "user", "content": "Hi"},
    ]
    assert sample_chat(chat_run, tmp_path, as_file(tmp_path, history)) == first + "\n"
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And?"}]
    assert sample_chat(chat_run, tmp_path, as_file(tmp_path, history)) == second + "\n"


def test_chat_true_with_messages_goes_on_from_them_in_the_terminal(chat_run, tmp_path):
    """Issue 50 item 12: chat=true beside messages was ignored without a word (one reply, then
    exit); the terminal conversation now starts from them, their reply first. A system= beside
    them is refused: messages hold the whole conversation."""
    first = sample_chat(chat_run, tmp_path, as_file(tmp_path, MESSAGES))
    history = [*MESSAGES, {"role": "assistant", "content": first[:-1]}]
    second = sample_chat(
        chat_run, tmp_path, as_file(tmp_path, [*history, {"role": "user", "content": "And?"}])
    )
    out = sample_chat(
        chat_run, tmp_path, "chat=true", as_file(tmp_path, MESSAGES), input="And?\n\n"
    )
    assert out == first + second
    proc = run_script(
        "sample.py",
        f"checkpoint={chat_run}",
        "system=Be brief.",
        as_file(tmp_path, MESSAGES),
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and proc.stderr.startswith(
        "error: messages is the whole conversation"
    )


def test_attention_over_a_conversation(serve_in_process, chat_run, tmp_path):
    """/api/attention with messages: the template's ids, the newest page_tokens of them, and
    where each turn starts; text and messages together, no messages, or messages to a base
    model: 400."""
    url = serve_url(serve_in_process, chat_run)
    status, _, view = request(url, "POST", "/api/attention", {"messages": MESSAGES})
    ids = render(MESSAGES, load_source(chat_run).tokenizer(), generation_prompt=False)[0]
    assert status == 200 and view["ids"] == ids and not view["truncated"]
    assert view["turns"] == [i for i, token in enumerate(ids) if token == 50257]
    assert len(view["turns"]) == 4
    longer = MESSAGES + [{"role": "assistant", "content": "word " * 100}]
    status, _, view = request(url, "POST", "/api/attention", {"messages": longer})
    ids = render(longer, load_source(chat_run).tokenizer(), generation_prompt=False)[0]
    assert view["ids"] == ids[-128:] and view["truncated"]  # the newest reply kept
    both = {"messages": MESSAGES, "text": "hi"}
    assert request(url, "POST", "/api/attention", both)[0] == 400
    status, _, body = request(url, "POST", "/api/attention", {"messages": []})  # was a 500
    assert status == 400 and body["error"]["param"] == "messages"
    assert "at least 1 item" in body["error"]["message"]
    base = tmp_path / "base"
    model = GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=1, n_embd=8))
    save_checkpoint(base / "checkpoints" / "best", model, {"data": {"tokenizer": "gpt2"}}, {})
    status, _, body = request(
        serve_url(serve_in_process, base), "POST", "/api/attention", {"messages": MESSAGES}
    )
    assert status == 400 and "without a chat template" in body["error"]["message"]


def test_more_messages_than_prompt_tokens_are_refused_before_validation(serve_in_process, chat_run):
    """Issue 50 item 2: 30,000 empty messages were validated and rendered on the event loop
    before the 400; more messages than max_prompt_tokens (each is a token at least) are refused
    on their count, on both routes that take messages."""
    url, empty = serve_url(serve_in_process, chat_run), {"role": "user", "content": ""}
    for path in ("/v1/chat/completions", "/api/attention"):
        status, _, body = request(url, "POST", path, {"messages": [empty] * 129})
        assert status == 400 and body["error"]["param"] == "messages"
        assert (
            body["error"]["message"] == "129 messages, over the 128 tokens of a prompt: send fewer"
        )
    status, _, _ = request(url, "POST", "/api/attention", {"messages": [empty] * 128})
    assert status == 200


def test_a_stop_string_ends_a_reply(serve_in_process, chat_run):
    client = serve(serve_in_process, chat_run)
    fields = dict(model="chat", messages=MESSAGES, temperature=0, max_tokens=12)
    full = client.chat.completions.create(**fields).choices[0].message.content
    stop = full[3:5]
    cut = client.chat.completions.create(**fields, stop=[stop]).choices[0]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"
