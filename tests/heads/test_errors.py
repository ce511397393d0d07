"""Bad input gives clear errors: wrong target, corrupt files, missing keys, unknown format, bad d2t."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads import HeadsConfig, load_heads
from heads.checkpoint import weights_file
from heads.draft_vocab import build_vocab_mapping, validate_vocab_mapping
from tests.heads.helpers import TARGET_NAME, save_random_heads, tiny_target
from tests.tiny_models import STORIES260K, stories260k


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    return save_random_heads(target, tmp_path_factory, ("medusa", "eagle3"))


@pytest.mark.parametrize("overrides, field", [({"hidden_size": 32, "head_dim": 8}, "hidden_size 64"),
                                              ({"vocab_size": 300}, "vocab_size 256"),
                                              ({"num_hidden_layers": 3}, "num_hidden_layers 2")])
def test_refuses_other_target_shapes(saved, overrides, field):
    other = tiny_target(**overrides)
    with pytest.raises(ValueError) as err:
        load_heads(saved["eagle3"], target=other, target_name="other-model")
    message = str(err.value)
    assert field in message and TARGET_NAME in message and "other-model" in message


def test_refuses_other_base_model_with_same_shapes(saved, target):
    with pytest.raises(ValueError, match=r"base model 'tiny-llama' \(head\) vs 'someone/else' \(target\)"):
        load_heads(saved["medusa"], target=target, target_name="someone/else")
    load_heads(saved["medusa"], target=target, target_name="someone/else", allow_base_model_mismatch=True)
    load_heads(saved["medusa"], target=target, target_name="/models/tiny-llama")  # same name, other place


def test_stories260k_head_refuses_tiny_llama(tmp_path, target):
    model = stories260k()
    config = HeadsConfig.for_target("eagle3", model.config, str(STORIES260K), draft_vocab_size=64)
    assert config.target_layers == [1, 2, 4] and config.vocab_size == 512
    from heads import build_heads
    build_heads(config).save_pretrained(tmp_path / "s")
    load_heads(tmp_path / "s", target=model)  # its own target: fine (name from model._name_or_path)
    with pytest.raises(ValueError, match="stories260K.*cannot run on target 'tiny-llama'"):
        load_heads(tmp_path / "s", target=target, target_name="tiny-llama")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors(saved, tmp_path, damage):
    import shutil
    path = tmp_path / "h"
    shutil.copytree(saved["eagle3"], path)
    wfile = path / weights_file("eagle3")
    data = wfile.read_bytes()
    wfile.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00" * 64, "empty": b""}[damage])
    with pytest.raises(ValueError, match="corrupt or truncated safetensors"):
        load_heads(path)


def test_missing_weights_file_and_config(saved, tmp_path):
    import shutil
    path = tmp_path / "h"
    shutil.copytree(saved["medusa"], path)
    (path / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.safetensors"):
        load_heads(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_heads(path)


def _edit_config(src, dst, edit):
    import shutil
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    edit(data)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def test_missing_config_keys_unknown_keys_and_format_version(saved, tmp_path):
    path = _edit_config(saved["medusa"], tmp_path / "a", lambda d: d["specheads"].pop("vocab_size"))
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['vocab_size'\]"):
        load_heads(path)
    path = _edit_config(saved["medusa"], tmp_path / "b", lambda d: d["specheads"].update(format_version=99))
    with pytest.raises(ValueError, match="unknown format_version 99"):
        load_heads(path)
    path = _edit_config(saved["medusa"], tmp_path / "c", lambda d: d["specheads"].update(colour="red"))
    with pytest.raises(ValueError, match=r"unknown head config key\(s\) \['colour'\]"):
        load_heads(path)
    path = _edit_config(saved["medusa"], tmp_path / "d", lambda d: d.pop("specheads"))
    with pytest.raises(ValueError, match="not a specheads head directory.*heads.convert"):
        load_heads(path)
    path = _edit_config(saved["medusa"], tmp_path / "e", lambda d: d["specheads"].update(medusa_num_heads=4))
    with pytest.raises(ValueError, match=r"missing \['heads.3"):
        load_heads(path)


def _edit_tensors(src, dst, edit):
    import shutil
    shutil.copytree(src, dst)
    wfile = dst / "model.safetensors"
    tensors = load_file(str(wfile))
    edit(tensors)
    save_file(tensors, str(wfile))
    return dst


def test_bad_d2t_is_refused(saved, tmp_path):
    def outside(t):
        t["d2t"][-1] = 10_000
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        load_heads(_edit_tensors(saved["eagle3"], tmp_path / "a", outside))

    def missing(t):
        del t["d2t"]
    with pytest.raises(ValueError, match=r"missing \['d2t'\]"):
        load_heads(_edit_tensors(saved["eagle3"], tmp_path / "b", missing))

    def wrong_dtype(t):
        t["d2t"] = t["d2t"].to(torch.int32)
    with pytest.raises(ValueError, match="d2t must be int64"):
        load_heads(_edit_tensors(saved["eagle3"], tmp_path / "c", wrong_dtype))

    def inconsistent(t):
        t["t2d"] = torch.zeros_like(t["t2d"])
    with pytest.raises(ValueError, match="t2d disagrees with d2t"):
        load_heads(_edit_tensors(saved["eagle3"], tmp_path / "d", inconsistent))

    def wrong_shape(t):
        t["fc.weight"] = t["fc.weight"][:, :128].contiguous()
    with pytest.raises(ValueError, match=r"fc.weight: expected \[64, 192\], got \[64, 128\]"):
        load_heads(_edit_tensors(saved["eagle3"], tmp_path / "e", wrong_shape))


def test_vocab_mapping_from_counts():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_vocab_mapping(counts, 4)
    kept = d2t + torch.arange(4)
    assert kept.tolist() == [0, 2, 3, 5]  # top-4 by count, sorted by id
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.nonzero().flatten().tolist() == [0, 2, 3, 5]
    validate_vocab_mapping(d2t, t2d, 8, 4)
    d2t_tie, _ = build_vocab_mapping(torch.tensor([1, 1, 1, 1]), 2)
    assert (d2t_tie + torch.arange(2)).tolist() == [0, 1]  # ties: smaller id first
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_mapping(counts, 9)


def test_config_validation_messages():
    base = dict(kind="eagle3", base_model_name_or_path="m", hidden_size=64, vocab_size=256, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2)
    assert HeadsConfig(**base).target_layers == [2, 4, 5]
    with pytest.raises(ValueError, match="kind"):
        HeadsConfig(**{**base, "kind": "lookahead"})
    with pytest.raises(ValueError, match=r"target_layers.*\[1, 7\]"):
        HeadsConfig(**{**base, "target_layers": [0, 4, 5]})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        HeadsConfig(**{**base, "draft_vocab_size": 1000})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        HeadsConfig(**{**base, "num_key_value_heads": 3})
    config = HeadsConfig(**base)
    assert HeadsConfig.from_json(config.to_json()) == config
