"""data.distill on stories260K (plain format): turn order, resume after a kill, 2 processes, bad input."""

import json
import os
import socket
import subprocess
import sys

import datasets
import pytest

from data import distill
from data.chat_format import chat_format
from data.distill import DistillConfig, answer_conversations, bad_rows_line, run
from data.engines import HFEngine, Sampling
from data.prompts import SkippedRow
from heads.loading import load_tokenizer
from tests.tiny_models import REPO, STORIES260K, stories260k

ROWS = [
    {"turns": ["Tell me a story about a cat.", "Now about a dog."]},
    {"turns": ["Once upon a time"]},
    "{broken json",
    {"turns": ["Lily went to the park."]},
    {"turns": ["Ben had a red ball.", "What did Ben do?", "And then?"]},
    {"turns": ["The sun was hot."]},
]
COLUMNS = ["input_ids", "loss_mask", "text", "conversation", "index", "truncated_turns", "generated_tokens"]


def config(prompts, output_dir, **overrides):
    values = dict(model=str(STORIES260K), prompts=prompts, output_dir=str(output_dir), plain_format=True,
                  max_new_tokens=6, batch_size=2, shard_size=2)
    values.update(overrides)
    return DistillConfig(**values)


def rows(path):
    dataset = datasets.load_from_disk(str(path))
    return {column: dataset[column] for column in COLUMNS}


@pytest.fixture(scope="module")
def reference(prompts, tmp_path_factory):
    """One uninterrupted 1-process greedy run."""
    output_dir = tmp_path_factory.mktemp("reference") / "out"
    manifest = run(config(prompts, output_dir))
    return output_dir, manifest


def test_later_turns_see_the_targets_own_earlier_answers():
    tokenizer = load_tokenizer(str(STORIES260K))
    model = stories260k()
    fmt = chat_format(tokenizer, plain_format=True)
    seen = []
    generate = model.generate

    def recording_generate(**kwargs):
        seen.append([tokenizer.decode(row[row != 0]) for row in kwargs["input_ids"]])  # pad id 0 stripped
        return generate(**kwargs)

    model.generate = recording_generate
    engine = HFEngine(model, Sampling(5, fmt.stop_token_ids), pad_id=0, batch_size=4)
    conversations = [(0, [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "IGNORED"},
                          {"role": "user", "content": "Another one."}]),
                     (1, [{"role": "user", "content": "Hi"}])]
    answered = answer_conversations(engine, tokenizer, fmt, conversations, 5, 512)
    first, second = answered[0].messages[1]["content"], answered[0].messages[3]["content"]
    assert [m["role"] for m in answered[0].messages] == ["user", "assistant", "user", "assistant"]
    assert "IGNORED" not in json.dumps(answered[0].messages)
    assert len(seen) == 2 and len(seen[0]) == 2 and len(seen[1]) == 1  # round 1: both, round 2: only conv 0
    assert first and first in seen[1][0] and "Another one." in seen[1][0]
    assert seen[1][0].index(first) < seen[1][0].index("Another one.")
    assert second != "IGNORED" and answered[1].messages[1]["role"] == "assistant"


def test_dataset_manifest_and_masks(reference, prompts):
    output_dir, manifest = reference
    data = rows(output_dir)
    assert data["index"] == [0, 1, 2, 3, 4]  # 5 usable conversations; line 3 is not JSON
    assert manifest["skipped_rows"] == 1 and manifest["skipped_row_details"][0]["line"] == 3
    assert manifest["conversations_written"] == 5 and manifest["model"] == str(STORIES260K)
    assert manifest["generation"]["max_new_tokens"] == 6 and manifest["chat_template_sha256"]
    assert manifest["tokens"]["total"] == sum(len(ids) for ids in data["input_ids"])
    assert not (output_dir / "shards").exists()
    tokenizer = load_tokenizer(str(STORIES260K))
    eos = tokenizer.eos_token_id
    for ids, mask, conversation, truncated in zip(data["input_ids"], data["loss_mask"], data["conversation"],
                                                 data["truncated_turns"], strict=True):
        assert len(ids) == len(mask) and ids[0] == tokenizer.bos_token_id and mask[0] == 0
        messages = json.loads(conversation)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(answers) == sum(m["role"] == "user" for m in messages)  # every user turn answered
        learned = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert all(answer.strip() in learned for answer in answers)
        # every answer ends in </s> in the text; it is learned only where the model emitted it (not cut)
        learned_eos = sum(1 for t, m in zip(ids, mask, strict=True) if t == eos and m)
        assert learned_eos == len(answers) - len(truncated) and ids.count(eos) == len(answers)
    assert manifest["assistant_turns"] == 8


def test_resume_after_a_kill_equals_an_uninterrupted_run(reference, prompts, tmp_path, monkeypatch):
    output_dir = tmp_path / "out"
    write_shard = distill.write_shard
    written = []

    def dying_write_shard(path, columns, meta, hidden=None):
        if written:
            raise KeyboardInterrupt("simulated kill")
        written.append(path.name)
        write_shard(path, columns, meta, hidden)

    monkeypatch.setattr(distill, "write_shard", dying_write_shard)
    with pytest.raises(KeyboardInterrupt):
        run(config(prompts, output_dir))
    assert sorted(p.name for p in (output_dir / "shards").iterdir()) == ["shard-00000"]  # no partial shard left
    assert not (output_dir / "manifest.json").exists() and not (output_dir / "state.json").exists()

    generated = []
    answer = distill.answer_conversations
    monkeypatch.setattr(distill, "write_shard", write_shard)
    monkeypatch.setattr(distill, "answer_conversations",
                        lambda engine, tok, fmt, chunk, *a: generated.append(chunk[0][0]) or answer(engine, tok, fmt,
                                                                                                       chunk, *a))
    run(config(prompts, output_dir))
    assert generated == [2, 4]  # shard 0 (conversations 0, 1) was not generated again
    assert rows(output_dir) == rows(reference[0])
    assert run(config(prompts, output_dir))["conversations_written"] == 5  # complete: nothing to do
    assert generated == [2, 4]


def test_time_budget_keeps_the_finished_shards(reference, prompts, tmp_path):
    """--max_minutes: once the next shard would pass the budget no shard is started (the first always is); the
    dataset holds the finished shards, equal to the same rows of an unbounded run, the manifest lists the rest, and
    the directory is complete."""
    output_dir = tmp_path / "out"
    manifest = run(config(prompts, output_dir, max_minutes=1e-9))
    assert manifest["time_budget"] == {"max_minutes": 1e-9, "shards": 3, "shards_left": [1, 2],
                                       "conversations_left": 3}
    budgeted, whole = rows(output_dir), rows(reference[0])
    assert budgeted["index"] == [0, 1]
    assert budgeted == {column: values[:2] for column, values in whole.items()}
    assert not (output_dir / "shards").exists()
    assert run(config(prompts, output_dir))["conversations_written"] == 2  # complete: nothing to do
    assert "time_budget" not in reference[1]


def test_over_budget_is_elapsed_plus_the_mean_shard():
    assert not distill.over_budget(0, 1e9, [1.0])  # no budget
    assert not distill.over_budget(1, 1e9, [])  # the first shard always runs
    assert not distill.over_budget(1, 50.0, [8.0, 12.0])  # 50 + 10 = 60 s: fits a minute
    assert distill.over_budget(1, 50.5, [8.0, 12.0])
    with pytest.raises(ValueError, match="--max_minutes"):
        config("p", "o", max_minutes=-1)


def test_sampled_run_resumes_identically(prompts, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    run(config(prompts, whole, temperature=1.0, seed=3, max_prompts=4))
    resumed = tmp_path / "resumed"
    write_shard = distill.write_shard
    monkeypatch.setattr(distill, "write_shard", lambda path, *a: (_ for _ in ()).throw(RuntimeError("kill"))
                        if path.name == "shard-00001" else write_shard(path, *a))
    with pytest.raises(RuntimeError):
        run(config(prompts, resumed, temperature=1.0, seed=3, max_prompts=4))
    monkeypatch.setattr(distill, "write_shard", write_shard)
    run(config(prompts, resumed, temperature=1.0, seed=3, max_prompts=4))
    assert rows(resumed) == rows(whole)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_equal_one_process(reference, prompts, tmp_path):
    output_dir = tmp_path / "two"
    # `--cpu` makes accelerate start a single process; --multi_gpu on a machine without CUDA runs 2 CPU ranks
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "-m", "data.distill",
               "--model", str(STORIES260K), "--prompts", prompts, "--output_dir", str(output_dir), "--plain_format",
               "--max_new_tokens", "6", "--batch_size", "2", "--shard_size", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), ACCELERATE_USE_CPU="1")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((output_dir / "manifest.json").read_text())
    assert manifest["num_processes"] == 2
    assert rows(output_dir) == rows(reference[0])


def test_output_dir_of_another_model_is_refused(reference, prompts, tmp_path):
    other = tmp_path / "stories-copy"
    other.symlink_to(STORIES260K)
    with pytest.raises(ValueError, match="--output_dir .*holds data of model .*stories260K.*use another --output_dir"):
        run(config(prompts, reference[0], model=str(other)))


def test_other_settings_and_foreign_directories_are_refused(reference, prompts, tmp_path):
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        run(config(prompts, reference[0], max_new_tokens=7))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no run.json"):
        run(config(prompts, foreign))


def test_missing_template_names_the_flag(prompts, tmp_path):
    with pytest.raises(ValueError, match="--plain_format"):
        run(config(prompts, tmp_path / "out", plain_format=False))
    assert not (tmp_path / "out").exists()


def test_too_long_prompts_are_skipped_and_reported(prompts, tmp_path):
    long_prompts = tmp_path / "long.jsonl"
    long_prompts.write_text(json.dumps({"turns": ["word " * 200]}) + "\n" +
                            json.dumps({"turns": ["Hi", "word " * 100]}) + "\n")
    manifest = run(config(str(long_prompts), tmp_path / "out", max_length=64))
    assert manifest["conversations_written"] == 1 and manifest["conversations_skipped"] == 1
    assert "--max_length 64" in manifest["skipped_conversations"][0]["reason"]
    assert manifest["unanswered_turns"] == 1  # conversation 1 keeps its first answer, its second turn is dropped
    data = rows(tmp_path / "out")
    assert data["index"] == [1] and [m["role"] for m in json.loads(data["conversation"][0])] == ["user", "assistant"]


def test_dry_run_prints_marked_example_and_writes_nothing(prompts, tmp_path, capsys):
    distill.main(["--model", str(STORIES260K), "--prompts", prompts, "--output_dir", str(tmp_path / "out"),
                  "--plain_format", "--dry_run", "--max_new_tokens", "4"])
    shown = capsys.readouterr().out
    assert "\u27e6" in shown and "\u27e7" in shown and "User: Tell me a story about a cat." in shown
    assert not (tmp_path / "out").exists()


def test_yaml_config_defaults_and_unknown_keys(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {STORIES260K}\nprompts: p.jsonl\noutput_dir: o\nmax_new_tokens: 9\n")
    parsed = distill.parse_config(DistillConfig, ["--config", str(recipe), "--batch_size", "3"])
    assert (parsed.max_new_tokens, parsed.batch_size, parsed.prompts) == (9, 3, "p.jsonl")
    recipe.write_text("model: m\nmax_tokens: 9\n")
    with pytest.raises(ValueError, match="unknown key.*max_tokens"):
        distill.parse_config(DistillConfig, ["--config", str(recipe)])


def test_interleave_spreads_each_part_evenly_in_its_order():
    assert distill.interleave([list("abcdef"), ["X", "Y"]]) == list("abXcdeYf")  # X at 1/4, Y at 3/4 of the way
    assert distill.interleave([[1, 2, 3], []]) == [1, 2, 3]
    mixed = distill.interleave([list(range(100)), [f"t{i}" for i in range(25)]])
    assert [x for x in mixed if isinstance(x, int)] == list(range(100))
    assert [i for i, x in enumerate(mixed) if isinstance(x, str)][:3] == [2, 7, 12]  # one in five, from the start


def test_generate_from_several_sources_interleaves_them_and_records_them(reference, prompts, tmp_path):
    """--sources in generate mode: each source capped, the conversations interleaved in proportion, every answer the
    one the target gives to that prompt alone (the runtime engine is batch-invariant: the chat rows equal a run of
    --prompts alone), the sources in the manifest and in the run's identity; a missing or distilled source is an
    error naming --sources."""
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"prompt": f"Translate into French: the cat number {i}."})
                               for i in range(3)) + "\n")
    output_dir = tmp_path / "out"
    exact = dict(engine="runtime", dtype="float32")
    manifest = run(config(None, output_dir, sources=[f"chat={prompts}:4", f"fr={other}:2"], **exact))
    data = rows(output_dir)
    firsts = [json.loads(c)[0]["content"] for c in data["conversation"]]
    assert [text.startswith("Translate") for text in firsts] == [False, True, False, False, True, False]
    assert manifest["sources"] == [f"chat={prompts}:4", f"fr={other}:2"] and manifest["conversations_read"] == 6
    assert manifest["skipped_row_details"][0]["reason"].startswith("chat: ")  # line 3 of the chat file
    run(config(prompts, tmp_path / "alone", max_prompts=4, **exact))
    whole = rows(tmp_path / "alone")
    chat_rows = [i for i, text in enumerate(firsts) if not text.startswith("Translate")]
    assert [data["input_ids"][i] for i in chat_rows] == whole["input_ids"][:4]
    with pytest.raises(ValueError, match="other settings"):  # another mix is another run
        run(config(None, output_dir, sources=[f"chat={prompts}:4", f"fr={other}:3"], **exact))
    with pytest.raises(FileNotFoundError, match=r"--sources nope=/no/such\.jsonl: no such file"):
        run(config(None, tmp_path / "x", sources=["nope=/no/such.jsonl"]))
    with pytest.raises(ValueError, match="--sources d=.*a distilled dataset"):
        run(config(None, tmp_path / "y", sources=[f"d={reference[0]}"]))


def test_the_run_names_the_first_bad_rows_and_where_the_rest_are():
    rows = [SkippedRow(line, "not JSON: Expecting value") for line in (2, 5, 9)]
    assert bad_rows_line("--prompts p.jsonl", rows, shown=2) == (
        "skipped bad rows of --prompts p.jsonl: line 2: not JSON: Expecting value; line 5: not JSON: Expecting value "
        "(and 1 more); all in manifest.json skipped_row_details")
