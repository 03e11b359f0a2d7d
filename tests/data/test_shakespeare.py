"""The embedded default: fixed split by whole plays, and token files that decode to the source."""

from __future__ import annotations

import numpy as np

from data.pipeline import PreparedData
from data.sources import VAL_PLAYS, load_shakespeare, play_files
from data.tokenizer import get_tokenizer


def test_split_is_exactly_the_named_plays() -> None:
    splits = load_shakespeare({})
    assert sorted(splits["val"]["title"]) == sorted(VAL_PLAYS)
    assert set(VAL_PLAYS) == {"julius-caesar", "macbeth", "the-tempest", "twelfth-night"}
    assert len(splits["train"]) == 34
    assert set(splits["train"]["title"]).isdisjoint(splits["val"]["title"])
    assert set(splits["train"]["title"]) | set(VAL_PLAYS) == set(play_files())


def test_no_training_document_in_validation() -> None:
    splits = load_shakespeare({})
    train_texts = set(splits["train"]["text"])
    assert not train_texts & set(splits["val"]["text"])


def test_token_files_decode_back_to_the_plays(shakespeare: PreparedData) -> None:
    enc = get_tokenizer("gpt2")
    eot = enc.decode([enc.eot_token])
    splits = load_shakespeare({})
    for split in ("train", "val"):
        tokens = shakespeare.tokens(split)
        assert tokens.dtype == np.uint16 and tokens.ndim == 1
        assert not tokens.flags.writeable
        expected = "".join(eot + text for text in splits[split]["text"])
        assert enc.decode(tokens.tolist()) == expected


def test_meta_counts_tokens_bytes_and_documents(shakespeare: PreparedData) -> None:
    meta = shakespeare.meta
    assert meta["dataset"] == "shakespeare" and meta["tokenizer"] == "gpt2"
    assert meta["vocab_size"] == shakespeare.vocab_size == 50257
    assert meta["dtype"] == "uint16"
    splits = load_shakespeare({})
    for split in ("train", "val"):
        stats = meta["splits"][split]
        assert stats["documents"] == len(splits[split])
        assert stats["bytes"] == sum(len(t.encode("utf-8")) for t in splits[split]["text"])
        assert stats["tokens"] == len(shakespeare.tokens(split))
        assert 2.5 < stats["bytes"] / stats["tokens"] < 4  # bytes per token
