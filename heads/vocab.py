"""`python -m heads.vocab`: give saved heads a reduced draft vocabulary (heads.draft_vocab), counted on a
distilled dataset's assistant tokens (loss_mask 1):

    python -m heads.vocab --heads DIR --dataset ARROW_DIR --size 8192 [--output_dir OUT]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import datasets
from torch import Tensor

from heads.checkpoint import load_heads, save_heads
from heads.cli import parse_flags, run_cli
from heads.config import OWN_LM_HEAD_KINDS
from heads.draft_vocab import build_vocab_mapping, count_tokens, coverage


@dataclass
class VocabFlags:
    heads: str = field(default="", metadata={"help": "Heads directory (Medusa, EAGLE-1/2 or MTP) to give a draft "
                                             "vocabulary; rewritten in place unless --output_dir."})
    dataset: str = field(default="", metadata={"help": "Distilled Arrow dataset (python -m data.distill output): "
                                               "its assistant tokens (loss_mask 1) are counted."})
    size: int = field(default=8192, metadata={"help": "Draft vocabulary size: the N most frequent target ids; 0 "
                                              "removes the draft vocabulary (full target vocabulary)."})
    output_dir: str = field(default="", metadata={"help": "Write the heads here instead of over --heads."})


def dataset_token_counts(dataset_dir: str, vocab_size: int) -> Tensor:
    """Counts [V] of the assistant tokens (loss_mask 1) of a `save_to_disk` dataset with input_ids/loss_mask."""
    if not Path(dataset_dir).is_dir():
        raise FileNotFoundError(f"--dataset {dataset_dir}: no such directory (expected a data.distill output)")
    rows = datasets.load_from_disk(dataset_dir)
    if not {"input_ids", "loss_mask"} <= set(rows.column_names):
        raise ValueError(f"--dataset {dataset_dir}: expected columns input_ids and loss_mask, got {rows.column_names}")
    return count_tokens(([t for t, m in zip(ids, mask, strict=True) if m]
                         for ids, mask in zip(rows["input_ids"], rows["loss_mask"], strict=True)), vocab_size)


def main(argv: list[str] | None = None) -> None:
    flags = parse_flags(VocabFlags, argv)
    if not flags.heads or not flags.dataset:
        raise ValueError("--heads and --dataset are required")
    heads = load_heads(flags.heads)
    config = heads.config
    if config.kind in OWN_LM_HEAD_KINDS:
        name = {"eagle3": "EAGLE-3", "peagle": "P-EAGLE"}[config.kind]
        raise ValueError(f"--heads {flags.heads}: {name} heads have their draft vocabulary built into lm_head "
                         f"({config.draft_vocab_size} rows, set at training by --draft_vocab_size)")
    if not 0 <= flags.size <= config.vocab_size:
        raise ValueError(f"--size {flags.size}: expected 0 (full vocabulary) .. {config.vocab_size}")
    counts = dataset_token_counts(flags.dataset, config.vocab_size)
    if flags.size:
        heads.set_vocab_mapping(*build_vocab_mapping(counts, flags.size))
        share = coverage(counts, [flags.size], counts)[flags.size]
        print(f"draft vocabulary: {flags.size} of {config.vocab_size} target ids, covering {share:.1%} of the "
              f"{int(counts.sum())} assistant tokens of {flags.dataset}")
    else:
        config.draft_vocab_size = 0
        print("draft vocabulary removed: drafting uses the full target vocabulary")
    out = save_heads(heads, flags.output_dir or flags.heads)
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main)
