"""pos_embedding=rope rotates each head's q and k by their positions: rotations keep lengths, and
a query-key score depends on the two vectors and the distance between their positions only."""

from __future__ import annotations

import pytest
import torch

from model import GPT, gpt
from model.gpt import apply_rope, rope_tables
from model.inspection import attention_probs
from tests.conftest import tiny_config


def _rotated(x: torch.Tensor, position: int, base: float = 10000.0) -> torch.Tensor:
    """x (hs,) rotated as if it stood at `position`."""
    cos, sin = rope_tables(torch.tensor([position]), x.numel(), base)
    return apply_rope(x.view(1, 1, 1, -1), cos, sin).view(-1)


def test_rotation_preserves_every_pairs_norm():
    torch.manual_seed(0)
    cos, sin = rope_tables(torch.arange(64), head_size=16, base=10000.0)
    x = torch.randn(2, 3, 64, 16, dtype=torch.float64)
    y = apply_rope(x, cos.double(), sin.double())  # (B, nh, T, hs)
    assert y.shape == x.shape and y.dtype == x.dtype
    # each pair (x_i, x_{i + hs/2}) is rotated in its own plane: every pair keeps its length
    pair_norms = lambda t: torch.hypot(*t.chunk(2, dim=-1))  # noqa: E731
    torch.testing.assert_close(pair_norms(y), pair_norms(x))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0: angle 0, unchanged
    assert not torch.allclose(y[:, :, 1:], x[:, :, 1:])


def test_rotation_follows_the_formula_of_the_docstring():
    hs, base, p = 8, 100.0, 5
    x = torch.arange(1.0, hs + 1)
    y = _rotated(x, p, base)
    for i in range(hs // 2):
        angle = torch.tensor(p * base ** (-2 * i / hs))
        a, b = x[i], x[i + hs // 2]
        torch.testing.assert_close(y[i], a * angle.cos() - b * angle.sin())
        torch.testing.assert_close(y[i + hs // 2], a * angle.sin() + b * angle.cos())


@pytest.mark.parametrize("m, n, shift", [(3, 1, 5), (7, 7, 20), (0, 9, 30), (12, 2, 1)])
def test_scores_depend_only_on_the_relative_position(m, n, shift):
    """q at position m and k at n score the same as q at m + shift and k at n + shift."""
    torch.manual_seed(0)
    q, k = torch.randn(32), torch.randn(32)
    score = _rotated(q, m) @ _rotated(k, n)
    shifted = _rotated(q, m + shift) @ _rotated(k, n + shift)
    torch.testing.assert_close(shifted, score, atol=1e-5, rtol=1e-5)
    # ... and not the same once the distance changes: the positions do reach the score
    moved = _rotated(q, m) @ _rotated(k, n + 1)
    assert not torch.isclose(moved, score, atol=1e-3)


def test_a_rope_model_has_no_position_table():
    torch.manual_seed(0)
    model = GPT(tiny_config(pos_embedding="rope"))
    assert "wpe" not in model.transformer
    assert not any("wpe" in name for name, _ in model.named_parameters())
    assert model.num_params(exclude_positions=True) == model.num_params(exclude_positions=False)
    learned = GPT(tiny_config())
    assert learned.num_params(exclude_positions=False) - model.num_params() == 16 * 16  # wpe
    assert all(key.startswith(("transformer.", "lm_head.")) for key in model.state_dict())


def test_a_rope_model_sees_the_order_of_its_tokens(monkeypatch):
    """Without wpe, positions enter only through the rotations: swapping two earlier tokens
    must change the last position's logits (it would not for attention without positions)."""
    torch.manual_seed(0)
    model = GPT(tiny_config(pos_embedding="rope", n_layer=1)).eval()
    idx = torch.randint(0, 101, (1, 8))
    swapped = idx.clone()
    swapped[0, [2, 5]] = idx[0, [5, 2]]
    with torch.no_grad():
        assert not torch.allclose(model(idx)[0][0, -1], model(swapped)[0][0, -1], atol=1e-6)
        monkeypatch.setattr(gpt, "rope_tables", lambda pos, *_: (1.0, 0.0))  # angle 0: no ...
        torch.testing.assert_close(model(idx)[0][0, -1], model(swapped)[0][0, -1])  # ... blind


def test_attention_probs_use_the_rotated_queries_and_keys():
    """attention_probs (the formula, whatever `attention` is) recomputed by hand from layer 0's
    q and k, rotated by their positions."""
    torch.manual_seed(0)
    model = GPT(tiny_config(pos_embedding="rope", qk_norm=True, attention="flash")).eval()
    idx = torch.randint(0, 101, (2, 16))
    S = attention_probs(model, idx)  # (n_layer, B, nh, T, T)
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        x = model.transformer.h[0].ln_1(model.transformer.wte(idx))
        q, k, _ = attn.c_attn(x).split(16, dim=2)
        q, k = (t.view(2, 16, 2, 8).transpose(1, 2) for t in (q, k))  # (B, nh, T, hs)
        q, k = attn.q_norm(q), attn.k_norm(k)
        tables = rope_tables(torch.arange(16), 8, 10000.0)  # positions 0..15
        q, k = apply_rope(q, *tables), apply_rope(k, *tables)
        scores = (q @ k.transpose(-2, -1)) / 8**0.5
        scores = scores.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(S[0], scores.softmax(-1))


def test_tables_stay_float32_in_a_bfloat16_model(monkeypatch):
    """sample.py runs `model.to(bfloat16)`: cos and sin must not be rounded to bfloat16 (off by
    up to 2^-9, a rotation that no longer keeps lengths), only the rotated q and k are."""
    model = GPT(tiny_config(pos_embedding="rope", block_size=1024)).to(torch.bfloat16)
    seen = []
    tables = gpt.rope_tables
    monkeypatch.setattr(gpt, "rope_tables", lambda *a: seen.append(tables(*a)) or seen[-1])
    with torch.no_grad():
        model(torch.zeros(1, 1004, dtype=torch.long))  # positions 0 .. 1003
    cos, sin = seen[0]
    assert cos.dtype == sin.dtype == torch.float32
    angles = torch.arange(1000, 1004, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, 8, 2, dtype=torch.float64) / 8
    )
    torch.testing.assert_close(cos[0, 1000:].double(), angles.cos(), atol=1e-4, rtol=0)
    assert (
        cos[0, 1000:].double() - angles.cos()
    ).abs().max() < 2**-9 / 4  # not bfloat16's rounding
    assert model.transformer.wte.weight.dtype == torch.bfloat16  # the rest is cast
    x = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    assert apply_rope(x, cos[:, 1000:], sin[:, 1000:]).dtype == torch.bfloat16


def test_a_bfloat16_rope_model_is_within_rounding_of_float32():
    torch.manual_seed(0)
    model = GPT(tiny_config(pos_embedding="rope", norm="rmsnorm", qk_norm=True)).eval()
    idx = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        expected, _ = model(idx)
        got, _ = model.to(torch.bfloat16)(idx)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1.6e-2)
