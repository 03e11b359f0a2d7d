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


@pytest.fixture(autouse=True, scope="package")
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Every architecture option of GPTConfig, alone and all together, as GPTConfig overrides for
# tests/conftest.py's tiny_config (head size 8: rope needs an even one). zero_init_proj is left
# out: zeroed projections silence attention at init, so equivalence and causality checks would
# pass trivially (test_options.py checks it on its own).
ARCHITECTURES = {
    "gpt2": {},
    "rope": dict(pos_embedding="rope"),
    "rmsnorm": dict(norm="rmsnorm"),
    "qk_norm": dict(qk_norm=True),
    "relu2": dict(mlp="relu2"),
    "swiglu": dict(mlp="swiglu"),
    "softcap": dict(logit_softcap=0.1),  # about the logits' size at init: tanh bends them
    "untied": dict(tie_embeddings=False),
    "all": dict(
        pos_embedding="rope",
        norm="rmsnorm",
        qk_norm=True,
        mlp="swiglu",
        logit_softcap=0.1,
        tie_embeddings=False,
    ),
}
