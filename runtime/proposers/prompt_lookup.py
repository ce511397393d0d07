"""Prompt lookup: draft the continuation of an earlier occurrence of the last n tokens (no model, no training).

For n from max_ngram down to min_ngram, find the EARLIEST earlier occurrence of the last n committed tokens
(as transformers' prompt_lookup_num_tokens does: the prompt, where copied text usually comes from, is
searched first) and propose the tokens that followed it, as a chain. Deterministic: Draft.probs is None.
"""

from __future__ import annotations

import torch

from runtime.proposers.base import Draft, root_only
from runtime.tree import Tree


def lookup_continuation(ids: torch.Tensor, max_ngram: int, min_ngram: int, max_tokens: int) -> torch.Tensor:
    """ids [T] -> up to `max_tokens` tokens [m] that followed the earliest earlier match of the longest
    suffix n-gram (n in max_ngram..min_ngram); empty [0] if none matches."""
    length = ids.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = ids[:-1].unfold(0, n, 1)  # [T - n, n]; window i = ids[i:i+n], followed by ids[i+n] (i+n < T)
        hits = (windows == ids[-n:]).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[0]) + n
            return ids[start:start + max_tokens]
    return ids[:0]


class PromptLookupProposer:
    """n-gram matching in the context (prompt + generated tokens)."""

    hidden_state_indices: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"--min_ngram/--max_ngram: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        pass

    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return root_only(committed_ids)
        continuation = lookup_continuation(committed_ids, self.max_ngram, self.min_ngram, max_tokens)  # [m]
        return Draft(tokens=torch.cat([committed_ids[-1:], continuation]), tree=Tree.chain(continuation.numel()))

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        pass
