"""Sampling from a trained causalgpt: `from inference import generate, SamplingParams`."""

from inference.generate import SamplingParams, generate, stream_tokens
from inference.text import TextStream

__all__ = [
    "SamplingParams",
    "TextStream",
    "generate",
    "stream_tokens",
]
