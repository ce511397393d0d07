"""--loss_tokens all: every token of a training row is a label (the prompt's too); held-out rows keep their mask."""

from __future__ import annotations

import pytest
import torch

from heads.loading import load_model
from training.batching import Collator, IndexedRows
from training.config import parse_config
from training.data_source import load_training_data
from training.methods import build_training_module


def _labels_and_loss(args: list[str], all_tokens: bool, rows: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    config = parse_config(args)
    target = load_model(config.model, dtype="float32")
    data = load_training_data(config, target)
    module = build_training_module(config, target, lambda: data.assistant_tokens(list(range(len(data.rows)))))
    view = IndexedRows(data.rows, rows + [None], all_tokens=all_tokens, filler=rows[0])
    batch = Collator(data.pad_token_id, config.max_length)([view[i] for i in range(len(view))])
    output = module(batch, train=False)
    return batch["attention_mask"], batch["loss_mask"], output.loss.item(), output.depth.count


def test_all_tokens_labels_every_token_of_a_real_row_and_adds_the_prompts_loss(train_args, tmp_path):
    """With all tokens, a real row's mask is its attention mask (a padding row still counts nowhere), so depth 0
    counts every position with a token two ahead, and the loss is the answers' loss plus the prompts' (positive)."""
    args = train_args("eagle", tmp_path)
    rows = [3, 7, 11]
    _, answers_mask, answers_loss, answers_count = _labels_and_loss(args, False, rows)
    tokens, every_mask, every_loss, every_count = _labels_and_loss(args, True, rows)
    lengths = every_mask[:len(rows)].sum(-1)
    assert every_mask[-1].sum() == 0 and answers_mask[-1].sum() == 0  # the padding row
    assert (every_mask[:len(rows)] >= answers_mask[:len(rows)]).all()
    assert every_mask[:len(rows)].equal(tokens[:len(rows)])  # every token of a real row, none of its padding
    assert every_count[0].item() == (lengths - 2).sum().item()
    assert answers_count[0].item() == answers_mask[:, 2:].sum().item() < every_count[0].item()
    assert every_loss > answers_loss > 0


def test_a_run_with_all_tokens_trains_and_evaluates_on_the_held_out_mask(train_args, tmp_path, reset_accelerate):
    """The held-out accuracy reads the loss mask whatever --loss_tokens says: both runs count the same labels."""
    import json

    from training.train_heads import main

    counts = []
    for mode in ("assistant", "all"):
        out = tmp_path / mode
        main(train_args("eagle", out, loss_tokens=mode, eval_steps=8))
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        counts.append([line["eval/tokens"] for line in lines if "eval/tokens" in line])
    assert counts[0] and counts[0] == counts[1]


def test_an_unknown_loss_tokens_value_is_refused(train_args, tmp_path):
    with pytest.raises(ValueError, match="--loss_tokens"):
        parse_config(train_args("eagle", tmp_path, loss_tokens="prompt"))
