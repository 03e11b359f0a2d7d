"""The model tests run torch on one thread; ARCHITECTURES is the table of options they cover.

Their tensors are tiny (a few thousand numbers), so a second intra-op thread only adds
synchronisation, and on a busy 2-core machine OpenMP threads that wait for a core make each
small op up to 20x slower: tests/model took 700 s with torch's default threads under load, and
about 30 s on one thread.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from model import ATTENTION_IMPLS, GPT
from model.causality import CausalityReport, jacobian_check, perturbation_check, random_tokens
from model.gpt import MLPS, NORMS, POS_EMBEDDINGS


@pytest.fixture(autouse=True, scope="package")
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The option matrix of the causality and KV-cache tests, generated from GPTConfig's fields: every
# field is a size (set by each test; the presets' head counts are covered by test_causality.py),
# an axis the tests parametrize over (attention, dropout via train mode), or an option listed
# here with its values, default first. test_causality.py fails when a field is in none of them,
# so a new option cannot be left out; choice fields take every value their tuple in
# GPTConfig (model/gpt.py) allows.
SIZES = {"vocab_size", "block_size", "n_layer", "n_head", "n_embd"}
AXES = {"attention", "dropout"}
OPTION_VALUES = {
    "bias": (True, False),
    "tie_embeddings": (True, False),
    "flash_block_q": (128, 3),  # tiles smaller than the sequence: several, some straddling
    "flash_block_k": (128, 2),
    "pos_embedding": POS_EMBEDDINGS,
    "rope_base": (10000.0, 100.0),
    "norm": NORMS,
    "qk_norm": (False, True),
    "mlp": MLPS,
    "mlp_ratio": (4, 1.5),
    "logit_softcap": (None, 0.1),  # about the logits' size at init: tanh bends them
    "zero_init_proj": (False, True),  # see random_projections
}
NEEDS = {"rope_base": dict(pos_embedding="rope")}  # an option that acts only with another


def _architectures() -> dict[str, dict]:
    """{"gpt2": {}}, each option's every other value alone (with what it needs), and "all":
    every option at its last value, as GPTConfig overrides for head size 8."""
    table = {"gpt2": {}}
    for key, values in OPTION_VALUES.items():
        for value in values[1:]:
            table[f"{key}={value}"] = {**NEEDS.get(key, {}), key: value}
    table["all"] = {key: values[-1] for key, values in OPTION_VALUES.items()}
    return table


ARCHITECTURES = _architectures()

# attention=triton runs its kernel under Triton's interpreter here (numpy, one program per tile
# and head at a time: 5-60 s a case), so it takes two option sets of ARCHITECTURES (one preset
# of test_causality's): the kernel sees only q, k and v, whose making the other implementations
# check in every case.
TRITON_OPTIONS = ["gpt2", "all"]


def matrix(names: list[str], triton: list[str]) -> list[tuple[str, str]]:
    """(name, attention) pairs: every name with every implementation but triton, its own."""
    return [(n, a) for n in names for a in ATTENTION_IMPLS if a != "triton" or n in triton]


def random_projections(model: GPT) -> GPT:
    """zero_init_proj changes only the initial values, but zeroed projections silence every
    block, and a leak through them could not show: give them random values, as training
    would."""
    if model.config.zero_init_proj:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("c_proj.weight"):
                    p.normal_(0.0, 0.02)
    return model


def assert_gives_manuals_logits_and_gradients(options: str, T: int, **attention) -> None:
    """A GPT with the `ARCHITECTURES[options]` and `attention` fields (an implementation and its
    settings) gives, on the manual model's weights, its logits and every parameter's gradient."""
    from tests.conftest import tiny_config

    torch.manual_seed(0)
    manual = GPT(tiny_config(attention="manual", block_size=T, **ARCHITECTURES[options]))
    other = GPT(tiny_config(**{**ARCHITECTURES[options], "block_size": T, **attention}))
    other.load_state_dict(manual.state_dict())
    idx, targets = torch.randint(0, 101, (2, T)), torch.randint(0, 101, (2, T))
    for model in (manual, other):
        model(idx, targets)[1].backward()
    torch.testing.assert_close(other(idx)[0], manual(idx)[0], atol=1e-5, rtol=0)
    pairs = zip(manual.named_parameters(), other.parameters(), strict=True)
    for (name, p_manual), p_other in pairs:
        torch.testing.assert_close(p_other.grad, p_manual.grad, atol=1e-5, rtol=0, msg=name)


def find_leaks(model: GPT) -> list[str]:
    """The perturbation and Jacobian checks on the model as it is (its mode and attention);
    one line per failure, [] when no leak was found."""
    idx = random_tokens(model, seq_len=16)
    return CausalityReport([perturbation_check(model, idx), jacobian_check(model, idx)]).failures()
