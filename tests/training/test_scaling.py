"""Data-scaling pieces: token-limited nested subsets, a separate held-out dataset (the command: tests/bench/test_scaling.py)."""

from __future__ import annotations

import pytest

from training.batching import limit_by_tokens


def test_token_subsets_are_nested_and_hold_enough_tokens():
    counts = [5, 1, 7, 3, 9, 2, 4, 8, 6, 10]
    rows = list(range(10))
    small, large = limit_by_tokens(counts, rows, 10, seed=3), limit_by_tokens(counts, rows, 30, seed=3)
    assert set(small) <= set(large)
    assert sum(counts[r] for r in small) >= 10 and sum(counts[r] for r in large) >= 30
    # the last row added was needed: without it the subset would hold fewer tokens than asked
    assert limit_by_tokens(counts, rows, 0, seed=3) == rows == limit_by_tokens(counts, rows, 10**6, seed=3)


def test_eval_dataset_is_held_out_and_token_limit_applies(reset_accelerate, train_args, stories_dataset, tmp_path):
    from training.train_heads import main

    final = main(train_args("eagle", tmp_path / "run", max_steps=2, eval_dataset=str(stories_dataset),
                            eval_samples=4, max_train_tokens=300))
    assert 300 <= final["train/assistant_tokens"] < 300 + 60  # rows hold < 60 assistant tokens each
    assert final["train/rows"] < 20
    assert final["eval/tokens"] > 0


def test_eval_dataset_missing_is_an_error_naming_the_flag(reset_accelerate, train_args, tmp_path):
    from training.train_heads import main

    with pytest.raises(FileNotFoundError, match="--eval_dataset"):
        main(train_args("eagle", tmp_path / "run", max_steps=2, eval_dataset=str(tmp_path / "nope")))
