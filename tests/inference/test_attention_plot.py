"""The attention figure: one heatmap per head, the future masked (blank, not 0), a real PNG."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.tokenizer import get_tokenizer
from inference.attention_plot import plot_attention, prompt_attention, token_labels
from model import GPT
from tests.conftest import tiny_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_config(n_layer=3, n_head=4, n_embd=32)).eval()


def test_the_plotted_probabilities_are_causal_rows_summing_to_one(model):
    idx = torch.randint(0, 101, (2, 9))
    probs = prompt_attention(model, idx)
    # last layer, first row (batch size changes the float summation order, hence close not equal)
    torch.testing.assert_close(probs, model.attention_probs(idx)[-1, 0])
    assert probs.shape == (4, 9, 9)
    assert torch.equal(probs.triu(diagonal=1), torch.zeros_like(probs))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, 9))


def test_the_layer_can_be_chosen_and_out_of_range_layers_are_refused(model):
    idx = torch.randint(0, 101, (1, 6))
    all_layers = model.attention_probs(idx)
    assert torch.equal(prompt_attention(model, idx, 0), all_layers[0, 0])
    assert torch.equal(prompt_attention(model, idx, -2), all_layers[1, 0])
    with pytest.raises(ValueError, match="attention_layer=3 is out of range"):
        prompt_attention(model, idx, 3)


def test_the_figure_is_a_png_with_one_panel_per_head_and_the_future_masked(model, tmp_path):
    idx = torch.randint(0, 101, (1, 7))
    probs = prompt_attention(model, idx)
    path = tmp_path / "plots" / "attention.png"
    fig = plot_attention(probs, [f"t{i}" for i in range(7)], path, "title")
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    heatmaps = [ax.images[0] for ax in fig.axes if ax.images]
    assert len(heatmaps) == 4
    future = np.triu(np.ones((7, 7), dtype=bool), k=1)
    for h, image in enumerate(heatmaps):
        data = image.get_array()
        assert np.array_equal(np.ma.getmaskarray(data), future)  # drawn blank, not as 0
        assert np.array_equal(data.filled(0.0), probs[h].numpy())
        assert image.get_clim() == (0.0, 1.0)  # one shared scale
    assert any(ax.get_label() == "<colorbar>" for ax in fig.axes)


def test_token_labels_make_whitespace_visible_and_stay_short():
    tok = get_tokenizer("gpt2")
    ids = tok.encode_ordinary(" hello\n internationalization")
    labels = token_labels(tok, ids)
    assert labels[0] == "␣hello"
    assert "↵" in labels
    assert all(len(label) <= 10 for label in labels)


def test_a_token_that_is_part_of_a_character_shows_its_bytes():
    """A byte tokenizer's "é" is two tokens, neither a character: each is its byte in hex,
    not a '�' apiece; a whole character stays itself."""
    tok = get_tokenizer("bytes")
    assert token_labels(tok, tok.encode_ordinary("aé")) == ["a", "C3", "A9"]
