"""data.task_prompts: translation requests built from any prompt file's user text, the same on every machine."""

import json

import pytest

from data import task_prompts
from data.task_prompts import TRANSLATE_FORMS, TaskPromptsConfig, main, pick_texts, translate_prompts


def test_translate_cycles_phrasings_per_prompt_and_languages_per_four():
    prompts = translate_prompts([f"text {i}" for i in range(9)], ["French", "German"])
    assert prompts[0] == "Translate into French:\n\ntext 0"
    assert prompts[3] == "text 3\n\nTranslate the text above into French."
    assert prompts[4] == "Translate into German:\n\ntext 4" and prompts[8] == "Translate into French:\n\ntext 8"
    assert all(f"text {i}" in prompt for i, prompt in enumerate(prompts)) and len(TRANSLATE_FORMS) == 4


def test_pick_texts_is_seeded_and_starts_where_asked():
    texts = [f"t{i}" for i in range(10)]
    assert pick_texts(texts, 3, -4, seed=1) == pick_texts(texts, 3, -4, seed=1)
    assert set(pick_texts(texts, 4, -4, seed=1)) == {"t6", "t7", "t8", "t9"}
    assert pick_texts(texts, 5, 0, seed=1) != pick_texts(texts, 5, 0, seed=2)
    with pytest.raises(ValueError, match="--text: 4 usable texts from row -4 on, fewer than --count 5"):
        pick_texts(texts, 5, -4, seed=0)


def test_cli_writes_prompts_data_prompts_reads(tmp_path):
    source = tmp_path / "questions.jsonl"
    source.write_text("\n".join(json.dumps({"question": f"Tom has {i} apples. How many?"}) for i in range(6))
                      + "\n" + json.dumps({"question": "   "}) + "\n")
    out = tmp_path / "translate.jsonl"
    prompts = main(["--text", str(source), "--count", "4", "--start", "1", "--seed", "3", "--languages", "Italian",
                    "--output", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["prompt"] for row in rows] == prompts and len(prompts) == 4
    assert all("Italian" in prompt and "apples" in prompt for prompt in prompts)
    assert "Tom has 0 apples" not in out.read_text()  # --start 1
    from data.prompts import read_conversations
    conversations, _ = read_conversations(str(out))
    assert [c[0]["content"] for c in conversations] == prompts
    assert main(["--text", str(source), "--count", "4", "--start", "1", "--seed", "3", "--languages", "Italian",
                 "--output", str(tmp_path / "again.jsonl")]) == prompts


def test_bad_flags_name_themselves():
    with pytest.raises(ValueError, match="--task must be one of"):
        TaskPromptsConfig(task="summarise", text="x", output="y")
    with pytest.raises(ValueError, match="--text is required"):
        TaskPromptsConfig(output="y")
    with pytest.raises(ValueError, match="--count must be >= 1"):
        TaskPromptsConfig(text="x", output="y", count=0)
    with pytest.raises(ValueError, match="--languages"):
        TaskPromptsConfig(text="x", output="y", languages=[])
    assert task_prompts.TASKS["translate"] is translate_prompts
