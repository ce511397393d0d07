"""read_conversations: every supported format, malformed rows skipped with their line, bad sources rejected."""

import json

import pytest

from data.prompts import SkippedRow, read_conversations
from tests.tiny_models import DATA


def write_jsonl(path, rows):
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return str(path)


def test_sharegpt_roles_and_system(tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", [
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye"}]}])
    conversations, skipped = read_conversations(source)
    assert skipped == []
    assert conversations == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]]


def test_openai_messages_json_list(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"messages": [{"role": "user", "content": "2+2?"},
                                              {"role": "assistant", "content": "4"}]}]))
    conversations, skipped = read_conversations(str(path))
    assert conversations == [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]
    assert skipped == []


def test_alpaca_instruction_input_output(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", [
        {"instruction": "Translate", "input": "chat", "output": "cat"},
        {"instruction": "Say hi", "input": "", "output": ""}])
    conversations, _ = read_conversations(source)
    assert conversations[0] == [{"role": "user", "content": "Translate\n\nchat"},
                                {"role": "assistant", "content": "cat"}]
    assert conversations[1] == [{"role": "user", "content": "Say hi"}]


def test_mt_bench_turns_are_user_messages():
    conversations, skipped = read_conversations(str(DATA / "mt_bench_question.jsonl"), max_rows=3)
    assert len(conversations) == 3 and skipped == []
    assert [m["role"] for m in conversations[0]] == ["user", "user"]


@pytest.mark.parametrize("name,first_key", [("sharegpt_prompts.jsonl", "prompt"), ("humaneval.jsonl", "prompt"),
                                            ("gsm8k_train.jsonl", "question"),
                                            ("sharegpt_sample.jsonl", "conversations")])
def test_shared_files(name, first_key):
    conversations, skipped = read_conversations(str(DATA / name), max_rows=5)
    assert len(conversations) == 5 and skipped == []
    first = json.loads((DATA / name).open().readline())
    if first_key == "conversations":
        assert conversations[0][0]["content"] == first["conversations"][0]["value"]
    else:
        assert conversations[0][0] == {"role": "user", "content": first[first_key]}


def test_plain_text_column(tmp_path):
    conversations, _ = read_conversations(write_jsonl(tmp_path / "t.jsonl", [{"text": "Once"}]))
    assert conversations == [[{"role": "user", "content": "Once"}]]


def test_malformed_rows_reported_with_line_numbers_and_skipped(tmp_path):
    source = write_jsonl(tmp_path / "bad.jsonl", [
        {"conversations": [{"from": "human", "value": "ok 1"}]},
        "{not json",
        {"conversations": [{"from": "alien", "value": "x"}]},
        {"conversations": "nope"},
        {"other": 1},
        {"conversations": [{"from": "gpt", "value": "answer without question"}]},
        {"conversations": [{"from": "human", "value": 7}]},
        {"conversations": [{"from": "human", "value": "ok 2"}]},
        {"conversations": [{"from": "human", "value": "ok"}, {"from": "gpt", "value": "a"},
                           {"from": "human", "value": " \n"}]},
    ])
    conversations, skipped = read_conversations(source)
    assert [c[0]["content"] for c in conversations] == ["ok 1", "ok 2"]
    assert [row.line for row in skipped] == [2, 3, 4, 5, 6, 7, 9]
    assert all(isinstance(row, SkippedRow) and row.reason for row in skipped)
    assert "not JSON" in skipped[0].reason and "alien" in skipped[1].reason
    assert "no user message" in skipped[4].reason
    assert "user message 2 is empty" in skipped[6].reason


def test_an_empty_prompt_is_a_bad_row(tmp_path):
    conversations, skipped = read_conversations(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "  "}, {"prompt": "b"},
                                                                                   {"text": ""}]))
    assert [c[0]["content"] for c in conversations] == ["b"]
    assert [(row.line, row.reason) for row in skipped] == [(1, "user message 0 is empty"),
                                                           (3, "missing column `prompt` (format detected from "
                                                               "earlier rows)")]


def test_max_rows_counts_conversations_and_ignores_lines_past_the_cut(tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, "oops", {"prompt": "b"}, "oops", {"prompt": "c"}])
    conversations, skipped = read_conversations(source, max_rows=2)
    assert [c[0]["content"] for c in conversations] == ["a", "b"]
    assert [row.line for row in skipped] == [2]


def test_not_json_file_is_a_clear_error(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text("just some text\nand more\n")
    with pytest.raises(ValueError, match="notes.jsonl.*not a JSON"):
        read_conversations(str(path))


def test_no_recognised_columns_is_a_clear_error(tmp_path):
    source = write_jsonl(tmp_path / "cols.jsonl", [{"foo": "x"}, {"bar": "y"}])
    with pytest.raises(ValueError, match="cols.jsonl.*no row has a recognised column"):
        read_conversations(source)


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_conversations(str(tmp_path / "missing.jsonl"))


def test_dataset_directory_via_load_dataset(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"instruction": "Hi", "output": "Hello"}, {"instruction": 3}])
    conversations, skipped = read_conversations(str(folder))
    assert conversations == [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]]
    assert skipped == [SkippedRow(1, "`instruction` is int, expected a string")]


def test_dataset_with_no_recognised_column(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"foo": "x"}])
    with pytest.raises(ValueError, match="no recognised column in \\['foo'\\]"):
        read_conversations(str(folder))


def test_prompt_rows_keep_their_answer_column(tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "def f():\n", "canonical_solution": "    return 1\n"},
        {"prompt": "Q", "completion": "A"}, {"prompt": "only a prompt"}])
    conversations, _ = read_conversations(source)
    assert conversations == [
        [{"role": "user", "content": "def f():\n"}, {"role": "assistant", "content": "def f():\n    return 1\n"}],
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
        [{"role": "user", "content": "only a prompt"}]]


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b\x85c"}, ensure_ascii=False) + "\n" + json.dumps({"prompt": "d"}))
    conversations, skipped = read_conversations(str(path))
    assert skipped == [] and conversations == [[{"role": "user", "content": "a\u2028b\x85c"}],
                                               [{"role": "user", "content": "d"}]]
