"""Streaming text: only complete characters are shown; stop strings end a sample, unshown."""

from __future__ import annotations

import pytest

from data.tokenizer import get_tokenizer
from inference import TextStream

tok = get_tokenizer("gpt2")


def push_all(stream: TextStream, text: str) -> list[str]:
    return [stream.push(t) for t in tok.encode_ordinary(text)]


def test_a_character_split_across_tokens_is_shown_only_when_complete():
    ids = tok.encode_ordinary("🙂 é")
    assert len(ids) == 3  # the emoji's four bytes span two tokens
    stream = TextStream(tok)
    assert [stream.push(t) for t in ids] == ["", "🙂", " é"]
    assert stream.finish() == ""


def test_an_unfinished_character_at_the_end_becomes_a_replacement_character():
    stream = TextStream(tok)
    stream.push(tok.encode_ordinary("🙂")[0])
    assert stream.finish() == "\ufffd"
    assert stream.text == "\ufffd"


def test_without_stop_strings_the_pieces_add_up_to_the_decoded_text():
    text = "Hello, world!\nThe end."
    stream = TextStream(tok)
    assert "".join(push_all(stream, text)) + stream.finish() == text


def test_a_stop_string_ends_the_sample_and_is_not_shown():
    stream = TextStream(tok, stop=["END"])
    shown = "".join(push_all(stream, "Hello world. END and more"))
    assert shown == "Hello world. "
    assert stream.done and stream.text == "Hello world. "
    assert stream.push(tok.encode_ordinary(" x")[0]) == ""


def test_a_stop_string_spanning_tokens_is_caught_and_its_start_is_never_shown_early():
    stream = TextStream(tok, stop=["\n\n"])
    pieces = push_all(stream, "one\n")
    assert "".join(pieces) == "one"  # the "\n" might begin "\n\n": held back
    assert "".join(push_all(stream, "\ntwo")) == ""
    assert stream.done and stream.text == "one"


def test_held_back_text_is_released_when_the_stop_string_does_not_follow():
    stream = TextStream(tok, stop=["\n\n"])
    assert "".join(push_all(stream, "one\ntwo")) == "one\ntwo"
    assert not stream.done


def test_the_earliest_of_several_stop_strings_wins_and_finish_releases_what_was_held():
    stream = TextStream(tok, stop=["World", "lo"])
    assert "".join(push_all(stream, "Hello World")) == "Hel"
    other = TextStream(tok, stop=["ENDING"])
    assert "".join(push_all(other, "the END")) + other.finish() == "the END"


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError, match="non-empty"):
        TextStream(tok, stop=[""])
