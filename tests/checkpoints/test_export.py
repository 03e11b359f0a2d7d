"""export.py's directories load in plain transformers and compute our logits and our tokenizers'
ids; options without an exact equivalent and a non-empty `out` are refused in one line."""

from __future__ import annotations

import pytest
import torch

from base.errors import ConfigError
from checkpoints.export import export_checkpoint
from checkpoints.hf import FIELDS, Field, Need, hf_keys
from checkpoints.store import load_checkpoint, save_checkpoint
from data.tokenizer import load_tokenizer
from model import GPT
from tests.conftest import (
    RUN,
    TEXT,
    TRICKY,
    load_preset,
    make_trainer,
    save_tiny_checkpoint,
    tiny_config,
)

transformers = pytest.importorskip("transformers")


def export(tmp_path, path, **cfg):
    return export_checkpoint({"checkpoint": str(path), "out": str(tmp_path / "out"), **cfg})


@pytest.mark.parametrize(
    "options, architecture, tokenizer",
    [
        ({}, "GPT2LMHeadModel", "gpt2"),
        ({"bias": False, "tie_embeddings": False, "mlp_ratio": 2}, "GPT2LMHeadModel", "bytes"),
        (
            {"pos_embedding": "rope", "norm": "rmsnorm", "mlp": "swiglu"},
            "LlamaForCausalLM", "bpe-300",
        ),
        (
            {"pos_embedding": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
             "tie_embeddings": False, "rope_base": 500.0},
            "LlamaForCausalLM", "bytes",
        ),
    ],
)  # fmt: skip
def test_transformers_computes_our_logits_and_loss(tmp_path, options, architecture, tokenizer):
    """Our logits on any ids, and our loss on a text tokenized by each side's own tokenizer."""
    path, ours = save_tiny_checkpoint(tmp_path, tokenizer=tokenizer, **options)
    out = export(tmp_path, path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == architecture
    idx = torch.randint(0, ours.config.vocab_size, (2, 16))
    their_ids = transformers.AutoTokenizer.from_pretrained(out)(TEXT, return_tensors="pt")
    their_ids = their_ids["input_ids"][:, :16]
    our_ids = torch.tensor([load_tokenizer(tokenizer, path).encode_ordinary(TEXT)[:16]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx)[0], atol=1e-4, rtol=0)
        loss = theirs(their_ids, labels=their_ids).loss
        torch.testing.assert_close(loss, ours(our_ids[:, :-1], our_ids[:, 1:])[1])


@pytest.mark.parametrize(
    "options", [{}, {"pos_embedding": "rope", "norm": "rmsnorm", "mlp": "swiglu"}]
)
def test_a_padded_vocabulary_exports_as_the_tokenizers(tmp_path, options):
    """The GPT-2 presets pad 50257 rows to 50304; the export has the tokenizer's 50257."""
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=50304, **options)).eval()
    path = save_checkpoint(tmp_path / "ckpt", model, RUN, {"step": 1, "tokenizer": "gpt2"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export(tmp_path, path)).eval()
    assert theirs.config.vocab_size == 50257
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(
            theirs(idx).logits, model(idx)[0][..., :50257], atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("name", ["gpt2", "bytes", "bpe-300"])
def test_the_tokenizer_gives_our_ids(tmp_path, name):
    """Code, accents, CJK, emoji, runs of spaces and newlines, and "<|endoftext|>" as text."""
    path, _ = save_tiny_checkpoint(tmp_path, tokenizer=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export(tmp_path, path))
    ours = load_tokenizer(name, path)
    assert tokenizer.is_fast and tokenizer.eos_token_id == ours.eot_token
    for text in [TEXT, *TRICKY]:
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.encode_ordinary(text), text
        assert tokenizer.decode(ids) == text


def test_generate_stops_at_block_size_without_a_warning(tmp_path, caplog):
    """transformers' own generate(), given no length, stops at the model's context (prompt
    included), quietly: a bytes model with 64 positions."""
    out = export(tmp_path, save_tiny_checkpoint(tmp_path, tokenizer="bytes", block_size=64)[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = transformers.AutoTokenizer.from_pretrained(out)("ROMEO:", return_tensors="pt").input_ids
    for _ in range(2):  # every call, not only the first
        with caplog.at_level("WARNING"):
            assert model.generate(ids, do_sample=False).shape == (1, 64)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_the_docs_pipeline_generates_within_the_positions(tmp_path, monkeypatch):
    """docs/evaluation.md's line, verbatim but for the directory, on the nano preset (64
    positions): the pipeline's default 256 new tokens would index past them."""
    nano = load_preset("nano") | {"vocab_size": 50257}
    monkeypatch.chdir(export(tmp_path, save_tiny_checkpoint(tmp_path, **nano)[0]).parent)
    from transformers import pipeline

    text = pipeline("text-generation", "out")("ROMEO:")[0]["generated_text"]
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:")


@pytest.mark.parametrize(
    "options, named",
    [
        ({"mlp": "relu2"}, "model.mlp='relu2'"),
        ({"qk_norm": True}, "model.qk_norm=True"),
        ({"logit_softcap": 30.0}, "model.logit_softcap=30.0"),
        ({"norm": "rmsnorm"}, "model.norm='rmsnorm'"),
        ({"pos_embedding": "rope"}, "model.norm='layernorm'"),
        ({"pos_embedding": "rope", "norm": "rmsnorm", "mlp": "gelu"}, "model.mlp='gelu'"),
    ],
)
def test_options_without_an_equivalent_are_named(tmp_path, options, named):
    path, _ = save_tiny_checkpoint(tmp_path, **options)
    with pytest.raises(ConfigError, match=f"^{named.replace('.', '[.]')} has no equivalent"):
        export(tmp_path, path)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directory left


def test_a_field_the_table_says_has_no_equivalent_is_refused(tmp_path, monkeypatch):
    """export.py keeps no list of its own: a Need in checkpoints.hf.FIELDS is enforced."""
    path, _ = save_tiny_checkpoint(tmp_path, zero_init_proj=True)
    monkeypatch.setitem(FIELDS, "zero_init_proj", Field(Need(False), Need(False)))
    with pytest.raises(ConfigError, match="^model[.]zero_init_proj=True has no equivalent"):
        export(tmp_path, path)


@pytest.mark.parametrize(
    "options", [{}, {"pos_embedding": "rope", "norm": "rmsnorm", "mlp": "swiglu"}]
)
def test_config_json_holds_each_fields_value_under_its_keys(tmp_path, options):
    kind = "llama" if options else "gpt2"
    other = {"dropout": 0.125, "mlp_ratio": 2, "tie_embeddings": False, "rope_base": 500.0}
    path, ours = save_tiny_checkpoint(tmp_path, **options, **other)
    theirs = transformers.AutoConfig.from_pretrained(export(tmp_path, path)).to_dict()
    theirs |= theirs.get("rope_parameters", {})  # transformers 5 keeps rope_theta there
    for name, field in FIELDS.items():
        for key in hf_keys(name, kind):
            assert theirs[key] == getattr(ours.config, field.via or name), (name, key)


def test_a_non_empty_out_is_kept_unless_overwrite(tmp_path):
    path, _ = save_tiny_checkpoint(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="exists and is not empty; pass overwrite=true"):
        export(tmp_path, path)
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"
    out = export(tmp_path, path, overwrite=True)
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]
    with pytest.raises(ConfigError, match="out is required"):
        export_checkpoint({"checkpoint": str(path), "out": None})
    with pytest.raises(ConfigError, match="overwrite must be true or false, got 'maybe'"):
        export(tmp_path, path, overwrite="maybe")  # as every boolean key, not taken as false


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_overwrite_never_replaces_a_checkpoint_nor_writes_into_one(tmp_path, fmt):
    """overwrite=true once deleted the run exported when out was its run dir (or held it), and
    would have replaced any run's; an export inside a checkpoint vanished at the next save."""
    path, _ = save_tiny_checkpoint(tmp_path / "other")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    path.rename(run / "checkpoints" / "last")
    other, _ = save_tiny_checkpoint(tmp_path / "other")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    name = "model.gguf" if fmt == "gguf" else "hf"
    refused = {
        (run, run): "holds checkpoints",
        (run, tmp_path): "holds checkpoints",  # it holds the run
        (other, run): "holds checkpoints",  # another run's
        (run, run / "checkpoints" / "last" / name): "lies in the checkpoint",
    }
    for (source, out), why in refused.items():
        cfg = {"checkpoint": str(source), "out": str(out), "overwrite": True, "format": fmt}
        if fmt == "gguf" and out.is_dir():  # refused before anything is loaded
            why = "is a directory; format=gguf writes one file"
        with pytest.raises(ConfigError, match=f"out={out} {why}"):
            export_checkpoint(cfg)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    out = run / "exports" / name  # beside the checkpoints, in the run dir: taken
    cfg = {"checkpoint": str(run), "out": str(out), "overwrite": True, "format": fmt}
    assert export_checkpoint(cfg) == out and out.exists()


@pytest.mark.parametrize("out", ["x", "x.gguf"])
def test_an_out_under_a_file_is_one_line_naming_the_file(tmp_path, out):
    path, _ = save_tiny_checkpoint(tmp_path)
    (tmp_path / "notes.txt").write_text("a file")
    target = tmp_path / "notes.txt" / out
    fmt = "gguf" if out.endswith("gguf") else "hf"
    with pytest.raises(ConfigError, match=f"cannot write out={target}: a file is in the way"):
        export_checkpoint({"checkpoint": str(path), "out": str(target), "format": fmt})


def test_the_model_card_of_a_run_gives_the_whole_split_score_training_ended_with(tmp_path, corpus):
    """Issue 55: the card gave the eval_steps subset's bpb (2.9341) where training's last line
    and evaluate.py said 2.9234. A final model that is `best` records the whole split's score;
    `best` keeps comparing by the subset's loss."""
    trainer = make_trainer(tmp_path / "run", corpus, "train.max_steps=6")  # evaluated at 6
    summary = trainer.run()
    best = tmp_path / "run" / "checkpoints" / "best"
    meta = load_checkpoint(best).meta
    assert meta["step"] == 6 and meta["val_loss"] == trainer.state.best_val_loss
    assert meta["final_val_bpb"] == pytest.approx(summary["val_bpb"], abs=1e-4)
    assert meta["final_val_bpb"] != meta["val_bpb"]  # the subset's differs
    card = (export(tmp_path, best) / "README.md").read_text()
    whole = f"{summary['val_bpb']:.4f} bits per byte (the whole validation split, "
    assert f"{whole}{summary['val_tokens']:,} tokens)" in card


def test_the_model_card_states_data_steps_bpb_and_causality(tmp_path):
    check = {"positions": 7, "largest": 0.0, "measure": "change in the past", "passed": True}
    causality = {
        "checked": True,
        "causal": True,
        "checks": {"manual perturbation (eval)": check},
        "first_leak": None,
        "model": "a shrunk copy (same options): n_layer=2, n_embd=8, vocab_size=64",
        "seconds": 0.25,
    }  # the guard's record (trainer/preflight.py)
    meta = {"val_loss": 3.25, "val_bpb": 1.625, "causality": causality}
    card = (
        export(tmp_path, save_tiny_checkpoint(tmp_path, meta=meta)[0]) / "README.md"
    ).read_text()
    assert '"name": "shakespeare"' in card and "Steps: 7" in card
    assert "1.6250 bits per byte" in card and "Initialized from: random weights" in card
    assert "- Tokenizer: `gpt2`" in card
    assert (
        "- Causality check: passed on a shrunk copy (same options): n_layer=2, n_embd=8, "
        "vocab_size=64, in 0.25 s:\n"
        "  - manual perturbation (eval): 7 positions, largest change in the past 0.0e+00: pass\n"
    ) in card
    meta = {"causality": {"checked": False, "reason": "train.check_causality=false"}}
    card = (
        export(tmp_path, save_tiny_checkpoint(tmp_path, meta)[0], overwrite=True) / "README.md"
    ).read_text()
    assert "not recorded" in card
    assert "- Causality check: not run (train.check_causality=false)" in card
