"""The model is causal: the logits at position t depend on tokens <= t and on nothing after t.

Each check runs on every preset's head count (narrowed and made shallow for speed), on every
value of every option of GPTConfig (the matrix in conftest.py, generated from its fields), with
every attention implementation, in eval mode and in train mode with dropout on; and each check
is run on deliberately leaky variants, which it must catch and localise
(test_causality_controls.py has one per kind of leak).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig
from model.causality import (
    CausalityError,
    assert_causal,
    audit_function,
    check_causality,
    jacobian_check,
    perturbation_check,
    shrunk_config,
)
from model.gpt import unavailable_attention
from tests.conftest import PRESETS, ROOT, load_preset
from tests.model.conftest import (
    ARCHITECTURES,
    AXES,
    OPTION_VALUES,
    SIZES,
    TRITON_OPTIONS,
    find_leaks,
    matrix,
    random_projections,
)

# At most 2 layers of each preset: the causal mask is the same in every layer, so a leak shows
# at depth 1, and a second layer covers a leak reaching the logits through a later layer.
# gpt2-xl's 48 layers made its cases 10-40 s each and told nothing that 2 layers do not.
MAX_LAYERS = 2


DROPOUT = {"eval": 0.0, "train": 0.1}

TRITON_PRESETS = ["nano"]  # see TRITON_OPTIONS


def scaled_preset(name: str, attention: str, mode: str = "eval") -> GPTConfig:
    """The preset's options and head count at 4 dimensions per head (narrow heads keep gpt2-xl's
    25 heads fast) and a 64-token vocabulary: the copy check_causality.py and the guard check."""
    config = shrunk_config(load_preset(name), MAX_LAYERS)
    return dataclasses.replace(config, attention=attention, dropout=DROPOUT[mode])


def with_options(options: str, attention: str, mode: str = "eval") -> GPTConfig:
    sizes = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    return GPTConfig(**sizes, dropout=DROPOUT[mode], attention=attention, **ARCHITECTURES[options])


def test_every_preset_is_covered():
    assert {"nano", "mini", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"} <= set(PRESETS)


def test_every_config_field_is_in_the_option_matrix():
    """A new GPTConfig field fails here until it is a size, an axis or an option with values."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    assert fields == SIZES | AXES | set(OPTION_VALUES)
    assert not (SIZES & AXES or (SIZES | AXES) & set(OPTION_VALUES))


def test_the_option_matrix_takes_every_allowed_value():
    """Boolean options take both values, every value is valid and the first is the default (the
    choice fields' values are GPTConfig's own tuples: tests/model/conftest.py)."""
    defaults = GPTConfig()
    for key, values in OPTION_VALUES.items():
        if isinstance(getattr(defaults, key), bool):
            assert set(values) == {True, False}, key
        assert values[0] == getattr(defaults, key), key
        for value in values:
            GPTConfig(**{key: value})  # valid


def causal_in(config: GPTConfig, mode: str) -> None:
    """Both checks find no leak, in eval mode or in train mode (dropout on)."""
    torch.manual_seed(0)
    model = random_projections(GPT(config)).train(mode == "train")
    idx = torch.randint(0, 64, (2, 10))
    for check in (perturbation_check(model, idx), jacobian_check(model, idx)):
        assert check.passed, check.line()
        assert check.largest == 0.0


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("preset,attention", matrix(PRESETS, TRITON_PRESETS))
def test_future_tokens_cannot_change_past_logits(preset, attention, mode):
    causal_in(scaled_preset(preset, attention, mode), mode)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("options,attention", matrix(list(ARCHITECTURES), TRITON_OPTIONS))
def test_every_architecture_option_is_causal(options, attention, mode):
    causal_in(with_options(options, attention, mode), mode)


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
@pytest.mark.parametrize("options", ["gpt2", "pos_embedding=rope", "all"])
def test_checks_catch_a_leaky_mask_and_localise_it(options, leak, mode):
    """rope moves positions into attention: a leak must still show once it does; nothing
    before layer 0's attention sees the future, so that is where it enters."""
    torch.manual_seed(0)
    config = with_options(options, "manual", mode)
    model = _leaky(random_projections(GPT(config)).train(mode == "train"), LEAKS[leak](16))
    idx = torch.randint(0, 64, (3, 10))
    for check in (perturbation_check(model, idx), jacobian_check(model, idx)):
        assert not check.passed and check.largest > 0
        assert check.leak.where == "layer 0 attn" and check.leak.source > check.leak.t
        assert str(check.leak).startswith("leak: layer 0 attn: output at t=")
    assert not check_causality(model, seq_len=6, attention=("manual",)).causal


def test_checks_catch_sdpa_without_is_causal(monkeypatch):
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, is_causal, **k: sdpa(*a, is_causal=False, **k)
    )
    torch.manual_seed(0)
    model = GPT(scaled_preset("nano", "sdpa")).eval()
    leaks = find_leaks(model)
    assert leaks and all("leak: layer 0 attn: output at t=" in line for line in leaks)


def test_a_model_blind_to_its_own_input_is_reported():
    """The second half of the perturbation check: logits at s must react to the token at s."""
    torch.manual_seed(0)
    config = scaled_preset("nano", "manual")
    config.tie_embeddings = False
    model = GPT(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.zero_()  # every token looks the same
    check = perturbation_check(model, torch.randint(0, 64, (2, 8)))
    assert check.leak is None and len(check.problems) == 7 and not check.passed
    assert all("ignore the token" in p for p in check.problems)


def test_find_leaks_is_empty_for_the_default_model():
    torch.manual_seed(0)
    assert find_leaks(GPT(scaled_preset("mini", "manual", "train")).train()) == []


def test_check_causality_runs_every_check_on_every_implementation_and_keeps_the_mode():
    torch.manual_seed(0)
    model = GPT(with_options("all", "sdpa")).train()
    report = check_causality(model, seq_len=6)
    assert report.causal and report.first_leak is None and model.training
    kinds = ["perturbation (eval)", "jacobian (eval)", "kv-cache (eval)"]
    kinds += ["perturbation (train, dropout 0.1)", "jacobian (train, dropout 0.1)"]
    cannot = unavailable_attention(torch.device("cpu"))  # triton, where its package is missing
    own_first = [a for a in ("sdpa", "manual", "flash", "triton") if a not in cannot]
    assert [c.name for c in report.checks] == [f"{a} {k}" for a in own_first for k in kinds]
    summary = report.summary()
    assert summary["causal"] and summary["first_leak"] is None
    assert summary["checks"]["flash kv-cache (eval)"]["positions"] == 6


def test_assert_causal_passes_quietly_and_raises_with_the_localised_report():
    torch.manual_seed(0)
    model = GPT(with_options("gpt2", "manual"))
    assert_causal(model, seq_len=6)
    _leaky(model, LEAKS["off by one"](16))
    with pytest.raises(CausalityError, match="manual perturbation \\(eval\\): leak: layer 0 attn"):
        assert_causal(model, seq_len=6, attention=("manual",))


def test_the_docs_own_model_passes_and_its_maskless_twin_is_caught_where_it_leaks():
    """docs/model.md's five-line attention, run as it is there: assert_causal takes any function
    of ids to logits; the masked model passes, the one that forgets its mask is named at the
    first logit that moves with a later token (issue 57, item 2's own-model use)."""
    doc = (ROOT / "docs" / "model.md").read_text()
    block = doc.split("A five-line attention that forgets its mask")[1]
    code = block.split("```python\n")[1].split("```")[0]
    expected = "perturbation: leak: logits: output at t=2 depends on input at t=3 (|d|=2.3e-01)"
    assert expected in code  # the output the docs show is the one the code gives
    *passes, fails = code.split("assert_causal(TinyLM(mask=False))")
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(passes[0], "docs/model.md", "exec"), namespace)  # the masked model passes
    with pytest.raises(CausalityError, match=re.escape(expected)):
        namespace["assert_causal"](namespace["TinyLM"](mask=False))


class CachedLM(torch.nn.Module):
    """One head of attention with learned positions, a cache of its own (past keys and values in
    a dict) and an attention mask, for audit_function's hooks; `bug` plants one: "cache" puts
    the tokens after a prefill one position too far, "mask" reads positions from the mask but
    lets every query see the pads."""

    def __init__(self, bug: str | None = None, vocab: int = 64, dim: int = 16):
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(32, dim)
        self.qkv, self.head = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, vocab)
        self.bug, self.dim = bug, dim

    def new_cache(self, batch_size: int, max_len: int) -> dict[str, torch.Tensor]:
        return {kv: torch.zeros(batch_size, 0, self.dim) for kv in "kv"}

    def forward(self, idx, cache=None, attention_mask=None):
        mask = torch.ones_like(idx) if attention_mask is None else attention_mask  # (B, T)
        past = 0 if cache is None else cache["k"].size(1)
        past += self.bug == "cache" and past > 0
        positions = past + (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
        q, k, v = self.qkv(self.emb(idx) + self.pos(positions)).chunk(3, dim=-1)
        if cache is not None:
            k = cache["k"] = torch.cat([cache["k"], k], dim=1)  # (B, L, dim)
            v = cache["v"] = torch.cat([cache["v"], v], dim=1)
        T, L = idx.size(1), k.size(1)
        allowed = torch.ones(T, L, dtype=torch.bool).tril(L - T)  # (T, L)
        if attention_mask is not None and self.bug != "mask":  # pads hidden; each sees itself
            allowed = (allowed & mask[:, None].bool()) | torch.eye(T, dtype=torch.bool)
        scores = (q @ k.transpose(1, 2) / self.dim**0.5).masked_fill(~allowed, float("-inf"))
        return self.head(scores.softmax(-1) @ v)  # (B, T, vocab)


def test_a_functions_cache_and_mask_hooks_get_the_kv_cache_and_padding_checks():
    """Issue 57 item 1: a model of one's own, not ours, declares its cache and its attention
    mask; the audit decodes through the one and pads left and right with the other. It passes,
    and each planted bug fails the check that covers it, at the logits' first moved position."""
    torch.manual_seed(0)
    model = CachedLM()
    hooks = dict(new_cache=model.new_cache, attention_mask=True)
    report = audit_function(model, **hooks)
    assert [c.name for c in report.checks] == ["perturbation", "kv-cache", "padding"], str(report)
    assert report.causal and report.checks[1].largest < 1e-6, str(report)
    assert_causal(model, **hooks)
    with pytest.raises(
        CausalityError, match="kv-cache: leak: logits: cached output at t=2 differs"
    ):
        assert_causal(CachedLM(bug="cache"), **hooks)  # prefill 2, then positions one off
    with pytest.raises(CausalityError, match="padding: leak: logits: left-padded row 1's output"):
        assert_causal(CachedLM(bug="mask"), **hooks)
    assert audit_function(CachedLM(bug="mask")).causal  # no mask asked for: nothing to see
