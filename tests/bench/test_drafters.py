"""`python -m bench.drafters`: several drafters against plain decoding in one run, its configs and its resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.drafters import STATE_FILE, main, read_config
from heads import HeadsConfig, build_heads
from tests.tiny_models import REPO, STORIES260K, stories260k


def test_drafters_compares_methods(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))  # prompt lookup by cost measures a verify curve

    model = stories260k()
    for kind in ("medusa", "eagle"):
        build_heads(HeadsConfig.for_target(kind, model, str(STORIES260K), medusa_num_heads=3)).save_pretrained(
            tmp_path / kind)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    config = tmp_path / "bench.yaml"
    config.write_text(f"model: {STORIES260K}\nprompts: {prompts}\nmax_prompts: 1\nmax_new_tokens: 24\n"
                      f"output_dir: {tmp_path / 'out'}\nwarmup_tokens: 4\nrepeats: 2\nmethods:\n"
                      f"  - {{name: pl, method: prompt_lookup}}\n"
                      f"  - {{name: pl_auto, method: prompt_lookup, num_speculative_tokens: auto}}\n"
                      f"  - {{name: pl_cost, method: prompt_lookup, num_speculative_tokens: cost}}\n"
                      f"  - {{name: medusa3, heads: {tmp_path / 'medusa'}, tree_size: 3}}\n"
                      f"  - {{name: eagle2, heads: {tmp_path / 'eagle'}, tree_size: 4, tree_depth: 2, tree_top_k: 2}}\n"
                      f"  - {{name: hybrid, method: hybrid, heads: {tmp_path / 'eagle'}, tree_size: 4, tree_depth: 2, "
                      f"tree_top_k: 2}}\n")
    payload = main(["--config", str(config), "--output_dir", str(tmp_path / "elsewhere")])  # flag beats config
    assert [m["method"] for m in payload["methods"]] == ["pl", "pl_auto", "pl_cost", "medusa3", "eagle2", "hybrid"]
    assert all(m["greedy_identical"] for m in payload["methods"])
    assert not (tmp_path / "out").exists()
    detail = json.loads((tmp_path / "elsewhere" / "medusa3.json").read_text())
    assert detail["config"]["size"] == 3 and len(detail["prompts"]) == 1
    config.write_text(config.read_text().replace("tree_top_k: 2", "tree_top_k: 2, depth: 3"))
    with pytest.raises(ValueError, match="unknown key"):
        main(["--config", str(config)])


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("bench_heads_*.yaml")))
def test_drafters_configs_parse(name):
    """Every committed bench config has only known keys and valid methods, and the tree files it names exist."""
    config, specs = read_config(REPO / "configs" / name)
    assert specs and config["methods"]
    for spec in specs:
        if spec.options.tree:
            assert (REPO / spec.options.tree).is_file() or Path(spec.options.tree).is_file(), spec.options.tree


def test_drafters_config_errors_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--config"):
        read_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="--config .*expected a mapping"):
        read_config(bad)
    bad.write_text("methods: []\n")
    with pytest.raises(ValueError, match="non-empty list"):
        read_config(bad)


def test_drafters_resumes_from_its_state(tmp_path, capsys):
    """A cut run keeps its prompts: a rerun reads them back (same numbers) and measures only the rest; a state of
    another configuration is not mixed in."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Once upon a time", "The cat sat")))
    config = tmp_path / "bench.yaml"
    config.write_text(f"model: {STORIES260K}\nprompts: {prompts}\nmax_prompts: 2\nmax_new_tokens: 12\n"
                      f"output_dir: {tmp_path / 'out'}\nwarmup_tokens: 4\nmethods:\n"
                      f"  - {{name: pl, method: prompt_lookup}}\n")
    main(["--config", str(config)])
    state_path = tmp_path / "out" / STATE_FILE
    state = json.loads(state_path.read_text())
    first = state["records"]["pl"][0]
    cut = {**state, "records": {"pl": state["records"]["pl"][:1]}, "stats": {"pl": state["stats"]["pl"][:1]},
           "plain_stats": state["plain_stats"][:1]}  # as if killed after the first prompt
    state_path.write_text(json.dumps(cut))
    capsys.readouterr()
    payload = main(["--config", str(config)])
    assert "resuming: 1 of 2 prompts" in capsys.readouterr().err
    detail = json.loads((tmp_path / "out" / "pl.json").read_text())
    assert payload["prompts"] == 2 and detail["prompts"][0] == first  # read back, not measured again
    assert detail["prompts"][1]["index"] == 1 and detail["prompts"][1]["greedy_identical"]
    config.write_text(config.read_text().replace("max_new_tokens: 12", "max_new_tokens: 10"))
    main(["--config", str(config)])
    assert "another configuration: starting over" in capsys.readouterr().err
    assert all(p["plain"]["new_tokens"] == 10 for p in json.loads((tmp_path / "out" / "pl.json").read_text())["prompts"])


def test_drafters_per_category_samples_each_category(tmp_path, monkeypatch):
    """per_category: 1 decodes the first prompt of each category (bench.common.read_questions), not the first rows."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    rows = [("a", "Once upon a time"), ("a", "The cat sat"), ("b", "Tom had a ball"), ("c", "Lily saw a bird")]
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                               for i, (c, t) in enumerate(rows)))
    config = tmp_path / "bench.yaml"
    config.write_text(f"model: {STORIES260K}\nprompts: {prompts}\nmax_prompts: 8\nper_category: 1\nmax_new_tokens: 8\n"
                      f"output_dir: {tmp_path / 'out'}\nwarmup_tokens: 2\nmethods:\n"
                      f"  - {{name: pl, method: prompt_lookup}}\n")
    main(["--config", str(config)])
    state = json.loads((tmp_path / "out" / STATE_FILE).read_text())
    assert len(state["run"]["prompts"]) == 3  # categories a, b, c: rows 0, 2, 3
    detail = json.loads((tmp_path / "out" / "pl.json").read_text())
    assert len(detail["prompts"]) == 3 and all(r["identical_to_plain"] for r in detail["prompts"])
