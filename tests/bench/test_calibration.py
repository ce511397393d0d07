"""bench.calibration: draft confidence per step vs acceptance, and the gated speed-up arithmetic."""

from __future__ import annotations

import json

import pytest

from bench.calibration import confidence_bins, expected_bins, gated_speedup, main
from bench.common import load_target
from heads import HeadsConfig, build_heads
from tests.tiny_models import DATA, STORIES260K, stories260k

RECORDS = [(0.95, True), (0.92, True), (0.1, False), (0.5, False), (1.0, False)]


def test_bins_partition_the_steps():
    bins = confidence_bins(RECORDS)
    assert sum(b["steps"] for b in bins) == len(RECORDS)
    assert [b["steps"] for b in bins] == [1, 0, 1, 0, 0, 3]  # 1.0 falls in the last, closed bin
    assert bins[-1]["acceptance"] == pytest.approx(2 / 3) and bins[1]["acceptance"] is None


def test_gated_speedup_counts_draft_on_every_step_and_verify_only_when_drafted():
    # p >= 0.9: 3 drafted steps (2 accepted) -> 5 + 2 tokens; cost 5 x 0.05 + 3 x 1.5 + 2 x 1 = 6.75
    row = gated_speedup(RECORDS, 0.9, verify_two=1.5, draft=0.05)
    assert row["drafted_share"] == pytest.approx(0.6) and row["acceptance"] == pytest.approx(2 / 3)
    assert row["predicted_speedup"] == pytest.approx(7 / 6.75)
    never = gated_speedup(RECORDS, 1.1, verify_two=1.5, draft=0.05)  # drafts nothing, still pays the draft
    assert never["predicted_speedup"] == pytest.approx(1 / 1.05) and never["acceptance"] is None
    assert gated_speedup([], 0.5, 1.5, 0.05)["predicted_speedup"] is None


def test_cli_records_every_step_of_an_eagle_head(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    model = stories260k()
    build_heads(HeadsConfig.for_target("eagle", model, str(STORIES260K))).save_pretrained(tmp_path / "eagle")
    out = tmp_path / "calibration.json"
    result = main(["--model", str(STORIES260K), "--heads", str(tmp_path / "eagle"), "--prompts",
                   str(DATA / "tinystories_sample.jsonl"), "--max_prompts", "2", "--max_new_tokens", "12",
                   "--output_json", str(out)])
    assert json.loads(out.read_text()) == result
    # every step but the last of each prompt drafts one token (the last has no budget left): 11 steps at most
    assert 2 <= result["steps"] <= 22 and sum(b["steps"] for b in result["bins"]) == result["steps"]
    assert result["verify_two_tokens_cost"] > 0 and result["draft_cost"] > 0
    build_heads(HeadsConfig.for_target("medusa", model, str(STORIES260K))).save_pretrained(tmp_path / "medusa")
    with pytest.raises(ValueError, match="--heads: confidence calibration needs EAGLE"):
        main(["--model", str(STORIES260K), "--heads", str(tmp_path / "medusa"), "--max_prompts", "1"])


def test_expected_bins_average_each_bin():
    bins = expected_bins([(0.05, 0), (0.15, 1), (0.12, 0), (2.9, 3), (3.0, 2)])
    assert sum(b["steps"] for b in bins) == 5 and bins[1]["steps"] == 2
    assert bins[1]["expected"] == pytest.approx(0.135) and bins[1]["accepted"] == pytest.approx(0.5)
    assert bins[-1]["steps"] == 2 and bins[-1]["accepted"] == pytest.approx(2.5)  # 3.0 in the last, closed bin
    assert bins[2]["expected"] is None and bins[2]["accepted"] is None


def test_cli_dynamic_records_each_drafted_trees_expected(tmp_path, monkeypatch):
    """--eagle_tree dynamic: one record per drafted EAGLE-2 step, its expected within (0, size], its accepted within
    [0, size]; heads that do not draft EAGLE-2 trees are refused by name."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    model = stories260k()
    build_heads(HeadsConfig.for_target("eagle", model, str(STORIES260K))).save_pretrained(tmp_path / "eagle")
    out = tmp_path / "expected.json"
    flags = ["--model", str(STORIES260K), "--prompts", str(DATA / "tinystories_sample.jsonl"), "--max_prompts", "2",
             "--max_new_tokens", "12", "--eagle_tree", "dynamic", "--tree_size", "3", "--tree_depth", "2",
             "--tree_top_k", "2"]
    result = main([*flags, "--heads", str(tmp_path / "eagle"), "--output_json", str(out)])
    assert json.loads(out.read_text()) == result
    assert 2 <= result["steps"] <= 22 and sum(b["steps"] for b in result["expected_bins"]) == result["steps"]
    assert 0 < result["mean_expected"] <= 3 and 0 <= result["mean_accepted"] <= 3
    build_heads(HeadsConfig.for_target("medusa", model, str(STORIES260K))).save_pretrained(tmp_path / "medusa")
    with pytest.raises(ValueError, match="--eagle_tree dynamic needs EAGLE"):
        main([*flags, "--heads", str(tmp_path / "medusa")])
    with pytest.raises(ValueError, match="--eagle_tree must be static or dynamic"):
        main([*flags[:-8], "--eagle_tree", "chain", "--heads", str(tmp_path / "eagle")])


def test_load_target_without_the_cache_writes_nothing_there(tmp_path, monkeypatch):
    """`bench.cost_curve --no_cache` measures afresh: its target loader runs the verify check and the layout choice
    without reading or writing $SPECHEADS_CACHE (with the cache, the check's record is written)."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    load_target(model=str(STORIES260K), dtype="float32", weight_layout="rows", use_cache=False)
    assert not (tmp_path / "cache" / "verify_check").exists()
    load_target(model=str(STORIES260K), dtype="float32", weight_layout="rows")
    assert list((tmp_path / "cache" / "verify_check").glob("*.json"))
