"""The built-in bytes tokenizer and BPE trained on a dataset's training split
(data/tokenizer.py)."""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

import pytest
import regex

import data.pipeline
from base.errors import DataError
from data.pipeline import InvalidCache, PreparedData, prepare_data, verify_prepared
from data.sources import VAL_PLAYS, play_files
from data.tokenizer import (
    BPE,
    PATTERN,
    TOKENIZER_FILE,
    get_tokenizer,
    load_tokenizer,
    parse_tokenizer,
    train_bpe,
)
from tests.conftest import TRICKY


def bytes_per_token(data: PreparedData, split: str) -> float:
    stats = data.meta["splits"][split]
    return stats["bytes"] / stats["tokens"]


def random_unicode(seed: int, n: int = 400) -> str:
    """Code points from every plane (no surrogates: they are not encodable text)."""
    rng = random.Random(seed)
    points = []
    while len(points) < n:
        cp = rng.choice([rng.randrange(0x80), rng.randrange(0x800), rng.randrange(0x110000)])
        if not 0xD800 <= cp <= 0xDFFF:
            points.append(cp)
    return "".join(map(chr, points))


SAMPLES = [*TRICKY, random_unicode(0), random_unicode(1), "\x1c\x1d\x1e\x1f \x85 \u2028\u2029 \r\n"]


def reference_encode(bpe: BPE, text: str) -> list[int]:
    """Textbook BPE, independent of tiktoken and of the trainer: split with the pattern, then in
    each chunk repeatedly merge the adjacent pair that was learned first."""
    rank = {pair: 256 + i for i, pair in enumerate(bpe.merges)}
    out = []
    for chunk in regex.findall(bpe.pattern, text):
        ids = list(chunk.encode("utf-8"))
        while len(ids) > 1:
            pairs = list(zip(ids, ids[1:], strict=False))
            best = min(pairs, key=lambda p: rank.get(p, float("inf")))
            if best not in rank:
                break
            i = pairs.index(best)
            ids[i : i + 2] = [rank[best]]  # leftmost occurrence first, as training did
        out += ids
    return out


@pytest.fixture(scope="session")
def shakespeare_texts() -> dict[str, list[str]]:
    plays = play_files()
    return {
        "train": [p.read_text("utf-8") for name, p in plays.items() if name not in VAL_PLAYS],
        "val": [plays[name].read_text("utf-8") for name in VAL_PLAYS],
    }


@pytest.fixture(scope="session")
def shakespeare_bpe(shakespeare_cache: str) -> PreparedData:
    """Shakespeare prepared with bpe-1024, trained on its 34 training plays (~3 s)."""
    cfg = {"name": "shakespeare", "cache_dir": shakespeare_cache, "tokenizer": "bpe-1024"}
    return prepare_data(cfg, verbose=False)


# ----- bytes ---------------------------------------------------------------------------------


def test_bytes_is_the_256_bytes_and_endoftext() -> None:
    enc = get_tokenizer("bytes")
    assert enc.n_vocab == 257 and enc.eot_token == 256
    assert [enc.decode_single_token_bytes(i) for i in range(256)] == [
        bytes([i]) for i in range(256)
    ]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [256]
    assert load_tokenizer("bytes") is enc  # built in: the name is enough


@pytest.mark.parametrize("text", SAMPLES)
def test_bytes_round_trips_any_unicode(text: str) -> None:
    enc = get_tokenizer("bytes")
    ids = enc.encode_ordinary(text)
    assert ids == list(text.encode("utf-8"))
    assert enc.decode(ids) == text


# ----- training ------------------------------------------------------------------------------


def test_ties_go_to_the_smallest_pair_of_ids() -> None:
    # Every pair occurs once: (" ", "c") = (32, 99) wins, then (97, 98) = "ab" beats (256, 100).
    bpe, _ = train_bpe(["ab cd"], 259)
    assert bpe.merges == ((32, 99), (97, 98))


def test_training_is_deterministic_and_ignores_document_order(
    shakespeare_texts: dict[str, list[str]],
) -> None:
    docs = shakespeare_texts["val"]  # a small training set for speed
    first, _ = train_bpe(docs, 600)
    again, _ = train_bpe(docs, 600)
    shuffled, _ = train_bpe(list(reversed(docs)), 600)
    assert first.to_json() == again.to_json() == shuffled.to_json()


@pytest.mark.parametrize("n", [257, 258, 300, 777])
def test_exactly_n_distinct_tokens(shakespeare_texts: dict[str, list[str]], n: int) -> None:
    bpe, _ = train_bpe(shakespeare_texts["val"][:1], n)
    enc = bpe.encoding()
    assert bpe.name == f"bpe-{n}" and enc.n_vocab == n and enc.eot_token == n - 1
    assert len(set(bpe.token_bytes)) == n - 1


def test_too_little_text_for_n_is_a_data_error() -> None:
    with pytest.raises(
        DataError, match="needs 43 merges but the training split .3 bytes. allows only 2;"
    ):
        train_bpe(["abc"], 300)


def test_tiktoken_encodes_as_the_merges_say(shakespeare_bpe: PreparedData, shakespeare_texts):
    enc = shakespeare_bpe.tokenizer()
    bpe = BPE.from_json(shakespeare_bpe.tokenizer_file.read_text(), "bpe-1024")
    val = shakespeare_texts["val"][0]
    for text in [*SAMPLES, val[:20_000], val[-20_000:]]:
        ids = enc.encode_ordinary(text)
        assert ids == reference_encode(bpe, text)
        assert enc.decode(ids) == text


def test_the_split_pattern_is_gpt4s(shakespeare_bpe: PreparedData) -> None:
    from tiktoken_ext import openai_public

    assert f'r"""{PATTERN}"""' in inspect.getsource(openai_public.cl100k_base)
    assert json.loads(shakespeare_bpe.tokenizer_file.read_text())["pattern"] == PATTERN


def test_bpe_compresses_shakespeare_better_than_bytes(
    shakespeare_bpe: PreparedData, shakespeare: PreparedData, shakespeare_cache: str
) -> None:
    nbytes = prepare_data(
        {"name": "shakespeare", "cache_dir": shakespeare_cache, "tokenizer": "bytes"},
        verbose=False,
    )
    for split in ("train", "val"):
        assert bytes_per_token(nbytes, split) < 1.0  # one token per byte, plus one per play
        assert bytes_per_token(shakespeare_bpe, split) > 2.3
        # The bytes each token spans come from the raw text, whatever the tokenizer.
        assert (
            nbytes.meta["splits"][split]["bytes"]
            == shakespeare_bpe.meta["splits"][split]["bytes"]
            == shakespeare.meta["splits"][split]["bytes"]
        )


def test_the_saved_json_round_trips(shakespeare_bpe: PreparedData) -> None:
    text = shakespeare_bpe.tokenizer_file.read_text()
    saved = json.loads(text)  # plain JSON
    assert saved["name"] == "bpe-1024" and saved["vocab_size"] == 1024
    assert saved["special_tokens"] == {"<|endoftext|>": 1023} and len(saved["merges"]) == 767
    bpe = BPE.from_json(text, "bpe-1024")
    assert bpe.to_json() == text
    assert bpe.encoding()._mergeable_ranks == shakespeare_bpe.tokenizer()._mergeable_ranks


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(name="bpe-999"), "holds 'bpe-999'"),
        (lambda d: d.update(format="pickle"), "format"),
        (lambda d: d["merges"].__setitem__(3, ["ff", "zz"]), "ValueError"),
        (lambda d: d["merges"].append(d["merges"][0]), "not a new merge"),
        (lambda d: d.pop("pattern"), "KeyError"),
        (lambda d: d.update(special_tokens={"<|endoftext|>": 5}), "special_tokens"),
    ],
)
def test_a_bad_tokenizer_file_is_a_data_error(
    shakespeare_bpe: PreparedData, tmp_path: Path, edit, message: str
) -> None:
    saved = json.loads(shakespeare_bpe.tokenizer_file.read_text())
    edit(saved)
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(saved))
    with pytest.raises(DataError, match=message):
        load_tokenizer("bpe-1024", tmp_path)


# ----- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bpe-100", "bpe-x", "bpe-", "bpe-0300", "bpe-2k", "nope"])
def test_bad_names_are_one_line_errors_naming_the_accepted_forms(name: str, tmp_path) -> None:
    for attempt in (
        lambda: get_tokenizer(name),
        lambda: load_tokenizer(name, tmp_path),
        lambda: prepare_data(
            {"name": "shakespeare", "cache_dir": str(tmp_path), "tokenizer": name}
        ),
    ):
        with pytest.raises(DataError) as e:
            attempt()
        message = str(e.value)
        assert "\n" not in message and name in message
        assert "gpt2, bytes, bpe-<N> with N >= 257" in message
    assert not any(tmp_path.iterdir())  # refused before loading or writing anything


def test_trained_tokenizers_need_their_directory(tmp_path: Path) -> None:
    assert parse_tokenizer("bpe-2048") == 2048 and parse_tokenizer("bytes") is None
    with pytest.raises(DataError, match="load_tokenizer"):
        get_tokenizer("bpe-2048")
    with pytest.raises(DataError, match="give the directory"):
        load_tokenizer("bpe-2048")
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer("bpe-2048", tmp_path)


# ----- preparation and its cache -------------------------------------------------------------

UNIQUE = " zyzzogeton"  # occurs only in the validation file


@pytest.fixture
def toy(tmp_path: Path) -> dict:
    hamlet = play_files()["hamlet"].read_text("utf-8")[:20_000]
    (tmp_path / "train.txt").write_text(hamlet + "caf\u00e9 \u65e5\u672c\n", encoding="utf-8")
    (tmp_path / "val.txt").write_text("The caf\u00e9" + UNIQUE * 2000 + "\n", encoding="utf-8")
    return {
        "name": "text",
        "cache_dir": str(tmp_path / "cache"),
        "train_files": [str(tmp_path / "train.txt")],
        "val_files": [str(tmp_path / "val.txt")],
        "tokenizer": "bpe-300",
    }


def test_the_validation_split_never_trains_the_tokenizer(toy: dict) -> None:
    prepared = prepare_data(toy, verbose=False)
    enc = prepared.tokenizer()
    train_text = Path(toy["train_files"][0]).read_text()
    alone, _ = train_bpe([train_text], 300)
    assert prepared.tokenizer_file.read_text() == alone.to_json()
    assert not any(b"zyzz" in t for t in alone.token_bytes)
    assert len(enc.encode_ordinary(UNIQUE)) > 2
    # Control: had the validation text been seen, the word would be one token.
    leaked, _ = train_bpe([train_text, Path(toy["val_files"][0]).read_text()], 300)
    assert len(leaked.encoding().encode_ordinary(UNIQUE)) == 1


def test_each_tokenizer_spec_has_its_own_directory(toy: dict) -> None:
    small = prepare_data(toy, verbose=False)
    large = prepare_data({**toy, "tokenizer": "bpe-310"}, verbose=False)
    plain = prepare_data({**toy, "tokenizer": "bytes"}, verbose=False)
    assert len({small.dir, large.dir, plain.dir}) == 3
    assert small.dir.name.startswith("bpe-300-") and large.dir.name.startswith("bpe-310-")
    assert (small.vocab_size, large.vocab_size, plain.vocab_size) == (300, 310, 257)
    assert small.tokenizer().n_vocab == 300 and large.tokenizer().n_vocab == 310
    assert plain.tokenizer_file is None and not (plain.dir / TOKENIZER_FILE).exists()
    assert small.meta["tokenizer_file"]["name"] == TOKENIZER_FILE
    assert small.meta["tokenizer_training"]["bytes"] == len(
        Path(toy["train_files"][0]).read_bytes()
    )


def test_a_repeat_reuses_and_changed_training_text_retrains(
    toy: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = prepare_data(toy, verbose=False)
    with monkeypatch.context() as m:
        m.setattr(data.pipeline, "train_bpe", lambda *a, **k: pytest.fail("retrained"))
        assert prepare_data(toy, verbose=False).dir == first.dir
    other = play_files()["othello"].read_text("utf-8")[:20_000]
    Path(toy["train_files"][0]).write_text(other, encoding="utf-8")
    second = prepare_data(toy, verbose=False)
    assert second.dir != first.dir
    assert second.tokenizer_file.read_text() != first.tokenizer_file.read_text()
    assert second.tokenizer().decode(second.tokens("train").tolist()[1:]) == other


def test_a_damaged_tokenizer_file_invalidates_the_cache(toy: dict) -> None:
    first = prepare_data(toy, verbose=False)
    good = first.tokenizer_file.read_bytes()
    first.tokenizer_file.write_bytes(good.replace(b'"20"', b'"21"', 1))
    with pytest.raises(InvalidCache, match=f"{TOKENIZER_FILE} fails its sha256 check"):
        verify_prepared(first.dir, first.meta["fingerprint"])
    again = prepare_data(toy, verbose=False)
    assert again.dir == first.dir and again.tokenizer_file.read_bytes() == good


@pytest.mark.parametrize("tokenizer", ["gpt2", "bytes", "bpe-300"])
def test_bytes_are_counted_from_the_raw_text(toy: dict, tokenizer: str) -> None:
    prepared = prepare_data({**toy, "tokenizer": tokenizer}, verbose=False)
    enc = prepared.tokenizer()
    for split, key in (("train", "train_files"), ("val", "val_files")):
        raw = Path(toy[key][0]).read_bytes()
        stats = prepared.meta["splits"][split]
        assert stats["bytes"] == len(raw) != len(raw.decode())  # bytes, not characters
        ids = prepared.tokens(split).tolist()
        assert ids[0] == enc.eot_token and enc.decode_bytes(ids[1:]) == raw
        if tokenizer == "bytes":
            assert stats["tokens"] == stats["bytes"] + stats["documents"]
