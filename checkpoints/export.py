"""`python export.py`: a model as a Hugging Face directory that plain `transformers` loads.

    config.json, model.safetensors         GPT2LMHeadModel (GPT-2's architecture) or
                                           LlamaForCausalLM (rope + rmsnorm + swiglu)
    vocab.json, merges.txt,                GPT-2's tokenizer (AutoTokenizer: the same ids as
    tokenizer_config.json                  tiktoken's gpt2)
    README.md                              a model card: data, steps, validation bpb

Only exact equivalents are exported: each mapping computes the same logits as our model (tests
check it against transformers). An option without one fails in one line naming it. What each
GPTConfig field becomes is checkpoints.hf.FIELDS, the table the GPT-2 import reads too.

The export is written into a temporary sibling directory and swapped into place
(base.files.write_dir_atomic), so `out` never holds half an export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from base.errors import ConfigError
from base.files import write_dir_atomic
from checkpoints.hf import FIELDS, HF_FIXED, hf_keys, needs
from checkpoints.sources import load_source
from checkpoints.store import Checkpoint, find_checkpoint
from data.tokenizer import GPT2_N_VOCAB, gpt2_bpe_files
from model import GPT, GPTConfig

EOT = "<|endoftext|>"
# transformers' class of each architecture, by its column in checkpoints.hf.FIELDS
ARCHITECTURES = dict(gpt2="GPT2LMHeadModel", llama="LlamaForCausalLM")


def export_checkpoint(cfg: dict[str, Any]) -> Path:
    """Export `cfg["checkpoint"]` (any model source; null: the newest run) to `cfg["out"]`."""
    out = cfg.get("out")
    if not out:
        raise ConfigError("out is required: python export.py checkpoint=<run dir> out=<dir>")
    out = Path(str(out)).expanduser().absolute()
    overwrite = cfg.get("overwrite", False)
    if not isinstance(overwrite, bool):
        raise ConfigError(f"overwrite must be true or false, got {overwrite!r}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"out={out} exists and is not empty; pass overwrite=true to replace it")
    source = cfg.get("checkpoint")
    ckpt = load_source(find_checkpoint(None) if source is None else source)
    files = hf_files(ckpt)  # everything checked before anything is written
    write_dir_atomic(out, lambda tmp: _write_files(tmp, files))
    return out


def hf_files(ckpt: Checkpoint) -> dict[str, Any]:
    """The export's files: name -> tensors (model.safetensors), a dict (json), text, or a
    file to copy."""
    if ckpt.tokenizer_name != "gpt2":
        raise ConfigError(
            f"data.tokenizer={ckpt.tokenizer_name} has no Hugging Face tokenizer export; only "
            "models trained with data.tokenizer=gpt2 can be exported"
        )
    model = ckpt.model.float().cpu()
    config = model.config
    kind = _architecture(config)
    hf_config = _hf_config(config, kind)
    state = _gpt2_state(model) if kind == "gpt2" else _llama_state(model)
    n_vocab = ckpt.tokenizer().n_vocab  # a padded vocabulary (50304) exports as GPT-2's 50257
    if config.vocab_size > n_vocab:  # the padding rows are never drawn nor trained: dropped
        hf_config["vocab_size"] = n_vocab
        embeddings = ("wte.weight", "embed_tokens.weight", "lm_head.weight")
        state = {k: v[:n_vocab] if k.endswith(embeddings) else v for k, v in state.items()}
    vocab, merges = gpt2_bpe_files()
    return {
        "config.json": hf_config,
        "model.safetensors": state,
        "vocab.json": vocab,  # GPT-2's encoder.json is Hugging Face's vocab.json, byte for byte
        "merges.txt": merges,  # and its vocab.bpe their merges.txt
        "tokenizer_config.json": {
            "tokenizer_class": "GPT2Tokenizer",
            "model_max_length": config.block_size,
            "bos_token": EOT,
            "eos_token": EOT,
            "unk_token": EOT,
            "add_prefix_space": False,
        },
        "special_tokens_map.json": {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT},
        "README.md": model_card(ckpt, ARCHITECTURES[kind]),
    }


def _architecture(config: GPTConfig) -> str:
    """The architecture, "gpt2" or "llama", chosen by pos_embedding; else a ConfigError naming
    the first option (in FIELDS' order) that it cannot reproduce."""
    kind = "llama" if config.pos_embedding == "rope" else "gpt2"
    for name, need in needs(kind).items():
        if (value := getattr(config, name)) != need:
            raise ConfigError(
                f"model.{name}={value!r} has no equivalent in transformers' "
                f"{ARCHITECTURES[kind]} (which pos_embedding={config.pos_embedding} maps to): "
                "export supports GPT-2's architecture and rope + rmsnorm + swiglu (Llama) "
                "without qk_norm or logit_softcap"
            )
    return kind


def _hf_config(config: GPTConfig, kind: str) -> dict[str, Any]:
    """config.json: each field's keys (FIELDS) and the fixed keys (HF_FIXED) of `kind`."""
    hf_config = {
        "architectures": [ARCHITECTURES[kind]],
        **{key: accepted[0] for key, accepted in HF_FIXED[kind].items()},
        "bos_token_id": GPT2_N_VOCAB - 1,
        "eos_token_id": GPT2_N_VOCAB - 1,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    }
    for name, field in FIELDS.items():
        hf_config.update(dict.fromkeys(hf_keys(name, kind), getattr(config, field.via or name)))
    if kind == "llama":  # rope_theta for transformers < 5, rope_parameters for 5
        hf_config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_base}
        hf_config["head_dim"] = config.head_size
    return hf_config


def _gpt2_state(model: GPT) -> dict[str, torch.Tensor]:
    """Our names are GPT-2's; its Conv1D layers store (in, out), the transpose of our Linear.
    Without biases (bias=false) GPT-2's are zeros: the same function."""
    state = dict(model.state_dict())
    if model.config.tie_embeddings:
        del state["lm_head.weight"]  # tied: transformers restores it from wte
    for name, w in list(state.items()):
        if name.startswith("transformer.h.") or name.startswith("transformer.ln_f."):
            state.setdefault(name.replace(".weight", ".bias"), torch.zeros(w.shape[0]))
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            state[name] = w.t()  # (out, in) -> Conv1D's (in, out)
    return state


def _llama_state(model: GPT) -> dict[str, torch.Tensor]:
    """c_attn holds W_Q | W_K | W_V and c_fc W_1 | W_3 (SiLU's input | the gate's other
    factor) side by side; Llama keeps each in its own Linear. Both rotate the pairs
    (i, i + head_size/2) (rotate_half), so q and k need no permutation."""
    c = model.config
    sd = model.state_dict()
    state = {"model.embed_tokens.weight": sd["transformer.wte.weight"]}
    kinds = ("weight", "bias") if c.bias else ("weight",)
    for i in range(c.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        state[theirs + "input_layernorm.weight"] = sd[ours + "ln_1.weight"]
        state[theirs + "post_attention_layernorm.weight"] = sd[ours + "ln_2.weight"]
        for kind in kinds:
            q, k, v = sd[f"{ours}attn.c_attn.{kind}"].split(c.n_embd)  # (C, C) or (C,) each
            gate, up = sd[f"{ours}mlp.c_fc.{kind}"].split(c.mlp_hidden)  # (hidden, C) each
            state.update(
                {
                    f"{theirs}self_attn.q_proj.{kind}": q,
                    f"{theirs}self_attn.k_proj.{kind}": k,
                    f"{theirs}self_attn.v_proj.{kind}": v,
                    f"{theirs}self_attn.o_proj.{kind}": sd[f"{ours}attn.c_proj.{kind}"],
                    f"{theirs}mlp.gate_proj.{kind}": gate,
                    f"{theirs}mlp.up_proj.{kind}": up,
                    f"{theirs}mlp.down_proj.{kind}": sd[f"{ours}mlp.c_proj.{kind}"],
                }
            )
    state["model.norm.weight"] = sd["transformer.ln_f.weight"]
    if not c.tie_embeddings:
        state["lm_head.weight"] = sd["lm_head.weight"]
    return state


def model_card(ckpt: Checkpoint, architecture: str) -> str:
    """README.md of the export: where the weights came from and how good they are."""
    meta, run = ckpt.meta, ckpt.run_config
    data = run.get("data") or {}
    train = run.get("train") or {}
    described = {k: v for k, v in data.items() if k not in ("cache_dir", "num_proc")}
    lines = [
        "---",
        "library_name: transformers",
        "tags: [causalgpt, text-generation]",
        "---",
        "# A causalgpt model",
        "",
        f"Exported by causalgpt's `export.py` from `{ckpt.path}` as a `{architecture}`.",
        "",
        f"- Model: {ckpt.model.num_params() / 1e6:.2f}M parameters, {ckpt.model.config}",
        "- Tokenizer: GPT-2 (`gpt2`)",
    ]
    if "train" in run:
        lines += [
            f"- Training data: {json.dumps(described)}",
            f"- Initialized from: {train.get('init_from') or 'random weights'}",
            f"- Steps: {meta.get('step')}",
        ]
    else:
        lines.append(f"- Weights: the Hugging Face model at {meta.get('source', ckpt.path)}")
    if meta.get("val_bpb") is not None:
        lines.append(
            f"- Validation: loss {meta['val_loss']:.4f} nats/token, {meta['val_bpb']:.4f} bits "
            "per byte (a fixed subset of the validation split, at the step above)"
        )
    else:
        lines.append(
            "- Validation: not recorded in this checkpoint; measure it with "
            "`python evaluate.py checkpoint=<this directory>`"
        )
    if "causality" in meta:
        lines.append(f"- Causality check: {json.dumps(meta['causality'])}")
    lines += [
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("<this directory>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this directory>")',
        "```",
        "",
    ]
    return "\n".join(lines)


def _write_files(tmp: Path, files: dict[str, Any]) -> None:
    """Write `files` (see hf_files) into the directory `tmp`."""
    for name, content in files.items():
        if isinstance(content, Path):
            shutil.copyfile(content, tmp / name)
        elif isinstance(content, str):
            (tmp / name).write_text(content)
        elif name.endswith(".safetensors"):
            tensors = {k: v.detach().contiguous() for k, v in content.items()}
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        else:
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
