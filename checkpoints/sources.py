"""Where a model comes from: the one resolver behind train.init_from, sample.py, evaluate.py and
export.py, so that every place accepting a model accepts the same three kinds of source:

1. a GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl): fetched through the Hugging Face hub
   client, which downloads it once and then serves it from its cache (HF_HUB_OFFLINE=1: the cache
   alone);
2. a local directory holding a Hugging Face GPT-2 model (config.json + model.safetensors or
   pytorch_model.bin, the latter read with weights_only=True: no code runs);
3. one of our checkpoint or run directories (checkpoints/store.py).

Each loads as a `Checkpoint`: the model, its tokenizer's name and metadata. A Hugging Face model
has no run config of ours; its stand-in has one data section, `HF_DATA` (the Shakespeare plays,
GPT-2's tokenizer), which is what `evaluate.py checkpoint=gpt2` scores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from base.errors import ConfigError
from checkpoints.hf import WEIGHT_FILES, load_hf_gpt2
from checkpoints.store import MANIFEST_FILE, Checkpoint, CheckpointError, load_checkpoint
from checkpoints.store import resolve_checkpoint as resolve_our_checkpoint
from data import PreparedData
from model import GPT, GPTConfig

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
HF_DATA = {"name": "shakespeare", "tokenizer": "gpt2"}  # what evaluate.py scores GPT-2 on
ACCEPTED = (
    f"a GPT-2 name ({', '.join(GPT2_NAMES)}), a Hugging Face GPT-2 directory (config.json + "
    f"{' or '.join(WEIGHT_FILES)}), or a causalgpt run or checkpoint directory"
)


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory (ours carry a manifest.json; theirs do not)."""
    return (
        (path / "config.json").is_file()
        and not (path / MANIFEST_FILE).is_file()
        and any((path / name).is_file() for name in WEIGHT_FILES)
    )


def download_gpt2(name: str) -> Path:
    """The local directory of GPT-2 `name` in the hub client's cache, downloaded if missing
    (config.json and model.safetensors only: every GPT-2 repository has safetensors)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=["config.json", "model.safetensors"]))
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"{name} is not in the Hugging Face cache and the hub cannot be reached (offline, or "
            f"HF_HUB_OFFLINE=1); download it once with network access, or point at a local copy: "
            f"a directory with config.json and model.safetensors, e.g. "
            f"train.init_from=/path/to/{name} (or checkpoint=/path/to/{name})"
        ) from None
    except OSError as e:  # the hub's HTTP errors derive from OSError too
        raise ConfigError(f"could not download {name} from the Hugging Face hub: {e}") from None


def load_hf_dir(path: Path, device: str | torch.device = "cpu", **overrides: Any) -> Checkpoint:
    """A Hugging Face GPT-2 directory as a Checkpoint (GPT-2's tokenizer, no trainer state)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {e}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != "gpt2":
        raise CheckpointError(
            f"{path} holds a {model_type!r} model; Hugging Face directories must hold GPT-2 "
            "(model_type 'gpt2' in config.json)"
        )
    try:
        model = load_hf_gpt2(path, **overrides)
    except (KeyError, RuntimeError) as e:  # missing tensors; unreadable weights
        raise CheckpointError(f"cannot load the GPT-2 weights in {path}: {e}") from None
    meta = {"tokenizer": "gpt2", "source": str(path), "step": None}
    return Checkpoint(path, model.to(device), {"data": dict(HF_DATA)}, meta)


def load_source(
    source: str | Path, device: str | torch.device = "cpu", **overrides: Any
) -> Checkpoint:
    """Load any model source (see the module docstring) on `device`; overrides: run-time
    GPTConfig fields (dropout, attention)."""
    name = str(source)
    if name in GPT2_NAMES and not Path(name).exists():
        ckpt = load_hf_dir(download_gpt2(name), device, **overrides)
        ckpt.meta["source"] = name
        return ckpt
    path = Path(name).expanduser()
    if is_hf_dir(path):
        return load_hf_dir(path, device, **overrides)
    try:
        path = resolve_our_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; a model source is {ACCEPTED}") from None
    return load_checkpoint(path, device, **overrides)


# ----- train.init_from: a source's model for a new run -------------------------------------------

# The source fixes the architecture; a run may change only what does not change the weights'
# meaning: dropout, the attention implementation, and a shorter context (block_size, the position
# table cropped). Optimizer, schedule and step start fresh: that is what sets it apart from
# train.resume, which continues a run.

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
