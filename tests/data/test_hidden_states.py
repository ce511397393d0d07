"""data.hidden_states: features equal a plain forward, resume after a kill, disk check, reader, bad input."""

import json
import pickle
import shutil
from collections import namedtuple

import datasets
import pytest
import torch

from data import hidden_states
from data.distill import DistillConfig
from data.distill import run as distill_run
from data.hidden_states import HiddenStatesConfig, HiddenStateShards, parse_layers, run
from tests.tiny_models import SMOLLM2, STORIES260K, stories260k


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    root = tmp_path_factory.mktemp("hs")
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [text]}) for text in
                                 ["A cat.", "Lily went to the park and saw a big red ball.", "Hi", "The sun.",
                                  "Ben and Tom played."]) + "\n")
    output_dir = root / "data"
    distill_run(DistillConfig(model=str(STORIES260K), prompts=str(prompts), output_dir=str(output_dir),
                              plain_format=True, max_new_tokens=5, batch_size=4, shard_size=8))
    return output_dir


def config(dataset, output_dir, **overrides):
    values = dict(model=str(STORIES260K), dataset=str(dataset), output_dir=str(output_dir), layers="-1,0,2",
                  dtype="float32", model_dtype="float32", batch_size=3, shard_size=2)
    values.update(overrides)
    return HiddenStatesConfig(**values)


def test_parse_layers():
    assert parse_layers("eagle3", 30) == [2, 15, 27]
    assert parse_layers("-1", 30) == [30]
    assert parse_layers("3, -2", 30) == [3, 29]
    assert parse_layers("eagle3", 5) == [2]  # (2, 5 // 2, 5 - 3) collapses on a 5-layer model
    with pytest.raises(ValueError, match="--layers.*outside"):
        parse_layers("31", 30)
    with pytest.raises(ValueError, match="--layers.*integers or 'eagle3'"):
        parse_layers("last", 30)


def test_features_equal_a_plain_forward_and_the_estimate_is_printed(distilled, tmp_path, capsys):
    index = run(config(distilled, tmp_path / "feat"))
    shown = capsys.readouterr().out
    data = datasets.load_from_disk(str(distilled))
    tokens = sum(len(ids) for ids in data["input_ids"])
    assert f"{tokens} tokens x 3 layers [5, 0, 2] x 64 x float32 = {tokens * 3 * 64 * 4} bytes" in shown
    assert index["layers"] == [5, 0, 2] and index["num_samples"] == 5 == len(index["samples"])
    features = HiddenStateShards(tmp_path / "feat")
    assert len(features) == 5 and features.layers == [5, 0, 2] and features.hidden_size == 64
    model = stories260k()
    for i, ids in enumerate(data["input_ids"]):
        with torch.no_grad():
            expected = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        got = features[i]
        assert set(got) == {5, 0, 2} and features.length(i) == len(ids)
        for layer in (5, 0, 2):
            assert got[layer].shape == (len(ids), 64) and got[layer].dtype == torch.float32
            torch.testing.assert_close(got[layer], expected[layer][0], atol=1e-5, rtol=1e-5)
    clone = pickle.loads(pickle.dumps(features))
    torch.testing.assert_close(clone[4][2], features[4][2])


def test_resume_after_a_kill_equals_an_uninterrupted_run(distilled, tmp_path, monkeypatch):
    run(config(distilled, tmp_path / "whole", dtype="bf16"))
    write = hidden_states.write_feature_shard
    calls = []

    def dying_write(path, tensors, metadata):
        if calls:
            raise KeyboardInterrupt("simulated kill")
        calls.append(path.name)
        write(path, tensors, metadata)

    monkeypatch.setattr(hidden_states, "write_feature_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run(config(distilled, tmp_path / "resumed", dtype="bf16"))
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["run.json", "shard-00000.safetensors"]
    written = []
    monkeypatch.setattr(hidden_states, "write_feature_shard", lambda path, *a: written.append(path.name) or
                        write(path, *a))
    run(config(distilled, tmp_path / "resumed", dtype="bf16"))
    assert written == ["shard-00001.safetensors", "shard-00002.safetensors"]
    whole, resumed = HiddenStateShards(tmp_path / "whole"), HiddenStateShards(tmp_path / "resumed")
    assert resumed.dtype == torch.bfloat16
    for i in range(len(whole)):
        for layer in whole.layers:
            assert torch.equal(whole[i][layer], resumed[i][layer])
    with pytest.raises(ValueError, match="other settings.*layers"):
        run(config(distilled, tmp_path / "resumed", dtype="bf16", layers="eagle3"))


def test_refuses_to_start_without_enough_disk(distilled, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(ValueError, match="--output_dir .*need about .* MB but only 0.00 MB are free"):
        run(config(distilled, tmp_path / "feat"))
    assert not (tmp_path / "feat").exists()


def test_bad_inputs(distilled, tmp_path):
    with pytest.raises(FileNotFoundError, match="--dataset .*not a finished data.distill output"):
        run(config(tmp_path, tmp_path / "feat"))
    with pytest.raises(ValueError, match="vocabulary differs from --model"):
        run(config(distilled, tmp_path / "feat", model=str(SMOLLM2)))
    with pytest.raises(FileNotFoundError, match="no index.json"):
        HiddenStateShards(tmp_path)


def test_bf16_shards_load_back_exactly_what_was_written(distilled, tmp_path):
    """Storage dtype bf16 (the default): each stored value is the fp32 feature rounded to bf16, bit for bit."""
    run(config(distilled, tmp_path / "feat", dtype="bfloat16", model_dtype="float32"))
    features = HiddenStateShards(tmp_path / "feat")
    assert features.dtype == torch.bfloat16
    model = stories260k()
    data = datasets.load_from_disk(str(distilled))
    for i, ids in enumerate(data["input_ids"]):
        with torch.no_grad():
            expected = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for layer, tensor in features[i].items():
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, expected[layer][0].to(torch.bfloat16))
