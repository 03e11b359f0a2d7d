"""Check that a model is causal: `python check_causality.py [key=value ...]`.

The model is the one `python train.py` builds from the same overrides (shrunk by default), or a
trained one: `checkpoint=<run dir | checkpoint dir | Hugging Face GPT-2 dir>`, or any causal LM
transformers loads from a local directory (Llama, Mistral, ...: `audit_transformers`' checks).
Prints a one-line verdict, one line per check, then one JSON line; exit 0 when causal, 1 on a
leak, 2 on a user error. See configs/check_causality.yaml and the README ("Changing the model").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from base.errors import ConfigError, boolean, check, hydra_main, is_int, user_errors
from checkpoints.store import is_hf_dir, load_source
from hardware.device import resolve_device
from model import ATTENTION_IMPLS, GPT, GPTConfig
from model.causality import check_causality, shrunk_config, undrivable
from model.gpt import unavailable_attention

GPT2_VOCAB = 50257  # vocab_size: null at full size (only the tokenizer knows it; any size works)


def transformers_model(path: Path) -> tuple[torch.nn.Module, str] | None:
    """The causal LM of a transformers directory of another architecture than GPT-2 (GPT-2's
    becomes our GPT, and gets every implementation), and what it is; None for any other path."""
    if not is_hf_dir(path):
        return None
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except ValueError:  # not JSON: load_source says so
        return None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind in ("gpt2", None):  # ours to convert, or load_source's to refuse
        return None
    try:
        from transformers import AutoModelForCausalLM  # only here: seconds to import
    except ImportError:
        raise ConfigError(
            f"checkpoint={path} holds a transformers {kind!r} model: checking it needs the "
            "transformers package (pip install transformers)"
        ) from None

    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except ValueError as e:  # "Unrecognized configuration class ...": no causal LM of that type
        raise ConfigError(
            f"checkpoint={path} holds a {kind!r} model that transformers has no causal language "
            f"model for (an encoder?): {str(e).splitlines()[0]}"
        ) from None
    if reason := undrivable(model):
        raise ConfigError(
            f"checkpoint={path} holds a {kind!r} model the audit cannot check: {reason}"
        )
    return model, f"the transformers {kind} model in {path} ({model.config._attn_implementation})"


def model_to_check(cfg: dict[str, Any]) -> tuple[GPT | torch.nn.Module, str]:
    """The model named by `checkpoint` (ours, a Hugging Face GPT-2 directory, or a transformers
    causal LM), else the config's model (shrunk unless shrink=false), freshly initialised; and
    what it is, for the verdict ("causal: ... on <what>")."""
    if cfg["checkpoint"] is None:
        values = cfg["model"]
        if cfg["shrink"]:
            c = shrunk_config(values)
            sizes = f"n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd}"
            return GPT(c), f"the config's model, shrunk to {sizes} (options as configured)"
        config = GPTConfig.from_dict({**values, "vocab_size": values["vocab_size"] or GPT2_VOCAB})
        return GPT(config), f"the config's model, full size ({config})"
    if found := transformers_model(Path(str(cfg["checkpoint"])).expanduser()):
        return found
    ckpt = load_source(str(cfg["checkpoint"]))  # ours, a Hugging Face GPT-2 dir, a GPT-2 name
    if ckpt.meta.get("source"):  # Hugging Face weights
        return ckpt.model, f"Hugging Face GPT-2 weights from {ckpt.meta['source']}"
    return ckpt.model, f"checkpoint {ckpt.path}"


OWN_KEYS = ("checkpoint", "seq_len", "batch_size", "seed", "attention", "device")


def run(cfg: dict[str, Any], overrides: list[str] = ()) -> int:
    """Print the report; 0 when every check passes, 1 otherwise. With a checkpoint, the model
    is the checkpoint's: command-line `overrides` of anything but OWN_KEYS are refused."""
    ignored = [o for o in overrides if o.lstrip("+~").split("=")[0] not in OWN_KEYS]
    if cfg["checkpoint"] is not None and ignored:
        raise ConfigError(
            f"{ignored[0]} changes nothing with checkpoint=...: the model checked is the "
            f"checkpoint's; drop it (with a checkpoint, set only {', '.join(OWN_KEYS[1:])})"
        )
    for key, low in (("seq_len", 2), ("batch_size", 1)):
        check(key, cfg[key], is_int(cfg[key], low), f"an integer >= {low}")
    attention, impls = cfg["attention"], list(ATTENTION_IMPLS)
    check("attention", attention, attention in ["all", *impls], f"all or one of {impls}")
    boolean("shrink", cfg["shrink"])
    device = resolve_device(cfg["device"])
    torch.manual_seed(cfg["seed"])  # the same initial weights, and so the same report, each run
    model, description = model_to_check(cfg)
    ours = isinstance(model, GPT)
    if not ours and attention != "all":
        raise ConfigError(
            f"attention={attention} picks one of our implementations; {description} is checked "
            "with its own: drop attention"
        )
    attention = None if attention == "all" else (attention,)
    report = check_causality(
        model.to(device), cfg["seq_len"], cfg["batch_size"], cfg["seed"], attention
    )
    n, failures = len(report.checks), report.failures()
    if failures:
        failed = sum(not c.passed for c in report.checks)
        print(f"NOT causal: {failed} of {n} checks failed on {description}; first: {failures[0]}")
    else:
        print(f"causal: all {n} checks passed on {description}")
    if ours and attention is None and (skipped := unavailable_attention(device)):
        print("\n".join(f"not checked here: {why}" for why in skipped.values()))
    print(report)  # a line per check, then the JSON summary
    return 0 if report.causal else 1


@hydra_main("check_causality")
def main(cfg: DictConfig) -> None:
    with user_errors():
        overrides = list(HydraConfig.get().overrides.task)
        sys.exit(run(OmegaConf.to_container(cfg, resolve=True), overrides))


if __name__ == "__main__":
    main()
