"""The causalgpt model: `from model import GPT, GPTConfig`."""

from model.gpt import ATTENTION_IMPLS, GPT, GPTConfig, KVCache, eval_mode

__all__ = ["ATTENTION_IMPLS", "GPT", "GPTConfig", "KVCache", "eval_mode"]
