"""Rows of the distilled dataset (plus optional offline features) -> padded training batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset


class IndexedRows(Dataset):
    """A map-style view of selected dataset rows that also returns the row number (for error messages) and,
    for offline training, the stored features of that row (`features(row) -> {name: [T, H] tensor}`).

    An index None is a padding row (evaluation shards of equal length): the first real row with its loss
    mask zeroed and row number -1, so it costs a forward but counts nowhere. `all_tokens`: every token of a real row
    is a label (--loss_tokens all: the prompt's too), not the row's loss mask.
    """

    def __init__(self, rows: Any, indices: Sequence[int | None],
                 features: Callable[[int], dict[str, Tensor]] | None = None, filler: int = 0,
                 all_tokens: bool = False) -> None:
        self.rows = rows
        self.indices = list(indices)
        self.features = features
        self.filler = filler
        self.all_tokens = all_tokens

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item: int) -> dict[str, Any]:
        row = self.indices[item]
        record = self.rows[self.filler if row is None else row]
        if row is None:
            loss_mask = [0] * len(record["loss_mask"])
        else:
            loss_mask = [1] * len(record["input_ids"]) if self.all_tokens else record["loss_mask"]
        example = {"row": -1 if row is None else row, "input_ids": record["input_ids"], "loss_mask": loss_mask}
        if self.features is not None:
            example["features"] = self.features(self.filler if row is None else row)
        return example


@dataclass(frozen=True)
class Collator:
    """Right-pads a list of examples to the longest (capped at max_length).

    -> {"input_ids" [B, T] int64 (pad_token_id on padding), "attention_mask" [B, T] int64,
        "loss_mask" [B, T] int64 (0 on padding), "rows" [B] int64,
        optional "features": {name: [B, T, H] float (zeros on padding)}}.
    """

    pad_token_id: int
    max_length: int

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        lengths = [min(len(e["input_ids"]), self.max_length, featured_length(e)) for e in examples]
        width = max(lengths)
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        loss_mask = torch.zeros((len(examples), width), dtype=torch.long)
        for i, (example, length) in enumerate(zip(examples, lengths, strict=True)):
            if len(example["loss_mask"]) != len(example["input_ids"]):
                raise ValueError(f"dataset row {example['row']}: loss_mask has {len(example['loss_mask'])} "
                                 f"entries for {len(example['input_ids'])} input_ids")
            input_ids[i, :length] = torch.as_tensor(example["input_ids"][:length], dtype=torch.long)
            attention_mask[i, :length] = 1
            loss_mask[i, :length] = torch.as_tensor(example["loss_mask"][:length], dtype=torch.long)
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
                                 "rows": torch.tensor([e["row"] for e in examples], dtype=torch.long)}
        if "features" in examples[0]:
            batch["features"] = {name: pad_features([e["features"][name] for e in examples], lengths, width)
                                 for name in examples[0]["features"]}
        return batch


def featured_length(example: dict[str, Any]) -> int:
    """How much of a row can train: all of it, or with features shorter than the row (captured while the target
    generated it, data.distill --features_dir: the last generated token was never fed) one token past them. A
    position t reads feature t and, as targets, feature t + 1 and token t + 2, so the positions that count keep
    their features; the zero-padded feature past the end is never a target."""
    tokens = len(example["input_ids"])
    if "features" not in example:
        return tokens
    stored = {item.shape[0] for item in example["features"].values()}
    if len(stored) != 1 or max(stored) > tokens:
        raise ValueError(f"dataset row {example['row']}: stored features have {sorted(stored)} positions for "
                         f"{tokens} tokens (expected one count, at most the row's)")
    return min(tokens, stored.pop() + 1)


def pad_features(items: list[Tensor], lengths: list[int], width: int) -> Tensor:
    """[T_i, H] tensors -> [B, width, H], each cut to lengths[i] and zero-padded (also where T_i < lengths[i])."""
    out = items[0].new_zeros((len(items), width, items[0].shape[-1]))
    for i, (item, length) in enumerate(zip(items, lengths, strict=True)):
        kept = min(length, item.shape[0])
        out[i, :kept] = item[:kept]
    return out


def split_rows(num_rows: int, eval_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic held-out split: (train row ids, eval row ids); eval rows are never trained on."""
    if eval_samples >= num_rows:
        raise ValueError(f"--eval_samples {eval_samples}: the dataset has only {num_rows} rows; "
                         "keep some for training")
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[eval_samples:]), sorted(order[:eval_samples])


def limit_by_tokens(token_counts: Sequence[int], indices: Sequence[int], max_tokens: int, seed: int) -> list[int]:
    """A seeded random subset of `indices` holding at least `max_tokens` tokens (all when max_tokens is 0 or
    more than they hold), sorted. token_counts[i]: assistant tokens of row i. Nested: for one seed, the subset
    for N tokens is a prefix of the subset for any M > N (data-scaling runs see growing supersets)."""
    if max_tokens <= 0:
        return sorted(indices)
    order = torch.randperm(len(indices), generator=torch.Generator().manual_seed(seed)).tolist()
    kept, total = [], 0
    for position in order:
        if total >= max_tokens:
            break
        row = indices[position]
        kept.append(row)
        total += int(token_counts[row])
    return sorted(kept)
