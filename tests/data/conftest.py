"""Shared by the data.distill tests: the prompt file of `ROWS` (conversations of 1-3 user turns and one broken
line), written once per module."""

import json

import pytest

from tests.data.test_distill import ROWS


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in ROWS) + "\n")
    return str(path)
