"""train.init_from: start a run from a model source's weights (checkpoints/sources.py).

The source fixes the architecture; a run may change only what does not change the weights'
meaning: dropout, the attention implementation, and a shorter context (block_size, the position
table cropped). Optimizer, schedule and step start fresh: that is what sets it apart from
train.resume, which continues a run.
"""

from __future__ import annotations

from typing import Any

from base.errors import ConfigError
from checkpoints.sources import load_source
from data import PreparedData
from model import GPT, GPTConfig

RUNTIME_KEYS = ("dropout", "attention", "flash_block_q", "flash_block_k")


def pretrained_model(source: str, requested: dict[str, Any], data: PreparedData) -> GPT:
    """The model of `source` with this run's run-time fields. `requested`: the model keys the
    run sets (see trainer/cli.py); any other one that differs from the source's is an error
    naming it, as is a tokenizer other than the one the source was trained with."""
    runtime = {k: requested[k] for k in RUNTIME_KEYS if k in requested}
    ckpt = load_source(source, **runtime)
    theirs = ckpt.model.config
    if not ckpt.same_tokenizer(data):
        name = ckpt.tokenizer_name
        hint = f", which was trained with {name}: set data.tokenizer={name}"
        if data.tokenizer_name == name:
            hint = " (the same name, trained on other text: use the source's data)"
        raise ConfigError(
            f"data.tokenizer={data.tokenizer_name} does not match the vocabulary of "
            f"train.init_from={source}{hint}"
        )
    values = {k: v for k, v in requested.items() if not (k == "vocab_size" and v is None)}
    block_size = values.pop("block_size", theirs.block_size)
    GPTConfig.from_dict({**theirs.to_dict(), **values})  # unknown keys, bad values: named
    for key, value in values.items():
        if key not in RUNTIME_KEYS and value != getattr(theirs, key):
            raise ConfigError(
                f"model.{key}={value!r} contradicts train.init_from={source}, whose {key} is "
                f"{getattr(theirs, key)!r}: the architecture comes from the source; drop "
                f"model.{key} (run-time keys it allows: {', '.join(RUNTIME_KEYS)}, block_size)"
            )
    if block_size != theirs.block_size:
        ckpt.model.crop_block_size(block_size)
    return ckpt.model
