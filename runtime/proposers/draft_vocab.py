"""The vocabulary a head proposer drafts over: the whole target vocabulary, or the heads' draft vocabulary.

On a small target the drafter's vocabulary projection, not its layers, is the cost (SmolLM2-135M: 49,152 LM-head
rows per drafted level cost about one target decode step). Heads with a draft vocabulary (heads.draft_vocab: EAGLE-3's
built-in `d2t`, or one given to Medusa / EAGLE-1/2 / MTP heads) draft over its Vd most frequent target ids only:
the projection rows of those ids are gathered ONCE here (a [Vd, H] matrix), top-k is taken over draft ids and
mapped to target ids, and sampled rows q are put back on the target vocabulary with zeros outside it. Still
lossless: the target verifies every drafted token, and rejection sampling is exact for any q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from heads.base import HeadsModule
from heads.draft_vocab import draft_logits_to_target, draft_target_ids, draft_to_target_ids


@dataclass(frozen=True)
class DraftVocab:
    """Draft ids <-> target ids. `d2t` None: the full target vocabulary (draft id == target id)."""

    vocab_size: int  # V, the target's vocabulary
    d2t: Tensor | None = None  # [Vd] int64 (heads.draft_vocab layout)

    @staticmethod
    def of(heads: HeadsModule, vocab_size: int) -> DraftVocab:
        """The heads' draft vocabulary (heads trained before draft vocabularies existed: the full one)."""
        return DraftVocab(vocab_size, heads.d2t if heads.has_draft_vocab else None)

    @property
    def size(self) -> int:
        """Vd: how many tokens a draft row scores."""
        return self.vocab_size if self.d2t is None else int(self.d2t.numel())

    def rows(self, weight: Tensor) -> Tensor:
        """A projection weight [V, H] -> its draft-vocabulary rows [Vd, H] (a copy; the weight itself when full)."""
        return weight if self.d2t is None else weight.index_select(0, draft_target_ids(self.d2t).to(weight.device))

    def linear(self, lm_head: nn.Module) -> nn.Module:
        """An LM head [H -> V] restricted to the draft vocabulary [H -> Vd] (the module itself when full)."""
        if self.d2t is None:
            return lm_head
        bias = getattr(lm_head, "bias", None)
        weight = self.rows(lm_head.weight)
        reduced = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                            dtype=weight.dtype)
        with torch.no_grad():
            reduced.weight.copy_(weight)
            if bias is not None:
                reduced.bias.copy_(self.rows(bias))
        return reduced.requires_grad_(False)

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft ids [...] -> target ids [...]."""
        return draft_ids if self.d2t is None else draft_to_target_ids(draft_ids, self.d2t.to(draft_ids.device))

    def to_target_logits(self, logits: Tensor) -> Tensor:
        """Draft logits [..., Vd] -> target logits [..., V], -inf outside the draft vocabulary."""
        return logits if self.d2t is None else draft_logits_to_target(logits, self.d2t.to(logits.device),
                                                                       self.vocab_size)
