"""Sampling from a trained causalgpt: `from inference import generate, SamplingParams`."""

from inference.generate import SamplingParams, TokenContext, generate, next_token, stream_tokens
from inference.text import TextStream

__all__ = [
    "SamplingParams",
    "TextStream",
    "TokenContext",
    "generate",
    "next_token",
    "stream_tokens",
]
