"""GPT-2 weights in the Hugging Face layout load into our model and give the same logits."""

from __future__ import annotations

import pytest
import torch

from model.hf import load_hf_gpt2

transformers = pytest.importorskip("transformers")  # a declared dev dependency; CI installs it


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


def test_saved_directory_loads_with_its_config(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)  # config.json + model.safetensors
    ours = load_hf_gpt2(tmp_path, attention="sdpa").eval()
    idx = torch.randint(0, 101, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf_model(idx).logits, atol=1e-4, rtol=0)
    assert ours.config.n_head == 4 and ours.config.attention == "sdpa"


def test_missing_n_head_is_a_clear_error(hf_model):
    with pytest.raises(ValueError, match="n_head"):
        load_hf_gpt2(hf_model.state_dict())


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
    ).eval()
    idx = torch.randint(0, 101, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf_model(idx).logits, atol=1e-4, rtol=0)
    assert ours.config.dropout == 0.1


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
