"""Checks that a model is causal: the prediction at position t may use tokens <= t, nothing later.

Run them after hacking the model (`find_leaks(model)` returns [] when it is causal); the test suite
runs them on every preset and attention implementation, and on deliberately leaky variants to
prove that the checks catch a leak.
"""

from __future__ import annotations

import torch

from model.gpt import GPT


def _forward(model: GPT, idx: torch.Tensor, seed: int) -> torch.Tensor:
    """Logits with the RNG reseeded, so that dropout draws the same masks on every call."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        logits, _ = model(idx)
    return logits


@torch.no_grad()
def perturbation_leaks(
    model: GPT, idx: torch.Tensor, seed: int = 0, atol: float = 1e-6
) -> list[str]:
    """For each t, replace every token after t with a different random token: logits at
    positions <= t must stay the same (within atol) and logits after t must change.
    Returns one line per violation. Works in train mode too (dropout masks are reseeded)."""
    B, T = idx.shape
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    base = _forward(model, idx, seed)
    problems = []
    for t in range(T - 1):
        shift = torch.randint(1, V, (B, T - t - 1), generator=gen).to(idx.device)
        perturbed = idx.clone()
        perturbed[:, t + 1 :] = (idx[:, t + 1 :] + shift) % V  # every future token differs
        logits = _forward(model, perturbed, seed)
        past_change = (logits[:, : t + 1] - base[:, : t + 1]).abs().max().item()
        if past_change > atol:
            problems.append(f"t={t}: logits at positions <= t moved by {past_change:.3g}")
        if torch.equal(logits[:, t + 1 :], base[:, t + 1 :]):
            problems.append(f"t={t}: logits after t ignore the tokens they should see")
    return problems


def jacobian_leaks(model: GPT, idx: torch.Tensor, seed: int = 0) -> list[str]:
    """For each t, d logits[:, t] / d embeddings[:, t'] must be exactly zero for every t' > t
    (and not all zero for t' <= t). Returns one line per violation."""
    T = idx.size(1)
    problems = []
    for t in range(T):
        emb = model.transformer.wte(idx).detach().requires_grad_(True)  # (B, T, C)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            logits, _ = model(embeddings=emb)
        (grad,) = torch.autograd.grad(logits[:, t].sum(), emb)  # (B, T, C)
        if t + 1 < T and grad[:, t + 1 :].abs().max().item() != 0.0:
            problems.append(f"t={t}: gradient reaches positions > t")
        if grad[:, : t + 1].abs().max().item() == 0.0:
            problems.append(f"t={t}: gradient does not reach positions <= t")
    return problems


def find_leaks(
    model: GPT, batch_size: int = 2, seq_len: int | None = None, seed: int = 0
) -> list[str]:
    """Both checks on random tokens; [] means no leak was found."""
    T = min(seq_len or 16, model.config.block_size)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (batch_size, T), generator=gen)
    idx = idx.to(model.lm_head.weight.device)
    return perturbation_leaks(model, idx, seed) + jacobian_leaks(model, idx, seed)
