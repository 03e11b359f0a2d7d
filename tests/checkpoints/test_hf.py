"""GPT-2 weights in the Hugging Face layout load into our model and give the same logits."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import base.files
from checkpoints import hf
from checkpoints.hf import FIELDS, load_hf_gpt2
from model.gpt import GPTConfig

transformers = pytest.importorskip("transformers")  # a declared dev dependency; CI installs it


def unclassified(config_class: type = GPTConfig) -> list[str]:
    """The fields of `config_class` that FIELDS does not classify (and FIELDS' stale entries)."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return sorted(names ^ FIELDS.keys())


def test_every_gptconfig_field_is_classified_once_for_interchange(monkeypatch):
    """FIELDS, which import and export read, classifies every GPTConfig field: a new field
    without an entry (negative control: a config with one more field) or an entry left behind by
    a removed field fails here, instead of exporting or importing a silently other model."""
    assert unclassified() == []

    @dataclasses.dataclass
    class Wider(GPTConfig):
        n_kv_head: int = 12

    assert unclassified(Wider) == ["n_kv_head"]
    monkeypatch.setitem(FIELDS, "n_kv_head", FIELDS["n_head"])
    assert unclassified(Wider) == [] and unclassified() == ["n_kv_head"]


@pytest.fixture
def hf_model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=101,
        n_positions=32,
        n_embd=48,
        n_layer=3,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


def test_state_dict_gives_the_same_logits(hf_model):
    ours = load_hf_gpt2(hf_model.state_dict(), n_head=4).eval()
    idx = torch.randint(0, 101, (2, 32))
    with torch.no_grad():
        expected = hf_model(idx).logits
        got, _ = ours(idx)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert ours.config.block_size == 32 and ours.config.n_layer == 3
    with pytest.raises(ValueError, match="n_head is not in the weights"):  # nor given
        load_hf_gpt2(hf_model.state_dict())


def test_saved_directory_loads_with_its_config(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)  # config.json + model.safetensors
    ours = load_hf_gpt2(tmp_path, attention="sdpa").eval()
    idx = torch.randint(0, 101, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf_model(idx).logits, atol=1e-4, rtol=0)
    assert ours.config.n_head == 4 and ours.config.attention == "sdpa"


@pytest.mark.parametrize(
    "key, value",
    [
        ("mlp", "swiglu"),
        ("pos_embedding", "rope"),
        ("norm", "rmsnorm"),
        ("qk_norm", True),
        ("mlp_ratio", 8 / 3),
        ("logit_softcap", 30.0),
    ],
)
def test_architecture_overrides_are_refused_by_name(hf_model, key, value):
    """GPT-2's weights fix the architecture: another value is a clear error, not a shape
    mismatch deep in the copy (or, for qk_norm and softcap, silently different logits)."""
    with pytest.raises(ValueError, match=rf"model\.{key}=.* is not GPT-2's architecture") as e:
        load_hf_gpt2(hf_model.state_dict(), n_head=4, **{key: value})
    assert "\n" not in str(e.value)


def test_gpt2s_own_architecture_values_and_other_overrides_load(hf_model):
    """And overrides that repeat the weights' shape: `bias=True` with weights that have biases
    once raised TypeError (a keyword twice)."""
    ours = load_hf_gpt2(
        hf_model.state_dict(),
        n_head=4,
        mlp="gelu",
        pos_embedding="learned",
        norm="layernorm",
        mlp_ratio=4.0,
        logit_softcap=None,
        dropout=0.1,
        zero_init_proj=True,  # an init option: the loaded weights replace the zeros
        bias=True,
        n_layer=3,
        vocab_size=101,
    ).eval()
    idx = torch.randint(0, 101, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf_model(idx).logits, atol=1e-4, rtol=0)
    assert ours.config.dropout == 0.1 and ours.config.bias is True and ours.config.n_layer == 3


# ----- a foreign directory: config.json is checked, and checked against the weights ----------


def hf_dir(hf_model, path, **config_edits):
    """save_pretrained's directory with config.json edited by hand."""
    hf_model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(config_edits)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "edits, message",
    [
        (dict(n_head=5), "n_head=5 does not divide n_embd=48"),
        (dict(n_embd=8192, n_head=16), "n_embd=8192 disagrees with the weights, which give 48"),
        (dict(n_layer=24), "n_layer=24 disagrees with the weights, which give 3"),
        (dict(n_positions=4096), "n_positions=4096 disagrees with the weights, which give 32"),
        (dict(vocab_size=50257), "vocab_size=50257 disagrees with the weights, which give 101"),
        (dict(n_inner=64), "n_inner=64 is not 4 * n_embd = 192"),
        (dict(n_layer="3"), "n_layer must be a positive integer, got '3'"),
        (dict(n_head=4.0), "n_head must be a positive integer, got 4.0"),
        (dict(activation_function="relu"), "activation_function='relu' is not GPT-2's"),
        (dict(model_type="llama"), "model_type='llama' is not GPT-2's"),
    ],
)
def test_a_foreign_config_json_is_one_error_before_any_tensor_is_read(
    hf_model, tmp_path, monkeypatch, edits, message
):
    path = hf_dir(hf_model, tmp_path, **edits)

    def refuse(*args, **kwargs):
        raise AssertionError("tensors read or a model built before the check")

    monkeypatch.setattr(hf, "load_file", refuse)
    monkeypatch.setattr(hf, "GPT", refuse)
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        load_hf_gpt2(path)
    assert str(e.value).startswith(str(path / "config.json")) and "\n" not in str(e.value)


def test_a_config_json_that_is_not_an_object_is_one_error(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json is corrupt: not a JSON object"):
        load_hf_gpt2(tmp_path)


def test_an_oversized_config_json_is_refused_before_it_is_read(hf_model, tmp_path, monkeypatch):
    """A downloaded model directory cannot make the loader read gigabytes of JSON either."""
    hf_model.save_pretrained(tmp_path)
    size = (tmp_path / "config.json").stat().st_size
    monkeypatch.setattr(base.files, "MAX_JSON_BYTES", size - 1)
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("config.json was read"))
    with pytest.raises(ValueError, match=f"config.json has {size:,} bytes: too large to be a"):
        load_hf_gpt2(tmp_path)


def test_a_pytorch_bin_directory_is_checked_and_loads(hf_model, tmp_path):
    """pytorch_model.bin (read memory-mapped, weights_only) gives the same model; its
    config.json is checked against it like a safetensors directory's."""
    hf_model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    idx = torch.randint(0, 101, (1, 20))
    with torch.no_grad():
        got = load_hf_gpt2(tmp_path).eval()(idx)[0]
        torch.testing.assert_close(got, hf_model(idx).logits, atol=1e-4, rtol=0)
    hf_dir(hf_model, tmp_path, n_layer=24)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="n_layer=24 disagrees"):
        load_hf_gpt2(tmp_path)


@pytest.mark.parametrize("key, value", [("bias", False), ("n_layer", 2), ("block_size", 64)])
def test_overrides_that_contradict_the_weights_are_refused_by_name(hf_model, key, value):
    with pytest.raises(ValueError, match=rf"model\.{key}={value!r} does not match the weights"):
        load_hf_gpt2(hf_model.state_dict(), n_head=4, **{key: value})


def test_a_padded_vocabulary_adds_zero_rows_and_keeps_the_logits_and_crops_back(hf_model):
    idx = torch.randint(0, 101, (2, 32))
    with torch.no_grad():
        expected = hf_model(idx).logits  # (2, 32, 101)
    padded = load_hf_gpt2(hf_model.state_dict(), n_head=4, vocab_size=128).eval()
    assert padded.config.vocab_size == 128 and padded.config.tie_embeddings
    assert padded.transformer.wte.weight[101:].abs().sum() == 0
    with torch.no_grad():
        got, _ = padded(idx)
    torch.testing.assert_close(got[..., :101], expected, atol=1e-4, rtol=0)
    # A padded state dict (e.g. a checkpoint of a padded run) crops back to the real rows.
    state = dict(hf_model.state_dict())
    for key in ("transformer.wte.weight", "lm_head.weight"):
        state[key] = torch.cat([state[key], torch.randn(27, 48)])  # (128, 48)
    cropped = load_hf_gpt2(state, n_head=4, vocab_size=101).eval()
    assert cropped.transformer.wte.weight.shape == (101, 48)
    with torch.no_grad():
        torch.testing.assert_close(cropped(idx)[0], expected, atol=1e-4, rtol=0)
