"""The causalgpt model: `from model import GPT, GPTConfig`."""

from model.config import ATTENTION_IMPLS, GPTConfig, load_preset, preset_names
from model.gpt import GPT, KVCache, eval_mode

__all__ = [
    "ATTENTION_IMPLS",
    "GPT",
    "GPTConfig",
    "KVCache",
    "load_preset",
    "eval_mode",
    "preset_names",
]
