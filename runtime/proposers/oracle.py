"""The oracle drafter (benchmarks only): drafts the continuation plain greedy decoding produced for the prompt.

With greedy acceptance every drafted token is then accepted (tau = chain length + 1 except where the
reference ends), so a run with this drafter measures the ceiling of speculative speed-up on this machine:
what a perfect drafter of zero cost would give at each chain length, verify cost and loop overhead included.
It cannot generate anything new; `bench.speed --oracle_sizes 1,2,4,8,16` uses it.
"""

from __future__ import annotations

import torch

from runtime.proposers.base import Draft, chain_draft, root_only


class OracleProposer:
    """Drafts `reference` (the new tokens plain greedy decoding produced for the same prompt) as a chain."""

    hidden_state_indices: tuple[int, ...] = ()

    def __init__(self, reference: list[int] | torch.Tensor):
        self.reference = torch.as_tensor(reference, dtype=torch.long).flatten()  # [R]
        self.prompt_length = 0

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        self.prompt_length = prompt_ids.numel()

    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        """committed_ids [T + g] = prompt + g new tokens; drafts reference[g : g + max_tokens]."""
        done = committed_ids.numel() - self.prompt_length
        continuation = self.reference[done:done + max(max_tokens, 0)].to(committed_ids.device)  # [m]
        if continuation.numel() == 0:
            return root_only(committed_ids)
        return chain_draft(committed_ids, continuation)

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        pass
