"""Sampling from a trained causalgpt: `from inference import generate, SamplingParams`."""

from inference.generate import SamplingParams, TextStream, generate, stream_tokens

__all__ = ["SamplingParams", "TextStream", "generate", "stream_tokens"]
