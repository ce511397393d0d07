"""The proposer contract: every drafter (draft model, prompt lookup, Medusa, EAGLE, MTP) implements it.

The decode loop (runtime/loop.py) calls, once per step:
    draft = proposer.propose(state)          # candidate tree rooted at the last committed token
    ... verify + accept ...
    proposer.on_accept(state, draft, acceptance, target_hidden)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import torch

from runtime.tree import Tree


@dataclass(frozen=True)
class Draft:
    """A candidate tree with its tokens and, for sampled drafts, the distributions children came from.

    tokens[0] is the root: the last committed token. `probs[i]` (if not None) is the draft distribution q,
    after the same temperature/top-k/top-p processing as the target, from which the children of node i
    were drawn *without replacement*, in child order. `probs is None` means the children are deterministic
    guesses (point masses); rejection sampling stays lossless either way. `point_mass[i]` True marks node i as a
    deterministic guess even where its parent's row of `probs` gave its siblings (a hybrid tree: sampled head
    children and prompt-lookup tokens under one node). `expected` is the drafter's own estimate of the draft
    tokens the target will accept: the sum over non-root nodes of the path's draft probability (EAGLE-2's scores,
    `tree_drafting.ordered_draft`); None where the drafter has none.
    """

    tokens: torch.Tensor  # [N] int64
    tree: Tree
    probs: torch.Tensor | None = None  # [N, V] float32 or None
    point_mass: torch.Tensor | None = None  # [N] bool or None (None: every node as `probs` says)
    expected: float | None = None  # the drafter's estimate of accepted draft tokens, or None


class Proposer(Protocol):
    """A drafter. Owns its own state (draft KV cache, n-gram index...); the loop passes state explicitly."""

    #: which target hidden states the proposer needs from each verify forward (HF hidden_states indices,
    #: e.g. [-1] for Medusa/EAGLE-1, [2, L//2, L-3] for EAGLE-3); empty for none.
    hidden_state_indices: tuple[int, ...]

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        """Start a new sequence. prompt_ids: [T]; prefill_hidden: index -> [T, H] target hidden states."""

    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        """Draft a tree rooted at committed_ids[-1] with at most `max_tokens` non-root nodes."""

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        """Update drafter state. accepted_nodes: node ids root..last accepted (root included);
        tree_hidden: index -> [N, H] target hidden states at the tree nodes (for feature-based drafters)."""


def per_row(proposer: Proposer, rows: int) -> list[Proposer]:
    """`rows` proposers for a batch (generate_batch takes one per row): `proposer` and shallow copies of it. The
    copies share weights; each row's per-sequence state is created by its own `reset`, and a proposer holding
    another stateful object (the draft model's cache) makes its own in `__copy__`."""
    if rows < 1:
        raise ValueError(f"per_row: need at least one row, got {rows}")
    return [proposer] + [copy.copy(proposer) for _ in range(rows - 1)]


def pending_entries(proposer) -> int:
    """Committed entries a stateful drafter has been given but not yet run through its own layers (an EAGLE or MTP
    layer feeds them at its next propose, in one call): what that propose pays for before drafting anything. 0 for a
    drafter without such state."""
    return int(getattr(proposer, "pending_entries", 0))


def chain_draft(committed_ids: torch.Tensor, tokens: torch.Tensor) -> Draft:
    """A chain of `tokens` [k] below the root (committed_ids[-1]): what prompt lookup and the oracle draft."""
    return Draft(tokens=torch.cat([committed_ids[-1:], tokens]), tree=Tree.chain(tokens.numel()))


def root_only(committed_ids: torch.Tensor) -> Draft:
    """The empty draft: just the root (committed_ids[-1]); verifying it is one plain decoding step."""
    return Draft(tokens=committed_ids[-1:].clone(), tree=Tree.chain(0))


class Autoregressive:
    """Proposes nothing: the loop then does plain decoding (tau = 1.0). The baseline of every benchmark."""

    hidden_state_indices: tuple[int, ...] = ()

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        pass

    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        return root_only(committed_ids)

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        pass
