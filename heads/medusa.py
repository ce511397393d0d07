"""Medusa heads (Cai et al., 2024).

Alignment: input = target hidden_states[-1] (after the final norm) at position t; head h (0-based)
predicts token t+2+h (the target's own LM head predicts t+1).

Each head is `medusa_num_layers` residual blocks x + SiLU(W x + b) with independent weights, zero-initialised
so a fresh head is the identity, followed by a vocabulary projection: its own Linear(H, V, bias=False), or
with `medusa_shared_lm_head=True` the target's frozen LM head (passed in, never saved): only the blocks train
(H^2 + H parameters per block instead of H^2 + H + V H; 0.33M instead of 28.6M per head on SmolLM2-135M), the
design TGI's MedusaHeadV2 loads. `compute_logits` is the one function that makes Medusa logits.
Parameter names inside `heads.{h}` are the FasterDecoding names `{l}.linear.weight/bias` and `{L}.weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import HeadsModule
from heads.config import HeadsConfig


def shared_lm_head_rows(lm_head: nn.Module) -> Tensor:
    """The weight [V, H] of the target's LM head, for heads that share it (a biased LM head is refused)."""
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("medusa_shared_lm_head: the target's LM head has a bias, which shared Medusa heads do not "
                         "apply; train with --medusa_shared_lm_head false")
    return lm_head.weight


class ResBlock(nn.Module):
    """x + SiLU(linear(x)); weight and bias start at zero (identity). [..., H] -> [..., H]."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(HeadsModule, kind="medusa"):
    """K Medusa heads. `heads[h]` = Sequential(ResBlock x L[, Linear(H, V)])."""

    def __init__(self, config: HeadsConfig) -> None:
        if config.kind != "medusa":
            raise ValueError(f"MedusaHeads needs kind 'medusa', got {config.kind!r}")
        super().__init__(config)
        hidden, vocab = config.hidden_size, config.vocab_size
        heads = []
        for _ in range(config.medusa_num_heads):
            layers: list[nn.Module] = [ResBlock(hidden) for _ in range(config.medusa_num_layers)]
            if not config.medusa_shared_lm_head:
                layers.append(nn.Linear(hidden, vocab, bias=False))
            heads.append(nn.Sequential(*layers))
        self.heads = nn.ModuleList(heads)

    @property
    def num_heads(self) -> int:
        return self.config.medusa_num_heads

    def head_hidden_states(self, hidden_states: Tensor, num_heads: int | None = None) -> Tensor:
        """Residual blocks of heads 0..K'-1 (K' = num_heads, default all): [..., H] -> [K', ..., H]."""
        layers = self.config.medusa_num_layers
        return torch.stack([head[:layers](hidden_states) for head in list(self.heads)[:num_heads]])

    def compute_logits(self, hidden_states: Tensor, lm_head_rows: Tensor | None = None,
                       num_heads: int | None = None) -> Tensor:
        """Logits [K', ..., V'] of heads 0..K'-1 (K' = num_heads, default all) at hidden_states [..., H] (target
        hs[-1]); logits[h] is for token t+2+h. The one place Medusa logits are made (training and runtime).

        `lm_head_rows` says which vocabulary rows to project onto:
        - None: each head's own [V, H] projection (heads with projections only);
        - [V', H]: every head projects onto these rows: the target's LM head weight for shared heads
          (`medusa_shared_lm_head=True`, required), or only its rows of a reduced draft vocabulary;
        - [K', V', H]: head h projects onto rows[h] (e.g. each head's own projection restricted to a draft
          vocabulary).
        """
        shared = self.config.medusa_shared_lm_head
        if lm_head_rows is None:
            if shared:
                raise ValueError(f"MedusaHeads(medusa_shared_lm_head=True) needs lm_head_rows [V, "
                                 f"{self.config.hidden_size}] (the target's LM head weight)")
            return torch.stack([head(hidden_states) for head in list(self.heads)[:num_heads]])
        count = num_heads or self.num_heads
        if lm_head_rows.shape[-1] != self.config.hidden_size or lm_head_rows.ndim not in (2, 3) or (
                lm_head_rows.ndim == 3 and lm_head_rows.shape[0] != count):
            raise ValueError(f"MedusaHeads.compute_logits: lm_head_rows must be [V', {self.config.hidden_size}] or "
                             f"[{count}, V', {self.config.hidden_size}], got {list(lm_head_rows.shape)}")
        if not shared and lm_head_rows.ndim == 2:
            raise ValueError("MedusaHeads has its own projections (medusa_shared_lm_head=False): pass no "
                             "lm_head_rows, or one [V', H] block of rows per head")
        hidden = self.head_hidden_states(hidden_states, num_heads).to(lm_head_rows.dtype)  # [K', ..., H]
        if lm_head_rows.ndim == 2:
            return F.linear(hidden, lm_head_rows)
        return torch.stack([F.linear(x, rows) for x, rows in zip(hidden, lm_head_rows, strict=True)])

    def forward(self, hidden_states: Tensor, lm_head: nn.Module | None = None) -> Tensor:
        """hidden_states [B, S, H] (target hs[-1]) -> logits [K, B, S, V]; logits[h] is for token t+2+h.

        `lm_head` (the target's) is required with `medusa_shared_lm_head=True` and refused otherwise.
        """
        if lm_head is None:
            return self.compute_logits(hidden_states)
        if not self.config.medusa_shared_lm_head:
            raise ValueError("MedusaHeads has its own projections; do not pass lm_head=")
        return self.compute_logits(hidden_states, shared_lm_head_rows(lm_head))

    @torch.no_grad()
    def init_from_lm_head(self, lm_head_weight: Tensor) -> None:
        """Copy the target's LM head weight [V, H] into every head's projection (Medusa's initialisation)."""
        if self.config.medusa_shared_lm_head:
            raise ValueError("medusa_shared_lm_head=True: the heads have no projection to initialise")
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(lm_head_weight.shape) != expected:
            raise ValueError(f"init_from_lm_head: expected weight {list(expected)}, "
                             f"got {list(lm_head_weight.shape)}")
        for head in self.heads:
            head[-1].weight.copy_(lm_head_weight)
