"""data.distill --features_dir: the runtime engine keeps the target's hidden states of the forwards that answer, so
the features need no second pass. They are data.hidden_states' features of the merged dataset at every position
before each row's last generated token (float32: equal to a separate forward up to kernel rounding), in its format
(training reads them with --features); a rerun after an interrupted merge gives the same files; other engines and
a directory holding other files are refused by name."""


import datasets
import pytest
import torch

from data import distill
from data.distill import DistillConfig, captured_features, common_prefix, run
from data.engines import Answer
from data.hidden_states import HiddenStatesConfig, HiddenStateShards
from data.hidden_states import run as hidden_states
from tests.tiny_models import STORIES260K

torch.set_num_threads(1)


def config(prompts, tmp_path, name="out", **overrides):
    values = dict(model=str(STORIES260K), prompts=prompts, output_dir=str(tmp_path / name), plain_format=True,
                  max_new_tokens=12, batch_size=3, shard_size=2, engine="runtime", dtype="float32",
                  features_dir=str(tmp_path / f"{name}-features"), features_dtype="float32")
    values.update(overrides)
    return DistillConfig(**values)


def separate_forward(dataset_dir, output_dir, dtype):
    hidden_states(HiddenStatesConfig(model=str(STORIES260K), dataset=str(dataset_dir), output_dir=str(output_dir),
                                     layers="-1", dtype="float32", model_dtype=dtype, batch_size=1))
    return HiddenStateShards(output_dir)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_features_are_a_separate_forwards_before_each_rows_last_generated_token(prompts, tmp_path, dtype):
    manifest = run(config(prompts, tmp_path, dtype=dtype))
    dataset = datasets.load_from_disk(str(tmp_path / "out"))
    captured = HiddenStateShards(tmp_path / "out-features")
    reference = separate_forward(tmp_path / "out", tmp_path / "reference", dtype)
    assert len(captured) == len(dataset) == 5 and captured.layers == reference.layers == [5]
    assert manifest["features"]["positions"] == captured.index["num_tokens"] > 0
    assert manifest["features"]["cut_rows"] == 0
    for row in range(len(dataset)):
        ids, mask = dataset[row]["input_ids"], dataset[row]["loss_mask"]
        got, want = captured[row][5], reference[row][5]
        last_learned = max(i for i, m in enumerate(mask) if m)  # the last generated token (its stop id)
        assert got.shape[0] == last_learned < len(ids)  # every position before it, none from it on
        if dtype == "float32":
            torch.testing.assert_close(got, want[:got.shape[0]], rtol=1e-4, atol=1e-4)
        else:  # bf16 kernels round differently: aligned if every position points the way the forward's does
            cosine = torch.nn.functional.cosine_similarity(got.float(), want[:got.shape[0]].float(), dim=-1)
            assert cosine.min() > 0.99


def test_a_rerun_after_an_interrupted_merge_gives_the_same_features(prompts, tmp_path, monkeypatch):
    clean = run(config(prompts, tmp_path, "clean"))
    original = distill.merge_shards

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("killed before the merge")

    monkeypatch.setattr(distill, "merge_shards", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(config(prompts, tmp_path, "resumed"))
    monkeypatch.setattr(distill, "merge_shards", original)
    assert not (tmp_path / "resumed-features").exists()
    resumed = run(config(prompts, tmp_path, "resumed"))
    assert resumed["features"]["positions"] == clean["features"]["positions"]
    a, b = HiddenStateShards(tmp_path / "clean-features"), HiddenStateShards(tmp_path / "resumed-features")
    assert a.index["samples"] == b.index["samples"]
    assert all(a[i][5].equal(b[i][5]) for i in range(len(a)))


def test_a_merge_that_dies_while_writing_the_features_leaves_the_shards_for_the_rerun(prompts, tmp_path,
                                                                                      monkeypatch):
    from data import hidden_states

    clean = run(config(prompts, tmp_path, "clean"))
    original = hidden_states.replace_dir

    def dying(*args):
        raise KeyboardInterrupt("killed while the features are put in place")

    monkeypatch.setattr(hidden_states, "replace_dir", dying)
    with pytest.raises(KeyboardInterrupt):
        run(config(prompts, tmp_path, "resumed"))
    monkeypatch.setattr(hidden_states, "replace_dir", original)
    resumed = run(config(prompts, tmp_path, "resumed"))
    assert resumed["features"] == {**clean["features"], "dir": str(tmp_path / "resumed-features")}
    a, b = HiddenStateShards(tmp_path / "clean-features"), HiddenStateShards(tmp_path / "resumed-features")
    assert all(a[i][5].equal(b[i][5]) for i in range(len(a)))


def test_features_dir_needs_the_runtime_engine_and_a_directory_of_its_own(prompts, tmp_path):
    with pytest.raises(ValueError, match="--features_dir is written by --engine runtime"):
        config(prompts, tmp_path, engine="hf")
    with pytest.raises(ValueError, match="--features_dtype"):
        config(prompts, tmp_path, features_dtype="int3")
    with pytest.raises(ValueError, match="--features_layers '40': index 40 is outside"):
        run(config(prompts, tmp_path, "layers", features_layers="40"))
    other = tmp_path / "out-features"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="--features_dir .*holds other files"):
        run(config(prompts, tmp_path))
    assert (other / "notes.txt").read_text() == "mine"


def test_a_row_that_retokenises_differently_keeps_the_features_before_the_difference():
    features = {7: torch.arange(9.0)[:, None]}  # positions 0..8 of a 10-token generated sequence
    answer = Answer([5, 6, 7, 2], None, True, 4, sequence=[1, 2, 3, 4, 9, 9, 5, 6, 7, 2], features=features)
    same, lost = captured_features([1, 2, 3, 4, 9, 9, 5, 6, 7, 2, 13], answer, [7])
    assert same[7].shape[0] == 9 and lost == 0
    cut, lost = captured_features([1, 2, 3, 4, 9, 9, 5, 8, 7, 2, 13], answer, [7])
    assert cut[7].squeeze(-1).tolist() == list(range(6)) and lost == 3  # trains tokens 0..6, all the target's
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0
