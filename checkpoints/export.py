"""`python export.py`: a model as a Hugging Face directory that plain `transformers` loads.

    config.json, model.safetensors         GPT2LMHeadModel (GPT-2's architecture) or
                                           LlamaForCausalLM (rope + rmsnorm + swiglu)
    generation_config.json                 generation stops at block_size (n_positions)
    tokenizer.json, tokenizer_config.json  the model's tokenizer (gpt2, bytes or bpe-<N>) as
                                           a fast tokenizer: the same ids as ours; a chat
                                           model's adds <|im_start|>, <|im_end|> and the
                                           template (chat_template), and ends replies at
                                           <|im_end|> (generation_config.json)
    README.md                              a model card: data, steps, validation bpb

Only exact equivalents are exported: each mapping computes the same logits as our model (tests
check it against transformers). An option without one fails in one line naming it. What each
GPTConfig field becomes is checkpoints.hf.FIELDS, the table the GPT-2 import reads too.

The export is written into a temporary sibling directory and swapped into place
(base.files.write_dir_atomic), so `out` never holds half an export. `format=gguf` writes the
same export as one GGUF file for llama.cpp instead (checkpoints/llamacpp.py), through a
temporary file renamed into place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import tiktoken
import torch
from safetensors.torch import save_file

from base.errors import ConfigError, boolean, choice
from base.files import atomic_path, writable_error, write_dir_atomic
from checkpoints.hf import CONV1D_WEIGHTS, FIELDS, HF_FIXED, hf_keys, needs
from checkpoints.llamacpp import DTYPES, gguf_writer, write_gguf
from checkpoints.store import MANIFEST_FILE, Checkpoint, find_checkpoint, load_source
from data.chat import CHAT_TEMPLATE, IM_END, TEMPLATE
from data.tokenizer import gpt2_bpe_files
from model import GPTConfig

EOT = "<|endoftext|>"
# transformers' class of each architecture, by its column in checkpoints.hf.FIELDS
ARCHITECTURES = dict(gpt2="GPT2LMHeadModel", llama="LlamaForCausalLM")
TRANSFORMERS = {kind: f"transformers' {name}" for kind, name in ARCHITECTURES.items()}
LLAMA_CPP = {kind: f"llama.cpp's {kind}" for kind in ARCHITECTURES}  # GGUF's architectures
# Byte-level BPE files spell byte b as chr(b) where that is printable (not the space), the
# others as chr(256), chr(257), ... in byte order (GPT-2's bytes_to_unicode; tiktoken's too)
_SHIFTED = [b for b in range(256) if b == 32 or not chr(b).isprintable()]
BYTE_CHARS = [chr(256 + _SHIFTED.index(b)) if b in _SHIFTED else chr(b) for b in range(256)]


def export_checkpoint(cfg: dict[str, Any]) -> Path:
    """Export `cfg["checkpoint"]` (any model source; null: the newest run) to `cfg["out"]`: a
    Hugging Face directory, or with format=gguf one GGUF file."""
    as_gguf = choice("format", cfg.get("format", "hf"), ("hf", "gguf")) == "gguf"
    dtype = choice("gguf.dtype", (cfg.get("gguf") or {}).get("dtype", "float32"), list(DTYPES))
    out = cfg.get("out")
    if not out:
        raise ConfigError(
            "out is required: python export.py checkpoint=<run dir> out=<dir> "
            "(format=gguf: out=<file>.gguf)"
        )
    out = Path(str(out)).expanduser().absolute()
    overwrite = boolean("overwrite", cfg.get("overwrite", False))
    if as_gguf and out.is_dir():
        raise ConfigError(f"out={out} is a directory; format=gguf writes one file")
    if as_gguf and out.suffix != ".gguf":  # llama.cpp's tools and users look for the suffix
        raise ConfigError(f"out={out} has no .gguf suffix: give out={out.name}.gguf")
    if not as_gguf and out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file; give a directory")
    if (out.is_file() or out.is_dir() and any(out.iterdir())) and not overwrite:
        raise ConfigError(
            f"out={out} exists{'' if as_gguf else ' and is not empty'}; "
            "pass overwrite=true to replace it"
        )
    source = cfg.get("checkpoint")
    ckpt = load_source(find_checkpoint() if source is None else source)
    _refuse_checkpoints(out, ckpt.path)
    if as_gguf:  # everything checked, and the file built in memory, before anything is written
        _architecture(ckpt.model.config, LLAMA_CPP)
        writer = gguf_writer(hf_files(ckpt), ckpt.tokenizer(), dtype)
        _check_parent(out)
        with atomic_path(out) as tmp:
            write_gguf(writer, tmp)
        return out
    files = hf_files(ckpt)  # everything checked before anything is written
    _check_parent(out)
    write_dir_atomic(out, lambda tmp: _write_files(tmp, files))
    return out


def _refuse_checkpoints(out: Path, source: Path) -> None:
    """`out` may not hold the checkpoint exported or a run's checkpoints (the export replaces
    `out` whole), nor lie in a checkpoint (a save replaces that whole, the export with it)."""
    why = ""
    if source.resolve().is_relative_to(out.resolve()) or (out / "checkpoints").is_dir():
        why = "holds checkpoints (the one exported, or a run's), which the export would delete"
    elif held := next((d for d in out.parents if (d / MANIFEST_FILE).is_file()), None):
        why = f"lies in the checkpoint {held}, which its run's next save replaces whole"
    if why:
        raise ConfigError(f"out={out} {why}; give out a place of its own, e.g. out=exports/<name>")


def _check_parent(out: Path) -> None:
    """`out`'s directory, made if missing; one that cannot be is a one-line error."""
    if (reason := writable_error(out.parent)) is not None:
        raise ConfigError(f"cannot write out={out}: {reason} ({out.parent}); choose another out")


def hf_files(ckpt: Checkpoint) -> dict[str, Any]:
    """The export's files: name -> tensors (model.safetensors), a dict (json) or text."""
    config = ckpt.model.config
    kind = _architecture(config)
    tokenizer = ckpt.tokenizer()
    eot = tokenizer.eot_token  # <|endoftext|>
    hf_config = _hf_config(config, kind, eot)
    state = ckpt.model.float().cpu().stored_state()  # a tied head once, as wte
    n_vocab = tokenizer.n_vocab  # a padded vocabulary (50304) exports as GPT-2's 50257
    if config.vocab_size > n_vocab:  # the padding rows are never drawn nor trained: dropped
        hf_config["vocab_size"] = n_vocab
        embeddings = ("wte.weight", "lm_head.weight")
        state = {k: v[:n_vocab] if k.endswith(embeddings) else v for k, v in state.items()}
    special_tokens = dict.fromkeys(("bos_token", "eos_token", "unk_token"), EOT)
    ends: int | list[int] = eot
    chat = {}
    if ckpt.chat_template:  # a reply ends at <|im_end|>, or <|endoftext|> (as serve.py's)
        ends, chat = [tokenizer.encode_single_token(IM_END), eot], {"chat_template": CHAT_TEMPLATE}
        # <|im_end|> alone is special: "<|endoftext|>" stays text outside the template, as ours
        special_tokens = {"eos_token": IM_END}
    return {
        "config.json": hf_config,
        # generate()'s (and pipelines') length, the prompt included: never past the positions
        "generation_config.json": {
            "bos_token_id": eot,
            "eos_token_id": ends,
            "max_length": config.block_size,
        },
        "model.safetensors": _gpt2_state(state) if kind == "gpt2" else _llama_state(state),
        "tokenizer.json": _tokenizer_json(tokenizer),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": config.block_size,
            # "<|endoftext|>" in a text is text (encode_ordinary); a chat template's tokens
            # are added tokens, matched in the rendered template (as render() places them)
            "split_special_tokens": not chat,
            **special_tokens,
            **chat,
        },
        "special_tokens_map.json": special_tokens,
        "README.md": model_card(ckpt, ARCHITECTURES[kind]),
    }


def _architecture(config: GPTConfig, names: dict[str, str] = TRANSFORMERS) -> str:
    """The architecture, "gpt2" or "llama", chosen by pos_embedding; else a ConfigError naming
    the first option (in FIELDS' order) that it cannot reproduce, and where (`names`)."""
    kind = "llama" if config.pos_embedding == "rope" else "gpt2"
    for name, need in needs(kind).items():
        if (value := getattr(config, name)) != need:
            raise ConfigError(
                f"model.{name}={value!r} has no equivalent in {names[kind]} "
                f"(which pos_embedding={config.pos_embedding} maps to): "
                "export supports GPT-2's architecture and rope + rmsnorm + swiglu (Llama) "
                "without qk_norm or logit_softcap"
            )
    return kind


def _hf_config(config: GPTConfig, kind: str, eot: int) -> dict[str, Any]:
    """config.json: each field's keys (FIELDS) and the fixed keys (HF_FIXED) of `kind`."""
    hf_config = {
        "architectures": [ARCHITECTURES[kind]],
        **{key: accepted[0] for key, accepted in HF_FIXED[kind].items()},
        **dict.fromkeys(("bos_token_id", "eos_token_id"), eot),
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    }
    for name, field in FIELDS.items():
        hf_config.update(dict.fromkeys(hf_keys(name, kind), getattr(config, field.via or name)))
    if kind == "llama":  # rope_theta for transformers < 5, rope_parameters for 5
        hf_config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_base}
        hf_config["head_dim"] = config.head_size
    return hf_config


def _tokenizer_json(tokenizer: tiktoken.Encoding) -> dict[str, Any]:
    """tokenizer.json of a tiktoken byte-level BPE (all of ours): the same split regex and
    vocabulary. GPT-2's merges are its own 50,000 (merges.txt, the data-gym vocab.bpe tiktoken's
    gpt2 is built from). A trained one's: tiktoken merges the adjacent pair whose joined bytes
    rank lowest, so every split of a token into two tokens is a merge, in the order of the
    joined token's rank (as transformers' TikTokenConverter); tests check the ids on varied text."""
    ranks = tokenizer._mergeable_ranks  # tiktoken has no public accessor for it nor the regex

    def spell(b: bytes) -> str:
        return "".join(BYTE_CHARS[x] for x in b)

    if tokenizer.name.removesuffix(f"+{TEMPLATE}") == "gpt2":  # a chat model's too
        merges = gpt2_bpe_files()[1].read_text(encoding="utf-8").splitlines()[1:]  # "#version"
    else:
        merges = [
            f"{spell(token[:i])} {spell(token[i:])}"  # no space inside: byte 32 is spelled Ġ
            for token in sorted(ranks, key=ranks.get)
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    split = {"type": "Split", "pattern": {"Regex": tokenizer._pat_str}, "behavior": "Isolated"}
    specials = {t: tokenizer.encode_single_token(t) for t in tokenizer.special_tokens_set}
    flags = dict(single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
    return {
        "version": "1.0",
        "added_tokens": [  # a chat template's; <|endoftext|>: tokenizer_config.json's eos_token
            dict(id=i, content=t, **flags) for t, i in sorted(specials.items()) if t != EOT
        ],
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [{**split, "invert": False}, {**byte_level, "use_regex": False}],
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "vocab": {spell(b): rank for b, rank in ranks.items()} | specials,
            "merges": merges,
        },
    }


def _gpt2_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names are GPT-2's; its Conv1D layers store (in, out), the transpose of our Linear.
    Without biases (bias=false) GPT-2's are zeros: the same function."""
    for name, w in list(state.items()):
        if name.startswith(("transformer.h.", "transformer.ln_f.")):
            state.setdefault(name.replace(".weight", ".bias"), torch.zeros(w.shape[0]))
        if name.endswith(CONV1D_WEIGHTS):
            state[name] = w.t()  # (out, in) -> Conv1D's (in, out)
    return state


# Our modules -> Llama's. c_attn holds W_Q | W_K | W_V and c_fc W_1 | W_3 (SiLU's input | the
# gate's other factor) stacked, in this order; Llama keeps each in its own Linear.
LLAMA_NAMES = {
    "transformer.wte": ("model.embed_tokens",),
    "transformer.ln_f": ("model.norm",),
    "lm_head": ("lm_head",),
    "ln_1": ("input_layernorm",),
    "ln_2": ("post_attention_layernorm",),
    "attn.c_attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.c_proj": ("self_attn.o_proj",),
    "mlp.c_fc": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.c_proj": ("mlp.down_proj",),
}


def _llama_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors under Llama's names (LLAMA_NAMES), a stacked one split. Both rotate the pairs
    (i, i + head_size/2) (rotate_half), so q and k need no permutation."""
    theirs = {}
    for name, w in state.items():
        layer, module, kind = re.fullmatch(
            r"(?:transformer\.h\.(\d+)\.)?(.+)\.(\w+)", name
        ).groups()
        prefix = "" if layer is None else f"model.layers.{layer}."
        names = LLAMA_NAMES[module]
        for their_name, part in zip(names, w.chunk(len(names)), strict=True):
            theirs[f"{prefix}{their_name}.{kind}"] = part
    return theirs


def model_card(ckpt: Checkpoint, architecture: str) -> str:
    """README.md of the export: where the weights came from and how good they are."""
    meta, run = ckpt.meta, ckpt.run_config
    data = {k: v for k, v in (run.get("data") or {}).items() if k not in ("cache_dir", "num_proc")}
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
        f"- Tokenizer: `{ckpt.tokenizer_name}`",
    ]
    if "train" in run:
        lines += [
            f"- Training data: {json.dumps(data)}",
            f"- Initialized from: {(run['train'] or {}).get('init_from') or 'random weights'}",
            f"- Steps: {meta.get('step')}",
        ]
    else:
        lines.append(f"- Weights: the Hugging Face model at {meta.get('source', ckpt.path)}")
    if meta.get("final_val_bpb") is not None:  # what training's last line and evaluate.py say
        lines.append(
            f"- Validation: loss {meta['final_val_loss']:.4f} nats/token, "
            f"{meta['final_val_bpb']:.4f} bits per byte (the whole validation split, "
            f"{meta['final_val_tokens']:,} tokens)"
        )
    elif meta.get("val_bpb") is not None:
        lines.append(
            f"- Validation: loss {meta['val_loss']:.4f} nats/token, {meta['val_bpb']:.4f} bits "
            "per byte (the train.eval_steps subset of the validation split, at the step above; "
            "`python evaluate.py checkpoint=<this directory>` scores all of it)"
        )
    else:
        lines.append(
            "- Validation: not recorded in this checkpoint; measure it with "
            "`python evaluate.py checkpoint=<this directory>`"
        )
    if "causality" in meta:
        lines += _causality_lines(meta["causality"])
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


def _causality_lines(record: dict[str, Any]) -> list[str]:
    """The training guard's record (trainer/preflight.py) as the card's bullets: the verdict, the
    model it checked, and each check with its positions and largest violation."""
    if not record["checked"]:
        return [f"- Causality check: not run ({record['reason']})"]
    verdict = "passed" if record["causal"] else "FAILED"
    lines = [f"- Causality check: {verdict} on {record['model']}, in {record['seconds']} s:"]
    for name, check in record["checks"].items():
        status = "pass" if check["passed"] else "FAIL"
        lines.append(
            f"  - {name}: {check['positions']} positions, largest {check['measure']} "
            f"{check['largest']:.1e}: {status}"
        )
    return lines


def _write_files(tmp: Path, files: dict[str, Any]) -> None:
    """Write `files` (see hf_files) into the directory `tmp`."""
    for name, content in files.items():
        if isinstance(content, str):
            (tmp / name).write_text(content)
        elif name.endswith(".safetensors"):
            tensors = {k: v.contiguous() for k, v in content.items()}  # Conv1D's: transposed
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        else:
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
