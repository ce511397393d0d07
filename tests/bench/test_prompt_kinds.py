"""bench.prompt_kinds: deterministic prompt sets per kind, lengths in SmolLM2's tokenizer, rows bench.speed reads."""

import json
from pathlib import Path

import pytest

from bench import prompt_kinds
from bench.common import read_prompts
from bench.prompt_kinds import KINDS, SUMMARY_TOKENS, build_prompts, kind_files_dir, write_prompts

DATA = Path("../shared/data")
MODEL = "../shared/models/smollm2-135m-instruct"
pytestmark = pytest.mark.skipif(not (DATA.is_dir() and Path(MODEL, "tokenizer.json").is_file()),
                                reason="needs ../shared/data and SmolLM2's tokenizer")


@pytest.fixture(scope="module")
def count():
    return prompt_kinds.token_counter(MODEL)


@pytest.fixture(scope="module")
def rows(count):
    return build_prompts(list(KINDS), 3, 0, DATA, count)


def test_same_seed_same_file_other_seed_other_prompts(tmp_path, count, rows):
    write_prompts(rows, tmp_path / "a.jsonl")
    write_prompts(build_prompts(list(KINDS), 3, 0, DATA, count), tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    for kind in KINDS:
        assert (tmp_path / "a" / f"{kind}.jsonl").read_bytes() == (tmp_path / "b" / f"{kind}.jsonl").read_bytes()
    other = build_prompts(list(KINDS), 3, 1, DATA, count)
    assert [r["prompt"] for r in other] != [r["prompt"] for r in rows]


def test_every_kind_with_the_requested_count(rows):
    assert [r["kind"] for r in rows] == [k for k in KINDS for _ in range(3)]
    for row in rows:
        assert set(row) >= {"kind", "prompt", "source", "index", "prompt_tokens"}
        assert row["prompt"].strip() and row["prompt_tokens"] > 0
        assert len({r["prompt"] for r in rows if r["kind"] == row["kind"]}) == 3  # no repeats within a kind


def test_kind_does_not_depend_on_the_other_kinds(count, rows):
    alone = build_prompts(["rag", "qa"], 3, 0, DATA, count)
    assert [r for r in alone if r["kind"] == "qa"] == [r for r in rows if r["kind"] == "qa"]
    assert [r for r in alone if r["kind"] == "rag"] == [r for r in rows if r["kind"] == "rag"]


def test_summarise_prompts_are_long_documents(count):
    summaries = build_prompts(["summarise"], 6, 3, DATA, count)
    low, high = SUMMARY_TOKENS
    assert len(summaries) == 6
    for row in summaries:
        assert low <= count(row["prompt"]) <= high
        assert row["prompt"].rstrip().lower().split("\n")[-1].startswith(("summarise", "write a short summary"))
    assert summaries[0]["source"] == "tinystories_sample.jsonl"  # the five stories in a row: ~900 tokens
    assert {r["source"] for r in summaries[1:]} == {"tinyshakespeare.txt"}


def test_answers_are_in_the_prompts(rows):
    for row in rows:
        if row["kind"] == "qa":  # extractive: the quoted sentence and its successor are both in the passage
            assert row["reference"] in row["prompt"].rsplit("\n\n", 1)[0]
        if row["kind"] == "rag":
            number = int(row["reference"].strip("[]"))
            passages = len(row["index"])
            assert 3 <= passages <= 5 and 1 <= number <= passages
            assert f"[{passages}] " in row["prompt"] and "Using the passages, answer:" in row["prompt"]
            assert row["index"][number - 1].startswith("sharegpt_sample.jsonl:")
        if row["kind"] == "translate":
            assert row["prompt"].startswith(f"Translate into {row['reference']}:")


def test_rows_are_read_by_runtime_bench(tmp_path, rows):
    write_prompts(rows, tmp_path / "kinds.jsonl")
    assert read_prompts(str(tmp_path / "kinds.jsonl"), 100) == [r["prompt"] for r in rows]
    folder = kind_files_dir(tmp_path / "kinds.jsonl")
    assert folder == tmp_path / "kinds"
    for kind in KINDS:
        assert read_prompts(str(folder / f"{kind}.jsonl"), 100) == [r["prompt"] for r in rows if r["kind"] == kind]


def test_main_writes_files_and_prints_the_length_table(tmp_path, monkeypatch, capsys, count):
    monkeypatch.setattr(prompt_kinds, "token_counter", lambda model: count)
    out = tmp_path / "p" / "kinds.jsonl"
    rows = prompt_kinds.main(["--output", str(out), "--per_kind", "2", "--kinds", "math,code,chat"])
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    assert sorted(p.name for p in (tmp_path / "p" / "kinds").iterdir()) == ["chat.jsonl", "code.jsonl", "math.jsonl"]
    table = capsys.readouterr().out
    assert "| kind | count | tokens min | median | max |" in table
    assert table.count("| 2 |") == 3


def test_bad_arguments(count):
    with pytest.raises(ValueError, match=r"--kinds: unknown kind\(s\) \['poetry'\]"):
        prompt_kinds.parse_kinds("qa,poetry")
    with pytest.raises(ValueError, match="chat has only 80 prompts"):
        build_prompts(["chat"], 81, 0, DATA, count)
    with pytest.raises(ValueError, match="--per_kind must be >= 1"):
        build_prompts(["chat"], 0, 0, DATA, count)
    with pytest.raises(FileNotFoundError, match="no such file"):
        build_prompts(["math"], 1, 0, "/nonexistent", count)
