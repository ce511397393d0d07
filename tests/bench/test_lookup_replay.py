"""bench.lookup_replay: prompt lookup replayed on fixed answers under greedy verification, with a cost curve."""

from __future__ import annotations

import json

import pytest

from bench.lookup_replay import last_answer, main, replay
from runtime.cost_model import CostCurve, save_curve
from runtime.proposers.prompt_lookup import PromptLookupProposer

CPU = [1.0, 1.56, 1.7, 1.8, 1.85, 1.9, 1.95, 2.0, 2.05]  # verify cost of 1..9 tokens relative to one
FLAT = [1.0] * 9  # a GPU: verifying a few more tokens costs nothing


def test_last_answer_is_the_last_loss_mask_run_after_its_prompt():
    ids, mask = [1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 1, 0, 0, 1, 1, 0]
    assert last_answer(ids, mask, 10) == ([1, 2, 3, 4, 5], [6, 7])
    assert last_answer(ids, mask, 1) == ([1, 2, 3, 4, 5], [6])
    assert last_answer(ids, [0] * 8, 10) is None and last_answer(ids, [1] * 8, 10) is None  # no answer / no prompt


def test_replay_commits_the_answer_and_costs_what_it_drafts():
    story = [5, 6, 7, 8, 9, 10, 11, 12]
    prompt, answer = [1, 2] + story + [3], story * 3  # the answer copies the prompt's text
    copying = replay(PromptLookupProposer(3, 1, FLAT), prompt, answer, FLAT, max_tokens=8)
    assert copying["committed"] == answer  # greedy verification only ever commits the answer
    assert copying["tokens"] / copying["steps"] > 2 and copying["tokens"] / copying["cost"] > 2
    never = replay(PromptLookupProposer(3, 1, CPU, required_gain=100.0), prompt, answer, CPU, max_tokens=8)
    assert never["committed"] == answer and never["drafted_steps"] == 0 and never["cost"] == never["tokens"]
    # on this CPU curve copying still pays, and the margin does not stop a lookup that keeps being right
    cpu = replay(PromptLookupProposer(3, 1, CPU), prompt, answer, CPU, max_tokens=8)
    assert cpu["committed"] == answer and cpu["tokens"] / cpu["cost"] > 1.2


def _dataset(path, rows):
    import datasets

    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    return path


def test_cli_writes_results_and_names_bad_inputs(tmp_path):
    curve = tmp_path / "curve.json"
    save_curve(CostCurve(tokens=[1, 2, 4, 8, 16, 17], seconds=[1.0, 1.56, 1.8, 2.0, 2.5, 2.6], model="m",
                         device="cpu-1threads", dtype="float32", kv_length=256), curve)
    story = list(range(10, 30))
    answers = _dataset(tmp_path / "answers", {"input_ids": [[1] + story + [2] + story, [1, 2, 3, 4, 5, 6]],
                                             "loss_mask": [[0] * 22 + [1] * 20, [0, 0, 0, 1, 1, 1]]})
    out = tmp_path / "replay.json"
    rows = main(["--curve", str(curve), "--answers", str(answers), "--required_gain", "1.0,1000",
                 "--output", str(out)])
    assert [r["required_gain"] for r in rows] == [1.0, 1000.0] and rows[0]["answers"] == 2
    assert rows[0]["predicted_speedup"] > 1.0 and rows[1]["predicted_speedup"] == 1.0 and rows[1]["tau"] == 1.0
    assert json.loads(out.read_text())["results"] == rows
    both = main(["--curve", str(curve), "--answers", str(answers), "--occurrence", "earliest,longest_context"])
    assert [r["occurrence"] for r in both] == ["earliest", "longest_context"]
    with pytest.raises(ValueError, match="--occurrence: .*expected one of longest_context, earliest, latest"):
        main(["--curve", str(curve), "--answers", str(answers), "--occurrence", "first"])
    with pytest.raises(FileNotFoundError, match="--answers .*nowhere"):
        main(["--curve", str(curve), "--answers", str(tmp_path / "nowhere")])
    wrong = _dataset(tmp_path / "wrong", {"text": ["a"]})
    with pytest.raises(ValueError, match="--answers .*missing \\['input_ids', 'loss_mask'\\]"):
        main(["--curve", str(curve), "--answers", str(wrong)])
    with pytest.raises(ValueError, match="--prior"):
        main(["--curve", str(curve), "--answers", str(answers), "--prior", "0.3"])
    with pytest.raises(FileNotFoundError, match="--curve"):
        main(["--curve", str(tmp_path / "none.json"), "--answers", str(answers)])
