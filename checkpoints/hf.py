"""Load GPT-2 weights in the Hugging Face layout (`GPT2LMHeadModel`) into our GPT.

Our module names follow GPT-2's, so the only differences are HF's `Conv1D` layers, which store
weights as (in, out) and must be transposed, and buffers (`attn.bias`, `attn.masked_bias`) that
we do not keep. Works offline from a state dict, a safetensors file, or a model directory.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from model.config import GPTConfig
from model.gpt import GPT
from model.weights import read_safetensors_header, stored_shapes

_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# The GPTConfig values of GPT-2's architecture (GPTConfig's defaults): any other value of one of
# these changes the weights' meaning or shapes, so GPT-2's weights cannot be loaded with it.
GPT2_ARCHITECTURE = dict(
    pos_embedding="learned",
    norm="layernorm",
    qk_norm=False,
    mlp="gelu",
    mlp_ratio=4,
    logit_softcap=None,
)


# config.json keys that change what GPT-2's weights compute, and the values our GPT computes
# with; a present key with another value is refused (a silent difference in the logits otherwise).
HF_ARCHITECTURE = dict(
    model_type=("gpt2",),
    activation_function=("gelu_new", "gelu_pytorch_tanh"),  # GELU's tanh form, as ours
    layer_norm_epsilon=(1e-5,),
    scale_attn_weights=(True,),
    scale_attn_by_inverse_layer_idx=(False,),
    add_cross_attention=(False,),
)
HF_SIZES = ("vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner")
MAX_CONFIG_BYTES = 1 << 20  # a GPT-2 config.json has about 1 KB


def read_hf_config(file: Path) -> dict[str, Any]:
    """A Hugging Face GPT-2 config.json, every key we read checked (type, range, value) and
    named in a one-line ValueError. Other keys (labels, token ids, ...) do not affect us."""
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{file} has {file.stat().st_size:,} bytes: not a GPT-2 config.json")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{file} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    for key in HF_SIZES:
        value = config.get(key)
        if value is None:  # absent, or n_inner's "4 * n_embd"
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{file}: {key} must be a positive integer, got {value!r}")
    if config.get("n_embd") and config.get("n_head") and config["n_embd"] % config["n_head"]:
        raise ValueError(
            f"{file}: n_head={config['n_head']} does not divide n_embd={config['n_embd']}: each "
            "head gets n_embd / n_head dimensions"
        )
    for key, accepted in HF_ARCHITECTURE.items():
        if key in config and config[key] not in accepted:
            raise ValueError(
                f"{file}: {key}={config[key]!r} is not GPT-2's architecture, which our GPT "
                f"computes; it needs {key} in {list(accepted)}"
            )
    return config


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    # mmap: the tensors stay in the file until copied; weights_only never unpickles code
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _weights_file(path: Path) -> Path:
    if not path.is_dir():
        return path
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return path / name
    raise ValueError(f"{path} holds neither model.safetensors nor pytorch_model.bin")


def _resize_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """w (V, C) with `rows` rows: cropped, or padded with zeros (padded tokens are never drawn
    nor targets, so their rows only need to exist)."""
    if rows <= w.size(0):
        return w[:rows]
    return torch.cat([w, w.new_zeros(rows - w.size(0), w.size(1))])  # (rows, C)


def _resize_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """w (V, C) with `rows` rows: cropped, or padded with zeros (padded tokens are never drawn
    nor targets, so their rows only need to exist)."""
    if rows <= w.size(0):
        return w[:rows]
    return torch.cat([w, w.new_zeros(rows - w.size(0), w.size(1))])  # (rows, C)


def load_hf_gpt2(
    source: str | Path | dict[str, torch.Tensor], n_head: int | None = None, **overrides
) -> GPT:
    """A GPT holding the weights of a Hugging Face GPT-2 checkpoint.

    source: a state dict, a .safetensors/.bin file, or a directory with config.json. The shape
    comes from the weights (a safetensors header: read before any tensor); n_head (which shapes
    cannot tell) from config.json or the argument. Every size config.json claims is checked
    against the weights before the model is built.
    overrides: other GPTConfig fields, e.g. dropout=0.1 or attention="sdpa" for fine-tuning;
    not the architecture options (GPT2_ARCHITECTURE), which GPT-2's weights fix. vocab_size=50304
    (the GPT-2 presets' padded vocabulary) adds zero rows to the token embedding (and an untied
    head); a smaller one crops rows, e.g. the padding of a padded checkpoint.
    """
    for key, value in overrides.items():
        if key in GPT2_ARCHITECTURE and value != GPT2_ARCHITECTURE[key]:
            raise ValueError(
                f"model.{key}={value!r} is not GPT-2's architecture: GPT-2 weights need "
                f"model.{key}={GPT2_ARCHITECTURE[key]!r}"
            )
    vocab_size = overrides.pop("vocab_size", None)  # the rows wanted: padded or cropped to it
    sd, claims, where = None, {}, "the weights"
    if isinstance(source, dict):
        sd = source
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
    else:
        file = _weights_file(Path(source))
        config_file = file.parent / "config.json"
        if config_file.is_file():
            claims, where = read_hf_config(config_file), str(config_file)
        if file.suffix == ".safetensors":
            shapes = {k: t.shape for k, t in read_safetensors_header(file).items()}
        else:
            sd = _read_state_dict(file)
            shapes = {k: tuple(v.shape) for k, v in sd.items()}
    n_head = claims.get("n_head") if n_head is None else n_head
    if n_head is None:
        raise ValueError("n_head is not in the weights: pass n_head= or a folder with config.json")
    shapes = {k.removeprefix("transformer."): v for k, v in shapes.items()}
    config = _config_from_shapes(shapes, n_head, claims, where, overrides)
    _check_shapes(config, shapes)  # on a meta-device model: nothing allocated yet
    if sd is None:
        sd = _read_state_dict(file)
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    if vocab_size is not None and vocab_size != config.vocab_size:  # padded (or cropped) rows
        for key in ("wte.weight", "lm_head.weight"):
            if key in sd:
                sd[key] = _resize_rows(sd[key], vocab_size)
        config = dataclasses.replace(config, vocab_size=vocab_size)
    if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd["wte.weight"]):
        config = dataclasses.replace(config, tie_embeddings=False)
    model = GPT(config)
    ours = model.state_dict()
    for key, target in ours.items():
        hf_key = key.removeprefix("transformer.")
        if hf_key == "lm_head.weight" and config.tie_embeddings:
            continue  # the same tensor as wte.weight
        w = sd[hf_key]
        with torch.no_grad():
            target.copy_(w.t() if hf_key.endswith(_TRANSPOSED) else w)
    return model


def _config_from_shapes(
    shapes: dict[str, tuple[int, ...]],
    n_head: int,
    claims: dict[str, Any],
    where: str,
    overrides: dict[str, Any],
) -> GPTConfig:
    """GPTConfig from the weights' shapes, after checking what config.json claims about them.
    The head is taken as tied here; an untied one is found once the tensors are read."""
    for key in ("wte.weight", "wpe.weight"):
        if len(shapes.get(key, ())) != 2:
            raise ValueError(f"{where}: the weights have no 2-D {key}: not a GPT-2 checkpoint")
    vocab_size, n_embd = shapes["wte.weight"]
    layers = [int(m[1]) for k in shapes if (m := re.match(r"h\.(\d+)\.", k))]
    actual = dict(
        vocab_size=vocab_size,
        n_positions=shapes["wpe.weight"][0],
        n_ctx=shapes["wpe.weight"][0],
        n_embd=n_embd,
        n_layer=1 + max(layers, default=-1),
    )
    for key, value in actual.items():
        if claims.get(key) is not None and claims[key] != value:
            raise ValueError(
                f"{where}: {key}={claims[key]} disagrees with the weights, which give {value}"
            )
    if claims.get("n_inner") not in (None, 4 * n_embd):
        raise ValueError(f"{where}: n_inner={claims['n_inner']} is not 4 * n_embd = {4 * n_embd}")
    if "lm_head.weight" in shapes and shapes["lm_head.weight"] != shapes["wte.weight"]:
        raise ValueError(
            f"{where}: lm_head.weight has shape {shapes['lm_head.weight']}, "
            f"wte.weight {shapes['wte.weight']}: they must match"
        )
    shape = dict(  # what the weights themselves say: an override may repeat it, not change it
        vocab_size=vocab_size,
        block_size=actual["n_positions"],
        n_layer=actual["n_layer"],
        n_embd=n_embd,
        bias="ln_f.bias" in shapes,
    )
    for key, value in overrides.items():
        if key in shape and value != shape[key]:
            raise ValueError(
                f"model.{key}={value!r} does not match the weights, which have "
                f"model.{key}={shape[key]!r}"
            )
    return GPTConfig(**{**shape, **overrides, "n_head": n_head})


def _check_shapes(config: GPTConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor our model needs is in the weights with its shape (HF's Conv1D transposed)."""
    for key, shape in stored_shapes(config).items():
        hf_key = key.removeprefix("transformer.")
        if hf_key not in shapes:
            raise ValueError(f"weight {hf_key!r} is missing from the GPT-2 checkpoint")
        got = shapes[hf_key][::-1] if hf_key.endswith(_TRANSPOSED) else shapes[hf_key]
        if got != shape:
            raise ValueError(f"{hf_key}: shape {tuple(got)} != ours {shape}")
