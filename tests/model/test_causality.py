"""The model is causal: the logits at position t depend on tokens <= t and on nothing after t.

Each check runs on every preset's head count (narrowed and made shallow for speed), on every
architecture option, with every attention implementation, in eval mode and in train mode with
dropout on; and each check is run on deliberately leaky variants, which it must catch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import ATTENTION_IMPLS, GPT, GPTConfig, load_preset, preset_names
from model.causality import find_leaks, jacobian_leaks, perturbation_leaks
from model.hf import GPT2_ARCHITECTURE
from tests.model.conftest import ARCHITECTURES

HEAD_SIZE = 4  # narrow heads keep gpt2-xl's 25 heads fast
# At most 2 layers of each preset: the causal mask is the same in every layer, so a leak shows
# at depth 1, and a second layer covers a leak reaching the logits through a later layer.
# gpt2-xl's 48 layers made its cases 10-40 s each and told nothing that 2 layers do not.
MAX_LAYERS = 2


def scaled_preset(name: str, attention: str, dropout: float) -> GPTConfig:
    p = load_preset(name)
    return GPTConfig(
        vocab_size=97,
        block_size=16,
        n_layer=min(p["n_layer"], MAX_LAYERS),
        n_head=p["n_head"],
        n_embd=HEAD_SIZE * p["n_head"],
        dropout=dropout,
        bias=p["bias"],
        attention=attention,
        tie_embeddings=p["tie_embeddings"],
    )


def with_options(options: str, attention: str, dropout: float) -> GPTConfig:
    return GPTConfig(
        vocab_size=97,
        block_size=16,
        n_layer=2,
        n_head=2,
        n_embd=16,
        dropout=dropout,
        attention=attention,
        **ARCHITECTURES[options],
    )


def test_every_preset_is_covered():
    assert {"nano", "mini", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"} <= set(preset_names())


def test_every_architecture_option_is_covered():
    """Each option of GPT2_ARCHITECTURE (mlp_ratio only resizes) at a non-GPT-2 value."""
    changed = {key for options in ARCHITECTURES.values() for key in options}
    assert set(GPT2_ARCHITECTURE) - {"mlp_ratio"} <= changed
    assert {options["mlp"] for options in ARCHITECTURES.values() if "mlp" in options} == {
        "relu2",
        "swiglu",
    }


def assert_causal(config: GPTConfig, mode: str) -> None:
    """Both checks find no leak, in eval mode or in train mode (dropout on)."""
    torch.manual_seed(0)
    model = GPT(config)
    model.train(mode == "train")
    idx = torch.randint(0, 97, (2, 12))
    assert perturbation_leaks(model, idx) == []
    assert jacobian_leaks(model, idx) == []


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("attention", ATTENTION_IMPLS)
@pytest.mark.parametrize("preset", preset_names())
def test_future_tokens_cannot_change_past_logits(preset, attention, mode):
    assert_causal(scaled_preset(preset, attention, dropout=0.1 if mode == "train" else 0.0), mode)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("attention", ATTENTION_IMPLS)
@pytest.mark.parametrize("options", ARCHITECTURES)
def test_every_architecture_option_is_causal(options, attention, mode):
    assert_causal(with_options(options, attention, dropout=0.1 if mode == "train" else 0.0), mode)


def _leaky(model: GPT, allowed: torch.Tensor) -> GPT:
    for block in model.transformer.h:
        block.attn.causal_mask = allowed
    return model


LEAKS = {
    "no mask": lambda n: torch.ones(n, n, dtype=torch.bool),
    "off by one": lambda n: torch.ones(n, n, dtype=torch.bool).tril(diagonal=1),
}


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("leak", LEAKS)
@pytest.mark.parametrize("options", ["gpt2", "rope", "all"])
def test_checks_catch_a_leaky_mask(options, leak, mode):
    """rope moves positions into attention: a leak must still show once it does."""
    torch.manual_seed(0)
    model = GPT(with_options(options, "manual", dropout=0.1 if mode == "train" else 0.0))
    model.train(mode == "train")
    _leaky(model, LEAKS[leak](16))
    idx = torch.randint(0, 97, (3, 12))
    perturbation = perturbation_leaks(model, idx)
    jacobian = jacobian_leaks(model, idx)
    # every position but the last sees at least one future token
    assert len(perturbation) == 11 and all("moved" in line for line in perturbation)
    assert len(jacobian) == 11 and all("reaches positions > t" in line for line in jacobian)


def test_checks_catch_sdpa_without_is_causal(monkeypatch):
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, is_causal, **k: sdpa(*a, is_causal=False, **k)
    )
    torch.manual_seed(0)
    model = GPT(scaled_preset("nano", "sdpa", dropout=0.0)).eval()
    assert find_leaks(model)


def test_a_model_blind_to_its_own_input_is_reported():
    """The second half of the perturbation check: logits after t must react to the tokens."""
    torch.manual_seed(0)
    config = scaled_preset("nano", "manual", dropout=0.0)
    config.tie_embeddings = False
    model = GPT(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.zero_()  # every token looks the same
    problems = perturbation_leaks(model, torch.randint(0, 97, (2, 8)))
    assert problems and all("ignore the tokens" in p for p in problems)


def test_find_leaks_is_empty_for_the_default_model():
    torch.manual_seed(0)
    assert find_leaks(GPT(scaled_preset("mini", "manual", dropout=0.1)).train()) == []
