"""data.distill --mode teacher_forced on SmolLM2's tokenizer: exact loss masks on multi-turn conversations,
deduplication and a disjoint held-out split, bad rows skipped and counted, per-source caps, errors."""

import json

import datasets
import pytest

from data.distill import DistillConfig, main, run
from data.teacher_forced import Source, conversation_hash, parse_sources
from heads.loading import load_tokenizer
from tests.tiny_models import SMOLLM2

SYSTEM = {"role": "system", "content": "You are terse."}


def sharegpt(*turns, system=None):
    """ShareGPT row: turns alternate human, gpt, human, ..."""
    items = [{"from": "system", "value": system}] if system else []
    items += [{"from": "human" if i % 2 == 0 else "gpt", "value": text} for i, text in enumerate(turns)]
    return {"conversations": items}


def write_jsonl(path, rows):
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return str(path)


def build(tmp_path, sources, **overrides):
    values = dict(mode="teacher_forced", model=str(SMOLLM2), sources=sources, output_dir=str(tmp_path / "out"),
                  max_length=512, shard_size=3)
    values.update(overrides)
    return run(DistillConfig(**values))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(SMOLLM2))


def masked_texts(tokenizer, ids, mask):
    """The decoded text of each run of loss_mask == 1."""
    runs, previous = [], 0
    for token, value in zip(ids, mask, strict=True):
        if value and not previous:
            runs.append([])
        if value:
            runs[-1].append(token)
        previous = value
    return [tokenizer.decode(run) for run in runs]


def test_every_assistant_turn_is_learned_and_nothing_else(tmp_path, tokenizer):
    rows = [sharegpt("Hi there", "Hello! How can I help?", "Tell me a story.", "Once upon a time, a cat sat.",
                     "Shorter.", "Cat sat.", system="You are terse."),
            {"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
            {"prompt": "def one():\n", "canonical_solution": "    return 1\n"}]
    manifest = build(tmp_path, [write_jsonl(tmp_path / "mixed.jsonl", rows[:1]),
                                "gsm=" + write_jsonl(tmp_path / "gsm.jsonl", rows[1:2]),
                                "code=" + write_jsonl(tmp_path / "code.jsonl", rows[2:])])
    data = datasets.load_from_disk(str(tmp_path / "out"))
    assert data["index"] == [0, 1, 2] and manifest["conversations_written"] == 3
    answers = [["Hello! How can I help?", "Once upon a time, a cat sat.", "Cat sat."],
               ["2 + 3 = <<2+3=5>>5\n#### 5"], ["def one():\n    return 1\n"]]
    for ids, mask, expected in zip(data["input_ids"], data["loss_mask"], answers, strict=True):
        assert masked_texts(tokenizer, ids, mask) == [answer + "<|im_end|>" for answer in expected]
    unmasked = tokenizer.decode([t for t, m in zip(data["input_ids"][0], data["loss_mask"][0], strict=True) if not m])
    assert "You are terse." in unmasked and "Tell me a story." in unmasked and "Cat sat" not in unmasked
    assert [s["name"] for s in manifest["sources"]] == ["mixed", "gsm", "code"]
    assert sum(s["assistant_tokens"] for s in manifest["sources"]) == manifest["tokens"]["loss"]
    assert manifest["tokens"]["loss"] == sum(map(sum, data["loss_mask"]))
    assert manifest["mode"] == "teacher_forced" and manifest["tokens"]["generated"] == 0


def test_duplicates_removed_and_held_out_split_disjoint(tmp_path):
    prompts = [f"Question number {i}?" for i in range(40)]
    first = [sharegpt(p, f"Answer {i}.") for i, p in enumerate(prompts)]
    # the same conversations again (case and whitespace differ) and new answers to the same prompts
    second = [sharegpt("  " + p.upper(), f"answer   {i}.") for i, p in enumerate(prompts[:10])]
    second += [sharegpt(p, f"Another answer {i}.") for i, p in enumerate(prompts[10:20])]
    manifest = build(tmp_path, ["a=" + write_jsonl(tmp_path / "a.jsonl", first),
                                "b=" + write_jsonl(tmp_path / "b.jsonl", second)], eval_fraction=0.3)
    train = datasets.load_from_disk(str(tmp_path / "out"))
    held = datasets.load_from_disk(str(tmp_path / "out" / "eval"))
    assert manifest["duplicates_removed"] == 10
    assert {s["name"]: s["duplicates_removed"] for s in manifest["sources"]} == {"a": 0, "b": 10}
    assert len(train) + len(held) == 50 and len(held) == manifest["eval"]["conversations"] > 0
    assert sum(s["held_out_conversations"] for s in manifest["sources"]) == len(held)
    assert set(train["index"]).isdisjoint(held["index"])

    def first_prompts(rows):
        return {json.loads(c)[0]["content"].strip().lower() for c in rows["conversation"]}

    assert first_prompts(train).isdisjoint(first_prompts(held))  # a prompt never lands on both sides
    assert {conversation_hash(json.loads(c)) for c in train["conversation"]}.isdisjoint(
        conversation_hash(json.loads(c)) for c in held["conversation"])
    assert json.loads((tmp_path / "out" / "eval" / "manifest.json").read_text())["split_role"] == "eval"


def test_bad_rows_skipped_with_their_row_and_counted(tmp_path):
    long_answer = "word " * 600
    rows = [sharegpt("Hi", "Hello"),                                   # line 1: fine
            {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]},  # out of order
            {"conversations": [{"from": "gpt", "value": "I speak first"}, {"from": "human", "value": "ok"}]},
            sharegpt("Only a question"),                               # line 4: no assistant turn
            "{broken json",                                            # line 5: unreadable
            sharegpt("Long?", long_answer),                            # line 6: over --max_length
            sharegpt("One", "Uno", "Two", long_answer),                # line 7: cut after its first answer
            sharegpt("Q", "A", "trailing question"),                   # line 8: trailing user turn dropped
            sharegpt("Empty answer", "  ")]                            # line 9: empty message
    manifest = build(tmp_path, ["s=" + write_jsonl(tmp_path / "s.jsonl", rows)], max_length=300)
    assert manifest["skipped_by_reason"] == {"unreadable": 1, "roles_out_of_order": 2, "no_assistant_turn": 1,
                                             "empty_message": 1, "over_max_length": 1}
    assert sorted((row["row"], row["reason"]) for row in manifest["skipped_row_details"]) == [
        (2, "roles_out_of_order"), (3, "roles_out_of_order"), (4, "no_assistant_turn"), (5, "unreadable"),
        (6, "over_max_length"), (9, "empty_message")]
    (source,) = manifest["sources"]
    assert source["conversations"] == 3 and source["cut_conversations"] == 1 and source["dropped_turns"] == 1
    conversations = [json.loads(c) for c in datasets.load_from_disk(str(tmp_path / "out"))["conversation"]]
    assert [[m["content"] for m in c] for c in conversations] == [["Hi", "Hello"], ["One", "Uno"], ["Q", "A"]]
    assert max(manifest["tokens"]["max_length"], 0) <= 300


def test_caps_count_kept_conversations_and_a_distilled_dataset_is_a_source(tmp_path):
    rows = [sharegpt(f"Prompt {i}", f"Answer {i}") for i in range(6)]
    source = write_jsonl(tmp_path / "s.jsonl", rows)
    first = build(tmp_path, [f"s={source}:4"])
    assert first["conversations_written"] == 4 and first["sources"][0]["index_range"] == [0, 4]
    # the finished dataset as a source of a new mix: its conversations come back as they are, then deduplicated
    mixed = build(tmp_path, [f"old={tmp_path / 'out'}", f"new={source}"], output_dir=str(tmp_path / "mix"))
    assert [(s["conversations"], s["duplicates_removed"]) for s in mixed["sources"]] == [(4, 0), (2, 4)]
    before = datasets.load_from_disk(str(tmp_path / "out"))
    after = datasets.load_from_disk(str(tmp_path / "mix"))
    assert after["input_ids"][:4] == before["input_ids"] and after["loss_mask"][:4] == before["loss_mask"]


def test_source_without_answers_is_an_error_naming_it(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [sharegpt("Hi", "Hello")])
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"turns": ["Write a poem."]}, {"prompt": "Say hi"}])
    with pytest.raises(ValueError, match=r"--sources bench=.*prompts\.jsonl: no usable conversation.*no_assistant"):
        build(tmp_path, [good, f"bench={prompts}"])
    with pytest.raises(FileNotFoundError, match=r"--sources gone=.*missing\.jsonl: no such file"):
        build(tmp_path, [good, f"gone={tmp_path / 'missing.jsonl'}"], output_dir=str(tmp_path / "gone"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"--sources broken=.*bad\.jsonl: "):
        build(tmp_path, [good, f"broken={bad}"], output_dir=str(tmp_path / "broken"))


def test_resume_after_the_held_out_merge_and_other_settings_refused(tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", [sharegpt(f"Prompt {i}", f"Answer {i}") for i in range(12)])
    manifest = build(tmp_path, [source], eval_fraction=0.4)
    assert build(tmp_path, [source], eval_fraction=0.4) == manifest  # complete: nothing to do
    before = datasets.load_from_disk(str(tmp_path / "out"))["input_ids"]
    (tmp_path / "out" / "manifest.json").unlink()  # as if killed after OUT/eval was merged
    resumed = build(tmp_path, [source], eval_fraction=0.4)
    assert datasets.load_from_disk(str(tmp_path / "out"))["input_ids"] == before
    assert [s["held_out_conversations"] for s in resumed["sources"]] == [manifest["eval"]["conversations"]]
    assert resumed["tokens"] == manifest["tokens"] and not (tmp_path / "out" / "eval" / "shards").exists()
    with pytest.raises(ValueError, match="other settings"):
        build(tmp_path, [source], eval_fraction=0.5)


def test_parse_sources_flags():
    assert parse_sources(["sharegpt=data/s.jsonl:500", "data/gsm8k_train.jsonl", "hf=org/name"]) == [
        Source("sharegpt", "data/s.jsonl", 500), Source("gsm8k_train", "data/gsm8k_train.jsonl"),
        Source("hf", "org/name")]
    with pytest.raises(ValueError, match="used twice"):
        parse_sources(["a.jsonl", "x/a.jsonl"])
    with pytest.raises(ValueError, match="CAP must be >= 1"):
        parse_sources(["a=a.jsonl:0"])


def test_flags_from_the_command_line(tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", [sharegpt("Hi", "Hello")])
    manifest = main(["--mode", "teacher_forced", "--model", str(SMOLLM2), "--sources", f"x={source}:1",
                     "--output_dir", str(tmp_path / "cli"), "--max_length", "128"])
    assert manifest["conversations_written"] == 1
    generate = DistillConfig(model=str(SMOLLM2), sources=[source], output_dir=str(tmp_path / "x"))  # generate mixes
    assert generate.mode == "generate" and generate.sources == [source]  # sources too (tests/data/test_distill.py)
    with pytest.raises(ValueError, match="--sources replaces --prompts"):
        DistillConfig(mode="teacher_forced", model=str(SMOLLM2), sources=[source], prompts=source, output_dir="x")
