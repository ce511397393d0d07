"""save -> load gives identical outputs for every kind; only the head's own weights are saved."""

import json

import pytest
import torch
from safetensors.torch import load_file

from heads import EagleDraft, MedusaHeads, load_heads
from heads.checkpoint import weights_file
from tests.heads.helpers import TARGET_NAME, VARIANTS, head_outputs, random_heads


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_load_identical_outputs(variant, target, tmp_path):
    heads = random_heads(variant, target)
    before = head_outputs(heads, target)
    heads.save_pretrained(tmp_path / "h")
    kind = heads.config.kind
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == sorted(
        ["README.md", "config.json", weights_file(kind)])
    loaded = load_heads(tmp_path / "h", target=target, target_name=TARGET_NAME)
    assert type(loaded) is type(heads)
    assert loaded.config == heads.config
    for a, b in zip(before, head_outputs(loaded, target), strict=True):
        assert torch.equal(a, b)
    # only the head's own weights: no target embedding / LM head in the file
    tensors = load_file(str(tmp_path / "h" / weights_file(kind)))
    assert not any("embed" in name for name in tensors)
    big = [n for n, t in tensors.items() if t.shape[0] == target.config.vocab_size and t.dim() == 2]
    expected_big = heads.config.medusa_num_heads if variant == "medusa" else 0
    assert len(big) == expected_big, big


def test_class_from_pretrained_checks_kind(target, tmp_path):
    random_heads("eagle", target).save_pretrained(tmp_path / "e")
    assert isinstance(EagleDraft.from_pretrained(tmp_path / "e"), EagleDraft)
    with pytest.raises(ValueError, match="not a MedusaHeads"):
        MedusaHeads.from_pretrained(tmp_path / "e")


def test_resave_replaces_directory_atomically(target, tmp_path):
    out = tmp_path / "h"
    random_heads("mtp", target, seed=0).save_pretrained(out)
    (out / "stale.txt").write_text("old")
    random_heads("mtp", target, seed=5).save_pretrained(out)
    assert not (out / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["h"]  # no temporary leftovers


def test_model_card_and_metrics(target, tmp_path):
    heads = random_heads("eagle3", target)
    heads.config.metrics = {"tau_mt_bench": 3.21}
    heads.config.training_data = "sharegpt_sample.jsonl (self-distilled)"
    heads.save_pretrained(tmp_path / "h")
    card = (tmp_path / "h" / "README.md").read_text()
    assert f"base_model: {TARGET_NAME}" in card and "tau_mt_bench | 3.21" in card
    assert "sharegpt_sample.jsonl" in card and "EAGLE-3" in card
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["specheads"]["metrics"] == {"tau_mt_bench": 3.21}


def test_bfloat16_round_trip(target, tmp_path):
    heads = random_heads("eagle3", target).to(torch.bfloat16)
    assert heads.dtype == torch.bfloat16 and heads.d2t.dtype == torch.int64
    heads.save_pretrained(tmp_path / "h")
    loaded = load_heads(tmp_path / "h")
    assert loaded.dtype == torch.bfloat16 and loaded.config.dtype == "bfloat16"
    hidden = torch.randn(1, 3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(heads.project(torch.cat([hidden] * 3, -1)), loaded.project(torch.cat([hidden] * 3, -1)))


def test_unknown_repo_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="no-such/heads-repo"):
        load_heads("no-such/heads-repo")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_heads("./missing/dir")
