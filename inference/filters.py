"""Logit filters for sampling, applied by `next_token` in this order:
repetition penalty -> temperature -> top-k -> top-p -> min-p.

Each takes float logits (B, V) and returns new logits in which removed tokens are -inf, so the
filters compose and the final softmax renormalises over the tokens that survive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_repetition_penalty(
    logits: torch.Tensor, context: torch.Tensor, penalty: float
) -> torch.Tensor:
    """CTRL's penalty (Keskar et al., 2019): every token that occurs in `context` (B, T) gets
    less likely. Positive logits are divided by `penalty`, negative ones multiplied by it
    (dividing a negative logit would raise it). penalty < 1 favours repetition instead."""
    seen = logits.gather(-1, context)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, context, seen)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly the k highest logits of each row (ties broken by topk's order)."""
    keep = logits.topk(min(k, logits.size(-1)), dim=-1).indices
    return torch.full_like(logits, float("-inf")).scatter(-1, keep, logits.gather(-1, keep))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al., 2020): keep the smallest set of most likely tokens
    whose probabilities add up to at least p. The most likely token always survives."""
    sorted_probs, order = F.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # of strictly more likely tokens
    remove_sorted = mass_before >= p
    remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """min-p (Nguyen et al., 2024): keep tokens at least p times as likely as the most likely
    one, so the cut adapts to how confident the model is."""
    probs = F.softmax(logits, dim=-1)
    threshold = p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))
