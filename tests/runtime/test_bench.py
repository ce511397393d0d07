"""`python -m runtime.bench` end to end on stories260K (2 prompts x 20 new tokens)."""

from __future__ import annotations

import json

import pytest

from runtime.bench import main, parse_arguments
from tests.tiny_models import DATA, SMOLLM2, STORIES260K

PROMPTS = str(DATA / "tinystories_sample.jsonl")


def _bench(tmp_path, *flags: str) -> tuple[dict, dict]:
    out = tmp_path / "bench.json"
    result = main(["--model", str(STORIES260K), "--prompts", PROMPTS, "--max_prompts", "2",
                   "--max_new_tokens", "20", "--warmup_tokens", "4", "--output_json", str(out), *flags])
    return result, json.loads(out.read_text())


def test_prompt_lookup_bench_writes_json_and_is_greedy_identical(tmp_path, capsys):
    result, written = _bench(tmp_path, "--method", "prompt_lookup", "--compare_hf")
    assert written == json.loads(json.dumps(result))
    overall = written["overall"]
    assert overall["prompts"] == 2 and len(written["prompts"]) == 2
    assert overall["greedy_identical"] is True and overall["plain_identical"] is True
    assert overall["hf_assisted"]["greedy_identical"] is True
    for record in written["prompts"]:
        assert record["greedy_identical"] is True
        assert record["method"]["new_tokens"] == record["hf"]["new_tokens"] <= 20
        assert record["tau"] >= 1.0 and record["speedup"] > 0
        assert 0.0 <= record["draft_share"] + record["verify_share"] + record["prefill_share"] <= 1.0 + 1e-6
        assert all(0.0 <= a <= 1.0 for a in record["acceptance_per_depth"])
    for runner in ("plain", "hf", "method", "hf_assisted"):
        assert overall[runner]["new_tokens"] == sum(r[runner]["new_tokens"] for r in written["prompts"])
        assert overall[runner]["tokens_per_second"] > 0
    assert overall["speedup_total"] == pytest.approx(
        overall["method"]["tokens_per_second"] / overall["plain"]["tokens_per_second"])
    assert written["config"]["method"] == "prompt_lookup" and "prompt" not in written["config"]
    assert "median" in capsys.readouterr().out


def test_draft_model_bench_with_the_target_as_its_own_draft(tmp_path):
    """Self-drafting accepts every greedy draft token: tau = k + 1 except where max_new_tokens cuts the draft."""
    _, written = _bench(tmp_path, "--method", "draft_model", "--draft_model", str(STORIES260K),
                        "--num_speculative_tokens", "3", "--compare_hf", "--repeats", "2")
    overall = written["overall"]
    assert overall["greedy_identical"] is True and overall["hf_assisted"]["greedy_identical"] is True
    assert overall["acceptance_per_depth"] == [1.0, 1.0, 1.0]
    assert overall["tau"] > 3.0


def test_draft_model_with_another_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--draft_model"):
        _bench(tmp_path, "--method", "draft_model", "--draft_model", str(SMOLLM2))


def test_config_yaml_gives_defaults_and_rejects_unknown_keys(tmp_path):
    config = tmp_path / "bench.yaml"
    config.write_text("method: autoregressive\nmax_prompts: 3\nmax_new_tokens: 7\n")
    gen_args, bench_args = parse_arguments(["--config", str(config), "--max_prompts", "5"])
    assert (gen_args.method, gen_args.max_new_tokens, bench_args.max_prompts) == ("autoregressive", 7, 5)
    config.write_text("method: autoregressive\nmax_promts: 3\n")
    with pytest.raises(ValueError, match="unknown key.*max_promts"):
        parse_arguments(["--config", str(config)])
    with pytest.raises(FileNotFoundError, match="--config"):
        parse_arguments(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ValueError, match="--prompts FILE"):
        parse_arguments(["--prompt", "hello"])
    with pytest.raises(ValueError, match="--repeats"):
        parse_arguments(["--repeats", "0"])
    with pytest.raises(ValueError, match="--max_new_tokens"):
        parse_arguments(["--max_new_tokens", "0"])
    with pytest.raises(ValueError, match="--method"):
        parse_arguments(["--method", "medusa"])
