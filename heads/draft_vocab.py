"""The reduced draft vocabulary (EAGLE-3's `d2t` / `t2d`, FR-Spec's idea for every head kind) and how ids map.

- `d2t` int64 [draft_vocab_size]: target_id = draft_id + d2t[draft_id] (the layout vLLM and SGLang read).
- `t2d` bool [vocab_size]: True for target ids that are in the draft vocabulary.
The draft vocabulary is the `draft_vocab_size` most frequent target ids (ties broken by the smaller id),
sorted by id, so d2t is non-decreasing and draft id order follows target id order.

EAGLE-3 has it built in (its `lm_head` has Vd rows). Medusa, EAGLE-1/2 and MTP keep full-vocabulary
projections; with a draft vocabulary the runtime drafts over only those Vd rows (gathered once at load), which
on a small target is most of the draft's cost. Lossless: the target verifies every token (greedy: identical
output; sampling: q is zero outside the draft vocabulary and rejection sampling corrects for it).

Give saved heads a draft vocabulary with `python -m heads.vocab` (heads/vocab.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> Tensor:
    """Token counts [vocab_size] int64 over `sequences` (e.g. the assistant tokens of the training data)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        ids = torch.as_tensor(list(seq), dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"count_tokens: token id outside [0, {vocab_size})")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_vocab_mapping(token_counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """token_counts [V] -> (d2t int64 [draft_vocab_size], t2d bool [V])."""
    counts = torch.as_tensor(token_counts).to(torch.int64).flatten()
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size: expected 1..{vocab_size}, got {draft_vocab_size}")
    # Stable sort on -count keeps the smaller id first among equal counts.
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    kept = torch.sort(order).values
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def validate_vocab_mapping(d2t: Tensor, t2d: Tensor, vocab_size: int, draft_vocab_size: int,
                           source: str = "vocab mapping") -> None:
    """Raise ValueError naming `source` unless d2t/t2d describe the same `draft_vocab_size` target ids."""
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"{source}: d2t must be int64 [{draft_vocab_size}], got {d2t.dtype} {list(d2t.shape)}")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        raise ValueError(f"{source}: t2d must be bool [{vocab_size}], got {t2d.dtype} {list(t2d.shape)}")
    target_ids = d2t + torch.arange(draft_vocab_size, dtype=torch.int64)
    if draft_vocab_size and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size):
        bad = int(((target_ids < 0) | (target_ids >= vocab_size)).nonzero()[0])
        raise ValueError(f"{source}: d2t maps draft id {bad} to target id {int(target_ids[bad])}, outside the "
                         f"target vocabulary [0, {vocab_size})")
    if target_ids.unique().numel() != draft_vocab_size:
        raise ValueError(f"{source}: d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != draft_vocab_size or not bool(t2d[target_ids].all()):
        raise ValueError(f"{source}: t2d disagrees with d2t (t2d marks {int(t2d.sum())} ids, "
                         f"d2t maps {draft_vocab_size})")


def draft_target_ids(d2t: Tensor) -> Tensor:
    """The target ids of the draft vocabulary [Vd] int64, in draft id order."""
    return d2t + torch.arange(d2t.numel(), device=d2t.device)


def coverage(token_counts: Tensor, sizes: Iterable[int], evaluated_counts: Tensor) -> dict[int, float]:
    """Share of the tokens counted in `evaluated_counts` [V] that fall inside the draft vocabulary of each size
    built from `token_counts` [V] (sizes above V mean the full vocabulary)."""
    total = max(int(evaluated_counts.sum()), 1)
    shares = {}
    for size in sizes:
        _, t2d = build_vocab_mapping(token_counts, min(size, torch.as_tensor(token_counts).numel()))
        shares[size] = int(evaluated_counts[t2d].sum()) / total
    return shares


def draft_to_target_ids(draft_ids: Tensor, d2t: Tensor) -> Tensor:
    """Draft ids [...] -> target ids [...] (= draft_id + d2t[draft_id])."""
    return draft_ids + d2t[draft_ids]


def target_to_draft_ids(target_ids: Tensor, d2t: Tensor, t2d: Tensor) -> Tensor:
    """Target ids [...] -> draft ids [...], -1 where the target id is not in the draft vocabulary."""
    targets = draft_target_ids(d2t)
    index = torch.full((t2d.numel(),), -1, dtype=torch.int64, device=d2t.device)
    index[targets] = torch.arange(d2t.numel(), device=d2t.device)
    return index[target_ids]


def draft_logits_to_target(draft_logits: Tensor, d2t: Tensor, vocab_size: int) -> Tensor:
    """Draft logits [..., Vd] -> target-vocabulary logits [..., V], -inf for ids outside the draft vocab."""
    out = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    out[..., draft_target_ids(d2t)] = draft_logits
    return out


# ---- CLI: give saved heads a draft vocabulary ------------------------------------------------------------
