"""EAGLE-3 proposer: the EAGLE drafting of runtime/proposers/eagle.py with EAGLE-3's inputs and vocabulary.

Alignment (heads/eagle.py): committed entry s reads `project(cat(hs[l_low], hs[l_mid], hs[l_high]) at s)`
with the embedding of token s+1 (layers = the head config's `target_layers`, HF hidden_states indices);
drafted entries read their parent's pre-norm output instead. Logits come from the draft's own `norm` +
reduced-vocabulary `lm_head`; top-k is taken over the draft vocabulary and the chosen draft ids are mapped to
target ids with `d2t`. With sampling, q over the target vocabulary is zero outside the draft vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.eagle import Eagle3Draft
from runtime.proposers.eagle import PROMPT_WINDOW, DynamicTreeConfig, EagleProposer
from runtime.sampling import SamplingConfig
from runtime.tree_search import StaticTree


class Eagle3Proposer(EagleProposer):
    """EAGLE-3 drafts (static tree / chain, or EAGLE-2-style dynamic tree)."""

    def __init__(self, heads: Eagle3Draft, target_model: torch.nn.Module, tree: StaticTree | None = None,
                 dynamic: DynamicTreeConfig | None = None, sampling: SamplingConfig | None = None,
                 seed: int | None = None, prompt_window: int | None = PROMPT_WINDOW):
        super().__init__(heads, target_model, tree=tree, dynamic=dynamic, sampling=sampling, seed=seed,
                         prompt_window=prompt_window)

    def features(self, hidden: dict[int, Tensor]) -> Tensor:
        """{index: [n, H]} for the three target layers -> projected features [n, H]."""
        return self.heads.project([hidden[i].to(self.dtype) for i in self.hidden_state_indices])

    def draft_logits(self, outputs: Tensor) -> Tensor:
        """Its own norm + reduced lm_head [..., Vd]; `self.vocab` (the heads' d2t) maps ids back."""
        return self.heads.compute_logits(outputs).float()
