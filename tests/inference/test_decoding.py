"""The decoding layout: SplitLinear computes nn.Linear's values for any split of the columns; a
decoding copy gives the model's logits for every option, sharing everything but the Linears; it
is taken for float32 weights on a CPU (FSDP's shards: tests/parallel/test_wrapping.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.decoding import SplitLinear, decodes_from_a_copy, decoding_copy
from model import GPT
from tests.conftest import tiny_config
from tests.model.conftest import ARCHITECTURES


@pytest.mark.parametrize("parts", [1, 2, 3, 8])  # 3 and 8 leave the last block padded
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(), (1, 1), (2, 5)], ids=["vector", "one-token", "batch"])
def test_split_linear_computes_the_linear_layer(parts, bias, lead):
    torch.manual_seed(0)
    linear = nn.Linear(12, 7, bias=bias)
    x = torch.randn(*lead, 12)
    split = SplitLinear(linear, parts)
    assert split.blocks.shape == (parts, 12, -(-7 // parts))
    y = split(x)
    assert y.shape == (*lead, 7)
    torch.testing.assert_close(y, linear(x), atol=1e-6, rtol=1e-5)


def test_a_wrong_block_layout_shows():
    torch.manual_seed(0)
    linear = nn.Linear(12, 8)
    split = SplitLinear(linear, 2)
    x = torch.randn(3, 12)
    split.blocks = split.blocks.flip(0)  # the two halves of the output swapped
    assert not torch.allclose(split(x), linear(x))


def test_split_linear_is_a_detached_copy():
    linear = nn.Linear(4, 6)
    split = SplitLinear(linear, 2)
    assert not split.blocks.requires_grad
    assert split.blocks.untyped_storage().data_ptr() != linear.weight.untyped_storage().data_ptr()
    assert list(split.state_dict()) == []  # nothing of it is ever saved in a checkpoint


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_decoding_copy_gives_the_models_logits(arch):
    torch.manual_seed(0)
    model = GPT(tiny_config(**ARCHITECTURES[arch])).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    decoder = decoding_copy(model, parts=2)
    idx = torch.randint(0, 101, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(decoder(idx)[0], model(idx)[0], atol=1e-5, rtol=1e-4)
        cache, decoder_cache = model.new_kv_cache(2), decoder.new_kv_cache(2)
        model(idx[:, :11], cache=cache), decoder(idx[:, :11], cache=decoder_cache)
        torch.testing.assert_close(
            decoder(idx[:, 11:], cache=decoder_cache)[0],
            model(idx[:, 11:], cache=cache)[0],
            atol=1e-5,
            rtol=1e-4,
        )
    # the model itself is untouched: its own Linears, its own values
    assert all(type(m) is not SplitLinear for m in model.modules())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], atol=0, rtol=0)


def test_a_decoding_copy_shares_everything_but_the_linear_layers():
    model = GPT(tiny_config(tie_embeddings=True)).eval()
    decoder = decoding_copy(model, parts=2)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert "lm_head" in linears and len(linears) == 1 + 4 * model.config.n_layer
    modules = dict(decoder.named_modules())
    assert all(isinstance(modules[name], SplitLinear) for name in linears)
    assert not any(isinstance(m, nn.Linear) for m in decoder.modules())
    assert decoder.transformer.wte.weight is model.transformer.wte.weight  # shared, not copied
    assert decoder.transformer.ln_f.weight is model.transformer.ln_f.weight
    assert decoder.transformer.h[0].attn.causal_mask is model.transformer.h[0].attn.causal_mask


def test_generation_decodes_from_a_copy_only_for_float32_weights_on_a_cpu():
    model = GPT(tiny_config())
    assert decodes_from_a_copy(model)
    assert not decodes_from_a_copy(model.to(torch.bfloat16))  # nn.Linear's own path
