"""Bits per UTF-8 byte: the tokenizer-independent loss the project reports."""

from __future__ import annotations

import math


def bits_per_byte(loss_nats_per_token: float, tokens: float, nbytes: float) -> float:
    """Convert a mean loss over ``tokens`` tokens spanning ``nbytes`` UTF-8 bytes.

    Total nats = loss * tokens; dividing by bytes and ln 2 gives bits per byte, which compares
    models with different tokenizers on the same text.
    """
    return loss_nats_per_token * tokens / (nbytes * math.log(2))
