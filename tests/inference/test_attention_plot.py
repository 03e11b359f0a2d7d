"""The attention figure: one heatmap per head, the future masked (blank, not 0), a real PNG."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from base.errors import ConfigError
from data.tokenizer import get_tokenizer
from inference.attention_plot import (
    formula_view,
    plot_attention,
    plot_formula,
    prompt_attention,
    row_lines,
    token_labels,
)
from model import GPT
from model.inspection import attention_probs, formula_steps
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
    torch.testing.assert_close(probs, attention_probs(model, idx)[-1, 0])
    assert probs.shape == (4, 9, 9)
    assert torch.equal(probs.triu(diagonal=1), torch.zeros_like(probs))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, 9))


def test_the_layer_can_be_chosen_and_out_of_range_layers_are_refused(model):
    idx = torch.randint(0, 101, (1, 6))
    all_layers = attention_probs(model, idx)
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


def test_the_formula_view_is_the_models_steps_and_its_row_adds_up(model):
    """formula_view's numbers are formula_steps' for the chosen head; the row's softmax is its
    exponentials over their sum, y_i its weighted sum of the value rows; the head shares
    recompose the layer's output; the variance shrinks by d_k when scaled."""
    idx = torch.randint(0, 101, (1, 9))
    view = formula_view(model, idx, layer=1, head=2, row=5)
    steps = formula_steps(model, idx, 1)
    S = torch.tensor(view["steps"]["S"], dtype=torch.float64)
    torch.testing.assert_close(S, steps["S"][2].double(), atol=1e-6, rtol=0)
    assert view["steps"]["masked"][5][6] is None and view["steps"]["masked"][5][5] is not None
    row, d_k = view["row"], view["d_k"]
    assert d_k == 8 and len(row["dots"]) == 6  # query 5 sees keys 0..5
    weights = np.array(row["exps"]) / row["sum"]
    np.testing.assert_allclose(weights, row["weights"], atol=1e-6)  # S is the model's float32
    np.testing.assert_allclose(np.array(row["dots"]) / np.sqrt(d_k), row["scaled"], atol=1e-9)
    v = steps["V"][2, :6].double().numpy()  # (6, hs): the value rows query 5 sees
    np.testing.assert_allclose(np.array(row["weights"]) @ v, row["y"], atol=1e-6)
    s = view["sqrt_dk"]
    assert s["var_scaled"] == pytest.approx(s["var_raw"] / d_k)
    # without the division the scores are sqrt(d_k) times larger: a peakier softmax
    assert s["largest_unscaled"] >= s["largest"] and s["entropy_unscaled"] <= s["entropy"]
    assert len(view["heads"]["S"]) == 4 and min(view["heads"]["shares"]) > 0


@pytest.mark.parametrize("key, value", [("layer", 3), ("head", 4), ("row", 9), ("head", True)])
def test_the_formula_view_refuses_a_layer_head_or_row_out_of_range(model, key, value):
    args = dict(layer=0, head=0, row=None) | {key: value}
    with pytest.raises(ConfigError, match=f"{key}={value!r} is out of range"):
        formula_view(model, torch.randint(0, 101, (1, 9)), **args)


@pytest.mark.parametrize("T", [1, 7, 128])
def test_the_formula_figure_draws_every_step_the_row_and_labels(tmp_path, T):
    """Issue 55 item 7: X through W_O, the chosen row outlined in every matrix and drawn as bars
    beside its computation; labels thinned to MAX_TICKS (and the row's); the figure grows with
    the text (128 tokens: 6 inches a square step)."""
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=1, n_head=4, n_embd=32, block_size=128)).eval()
    view = formula_view(model, torch.randint(0, 101, (1, T)), layer=0, head=1)
    labels = [f"t{i}" for i in range(T)]
    fig = plot_formula(view, labels, tmp_path / "formula.png")
    assert (tmp_path / "formula.png").read_bytes().startswith(PNG_SIGNATURE)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    steps = ["X (the layer's input, normed)", "Q = X W_Q", "K = X W_K", "V = X W_V", "Q K^T"]
    steps += ["/ sqrt(8)", "mask: -inf above", "S = softmax", "Y = S V", "heads side by side"]
    steps += ["Y W_O^T: output", f"S[{T - 1}, j]: query {T - 1}"]
    assert [t[: len(s)] for t, s in zip(titles, steps, strict=True)] == steps
    matrices = [ax for ax in fig.axes if ax.get_images()]
    assert len(matrices) == 11
    for ax in matrices:  # the chosen (last) row outlined in red, its label shown
        rows = [p.get_y() + 0.5 for p in ax.patches if p.get_edgecolor()[:3] == (1, 0, 0)]
        assert T - 1 in rows, ax.get_title()
        shown = [t.get_text() for t in ax.get_yticklabels()]
        assert f"t{T - 1}" in shown and len(shown) <= 41
    assert fig.get_size_inches()[0] == pytest.approx(4 * max(3, 6 * T / 128))


def test_the_rows_lines(model):
    idx = torch.randint(0, 101, (1, 7))
    view = formula_view(model, idx, layer=0, head=1)
    labels = [f"t{i}" for i in range(7)]
    lines = row_lines(view, labels)
    assert lines[0].startswith("layer 0, head 1, query 6 ('t6')")
    assert lines[2].startswith("/ sqrt(8)") and lines[-1].startswith("why / sqrt(d_k)")
