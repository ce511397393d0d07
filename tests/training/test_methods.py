"""Training modules: Medusa with the shared target LM head trains only its residual blocks (Medusa-1 and -2)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from heads import load_heads
from heads.loading import load_model
from tests.tiny_models import STORIES260K
from training.config import parse_config
from training.methods import build_training_module

HIDDEN = 64  # stories260K


@pytest.fixture
def main(reset_accelerate):
    from training.train_heads import main as train_main

    return train_main


def trainable_names(module) -> list[str]:
    return [name for name, p in module.named_parameters() if p.requires_grad]


def test_shared_medusa_optimizes_only_residual_blocks(train_args, tmp_path):
    config = parse_config(train_args("medusa", tmp_path, medusa_shared_lm_head="true"))
    target = load_model(str(STORIES260K))
    module = build_training_module(config, target, lambda: [])
    names = trainable_names(module)
    assert names and all(n.startswith("heads.heads.") and ".linear." in n for n in names), names
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == 3 * (HIDDEN * HIDDEN + HIDDEN)
    batch = {"input_ids": torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["loss_mask"] = torch.ones_like(batch["input_ids"])
    module(batch).loss.backward()
    assert target.lm_head.weight.grad is None  # the frozen LM head passes gradients, it does not collect them
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)


@pytest.mark.parametrize("method", ["medusa", "medusa2"])
def test_shared_medusa_trains_and_saves_blocks_only(main, train_args, tmp_path, method):
    out = tmp_path / "run"
    extra = {"lora_r": 2} if method == "medusa2" else {}
    final = main(train_args(method, out, medusa_shared_lm_head="true", max_steps=4, **extra))
    assert final["eval/acceptance_length"] >= 1.0
    heads = load_heads(out / "heads")
    assert heads.config.medusa_shared_lm_head
    saved = load_file(str(out / "heads" / "medusa_lm_head.safetensors"))
    assert sorted(saved) == sorted(f"{h}.0.linear.{p}" for h in range(3) for p in ("weight", "bias"))
    assert any(bool(t.ne(0).any()) for t in saved.values())  # trained away from the zero (identity) start
    with pytest.raises(ValueError, match="medusa_shared_lm_head is True there"):
        main(train_args(method, tmp_path / "again", init_heads=out / "heads", **extra))


def test_target_labels_are_the_targets_own_greedy_tokens(stories_dataset):
    """--label_source target: depth d's label at position t is argmax of the target's logits at t+1+d."""
    import datasets

    from heads.loading import load_model
    from tests.tiny_models import STORIES260K
    from training.config import TrainConfig
    from training.losses import depth_targets
    from training.methods import ShiftedRows, apply_head, target_greedy_labels

    target = load_model(str(STORIES260K))
    row = datasets.load_from_disk(str(stories_dataset))[0]
    input_ids = torch.tensor([row["input_ids"]])
    loss_mask = torch.tensor([row["loss_mask"]])
    with torch.no_grad():
        out = target(input_ids=input_ids, output_hidden_states=True)
    targets = depth_targets(input_ids, loss_mask, 3)
    greedy = ShiftedRows(out.hidden_states[-1], targets.positions, 3, lambda x: apply_head(target.lm_head, x).argmax(-1))
    labelled = target_greedy_labels(targets, TrainConfig(label_source="target"), greedy.rows)
    positions = targets.positions[0].nonzero()[:, 0]
    argmax = out.logits[0].argmax(-1)  # [T]: the target's token after each prefix
    for depth in range(3):
        counted = targets.masks[depth]
        assert torch.equal(labelled.labels[depth][counted], argmax[positions + 1 + depth][counted])
    assert target_greedy_labels(targets, TrainConfig(label_source="data"), greedy.rows) is targets


def test_shared_medusa_with_a_draft_vocabulary_counts_outside_tokens_as_misses(reset_accelerate, train_args, tmp_path):
    """CE over the draft vocabulary's rows only; held-out counts are the same as with the full vocabulary."""
    from training.train_heads import main

    small = main(train_args("medusa", tmp_path / "small", max_steps=2, medusa_shared_lm_head="true",
                            draft_vocab_size=16))
    full = main(train_args("medusa", tmp_path / "full", max_steps=2, medusa_shared_lm_head="true",
                           draft_vocab_size=10**6))
    assert small["eval/tokens"] == full["eval/tokens"] > 0
    assert 0 <= small["eval/top5_d0"] <= 1 and small["eval/loss_d0"] > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_soft_targets_over_the_draft_vocabulary_only_match_the_full_head(stories_dataset, train_args, tmp_path, method):
    """--label_source data runs the target's LM head over the draft vocabulary's rows only (the full head served
    only to find its argmax). On the target's own greedy answers the labels ARE that argmax, so loss, gradients
    and hits equal those of the full head, train and eval; a label outside the draft vocabulary drops its position
    from the loss exactly as an outside argmax does."""
    import datasets

    rows = datasets.load_from_disk(str(stories_dataset))
    ids = [rows[i]["input_ids"] for i in range(2)]
    width = max(map(len, ids))
    batch = {"input_ids": torch.tensor([x + [0] * (width - len(x)) for x in ids]),
             "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
             "loss_mask": torch.tensor([rows[i]["loss_mask"] + [0] * (width - len(ids[i])) for i in range(2)])}
    target = load_model(str(STORIES260K))
    tokens = [t for x in ids for t in x]
    results = {}
    for source in ("target", "data"):
        torch.manual_seed(0)
        config = parse_config(train_args(method, tmp_path / source, label_source=source, draft_vocab_size=256))
        module = build_training_module(config, target, lambda: [tokens])
        out = module(batch, train=True, generator=torch.Generator().manual_seed(1))
        out.loss.backward()
        grads = [p.grad.clone() for p in module.parameters() if p.requires_grad]
        evaluated = module(batch, train=False)
        results[source] = (out, grads, evaluated)
    (full, full_grads, full_eval), (rows_only, rows_grads, rows_eval) = results["target"], results["data"]
    assert full.depth.count.sum() > 0
    torch.testing.assert_close(rows_only.loss, full.loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(rows_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(rows_eval.loss, full_eval.loss, rtol=1e-5, atol=1e-6)
    for name in ("correct", "correct_topk", "count"):
        assert torch.equal(getattr(rows_eval.depth, name), getattr(full_eval.depth, name)), name


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_eval_only_reproduces_the_runs_final_held_out_metrics(main, train_args, tmp_path, method):
    """--eval_only --init_heads DIR: the saved heads score on the held-out rows exactly what the run's final
    evaluation measured, and nothing but eval_metrics.json is written."""
    final = main(train_args(method, tmp_path / "run"))
    out = tmp_path / "eval"
    metrics = main(train_args(method, out, init_heads=tmp_path / "run" / "heads", eval_only="true"))
    evals = {k: v for k, v in final.items() if k.startswith("eval/")}
    assert evals and {k: metrics[k] for k in evals} == pytest.approx(evals, abs=1e-6)
    assert sorted(p.name for p in out.iterdir()) == ["eval_metrics.json"]
    with pytest.raises(ValueError, match="--eval_only: expected --init_heads"):
        main(train_args(method, tmp_path / "bad", eval_only="true"))
