"""heads.files: atomic writes round-trip, are world-readable, leave no temp file, and keep the old file on failure."""

import json
import os
import stat

import pytest

from heads.files import atomic_write_json, atomic_write_jsonl, atomic_write_text


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_writes_round_trip_with_mode_644_and_no_temp_files(tmp_path):
    text = atomic_write_text(str(tmp_path / "sub" / "a.txt"), "hello\n")  # str path, missing parent
    value = {"b": [1, 2.5, None], "a": "x"}
    data = atomic_write_json(tmp_path / "sub" / "b.json", value, indent=1)
    rows = [{"i": 0}, {"i": 1, "s": "y"}]
    lines = atomic_write_jsonl(tmp_path / "sub" / "c.jsonl", rows)

    assert text == tmp_path / "sub" / "a.txt" and text.read_text() == "hello\n"
    assert json.loads(data.read_text()) == value and data.read_text().endswith("\n")
    assert [json.loads(line) for line in lines.read_text().splitlines()] == rows
    assert all(_mode(path) == 0o644 for path in (text, data, lines))
    assert sorted(entry.name for entry in (tmp_path / "sub").iterdir()) == ["a.txt", "b.json", "c.jsonl"]


def test_overwrite_replaces_content(tmp_path):
    path = tmp_path / "a.json"
    atomic_write_json(path, {"v": 1})
    atomic_write_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 2}
    assert os.listdir(tmp_path) == ["a.json"]


def test_unserialisable_value_keeps_previous_file(tmp_path):
    path = atomic_write_json(tmp_path / "a.json", {"v": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"v": object()})
    with pytest.raises(TypeError):
        atomic_write_jsonl(path, [{"v": 2}, {"v": object()}])
    assert json.loads(path.read_text()) == {"v": 1}
    assert os.listdir(tmp_path) == ["a.json"]


def test_failed_replace_keeps_previous_file_and_removes_temp(tmp_path, monkeypatch):
    path = atomic_write_text(tmp_path / "a.txt", "old\n")

    def fail(src, dst):
        raise KeyboardInterrupt  # a BaseException, as when a run is interrupted mid-write

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(path, "new\n")
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["a.txt"]
