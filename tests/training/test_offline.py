"""Offline training (features from data.hidden_states shards) gives the same loss as the online target forward."""

from __future__ import annotations

import pytest
import torch

from heads.loading import load_model
from tests.tiny_models import STORIES260K
from training.batching import Collator, IndexedRows
from training.config import parse_config
from training.data_source import load_training_data
from training.methods import build_training_module


@pytest.fixture(scope="module")
def features_dir(stories_dataset, tmp_path_factory):
    from data.hidden_states import main as hidden_states

    out = tmp_path_factory.mktemp("features") / "stories"
    hidden_states(["--model", str(STORIES260K), "--dataset", str(stories_dataset), "--output_dir", str(out),
                   "--layers=1,2,4,-1", "--dtype", "float32", "--model_dtype", "float32", "--shard_size", "16"])
    return out


def one_batch_loss(args: list[str], train: bool, rows: tuple[int, ...] = (3, 7, 11)) -> tuple[float, torch.Tensor]:
    config = parse_config(args)
    target = load_model(config.model, dtype="float32")
    data = load_training_data(config, target)
    module = build_training_module(config, target, lambda: data.assistant_tokens(list(range(len(data.rows)))))
    batch = Collator(data.pad_token_id, config.max_length)([IndexedRows(data.rows, list(rows), data.features)[i]
                                                            for i in range(len(rows))])
    assert ("features" in batch) == bool(config.features)
    generator = torch.Generator().manual_seed(0)
    output = module(batch, train=train, generator=generator)
    return output.loss.item(), output.depth.correct


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3", "mtp"])
def test_online_and_offline_give_the_same_loss(method, train_args, features_dir, tmp_path):
    args = train_args(method, tmp_path)
    for train in (True, False):
        online, online_hits = one_batch_loss(args, train)
        offline, offline_hits = one_batch_loss(args + [f"--features={features_dir}"], train)
        assert offline == pytest.approx(online, rel=1e-5, abs=1e-5)
        assert offline_hits.equal(online_hits)


def test_features_missing_a_layer_are_refused(stories_dataset, tmp_path, train_args, reset_accelerate):
    from data.hidden_states import main as hidden_states
    from training.train_heads import main

    only_last = tmp_path / "features"
    hidden_states(["--model", str(STORIES260K), "--dataset", str(stories_dataset), "--output_dir", str(only_last),
                   "--layers=-1", "--dtype", "float32"])
    with pytest.raises(ValueError, match="needs \\[1, 2, 4, 5\\]"):
        main(train_args("eagle3", tmp_path / "run", features=only_last))


def test_held_out_features_give_the_same_evaluation_as_the_online_target(features_dir, stories_dataset, train_args,
                                                                          tmp_path, reset_accelerate):
    """--eval_features (shards of --eval_dataset) == evaluating with the target online."""
    from training.train_heads import main

    common = {"max_steps": 1, "eval_dataset": str(stories_dataset), "eval_samples": 6, "seed": 3}
    online = main(train_args("eagle", tmp_path / "online", **common))
    offline = main(train_args("eagle", tmp_path / "offline", eval_features=str(features_dir), **common))
    for key in ("eval/top1_d0", "eval/top1_d1", "eval/tokens"):
        assert online[key] == pytest.approx(offline[key], abs=1e-6), key
    assert online["eval/loss_d0"] == pytest.approx(offline["eval/loss_d0"], rel=1e-3)


def test_features_follow_their_dataset_when_both_are_moved(features_dir, stories_dataset, train_args, tmp_path):
    """A dataset and its features copied elsewhere together still match (the features record the dataset's content
    fingerprint, not only its path); features of another dataset are refused, naming --features."""
    import shutil

    import datasets

    from training.data_source import offline_features

    moved_data, moved_features = tmp_path / "data", tmp_path / "features"
    shutil.copytree(stories_dataset, moved_data)
    shutil.copytree(features_dir, moved_features)
    config = parse_config(train_args("eagle", tmp_path / "run") + [f"--features={moved_features}"])
    config.dataset = str(moved_data)
    rows = datasets.load_from_disk(str(moved_data))
    assert len(offline_features(config, [rows]).shards[0]) == len(rows)
    other = rows.map(lambda row: row)  # the same rows under another fingerprint, at another path
    other.save_to_disk(str(tmp_path / "other"))
    config.dataset = str(tmp_path / "other")
    with pytest.raises(ValueError, match="--features .* holds .* samples of .*not the .* rows of --dataset"):
        offline_features(config, [datasets.load_from_disk(str(tmp_path / "other"))])


def test_several_datasets_train_together_each_with_its_features(features_dir, stories_dataset, train_args, tmp_path):
    """--dataset A,B --features FA,FB: the rows of A then B, each read with its own features (a batch across both
    gives the online loss); a --features list that does not pair with --dataset is refused, naming --features."""
    import shutil

    import datasets

    from data.hidden_states import main as hidden_states

    rows = datasets.load_from_disk(str(stories_dataset))
    second, second_features = tmp_path / "second", tmp_path / "second_features"
    rows.select(range(len(rows) - 1, 4, -1)).save_to_disk(str(second))  # other rows, in another order
    shutil.copy(stories_dataset / "manifest.json", second / "manifest.json")
    hidden_states(["--model", str(STORIES260K), "--dataset", str(second), "--output_dir", str(second_features),
                   "--layers=1,2,4,-1", "--dtype", "float32", "--model_dtype", "float32", "--shard_size", "16"])
    args = train_args("eagle", tmp_path / "run", dataset=f"{stories_dataset},{second}")
    config = parse_config(args)
    data = load_training_data(config, load_model(config.model, dtype="float32"))
    assert len(data.rows) == 2 * len(rows) - 5
    assert data.rows[len(rows)]["input_ids"] == rows[len(rows) - 1]["input_ids"]
    across = (2, len(rows) - 1, len(rows), len(rows) + 9)
    for train in (True, False):
        online, online_hits = one_batch_loss(args, train, across)
        offline, offline_hits = one_batch_loss(args + [f"--features={features_dir},{second_features}"], train, across)
        assert offline == pytest.approx(online, rel=1e-5, abs=1e-5)
        assert offline_hits.equal(online_hits)
    with pytest.raises(ValueError, match="--features .* names 1 feature directory for the 2 of --dataset"):
        load_training_data(parse_config(args + [f"--features={features_dir}"]), load_model(config.model))


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3", "mtp"])
def test_features_shorter_than_the_row_train_it_one_token_past_them(method, train_args, features_dir, tmp_path):
    """Features captured while the target generated a row stop before its last tokens (data.distill --features_dir:
    the last generated token is never fed). The row then trains up to one token past its features: the same loss
    and hits as the online target forward on the row cut there."""
    args = train_args(method, tmp_path) + [f"--features={features_dir}"]
    config = parse_config(args)
    target = load_model(config.model, dtype="float32")
    data = load_training_data(config, target)
    module = build_training_module(config, target, lambda: data.assistant_tokens(list(range(len(data.rows)))))
    rows, short = [3, 7, 11], 3  # each row's features end `short` positions before its last token

    def cut_features(row: int) -> dict[str, torch.Tensor]:
        return {name: tensor[:-short] for name, tensor in data.features(row).items()}

    cut_rows = {row: {key: data.rows[row][key][:1 - short] for key in ("input_ids", "loss_mask")} for row in rows}
    collate = Collator(data.pad_token_id, config.max_length)
    offline = collate([IndexedRows(data.rows, rows, cut_features)[i] for i in range(len(rows))])
    online = collate([IndexedRows(cut_rows, rows)[i] for i in range(len(rows))])
    assert offline["input_ids"].equal(online["input_ids"]) and offline["loss_mask"].equal(online["loss_mask"])
    assert online["loss_mask"].sum() > 0
    for train in (True, False):
        got = module(offline, train=train, generator=torch.Generator().manual_seed(0))
        want = module(online, train=train, generator=torch.Generator().manual_seed(0))
        assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-5, abs=1e-5)
        assert got.depth.correct.equal(want.depth.correct)


def test_features_longer_than_the_row_are_refused():
    example = {"row": 4, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "features": {"h": torch.zeros(4, 2)}}
    with pytest.raises(ValueError, match="dataset row 4: stored features have \\[4\\] positions for 3 tokens"):
        Collator(0, 16)([example])
