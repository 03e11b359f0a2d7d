"""The architecture options compute what model/gpt.py's docstring says, checked by hand on tiny
inputs: the MLPs, RMSNorm, the logit softcap and zero-initialised projections. (rope: see
test_rope.py; all options against causality and the KV cache: test_causality.py and
test_kv_cache.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from model import GPT
from model.gpt import MLP, RMSNorm
from tests.conftest import tiny_config


def _mlp(kind: str, w_fc: torch.Tensor, w_proj: torch.Tensor) -> MLP:
    """An MLP with n_embd 2, no biases and the given weights (their shape sets the width)."""
    config = tiny_config(n_embd=2, n_head=1, mlp=kind, mlp_ratio=w_proj.size(1) / 2, bias=False)
    mlp = MLP(config)
    assert mlp.c_fc.weight.shape == w_fc.shape and mlp.c_proj.weight.shape == w_proj.shape
    with torch.no_grad():
        mlp.c_fc.weight.copy_(w_fc)
        mlp.c_proj.weight.copy_(w_proj)
    return mlp.eval()


def test_relu2_squares_the_positive_part():
    # x W_fc^T = (1*1 + 2*(-1), 1*2 + 2*0.5) = (-1, 3) -> ReLU^2 -> (0, 9) -> W_proj
    w_fc, w_proj = torch.tensor([[1.0, -1.0], [2.0, 0.5]]), torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    mlp = _mlp("relu2", w_fc, w_proj)
    y = mlp(torch.tensor([[[1.0, 2.0]]]))
    torch.testing.assert_close(y, torch.tensor([[[0 * 1 + 9 * 2.0, 0 * 3 - 9 * 1.0]]]))


def test_swiglu_is_silu_of_the_first_half_times_the_second():
    """n_embd 2, mlp_ratio 4: 2/3 of 8 hidden units rounded up to 8, c_fc (16, 2) = [W_1; W_3]."""
    torch.manual_seed(0)
    w1, w3, w_proj = torch.randn(8, 2), torch.randn(8, 2), torch.randn(2, 8)
    mlp = _mlp("swiglu", torch.cat([w1, w3]), w_proj)
    x = torch.tensor([[[0.5, -1.5]], [[2.0, 1.0]]])  # (B=2, T=1, C=2)
    a, b = x @ w1.T, x @ w3.T
    expected = ((a * torch.sigmoid(a)) * b) @ w_proj.T  # SiLU(a) = a * sigmoid(a)
    torch.testing.assert_close(mlp(x), expected)
    # negative control: the halves in the other order are a different function
    swapped = _mlp("swiglu", torch.cat([w3, w1]), w_proj)
    assert not torch.allclose(swapped(x), expected)


def test_gelu_is_gpt2s_tanh_approximation():
    torch.manual_seed(0)
    w_fc, w_proj = torch.randn(8, 2), torch.randn(2, 8)
    mlp = _mlp("gelu", w_fc, w_proj)
    x = torch.randn(1, 3, 2)
    h = x @ w_fc.T
    gelu = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))
    torch.testing.assert_close(mlp(x), gelu @ w_proj.T)


def test_rmsnorm_is_x_over_its_rms_times_the_gain():
    torch.manual_seed(0)
    norm = RMSNorm(6, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 7.0))
    x = torch.randn(2, 3, 6) * 5 + 2  # not centred: RMSNorm does not centre
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    assert [name for name, _ in norm.named_parameters()] == ["weight"]


@pytest.mark.parametrize("bias", [True, False])
def test_rmsnorm_models_have_no_norm_biases(bias):
    model = GPT(tiny_config(norm="rmsnorm", qk_norm=True, bias=bias))
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 2 + 1 + 2 * 2  # ln_1, ln_2 per block, ln_f, q_norm, k_norm per block
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    biases = [name for name, _ in model.named_parameters() if name.endswith("bias")]
    assert all(".c_" in name for name in biases)  # only the Linear layers', when bias is true
    assert bool(biases) == bias


def test_rmsnorm_under_bfloat16_autocast_keeps_the_input_dtype_and_does_not_warn():
    """qk_norm gets bfloat16 q and k with a float32 gain under autocast: torch's rms_norm warns
    on the mixed dtypes (a Python warning that every training step would print) and returns
    float32. RMSNorm computes in float32 and returns q's dtype."""
    torch.manual_seed(0)
    norm = RMSNorm(8)
    x = torch.randn(2, 2, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = norm(x.bfloat16())
        model = GPT(tiny_config(qk_norm=True, norm="rmsnorm", attention="sdpa"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(torch.randint(0, 101, (2, 16)), torch.randint(0, 101, (2, 16)))
        loss.backward()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), norm(x), atol=1e-2, rtol=1.6e-2)


def test_logit_softcap_bounds_the_logits_and_the_loss_uses_them():
    torch.manual_seed(0)
    free = GPT(tiny_config())
    capped = GPT(tiny_config(logit_softcap=0.05))  # below the largest logits at init
    capped.load_state_dict(free.state_dict())
    idx, targets = torch.randint(0, 101, (2, 16)), torch.randint(0, 101, (2, 16))
    raw, _ = free(idx)
    logits, _ = capped(idx)
    _, loss = capped(idx, targets)
    assert raw.abs().max() > 0.05  # the cap does bind ...
    assert logits.abs().max() < 0.05  # ... and bounds every logit
    torch.testing.assert_close(logits, 0.05 * torch.tanh(raw / 0.05))
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 101), targets.reshape(-1)))


@pytest.mark.parametrize("options", [{}, dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu")])
def test_zero_init_proj_makes_every_block_the_identity(options):
    """At init, with every projection into the residual stream at zero, the blocks add nothing:
    logits = ln_f(embedding) @ wte^T (+ wpe for learned positions)."""
    torch.manual_seed(0)
    model = GPT(tiny_config(zero_init_proj=True, **options)).eval()
    projections = [(n, p) for n, p in model.named_parameters() if n.endswith("c_proj.weight")]
    assert len(projections) == 2 * 2  # attn.c_proj and mlp.c_proj of both blocks
    assert all((p == 0).all() for _, p in projections)
    idx = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        x = model.transformer.wte(idx)
        if "wpe" in model.transformer:
            x = x + model.transformer.wpe(torch.arange(16))
        expected = model.lm_head(model.transformer.ln_f(x))
        torch.testing.assert_close(model(idx)[0], expected)
    # negative control: GPT-2's init does not start as the identity
    torch.manual_seed(0)
    default = GPT(tiny_config(**options))
    assert all(p.abs().sum() > 0 for n, p in default.named_parameters() if "c_proj.weight" in n)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_with_targets_forward_returns_the_loss_of_its_logits_and_no_logits(softcap):
    """The mean cross-entropy over targets != -1 of the logits forward returns without them."""
    torch.manual_seed(0)
    model = GPT(tiny_config(logit_softcap=softcap))
    idx, targets = torch.randint(0, 101, (2, 16)), torch.randint(0, 101, (2, 16))
    targets[0, :7] = -1
    logits, none = model(idx)
    assert logits.shape == (2, 16, 101) and none is None
    expected = F.cross_entropy(logits[targets != -1], targets[targets != -1])
    none, loss = model(idx, targets)
    assert none is None and loss.requires_grad
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
