"""Medusa heads (Cai et al., 2024).

Alignment: input = target hidden_states[-1] (after the final norm) at position t; head h (0-based)
predicts token t+2+h (the target's own LM head predicts t+1).

Each head is `medusa_num_layers` residual blocks x + SiLU(W x + b) with independent weights, zero-initialised
so a fresh head is the identity, followed by a vocabulary projection: its own Linear(H, V, bias=False), or
with `medusa_shared_lm_head=True` the target's LM head passed as `lm_head=` (not saved).
Parameter names inside `heads.{h}` are the FasterDecoding names `{l}.linear.weight/bias` and `{L}.weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import HeadsModule
from heads.config import HeadsConfig


class ResBlock(nn.Module):
    """x + SiLU(linear(x)); weight and bias start at zero (identity). [..., H] -> [..., H]."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(HeadsModule):
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

    def head_hidden_states(self, hidden_states: Tensor) -> Tensor:
        """Residual blocks only: hidden_states [B, S, H] -> [K, B, S, H]."""
        outs = []
        for head in self.heads:
            x = hidden_states
            for block in list(head)[: self.config.medusa_num_layers]:
                x = block(x)
            outs.append(x)
        return torch.stack(outs)

    def forward(self, hidden_states: Tensor, lm_head: nn.Module | None = None) -> Tensor:
        """hidden_states [B, S, H] (target hs[-1]) -> logits [K, B, S, V]; logits[h] is for token t+2+h.

        `lm_head` (the target's) is required with `medusa_shared_lm_head=True` and refused otherwise.
        """
        if self.config.medusa_shared_lm_head:
            if lm_head is None:
                raise ValueError("MedusaHeads(medusa_shared_lm_head=True).forward needs lm_head=")
            return lm_head(self.head_hidden_states(hidden_states))
        if lm_head is not None:
            raise ValueError("MedusaHeads has its own projections; do not pass lm_head=")
        return torch.stack([head(hidden_states) for head in self.heads])

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
