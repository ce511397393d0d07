"""bench.plain_dtypes: our plain loop per dtype (and llama.cpp when given), tokens/s and their ratios in JSON."""

from __future__ import annotations

import json

import pytest

from bench.plain_dtypes import main, parse_gguf
from tests.tiny_models import DATA, STORIES260K


def test_plain_speed_per_dtype_is_written(tmp_path):
    out = tmp_path / "plain.json"
    result = main(["--model", str(STORIES260K), "--prompts", str(DATA / "tinystories_sample.jsonl"),
                   "--max_prompts", "2", "--max_new_tokens", "12", "--repeats", "1", "--output_json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["ours_tokens_per_second"]) == {"float32", "bfloat16"}
    assert all(v > 0 for v in result["ours_tokens_per_second"].values())
    assert result["bf16_over_float32"] == pytest.approx(
        result["ours_tokens_per_second"]["bfloat16"] / result["ours_tokens_per_second"]["float32"])
    assert result["llama_cpp_tokens_per_second"] == {} and result["ours_over_llama_cpp"] == {}


def test_gguf_entries_name_their_dtype():
    assert parse_gguf(["bfloat16=a.gguf", "float32=b.gguf"]) == {"bfloat16": "a.gguf", "float32": "b.gguf"}
    with pytest.raises(ValueError, match="--gguf 'a.gguf': expected DTYPE=FILE.gguf"):
        parse_gguf(["a.gguf"])
