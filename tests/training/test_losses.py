"""Loss functions, metrics, schedule and the training-time-test unroll, on small tensors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from heads.checkpoint import build_heads
from heads.config import HeadsConfig
from heads.layers import DecoderLayer
from tests.tiny_models import tiny_config
from training.evaluation import depth_metrics, expected_acceptance_length
from training.loop import cosine_with_warmup, shard_rows, steps_within_budget, total_steps
from training.losses import depth_cross_entropy, depth_targets, eagle3_step_loss, label_count, shift_left
from training.methods import ShiftedRows, unroll_selected


def test_depth_cross_entropy_matches_shifted_cross_entropy_per_depth():
    torch.manual_seed(0)
    batch, length, vocab, depths = 2, 9, 11, 3
    ids = torch.randint(0, vocab, (batch, length))
    mask = torch.randint(0, 2, (batch, length))
    logits = [torch.randn(batch, length, vocab) for _ in range(depths)]
    targets = depth_targets(ids, mask, depths)
    out = depth_cross_entropy([x[targets.positions] for x in logits], targets, decay=0.5, top_k=2)
    expected_total = 0.0
    for d in range(depths):
        want, count = 0.0, 0
        for b in range(batch):
            for t in range(length - 2 - d):
                if mask[b, t + 2 + d]:
                    want += F.cross_entropy(logits[d][b, t][None], ids[b, t + 2 + d][None]).item()
                    count += 1
        assert out.depth.loss[d].item() == pytest.approx(want, rel=1e-5)
        assert out.depth.count[d].item() == count
        expected_total += 0.5**d * want
    assert out.loss.item() == pytest.approx(expected_total, rel=1e-5)
    assert label_count(mask).item() == out.depth.count[0].item()


def test_losses_are_sums_so_a_split_batch_adds_up():
    torch.manual_seed(1)
    ids, mask = torch.randint(0, 7, (4, 8)), torch.ones(4, 8, dtype=torch.long)
    logits = [torch.randn(4, 8, 7) for _ in range(2)]

    def loss(rows: slice):
        targets = depth_targets(ids[rows], mask[rows], 2)
        return depth_cross_entropy([x[rows][targets.positions] for x in logits], targets, 0.8, 1)

    whole = loss(slice(0, 4))
    halves = [loss(rows) for rows in (slice(0, 1), slice(1, 4))]
    assert whole.loss.item() == pytest.approx(sum(h.loss.item() for h in halves), rel=1e-6)


def test_expected_acceptance_length():
    assert expected_acceptance_length([]) == 1.0
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_acceptance_length([0.8, 0.0, 1.0]) == pytest.approx(1.8)
    with pytest.raises(ValueError):
        expected_acceptance_length([1.2])


def test_depth_metrics_names_and_tau():
    right = torch.zeros(1, 6, 5)
    right[..., 0] = 1.0  # always predicts token 0
    wrong = torch.zeros(1, 6, 5)
    wrong[..., 1], wrong[..., 0] = 1.0, 0.5  # token 0 second
    ids = torch.zeros(1, 6, dtype=torch.long)
    targets = depth_targets(ids, torch.ones(1, 6, dtype=torch.long), 2)
    out = depth_cross_entropy([right[targets.positions], wrong[targets.positions]], targets, 1.0, 2)
    metrics = depth_metrics(out.depth, 2)
    assert (metrics["eval/top1_d0"], metrics["eval/top1_d1"], metrics["eval/top2_d1"]) == (1.0, 0.0, 1.0)
    assert metrics["eval/acceptance_length"] == 2.0
    assert metrics["eval/loss_d0"] == pytest.approx(-math.log(math.e / (math.e + 4)))
    assert metrics["eval/tokens"] == 4


@pytest.mark.parametrize("over_draft", [False, True])
def test_eagle3_loss_skips_inexpressible_targets_but_counts_them_as_misses(over_draft):
    """Target logits over the whole vocabulary (its argmax decides what the draft can express) or, with over_draft,
    over the draft vocabulary only (the label decides): position 1's token 5 is outside, so only position 0 is
    in the loss, while both count in the accuracy."""
    vocab = 6
    draft_to_target = torch.tensor([0, 2, 4])
    in_draft = torch.zeros(vocab, dtype=torch.bool)
    in_draft[draft_to_target] = True
    labels = torch.tensor([2, 5])  # 5 is not in the draft vocabulary
    target_logits = torch.full((2, vocab), -10.0)
    target_logits[0, :] = torch.tensor([0.0, -10.0, 3.0, -10.0, 1.0, -10.0])
    target_logits[1, 5] = 10.0
    target = target_logits[:, draft_to_target] if over_draft else target_logits
    draft_logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 5.0, 0.0]])  # draft id 1 = target id 2 everywhere
    loss, (top1, topk, count) = eagle3_step_loss(draft_logits, target, labels, torch.ones(2, dtype=torch.bool),
                                                draft_to_target, in_draft, top_k=1, over_draft=over_draft)
    assert (top1.item(), count.item()) == (1, 2)
    only_first = -torch.log_softmax(draft_logits[0], -1) @ torch.softmax(target_logits[0, draft_to_target], -1)
    assert loss.item() == pytest.approx(only_first.item(), rel=1e-5)


def test_depth_targets_select_positions_with_any_label():
    ids = torch.arange(8)[None]
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0]])
    targets = depth_targets(ids, mask, 2)
    assert targets.positions[0].nonzero().flatten().tolist() == [2, 3, 4]  # t + 2 + d in {5, 6}
    assert targets.labels.tolist() == [[4, 5, 6], [5, 6, 7]]
    assert targets.masks.tolist() == [[False, True, True], [True, True, False]]
    assert shift_left(ids, 3).tolist() == [[3, 4, 5, 6, 7, 0, 0, 0]]


def test_cosine_with_warmup_schedule():
    assert cosine_with_warmup(0, 0, 10) == 1.0
    assert cosine_with_warmup(10, 0, 10) == pytest.approx(0.0)
    assert cosine_with_warmup(5, 0, 10) == pytest.approx(0.5)
    assert cosine_with_warmup(0, 4, 10) == pytest.approx(0.2)
    assert cosine_with_warmup(10, 0, 10, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert total_steps(-1, 2.0, 13, 2) == 13 and total_steps(7, 2.0, 13, 2) == 7


def test_steps_within_budget_only_shortens():
    # 10 steps in 5 s, 0.5 s per step from now on, 20 s budget: 30 more steps fit
    assert steps_within_budget(1000, 10, 5.0, 0.5, 20.0) == 40
    assert steps_within_budget(25, 10, 5.0, 0.5, 20.0) == 25  # the plan fits: kept, never lengthened
    assert steps_within_budget(1000, 10, 21.0, 0.5, 20.0) == 10  # already over: stop where it is
    assert steps_within_budget(1000, 10, 5.0, 0.0, 20.0) == 1000  # no rate measured: the plan


def test_eval_shards_are_equal_and_cover_every_row_once():
    rows = list(range(7))
    shards = [shard_rows(rows, i, 3) for i in range(3)]
    assert {len(s) for s in shards} == {3}
    assert sorted(r for s in shards for r in s if r is not None) == rows


def _sequential_drafts(draft, features, ids, embed, row, start, steps):
    """What a chain drafted from position `start` of `row` is at run time: prefix features 0..start in the draft's
    cache, then its own outputs fed back one position at a time -> [steps, H]."""
    prefix = draft(features[row:row + 1, : start + 1], shift_left(ids, 1)[row:row + 1, : start + 1],
                   embed_tokens=embed, position_ids=torch.arange(start + 1)[None])
    outs, hidden, cache = [prefix.hidden_states[0, start]], prefix.hidden_states[:, -1:], prefix.past_key_value
    for step in range(1, steps):
        out = draft(hidden, ids[row:row + 1, start + 1 + step: start + 2 + step], embed_tokens=embed,
                    position_ids=torch.tensor([[start + step]]), past_key_value=cache)
        outs.append(out.hidden_states[0, 0])
        hidden, cache = out.hidden_states, out.past_key_value
    return torch.stack(outs)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_unrolled_training_equals_sequential_drafting(kind):
    """Step s of the training unroll at a selected position t == the (s+1)-th token a chain drafted from t sees at
    run time, for rows of several lengths (right padding after the selected positions), scattered positions and a row
    with none selected; the gradients of the unroll equal those of the sequential drafts."""
    torch.manual_seed(0)
    target = tiny_config("llama")
    config = HeadsConfig.for_target(kind, target, base_model_name_or_path="tiny", draft_vocab_size=64)
    draft = build_heads(config).double()
    embed = torch.nn.Embedding(target.vocab_size, target.hidden_size).double()
    length, steps = 12, 3
    ids = torch.randint(0, target.vocab_size, (3, length))
    features = torch.randn(3, length, target.hidden_size, dtype=torch.float64)
    selected = torch.zeros(3, length, dtype=torch.bool)
    selected[0, 4:9] = True  # an answer after a prompt, then padding
    selected[2, [0, 2, 3, 8]] = True  # scattered positions; row 1 has none
    unrolled = unroll_selected(draft, features, ids, steps, embed, selected)
    assert [out.shape for out in unrolled] == [(9, target.hidden_size)] * steps
    weights = torch.randn(steps, 9, target.hidden_size, dtype=torch.float64)
    sum((out * weight).sum() for out, weight in zip(unrolled, weights, strict=True)).backward()
    grads = {name: param.grad.clone() for name, param in draft.named_parameters() if param.grad is not None}
    assert any(name.endswith("mlp.down_proj.weight") for name in grads)
    draft.zero_grad()
    chains = torch.stack([_sequential_drafts(draft, features, ids, embed, int(row), int(start), steps)
                          for row, start in selected.nonzero()], dim=1)  # [steps, N, H]
    for step in range(steps):
        assert torch.allclose(unrolled[step], chains[step], atol=1e-10), step
    (chains * weights).sum().backward()
    assert {name for name, param in draft.named_parameters() if param.grad is not None} == set(grads)
    for name, grad in grads.items():
        assert torch.allclose(draft.get_parameter(name).grad, grad, atol=1e-9), name


def test_unroll_one_step_with_qk_norm_layers_and_refusals():
    """The first step's selected-position forward also holds for a DecoderLayer with Qwen3's per-head q/k norms (the
    draft layers of DFlash), and `selected` refuses a wrong shape and a cache."""
    torch.manual_seed(0)
    target = tiny_config("llama")
    config = HeadsConfig.for_target("eagle", target, base_model_name_or_path="tiny")
    draft = build_heads(config).double()
    draft.layers[0] = DecoderLayer(config, mode="eagle", qk_norm=True).double()
    embed = torch.nn.Embedding(target.vocab_size, target.hidden_size).double()
    ids = torch.randint(0, target.vocab_size, (2, 9))
    features = torch.randn(2, 9, target.hidden_size, dtype=torch.float64)
    selected = torch.rand(2, 9) < 0.5
    (first,) = unroll_selected(draft, features, ids, 1, embed, selected)
    full = draft(features, shift_left(ids, 1), embed_tokens=embed, position_ids=torch.arange(9).expand(2, -1))
    assert torch.allclose(first, full.hidden_states[selected], atol=1e-12)
    with pytest.raises(ValueError, match="selected"):
        draft(features, ids, embed_tokens=embed, position_ids=torch.arange(9).expand(2, -1), selected=selected[:, :5])
    with pytest.raises(ValueError, match="selected"):
        draft(features, ids, embed_tokens=embed, position_ids=torch.arange(9).expand(2, -1), selected=selected,
              past_key_value=full.past_key_value)


def test_shifted_rows_equal_shifting_then_selecting():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 4)
    mask = torch.randint(0, 2, (2, 9))
    targets = depth_targets(torch.zeros(2, 9, dtype=torch.long), mask, 3)
    rows = ShiftedRows(x, targets.positions, 3, lambda v: v * 2)
    for step in range(3):
        want = (2 * shift_left(x, 1 + step))[targets.positions]
        counted = targets.masks[step]
        assert torch.equal(rows.rows(step)[counted], want[counted])
