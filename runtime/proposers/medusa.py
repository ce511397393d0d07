"""Medusa proposer: K heads on the target's last hidden state fill a static sparse tree.

Alignment (heads/medusa.py): head h at position t predicts token t+2+h. After a step, the last committed
token (the root of the next tree, at position T) has not been through the target yet; the newest target
hidden state is at T-1 (the last accepted node, or the last prompt token after prefill). Head h on it predicts
the token at T+1+h, i.e. tree depth h+1. So a tree of depth D needs D <= K heads, and every node at depth d
takes its children's candidates from the same row, head d's logits: node (r_1..r_d) holds head (d-1)'s
rank-r_d token. Candidates exist only at tree positions; the target verifies them in one forward.
"""

from __future__ import annotations

import torch

from heads.base import target_modules
from heads.medusa import MedusaHeads, shared_lm_head_rows
from runtime.proposers.base import Draft, root_only
from runtime.proposers.draft_vocab import DraftVocab
from runtime.proposers.tree_drafting import check_top_k, draft_static_tree
from runtime.sampling import SamplingConfig
from runtime.tree_search import StaticTree, validate_paths


class MedusaProposer:
    """Static-tree drafts from Medusa heads. Holds only the newest target hidden state between steps."""

    def __init__(self, heads: MedusaHeads, target_model: torch.nn.Module, tree: StaticTree,
                 sampling: SamplingConfig | None = None, seed: int | None = None, tree_source: str = "--tree"):
        validate_paths(tree.paths, tree_source, num_heads=heads.num_heads, vocab_size=heads.config.vocab_size)
        self.heads = heads
        self.tree = tree
        self.sampling = sampling or SamplingConfig()
        self.vocab_size = int(target_model.get_output_embeddings().weight.shape[0])
        self.vocab = DraftVocab.of(heads, self.vocab_size)
        check_top_k(tree.max_rank + 1, self.vocab.size, f"{tree_source}: top_k")
        # Draft-vocabulary rows (all rows without a draft vocabulary), gathered once: [Vd, H] of the target's LM
        # head that shared heads project onto; or [K, Vd, H] of each head's own projection (None: full, own).
        self.lm_head_rows = (self.vocab.rows(shared_lm_head_rows(target_modules(target_model).lm_head))
                             if heads.config.medusa_shared_lm_head else None)
        self.own_rows = (torch.stack([self.vocab.rows(head[-1].weight) for head in heads.heads])
                         if not heads.config.medusa_shared_lm_head and self.vocab.d2t is not None else None)
        self.hidden_state_indices = tuple(heads.config.target_layers)
        self.generator = torch.Generator().manual_seed(seed + 2) if seed is not None else None
        self._hidden: torch.Tensor | None = None  # [H] target hidden state at the position before the root

    @property
    def tree_size(self) -> int:
        """Non-root nodes of the full tree (the draft budget the loop should allow)."""
        return self.tree.tree.num_nodes - 1

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        if not prefill_hidden:
            raise ValueError("MedusaProposer needs the target's hidden states (hidden_state_indices)")
        self._hidden = prefill_hidden[self.hidden_state_indices[0]][-1]

    @torch.inference_mode()
    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        root = int(committed_ids[-1])
        if max_tokens <= 0 or self._hidden is None:
            return root_only(committed_ids)
        logits = self._head_logits(min(self.tree.tree.max_depth, max_tokens))  # [D, Vd]
        draft = draft_static_tree(self.tree, root, lambda depth, nodes, tokens, parents: logits[depth].expand(len(nodes), -1),
                                  self.sampling, self.generator, max_tokens, self.vocab_size, self.vocab.to_target,
                                  self.vocab.to_target_logits)
        return Draft(tokens=draft.tokens.to(committed_ids.device), tree=draft.tree, probs=draft.probs)

    def _head_logits(self, depth: int) -> torch.Tensor:
        """Logits [depth, Vd] of heads 0..depth-1 only (each head's vocabulary projection is as costly as the
        target's LM head, so heads deeper than the tree are skipped), over the draft vocabulary."""
        hidden = self._hidden.to(self.heads.dtype)[None]  # [1, H]
        rows = self.own_rows[:depth] if self.own_rows is not None else self.lm_head_rows  # None: own, full
        return self.heads.compute_logits(hidden, rows, num_heads=depth)[:, 0].float()

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        if not tree_hidden:
            raise ValueError("MedusaProposer needs the target's hidden states at the tree nodes")
        self._hidden = tree_hidden[self.hidden_state_indices[0]][accepted_nodes[-1]]
