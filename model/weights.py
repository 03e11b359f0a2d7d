"""What a weights file says, checked before anything is allocated for it.

A safetensors file starts with an 8-byte little-endian length N and N bytes of JSON naming
every tensor's dtype, shape and byte range; the tensors follow. `read_safetensors_header`
reads only that header (no tensor data) and checks that the byte ranges tile the rest of the
file exactly, so the shapes it returns are backed by bytes that really exist: whoever loads the
tensors allocates no more than the file's size. `check_config_against_weights` compares a
claimed GPTConfig with those shapes, naming the key and both values, on a model built on the
meta device (no memory), before the real model is built.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import NamedTuple

import torch

from model.config import GPTConfig
from model.gpt import GPT

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
# safetensors dtype -> bytes per element (the formats safetensors writes)
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # what a model's weights may be stored as


class TensorInfo(NamedTuple):
    dtype: str  # safetensors' name: "F32", "BF16", ...
    shape: tuple[int, ...]


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """name -> (dtype, shape) of every tensor in a safetensors file, from its header alone.
    Raises ValueError naming the file if the header is malformed or claims bytes it lacks."""
    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file: it has only {size} bytes")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(
                f"{path} is not a safetensors file: its header claims {n:,} bytes "
                f"(the file has {size:,})"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    tensors, ranges = {}, []
    for name, entry in header.items():
        tensors[name], span = _tensor_entry(path, name, entry)
        ranges.append((*span, name))
    end = 0  # the byte ranges must tile the data exactly: no overlaps, nothing unaccounted
    for begin, stop, name in sorted(ranges):
        if begin != end:
            raise ValueError(f"{path}: tensor {name!r} starts at byte {begin:,}, expected {end:,}")
        end = stop
    if end != size - 8 - n:
        raise ValueError(
            f"{path}: its tensors hold {end:,} bytes but the file has {size - 8 - n:,} after the "
            "header: it is truncated or was modified"
        )
    return tensors


def _tensor_entry(path: Path, name: str, entry: object) -> tuple[TensorInfo, tuple[int, int]]:
    """One header entry, checked: (dtype, shape) and its byte range [begin, end)."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"{path}: header entry {name!r} is not a tensor description")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(_natural(d) for d in shape)):
        raise ValueError(f"{path}: tensor {name!r} has a bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_natural, offsets))):
        raise ValueError(f"{path}: tensor {name!r} has bad data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise ValueError(
            f"{path}: tensor {name!r} of shape {tuple(shape)} and dtype {dtype} needs "
            f"{math.prod(shape) * DTYPE_BYTES[dtype]:,} bytes, its header gives it {end - begin:,}"
        )
    return TensorInfo(dtype, tuple(shape)), (begin, end)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def stored_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a checkpoint of `config` stores (a tied head once, as wte),
    from a model built on the meta device: no memory, whatever the config claims."""
    with torch.device("meta"):
        model = GPT(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


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
        (
            "tie_embeddings",
            config.tie_embeddings,
            "lm_head.weight" not in tensors,
            "lm_head.weight stored or not",
        ),
        (
            "pos_embedding",
            config.pos_embedding,
            "rope" if wpe is None else "learned",
            "wpe stored or not",
        ),
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
        if name not in tensors:
            raise ValueError(f"the config's model has {name}, {source} do not ({_keys(name)})")
        if name not in expected:
            raise ValueError(f"{source} hold {name}, the config's model does not ({_keys(name)})")
        if tensors[name].shape != expected[name]:
            raise ValueError(
                f"{source} give {name} the shape {tensors[name].shape}, the config's model "
                f"{expected[name]} ({_keys(name)})"
            )
        if tensors[name].dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{source} store {name} as {tensors[name].dtype}; weights are one of "
                f"{list(FLOAT_DTYPES)}"
            )


def _keys(tensor: str) -> str:
    """The config keys that decide whether a tensor exists and its shape, for the message."""
    if tensor.endswith("norm.weight"):
        return "see model.qk_norm and model.n_head"
    if ".mlp." in tensor:
        return "see model.mlp, model.mlp_ratio and model.bias"
    if tensor.endswith(".bias"):
        return "see model.bias and model.norm"
    return "see model.norm"
