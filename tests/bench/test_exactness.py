"""bench.exactness: per prompt, identical or not, where the method leaves plain decoding and the top-2 gap there."""

from __future__ import annotations

import json

import torch

from bench.exactness import first_divergence, main, prompt_result
from tests.tiny_models import DATA, STORIES260K


def test_bf16_draft_model_run_is_identical_and_records_tau(tmp_path):
    """In bfloat16 (batch-invariant kernels) a self-drafting model is identical to plain bf16 decoding on every
    prompt, with multi-token verifies (tau > 2)."""
    out = tmp_path / "exactness.json"
    result = main(["--model", str(STORIES260K), "--dtype", "bfloat16", "--method", "draft_model", "--draft_model",
                   str(STORIES260K), "--num_speculative_tokens", "4", "--prompts", str(DATA / "tinystories_sample.jsonl"),
                   "--max_prompts", "2", "--max_new_tokens", "24", "--output_json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    overall = result["overall"]
    assert overall["identical"] == 2 and overall["first_divergence_positions"] == [] and overall["tau"] > 2
    assert all(r["identical"] and r["tau"] > 2 for r in result["prompts"])
    assert result["config"]["dtype_used"] == "bfloat16"


def test_a_divergence_records_position_and_gap():
    gaps = torch.tensor([2.0, 0.5, 0.0625, 3.0])
    record = prompt_result(0, [5, 6, 7, 8], [5, 6, 9, 8], gaps, tau=1.5)
    assert record["identical"] is False and record["first_divergence"] == 2
    assert record["gap_at_divergence"] == 0.0625 and record["gap_share_at_most"] == 0.25
    assert record["plain_token"] == 7 and record["method_token"] == 9 and record["tau"] == 1.5
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([1], [1]) is None
