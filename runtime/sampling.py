"""Sampling settings and the one function that turns logits into the distribution we sample from.

`logits_to_probs` is the ONLY place temperature, top-k and top-p are applied. The decode loop applies it to
the target's logits and every drafter applies it to its own, so the draft distribution q and the target
distribution p that the acceptance rules compare (runtime/acceptance.py) are processed identically.
Greedy decoding (temperature 0) is the point mass on the argmax (ties: lowest token id), so every
acceptance rule reduces to exact-match acceptance under greedy settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. Applied in the order temperature -> top-k -> top-p (as transformers)."""

    temperature: float = 0.0  # 0 -> greedy (argmax)
    top_k: int = 0  # 0 -> off; otherwise keep the k most likely tokens
    top_p: float = 1.0  # 1 -> off; otherwise keep the smallest set of tokens with mass >= top_p

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """Next-token distribution after temperature, top-k and top-p.

    logits: [..., V] (any float dtype). Returns [..., V] float32 whose rows sum to 1. Greedy settings give
    the one-hot of the argmax. top-k keeps every token tied with the k-th largest logit.
    """
    if logits.ndim < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V > 0, got {tuple(logits.shape)}")
    logits = logits.float()
    if sampling.is_greedy:
        one_hot = torch.zeros_like(logits)
        return one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    scores = logits / sampling.temperature  # [..., V]
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [..., V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p  # the most likely token always has mass_before 0: kept
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_token(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row. probs: [..., V] non-negative rows with positive sum. Returns [...] int64."""
    if probs.ndim < 1 or probs.shape[-1] == 0:
        raise ValueError(f"probs must have shape [..., V] with V > 0, got {tuple(probs.shape)}")
    flat = probs.reshape(-1, probs.shape[-1])  # [R, V]
    if bool((flat < 0).any()) or not bool((flat.sum(dim=-1) > 0).all()):
        raise ValueError("probs rows must be non-negative with a positive sum")
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
