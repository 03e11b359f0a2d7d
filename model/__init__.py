"""The causalgpt model: `from model import GPT, GPTConfig`."""

from model.gpt import ATTENTION_IMPLS, GPT, GPTConfig, KVCache, eval_mode, load_preset, preset_names

__all__ = [
    "ATTENTION_IMPLS",
    "GPT",
    "GPTConfig",
    "KVCache",
    "load_preset",
    "eval_mode",
    "preset_names",
]
