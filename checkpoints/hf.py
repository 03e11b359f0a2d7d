"""Load GPT-2 weights in the Hugging Face layout (`GPT2LMHeadModel`) into our GPT; FIELDS, what
each GPTConfig field is in transformers' GPT-2 and Llama, for this import and for export.py.

Our module names follow GPT-2's, so the only differences are HF's `Conv1D` layers, which store
weights as (in, out) and must be transposed, and buffers (`attn.bias`, `attn.masked_bias`) that
we do not keep. Works offline from a state dict, a safetensors file, or a model directory.
checkpoints/store.py's `load_source` imports this module for a GPT-2 name (downloaded once
through the hub client) or a HF directory alone.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from base.errors import CheckpointError
from base.files import read_json_object, read_safetensors_header
from model.gpt import GPT, GPTConfig

# A Hugging Face directory's weights, in order of preference
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

# HF's Conv1D weights, stored (in, out): the transpose of our Linear's
CONV1D_WEIGHTS = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


@dataclasses.dataclass(frozen=True)
class Need:
    """The only value of a GPTConfig field that an architecture computes: any other value has no
    equivalent there (refused on export and on import)."""

    value: Any


@dataclasses.dataclass(frozen=True)
class Field:
    """How one GPTConfig field crosses to transformers' GPT-2 (GPT2LMHeadModel) and Llama
    (LlamaForCausalLM): a tuple of the config.json keys that hold its value (of `via`, if set);
    Need(value); or () for no key, where the weights alone carry it (GPT-2 without biases: zero
    biases) or it changes how or when we compute, not what (nothing to export or to check)."""

    gpt2: tuple[str, ...] | Need
    llama: tuple[str, ...] | Need
    via: str | None = None  # the GPTConfig attribute exported instead of the field itself


# Every GPTConfig field, classified once: export (checkpoints/export.py) and import (below) read
# only this table, and tests/checkpoints/test_hf.py fails on a field that is missing from it.
FIELDS = dict(
    vocab_size=Field(("vocab_size",), ("vocab_size",)),
    block_size=Field(("n_positions", "n_ctx"), ("max_position_embeddings",)),
    n_layer=Field(("n_layer",), ("num_hidden_layers",)),
    n_head=Field(("n_head",), ("num_attention_heads", "num_key_value_heads")),
    n_embd=Field(("n_embd",), ("hidden_size",)),
    dropout=Field(("resid_pdrop", "embd_pdrop", "attn_pdrop"), ("attention_dropout",)),
    bias=Field((), ("attention_bias", "mlp_bias")),
    attention=Field((), ()),  # the kernel: the same function
    tie_embeddings=Field(("tie_word_embeddings",), ("tie_word_embeddings",)),
    flash_block_q=Field((), ()),
    flash_block_k=Field((), ()),
    pos_embedding=Field(Need("learned"), Need("rope")),
    rope_base=Field((), ("rope_theta",)),  # GPT-2: learned positions, no rotation
    norm=Field(Need("layernorm"), Need("rmsnorm")),
    qk_norm=Field(Need(False), Need(False)),
    mlp=Field(Need("gelu"), Need("swiglu")),
    mlp_ratio=Field(("n_inner",), ("intermediate_size",), via="mlp_hidden"),
    logit_softcap=Field(Need(None), Need(None)),
    zero_init_proj=Field((), ()),  # initialization only: loaded weights replace it
)
# config.json keys that no field sets, with the values our GPT computes with (export writes the
# first); a present key with another value is refused on import (silently other logits otherwise).
HF_FIXED = dict(
    gpt2=dict(
        model_type=("gpt2",),
        activation_function=("gelu_new", "gelu_pytorch_tanh"),  # GELU's tanh form, as ours
        layer_norm_epsilon=(1e-5,),  # nn.LayerNorm's default, which our layernorm uses
        scale_attn_weights=(True,),
        scale_attn_by_inverse_layer_idx=(False,),
        add_cross_attention=(False,),
    ),
    llama=dict(model_type=("llama",), hidden_act=("silu",), rms_norm_eps=(1e-6,)),  # norm.py
)


def needs(architecture: str) -> dict[str, Any]:
    """{field: the only value `architecture` ("gpt2" or "llama") computes}."""
    columns = {name: getattr(field, architecture) for name, field in FIELDS.items()}
    return {name: c.value for name, c in columns.items() if isinstance(c, Need)}


def hf_keys(name: str, architecture: str = "gpt2") -> tuple[str, ...]:
    column = getattr(FIELDS[name], architecture)
    return () if isinstance(column, Need) else column


# GPT-2's weights fix these fields; mlp_ratio too, as GPT-2's n_inner defaults to 4 * n_embd
# (checked in config.json): the import does not read the hidden width from the weights.
GPT2_ARCHITECTURE = {**needs("gpt2"), "mlp_ratio": 4}
HF_SIZES = [  # the keys of GPT-2's integers: a config.json must give positive integers
    key
    for name, field in FIELDS.items()
    for key in hf_keys(name)
    if type(getattr(GPTConfig(), field.via or name)) is int
]


def read_hf_config(file: Path) -> dict[str, Any]:
    """A Hugging Face GPT-2 config.json, every key we read checked (type, range, value) and
    named in a one-line CheckpointError. Other keys (labels, token ids, ...) do not affect us."""
    config = read_json_object(file)
    for key in HF_SIZES:
        value = config.get(key)  # None: absent, or n_inner's "4 * n_embd"
        if value is not None and (type(value) is not int or value <= 0):
            raise CheckpointError(f"{file}: {key} must be a positive integer, got {value!r}")
    if config.get("n_embd") and config.get("n_head") and config["n_embd"] % config["n_head"]:
        raise CheckpointError(
            f"{file}: n_head={config['n_head']} does not divide n_embd={config['n_embd']}: each "
            "head gets n_embd / n_head dimensions"
        )
    for key, accepted in HF_FIXED["gpt2"].items():
        if key in config and config[key] not in accepted:
            raise CheckpointError(
                f"{file}: {key}={config[key]!r} is not GPT-2's architecture, which our GPT "
                f"computes; it needs {key} in {list(accepted)}"
            )
    return config


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
            raise CheckpointError(
                f"model.{key}={value!r} is not GPT-2's architecture: GPT-2 weights need "
                f"model.{key}={GPT2_ARCHITECTURE[key]!r}"
            )
    vocab_size = overrides.pop("vocab_size", None)  # the rows wanted: padded or cropped to it
    sd, claims, where = None, {}, "the weights"
    if isinstance(source, dict):
        sd = source
    else:
        file = path = Path(source)
        if path.is_dir():  # its first of WEIGHT_FILES
            file = next((path / n for n in WEIGHT_FILES if (path / n).is_file()), None)
        if file is None:
            raise CheckpointError(f"{path} holds neither {' nor '.join(WEIGHT_FILES)}")
        config_file = file.parent / "config.json"
        if config_file.is_file():
            claims, where = read_hf_config(config_file), str(config_file)
        if file.suffix != ".safetensors":
            # mmap: the tensors stay in the file until copied; weights_only never unpickles code
            sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    tensors = read_safetensors_header(file) if sd is None else sd  # a header: no tensor read
    shapes = {k.removeprefix("transformer."): tuple(v.shape) for k, v in tensors.items()}
    n_head = claims.get("n_head") if n_head is None else n_head
    if n_head is None:
        raise CheckpointError(
            "n_head is not in the weights: pass n_head= or a folder with config.json"
        )
    config = _config_from_shapes(shapes, n_head, claims, where, overrides)
    if sd is None:
        sd = load_file(str(file))
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    if vocab_size is not None and vocab_size != config.vocab_size:
        config = dataclasses.replace(config, vocab_size=vocab_size)  # checked: a positive int
        # rows padded with zeros (padded tokens are never drawn nor targets), or cropped (a
        # negative padding)
        for key in sd.keys() & {"wte.weight", "lm_head.weight"}:
            sd[key] = F.pad(sd[key], (0, 0, 0, vocab_size - len(sd[key])))
    if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd["wte.weight"]):
        config = dataclasses.replace(config, tie_embeddings=False)
    model = GPT(config)
    for key, target in model.stored_state().items():  # detached views of the parameters
        w = sd[key.removeprefix("transformer.")]
        target.copy_(w.t() if key.endswith(CONV1D_WEIGHTS) else w)
    return model


def _config_from_shapes(
    shapes: dict[str, tuple[int, ...]],
    n_head: int,
    claims: dict[str, Any],
    where: str,
    overrides: dict[str, Any],
) -> GPTConfig:
    """GPTConfig from the weights' shapes, after checking what config.json claims about them and
    that the weights hold every tensor it needs. The head is taken as tied here; an untied one is
    found once the tensors are read."""
    vocab_size, n_embd = shapes["wte.weight"]
    layers = [int(m[1]) for k in shapes if (m := re.match(r"h\.(\d+)\.", k))]
    shape = dict(  # what the weights themselves say: an override may repeat it, not change it
        vocab_size=vocab_size,
        block_size=shapes["wpe.weight"][0],
        n_layer=1 + max(layers, default=-1),
        n_embd=n_embd,
        bias="ln_f.bias" in shapes,
    )
    for name, value in shape.items():  # config.json's claims of them: its keys for each field
        for key in hf_keys(name):
            if claims.get(key) is not None and claims[key] != value:
                raise CheckpointError(
                    f"{where}: {key}={claims[key]} disagrees with the weights, which give {value}"
                )
    if claims.get("n_inner") not in (None, 4 * n_embd):
        raise CheckpointError(
            f"{where}: n_inner={claims['n_inner']} is not 4 * n_embd = {4 * n_embd}"
        )
    if shapes.get("lm_head.weight", shapes["wte.weight"]) != shapes["wte.weight"]:
        raise CheckpointError(
            f"{where}: lm_head.weight has shape {shapes['lm_head.weight']}, "
            f"wte.weight {shapes['wte.weight']}: they must match"
        )
    for key, value in overrides.items():
        if key in shape and value != shape[key]:
            raise CheckpointError(
                f"model.{key}={value!r} does not match the weights, which have "
                f"model.{key}={shape[key]!r}"
            )
    config = GPTConfig(**{**shape, **overrides, "n_head": n_head})
    # every tensor our model needs, with its shape (HF's Conv1D transposed): on the meta device
    for key, shape in GPT.stored_shapes(config).items():
        hf_key = key.removeprefix("transformer.")
        if hf_key not in shapes:
            raise CheckpointError(f"weight {hf_key!r} is missing from the GPT-2 checkpoint")
        got = shapes[hf_key][::-1] if hf_key.endswith(CONV1D_WEIGHTS) else shapes[hf_key]
        if got != shape:
            raise CheckpointError(f"{hf_key}: shape {tuple(got)} != ours {shape}")
    return config
