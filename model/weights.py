"""What a weights file says, checked before anything is allocated for it.

`read_safetensors_header` reads a safetensors file's header alone (no tensor data) through
safetensors itself, which refuses a header whose byte ranges do not tile the rest of the file
exactly: the shapes it returns are backed by bytes that really exist, so whoever loads the
tensors allocates no more than the file's size. `check_config_against_weights` compares a
claimed GPTConfig with those shapes, naming the key and both values, on a model built on the
meta device (no memory), before the real model is built.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from model.config import GPTConfig
from model.gpt import GPT

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # what a model's weights may be stored as


class TensorInfo(NamedTuple):
    dtype: str  # safetensors' name: "F32", "BF16", ...
    shape: tuple[int, ...]


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """name -> (dtype, shape) of every tensor in a safetensors file, from its header alone.
    Raises ValueError naming the file if the header is malformed or claims bytes it lacks."""
    try:
        with safe_open(str(path), "pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 - not a dict
            return {k: TensorInfo(s.get_dtype(), tuple(s.get_shape())) for k, s in slices.items()}
    except SafetensorError as e:
        raise ValueError(f"{path} is not a valid safetensors file: {e}") from None


def stored_state(model: GPT) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of `model` stores: its state, a tied head once (as wte)."""
    state = model.state_dict()
    if model.config.tie_embeddings:
        del state["lm_head.weight"]
    return state


def stored_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a checkpoint of `config` stores, from a model built on the
    meta device: no memory, whatever the config claims."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in stored_state(GPT(config)).items()}


def check_config_against_weights(
    config: GPTConfig, tensors: dict[str, TensorInfo], source: str = "the weights"
) -> None:
    """Raise ValueError naming the config key and both values if `config` does not describe
    the tensors (as read_safetensors_header returns them, in our checkpoints' layout)."""
    wte = tensors.get("transformer.wte.weight")
    if wte is None or len(wte.shape) != 2:
        raise ValueError(f"{source} have no token embedding transformer.wte.weight (2-D)")
    layers = {int(m[1]) for k in tensors if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    wpe = tensors.get("transformer.wpe.weight")
    claims = [
        ("vocab_size", config.vocab_size, wte.shape[0], "transformer.wte.weight"),
        ("n_embd", config.n_embd, wte.shape[1], "transformer.wte.weight"),
        ("n_layer", config.n_layer, max(layers, default=-1) + 1, "transformer.h.<i>"),
        ("tie_embeddings", config.tie_embeddings, "lm_head.weight" not in tensors, "lm_head"),
        ("pos_embedding", config.pos_embedding, "rope" if wpe is None else "learned", "wpe"),
    ]
    if wpe is not None and len(wpe.shape) == 2:
        claims.append(("block_size", config.block_size, wpe.shape[0], "transformer.wpe.weight"))
    for key, claimed, actual, tensor in claims:
        if claimed != actual:
            raise ValueError(
                f"model.{key}={claimed!r} disagrees with {source}, which give "
                f"{key}={actual!r} (from {tensor})"
            )
    expected = stored_shapes(config)
    for name in sorted(expected.keys() | tensors.keys()):
        keys = next(k for part, k in _KEYS if part in name)
        if name not in tensors:
            raise ValueError(f"the config's model has {name}, {source} do not (see {keys})")
        if name not in expected:
            raise ValueError(f"{source} hold {name}, the config's model does not (see {keys})")
        if (shape := tensors[name].shape) != expected[name]:
            raise ValueError(
                f"{source} give {name} the shape {shape}, the config's model {expected[name]} "
                f"(see {keys})"
            )
        if (dtype := tensors[name].dtype) not in FLOAT_DTYPES:
            raise ValueError(
                f"{source} store {name} as {dtype}; weights are one of {list(FLOAT_DTYPES)}"
            )


_KEYS = (  # (part of a tensor's name, the config keys that decide its existence and shape)
    ("norm.weight", "model.qk_norm and model.n_head"),
    (".mlp.", "model.mlp, model.mlp_ratio and model.bias"),
    (".bias", "model.bias and model.norm"),
    ("", "model.norm"),
)
