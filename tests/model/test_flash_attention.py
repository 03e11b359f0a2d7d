"""attention=flash computes the manual formula's outputs and gradients without storing S."""

from __future__ import annotations

import pytest
import torch

from model import GPT, flash_attention
from model.flash_attention import flash_causal_attention, key_tiles, query_tiles, tile_keep_mask
from model.gpt import causal_attention
from model.inspection import attention_probs
from tests.conftest import tiny_config
from tests.model.conftest import assert_gives_manuals_logits_and_gradients, find_leaks


def _qkv(B: int, H: int, Tq: int, Tk: int, hs: int, dtype=torch.float32):
    q = torch.randn(B, H, Tq, hs, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H, Tk, hs, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, Tk, hs, dtype=dtype, requires_grad=True)
    return q, k, v


def _allowed(Tq: int, Tk: int) -> torch.Tensor:
    """(Tq, Tk): the queries are the last Tq of Tk positions, as with a KV cache."""
    return torch.ones(Tk, Tk, dtype=torch.bool).tril()[Tk - Tq :]


@pytest.mark.parametrize(
    "B,H,Tq,Tk,hs,block_q,block_k",
    [
        (1, 1, 1, 1, 8, 4, 4),  # a single position
        (2, 3, 37, 37, 16, 8, 16),  # T not a multiple of either tile size
        (2, 2, 33, 33, 8, 7, 5),  # odd, unequal tiles: many diagonal-straddling shapes
        (1, 2, 10, 10, 8, 64, 64),  # tiles larger than T
        (1, 2, 5, 23, 8, 4, 3),  # Tq < Tk: queries after a cached prefix
        (2, 2, 1, 20, 8, 4, 4),  # one decoding step over a cache
    ],
)
def test_outputs_and_gradients_equal_manual_in_float32(B, H, Tq, Tk, hs, block_q, block_k):
    torch.manual_seed(0)
    q, k, v = _qkv(B, H, Tq, Tk, hs)
    expected = causal_attention(q, k, v, _allowed(Tq, Tk))
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    out = flash_causal_attention(q, k, v, block_q, block_k)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    for name, got, want in zip("qkv", grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


def test_bfloat16_is_within_bfloat16_rounding_of_float32_manual():
    """Tiles are computed in float32 and only the results are rounded to bfloat16, so the error
    is bfloat16's (8 bits of mantissa: ~0.4% relative): rtol 1.6e-2 (torch's bf16 default)
    plus atol 1e-2 for entries near zero, against manual in float32 on the same bf16 inputs."""
    torch.manual_seed(0)
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in _qkv(2, 3, 70, 70, 16))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    expected = causal_attention(q32, k32, v32, _allowed(70, 70))
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q32, k32, v32), grad_out)
    out = flash_causal_attention(q, k, v, 16, 16)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.bfloat16())
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    tol = dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), expected, **tol)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got.float(), want, **tol)


def test_tiles_above_the_diagonal_are_never_computed():
    """A NaN in V (or K) at position 8 poisons every output whose tile touches key 8, masked or
    not (0 * NaN = NaN): with 4 x 4 tiles, queries 0..7 never visit key tile 8..11, so they
    stay finite. Negative control: manual multiplies the whole S by V and poisons every row."""
    torch.manual_seed(0)
    q, k, v = _qkv(1, 2, 16, 16, 8)
    with torch.no_grad():
        v[:, :, 8] = float("nan")
    out = flash_causal_attention(q, k, v, 4, 4)  # (1, 2, 16, 8)
    assert out[:, :, :8].isfinite().all()
    assert out[:, :, 8:].isnan().all()  # the NaN does spread where the tile is visited
    manual = causal_attention(q, k, v, _allowed(16, 16))
    assert manual.isnan().all()

    q, k, v = _qkv(1, 2, 16, 16, 8)
    with torch.no_grad():
        k[:, :, 8] = float("nan")
    out = flash_causal_attention(q, k, v, 4, 4)
    (dq,) = torch.autograd.grad(out[:, :, :8].sum(), q)
    assert dq[:, :, :8].isfinite().all()  # the backward pass skips the same tiles


def test_causality_checks_catch_flash_without_its_diagonal_mask(monkeypatch):
    """Negative control for test_causality's flash cases: drop the mask on the tiles that
    straddle the diagonal and the leak must be reported."""
    monkeypatch.setattr(flash_attention, "_masked", lambda s, *_: s)
    torch.manual_seed(0)
    leaky = GPT(tiny_config(attention="flash", flash_block_q=4, flash_block_k=4)).eval()
    assert find_leaks(leaky)


@pytest.mark.parametrize("options", ["gpt2", "all"])
def test_the_model_with_flash_gives_manual_logits_and_gradients(options):
    tiles = dict(flash_block_q=4, flash_block_k=6)
    assert_gives_manuals_logits_and_gradients(options, T=16, attention="flash", **tiles)


def test_kv_cached_steps_over_several_tiles_match_the_full_forward():
    torch.manual_seed(0)
    model = GPT(tiny_config(attention="flash", flash_block_q=2, flash_block_k=3)).eval()
    idx = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_kv_cache(batch_size=2)
        chunks = [model(idx[:, a:b], cache=cache)[0] for a, b in [(0, 5), (5, 11), (11, 12)]]
        steps = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(12, 16)]
    torch.testing.assert_close(torch.cat([*chunks, *steps], dim=1), full, atol=1e-5, rtol=0)


def test_asking_for_the_weights_falls_back_to_the_manual_formula():
    torch.manual_seed(0)
    manual = GPT(tiny_config(attention="manual")).eval()
    flash = GPT(tiny_config(attention="flash")).eval()
    flash.load_state_dict(manual.state_dict())
    idx = torch.randint(0, 101, (2, 16))
    torch.testing.assert_close(attention_probs(flash, idx), attention_probs(manual, idx))


def test_dropout_is_manual_attention_with_the_per_tile_masks():
    """With dropout, each tile's keep-mask is a function of (seed, tile): assembling those
    masks into one (Tq, Tk) mask must give the formula (S * keep / (1 - p)) V exactly."""
    torch.manual_seed(0)
    p, seed, Tq, Tk, block_q, block_k = 0.3, 123, 11, 14, 4, 5
    q, k, v = _qkv(2, 2, Tq, Tk, 8)
    keep = torch.zeros(2, 2, Tq, Tk, dtype=torch.bool)
    for q0, q1 in query_tiles(Tq, block_q):
        for k0, k1, _ in key_tiles(q0, q1, Tk, Tk - Tq, block_k):
            shape = torch.Size((2, 2, q1 - q0, k1 - k0))
            keep[:, :, q0:q1, k0:k1] = tile_keep_mask(seed, q0, k0, Tk, shape, p, q.device)
    _, probs = causal_attention(q, k, v, _allowed(Tq, Tk), with_probs=True)
    expected = (probs * keep / (1 - p)) @ v  # (B, nh, Tq, hs)
    out = flash_causal_attention(q, k, v, block_q, block_k, dropout_p=p, seed=seed)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    kept = keep[_allowed(Tq, Tk).expand_as(keep)].float().mean().item()
    assert kept == pytest.approx(1 - p, abs=0.1)


def test_dropout_masks_follow_torch_seed():
    q, k, v = _qkv(1, 2, 9, 9, 8)
    torch.manual_seed(1)
    a = flash_causal_attention(q, k, v, 4, 4, dropout_p=0.5)
    torch.manual_seed(1)
    b = flash_causal_attention(q, k, v, 4, 4, dropout_p=0.5)
    c = flash_causal_attention(q, k, v, 4, 4, dropout_p=0.5)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("field", ["flash_block_q", "flash_block_k"])
@pytest.mark.parametrize("value", [0, -4, 2.5])
def test_tile_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=rf"model\.{field}"):
        tiny_config(**{field: value})


def test_more_queries_than_keys_is_refused():
    q, k, v = _qkv(1, 1, 5, 4, 8)
    with pytest.raises(ValueError, match="5 > 4"):
        flash_causal_attention(q, k, v)


def _errors_vs_float64(attend, q, k, v, g):
    """Max abs error of the output and of dQ, dK, dV against float64 attention of the same
    bfloat16 inputs, `attend` running under CPU bfloat16 autocast."""
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(*inputs)
    grads = torch.autograd.grad(out, inputs, g)
    errors = [(out.double() - ref).abs().max()]
    errors += [(a.double() - b).abs().max() for a, b in zip(grads, ref_grads, strict=True)]
    return torch.stack(errors)


@pytest.mark.parametrize("sharpness", [2.0, 4.0])
def test_bfloat16_autocast_error_is_sdpas_at_a_trained_models_sharpness(sharpness):
    """Under autocast, bfloat16 q, k, v (as a Linear gives them) with scores as sharp as a trained
    model's: flash's error against float64 stays within 1.5x of SDPA's, output and gradients.
    Rounding the tile scores to bfloat16 before the softmax gave 9-22x SDPA's error here."""
    torch.manual_seed(0)
    B, H, T, hs = 1, 2, 512, 64
    q, k = (
        (sharpness * torch.randn(B, H, T, hs)).bfloat16(),
        (sharpness * torch.randn(B, H, T, hs)).bfloat16(),
    )
    v = torch.randn(B, H, T, hs).bfloat16()
    g = torch.randn(B, H, T, hs).bfloat16()

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    flash = _errors_vs_float64(flash_causal_attention, q, k, v, g)
    reference = _errors_vs_float64(sdpa, q, k, v, g)
    assert (flash <= 1.5 * reference).all(), (flash, reference)
