"""--method dflash / peagle: short real training runs on stories260K's distilled data (Arrow), the heads they save,
the anchors / kept positions they train on, and bad input refused in one line naming the flag."""

from __future__ import annotations

import pytest
import torch

from heads.checkpoint import load_heads
from training.config import TrainConfig
from training.methods import peagle_kept, sample_anchors


@pytest.fixture
def main(reset_accelerate):
    from training.train_heads import main as train_main

    return train_main


@pytest.mark.parametrize(("method", "block", "depths"), [("dflash", 5, 4), ("peagle", 3, 3)])
def test_training_run_saves_heads_with_per_position_accuracy(main, train_args, tmp_path, method, block, depths):
    final = main(train_args(method, tmp_path / "run", block_size=block, num_layers=2, max_steps=6))
    assert final["step"] == 6 and all(f"eval/top1_d{d}" in final for d in range(depths))
    heads = load_heads(tmp_path / "run" / "heads")
    assert heads.config.kind == method and heads.config.block_size == block and heads.config.num_draft_layers == 2
    assert len(heads.config.metrics["top1_accuracy_per_depth"]) == depths
    assert heads.config.metrics["training_method"] == method


def test_anchors_and_kept_positions():
    loss_mask = torch.zeros(2, 12, dtype=torch.long)
    loss_mask[0, 5:10] = 1
    loss_mask[1, 2:4] = 1
    anchors, valid = sample_anchors(loss_mask, 4, True, torch.Generator().manual_seed(0))
    assert valid.sum(1).tolist() == [4, 2]  # row 1 has only 2 anchors with a label next
    for b in range(2):
        for a in anchors[b][valid[b]].tolist():
            assert loss_mask[b, a + 1] == 1
    even, ok = sample_anchors(loss_mask, 2, False, None)
    assert ok.all() and torch.equal(even, sample_anchors(loss_mask, 2, False, None)[0])  # deterministic
    candidates = torch.ones(1, 20, dtype=torch.bool)
    scores = torch.rand(1, 20, generator=torch.Generator().manual_seed(1))
    kept = [peagle_kept(candidates, d, 0.75, 0.2, scores) for d in range(1, 8)]
    counts = [int(v.sum()) for _, v in kept]
    assert counts == [15, 12, 9, 7, 5, 4, 4]  # ceil(20 * max(0.75^d, 0.2))
    for (shallow, a), (deep, b) in zip(kept, kept[1:], strict=False):  # nested: a deeper depth trains on a subset
        assert set(deep[b].tolist()) <= set(shallow[a].tolist())


@pytest.mark.parametrize(("flags", "flag"), [({"block_size": 1}, "--block_size"), ({"block_size": 65}, "--block_size"),
                                             ({"mask_token_id": -2}, "--mask_token_id"),
                                             ({"target_layer_ids": "1,x"}, "--target_layer_ids")])
def test_bad_flags_refused_by_the_config(flags, flag):
    with pytest.raises(ValueError, match=flag) as err:
        TrainConfig(method="dflash", **flags)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["dflash", "peagle"])
@pytest.mark.parametrize(("flags", "message"), [
    ({"mask_token_id": 100000}, r"--mask_token_id: expected an id in \[0, 511\]"),
    ({"target_layer_ids": "0,2"}, r"--target_layer_ids: expected HF hidden_states indices in \[1, 5\]"),
    ({"target_layer_ids": "2,9"}, r"--target_layer_ids: expected HF hidden_states indices in \[1, 5\]")])
def test_bad_flags_refused_against_the_target(main, train_args, tmp_path, method, flags, message):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message) as err:
        main(train_args(method, out, **flags))
    assert "\n" not in str(err.value)


def test_max_train_minutes_stops_the_loop_and_still_saves(main, train_args, tmp_path):
    """Equal-time comparisons: the loop stops at the wall-clock budget (the schedule keeps max_steps as horizon)."""
    final = main(train_args("dflash", tmp_path / "run", block_size=4, max_steps=100000, max_train_minutes=0.02))
    assert 1 <= final["step"] < 100000 and final["train/seconds"] < 60
    assert load_heads(tmp_path / "run" / "heads").config.metrics["training_steps"] == final["step"]


def test_fit_train_minutes_shortens_the_schedule_and_resume_keeps_it(main, train_args, tmp_path):
    """A recipe's time on a slower CPU: after 10 steps the measured step time shortens the horizon and the warmup
    becomes a share of it, the learning rate then follows the fitted cosine (fitted again as the rate is measured
    over more steps), and a resumed run goes on with the horizon, warmup and loop time its checkpoint holds."""
    import json

    from training.loop import cosine_with_warmup

    flags = {"max_steps": 100000, "fit_train_minutes": 0.05, "warmup_ratio": 0.2, "save_steps": 12,
             "save_total_limit": 0, "min_lr_ratio": 0.1}

    def records(directory):
        return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]

    def horizon(fits, step):  # the horizon the LR of `step` was computed with: the last fit before it
        return [f["fitted_steps"] for f in fits if f["step"] < step][-1]

    out = tmp_path / "run"
    final = main(train_args("eagle", out, **flags))
    fits = [r for r in records(out) if "fitted_steps" in r]
    assert fits[0]["step"] == 10 and all(f["planned_steps"] == 100000 for f in fits)
    assert all(12 <= f["fitted_steps"] < 100000 for f in fits)
    # the warmup is a share of the horizon the first fit gave (20000 steps of the planned 100000 would never end)
    warmup = int(0.2 * fits[0]["fitted_steps"])
    assert all(f["warmup_steps"] == warmup for f in fits)
    assert final["step"] <= fits[-1]["fitted_steps"] and final["train/seconds"] < 60
    for record in records(out):
        if "lr" in record and record["step"] > 10:  # the LR logged at step 10 was set before the first fit
            expected = cosine_with_warmup(record["step"], warmup, horizon(fits, record["step"]), 0.1)
            assert record["lr"] == pytest.approx(3e-3 * expected)

    checkpoint = out / "checkpoints" / "step_00000012"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    assert saved["total_steps"] == horizon(fits, 13) and 0 < saved["train_seconds"] < final["train/seconds"]
    resumed_dir = tmp_path / "resumed"
    main(train_args("eagle", resumed_dir, **flags, resume_from=checkpoint))
    first = next(r for r in records(resumed_dir) if r.get("step") == 13 and "lr" in r)
    assert saved["warmup_steps"] == warmup
    assert first["lr"] == pytest.approx(3e-3 * cosine_with_warmup(13, warmup, saved["total_steps"], 0.1))
