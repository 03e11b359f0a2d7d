"""Conversations: the one chat template (ChatML) and the offline conversation set.

A conversation is OpenAI's messages form, ``[{"role": "system" | "user" | "assistant",
"content": "..."}, ...]``. The template writes each message as

    <|im_start|>{role}\\n{content}<|im_end|>\\n

and a reply is asked for with ``<|im_start|>assistant\\n`` (the generation prompt); a reply ends at
``<|im_end|>``. ``<|im_start|>`` and ``<|im_end|>`` are special tokens added after the last id of
whichever tokenizer the model has (gpt2, bytes, bpe-N): ``chat_tokenizer``. Text between special
tokens is encoded with the tokenizer's own split rules, as Hugging Face tokenizers encode a
rendered template, so ``CHAT_TEMPLATE`` (the same format in Jinja, which both exports carry) gives
the ids ``render`` gives (tests/data/test_chat.py holds them equal through transformers).

Training counts the loss on assistant tokens alone: ``render``'s mask marks every token that holds
a byte of an assistant's content, and the ``<|im_end|>`` that ends it (the model must learn to
stop). Roles, headers and the other turns are context, never targets.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from itertools import accumulate
from typing import Any

import tiktoken

TEMPLATE = "chatml"  # what a chat checkpoint and a chat dataset record as `chat_template`
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ROLES = ("system", "user", "assistant")
# The same template in Jinja, for transformers' apply_chat_template and llama.cpp.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_tokenizer(base: tiktoken.Encoding) -> tiktoken.Encoding:
    """``base`` with ``<|im_start|>`` and ``<|im_end|>`` as its two next ids (tiktoken's own way
    to extend an encoding: its ranks and regex, more special tokens)."""
    n = base.n_vocab
    return tiktoken.Encoding(
        name=f"{base.name}+{TEMPLATE}",
        pat_str=base._pat_str,
        mergeable_ranks=base._mergeable_ranks,
        special_tokens={**base._special_tokens, IM_START: n, IM_END: n + 1},
    )


def render(
    messages: Sequence[dict[str, str]], tokenizer: tiktoken.Encoding, generation_prompt: bool
) -> tuple[list[int], list[bool]]:
    """(token ids, assistant mask) of ``messages`` in the template; with ``generation_prompt``,
    ``<|im_start|>assistant\\n`` follows, for the model to write the reply."""
    start, end = tokenizer.encode_single_token(IM_START), tokenizer.encode_single_token(IM_END)
    newline = tokenizer.encode_ordinary("\n")
    ids: list[int] = []
    mask: list[bool] = []
    for message in messages:
        head = f"{message['role']}\n"
        body = tokenizer.encode_ordinary(head + text_of(message["content"]))
        reply = message["role"] == "assistant"
        # each token's end, in bytes: those past the head hold content
        ends = accumulate(map(len, tokenizer.decode_tokens_bytes(body)))
        head_bytes = len(head.encode("utf-8"))
        ids += [start, *body, end, *newline]
        mask += [False, *(reply and e > head_bytes for e in ends), reply, *[False] * len(newline)]
    if generation_prompt:
        prompt = [start, *tokenizer.encode_ordinary("assistant\n")]
        ids, mask = ids + prompt, mask + [False] * len(prompt)
    return ids, mask


def generation_prompt(
    messages: Sequence[dict[str, str]], tokenizer: tiktoken.Encoding
) -> list[int]:
    """The ids a model continues to write the assistant's next reply."""
    return render(messages, tokenizer, generation_prompt=True)[0]


def text_of(content: Any) -> Any:
    """A message's text: OpenAI's newer form, a list of text parts ``[{"type": "text", "text":
    ...}]``, joined with nothing between; any other content as it is."""
    parts = isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    )
    return "".join(p["text"] for p in content) if parts else content


def bad_message(message: Any) -> str | None:
    """Why `message` is not a message of the template (None: it is one)."""
    if not isinstance(message, dict) or not isinstance(text_of(message.get("content")), str):
        return "a message without a string content (or text parts)"
    if message.get("role") not in ROLES:
        return f"a role other than {', '.join(ROLES)}"
    return None


def problem(messages: Any) -> str | None:
    """Why a conversation cannot be trained on (None: it can); data preparation skips and
    counts these."""
    if not isinstance(messages, list):
        return "messages that are not a list"
    if not messages:
        return "no messages"
    for message in messages:
        if why := bad_message(message):
            return why
        if not text_of(message["content"]).strip():
            return "an empty content"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    return None


def prompt_within(
    messages: Sequence[dict[str, str]], tokenizer: tiktoken.Encoding, block_size: int
) -> list[int]:
    """The generation prompt of `messages` in at most `block_size` tokens: the oldest turns after
    a leading system message are dropped one by one until it fits (then its last block_size
    tokens are kept)."""
    system = list(messages[:1]) if messages and messages[0]["role"] == "system" else []
    turns = list(messages[len(system) :])
    while len(ids := generation_prompt(system + turns, tokenizer)) > block_size and len(turns) > 1:
        turns = turns[1:]
    return ids[-block_size:]


# ----- the offline default: conversations from the plays ----------------------------------------

SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def speeches(play: str) -> Iterator[list[tuple[str, str]]]:
    """Each scene's speeches as (speaker, text): stage directions and headings dropped, the
    markdown line breaks ("  \\n") plain line breaks."""
    scene: list[tuple[str, str]] = []
    speaker, lines, directing = None, [], False
    for line in [*play.splitlines(), "#"]:
        line = line.rstrip()
        match = SPEAKER.match(line)
        if match or line.startswith("#"):
            if speaker and (text := "\n".join(lines).strip()):
                scene.append((speaker, text))
            speaker, lines = (match[1].strip() if match else None), []
            if line.startswith("#") and scene:
                yield scene
                scene = []
        elif line.startswith("_") or directing:  # a stage direction, "_..._", on one or more lines
            directing = not line.endswith("_")
        elif speaker and line:
            lines.append(line)


def play_conversations(play: str) -> Iterator[list[dict[str, str]]]:
    """One conversation per reply in a scene: a speech as the user's turn, the next speech (by
    another speaker) as the assistant's, the play and who speaks to whom in the system turn."""
    title = play.split("\n", 1)[0].removeprefix("# ").strip()
    for scene in speeches(play):
        for (asker, said), (answerer, reply) in zip(scene, scene[1:], strict=False):
            if asker != answerer:
                system = f"This is {title}. You are {answerer}, answering {asker}."
                yield [
                    {"role": "system", "content": system},
                    {"role": "user", "content": said},
                    {"role": "assistant", "content": reply},
                ]
