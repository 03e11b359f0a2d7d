"""Load GPT-2 weights in the Hugging Face layout (`GPT2LMHeadModel`) into our GPT.

Our module names follow GPT-2's, so the only differences are HF's `Conv1D` layers, which store
weights as (in, out) and must be transposed, and buffers (`attn.bias`, `attn.masked_bias`) that
we do not keep. Works offline from a state dict, a safetensors file, or a model directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from model.config import GPTConfig
from model.gpt import GPT

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


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                return _read_state_dict(path / name)
        raise ValueError(f"{path} holds neither model.safetensors nor pytorch_model.bin")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code


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
    comes from the weights; n_head (which shapes cannot tell) from config.json or the argument.
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
    if isinstance(source, dict):
        sd = source
    else:
        path = Path(source)
        sd = _read_state_dict(path)
        config_file = (path if path.is_dir() else path.parent) / "config.json"
        if n_head is None and config_file.is_file():
            n_head = json.loads(config_file.read_text())["n_head"]
    if n_head is None:
        raise ValueError("n_head is not in the weights: pass n_head= or a folder with config.json")
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    rows, n_embd = sd["wte.weight"].shape
    vocab_size = overrides.pop("vocab_size", rows)
    for key in ("wte.weight", "lm_head.weight"):
        if key in sd:
            sd[key] = _resize_rows(sd[key], vocab_size)
    n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("h."))
    config = GPTConfig(
        vocab_size=vocab_size,
        block_size=sd["wpe.weight"].shape[0],
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        bias="ln_f.bias" in sd,
        tie_embeddings="lm_head.weight" not in sd
        or bool(torch.equal(sd["lm_head.weight"], sd["wte.weight"])),
        **overrides,
    )
    model = GPT(config)
    ours = model.state_dict()
    for key, target in ours.items():
        hf_key = key.removeprefix("transformer.")
        if hf_key == "lm_head.weight" and config.tie_embeddings:
            continue  # the same tensor as wte.weight
        if hf_key not in sd:
            raise ValueError(f"weight {hf_key!r} is missing from the GPT-2 checkpoint")
        w = sd[hf_key]
        if hf_key.endswith(_TRANSPOSED):
            w = w.t()
        if w.shape != target.shape:
            raise ValueError(f"{hf_key}: shape {tuple(w.shape)} != ours {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(w)
    return model
