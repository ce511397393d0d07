"""bench.kinds: per-kind bench.drafters runs aggregated into one table (real bench.drafters JSON shapes)."""

import copy
import json
import shutil
from pathlib import Path

import pytest

from bench import drafters, kinds
from bench.common import read_prompts

FIXTURE = Path(__file__).parent / "fixtures" / "bench_heads_stories260k"  # bench_heads on stories260K, 1 prompt
STORIES = Path("../shared/models/stories260K")


def fake_kind(folder: Path, slowdown: float = 1.0, baseline_tps: float | None = None) -> Path:
    """A kind's bench_heads results from the fixture, the methods' seconds scaled by `slowdown`."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURE / "summary.json", folder / "summary.json")
    for name in ("lookup3", "lookup_cost"):
        result = json.loads((FIXTURE / f"{name}.json").read_text())
        for record in result["prompts"]:
            record["method"]["seconds"] *= slowdown
            record["method"]["tokens_per_second"] /= slowdown
            record["speedup"] /= slowdown
        if baseline_tps is not None:
            result["overall"]["baseline"] = {"layout": "rows", "tokens_per_second": 700.0,
                                             "forced": {"rows+panels": {"tokens_per_second": baseline_tps}}}
        (folder / f"{name}.json").write_text(json.dumps(result))
    return folder


def test_aggregate_two_kinds(tmp_path):
    a, b = fake_kind(tmp_path / "summarise"), fake_kind(tmp_path / "chat", slowdown=2.0, baseline_tps=1000.0)
    summary = kinds.aggregate({"summarise": a, "chat": b})
    record = json.loads((FIXTURE / "lookup3.json").read_text())["prompts"][0]
    plain_tps = record["plain"]["tokens_per_second"]
    rows = {(r["kind"], r["method"]): r for r in summary["rows"] + summary["overall"]}
    assert summary["kinds"] == ["summarise", "chat"] and summary["methods"] == ["lookup3", "lookup_cost"]
    assert summary["model"] == "../shared/models/stories260K" and summary["max_new_tokens"] == 8
    first = rows["summarise", "lookup3"]
    assert first["speedup"] == pytest.approx(record["speedup"])
    assert first["tau"] == pytest.approx(record["tau"])
    assert first["identical_to_plain"] == 1 and first["identical_to_plain_share"] == 1.0
    assert first["speedup_vs_fastest_plain"] is None  # bench_heads records no plain layouts
    assert first["prompt_tokens_median"] == record["prompt_tokens"]
    assert first["speedup_min"] == pytest.approx(record["speedup"])  # the worst prompt (one here)
    slow = rows["chat", "lookup3"]
    assert slow["speedup"] == pytest.approx(record["speedup"] / 2)
    assert slow["speedup_vs_fastest_plain"] == pytest.approx(record["method"]["tokens_per_second"] / 2 / 1000.0)
    overall = rows["all", "lookup3"]
    seconds = record["method"]["seconds"] * 3  # once at 1x, once at 2x
    assert overall["prompts"] == 2 and overall["new_tokens"] == 16
    assert overall["speedup"] == pytest.approx(16 / seconds / plain_tps)
    assert overall["tau"] == pytest.approx(record["tau"])
    assert overall["speedup_vs_fastest_plain"] is None  # summarise has no baseline
    table = kinds.markdown_table(summary)
    assert "| summarise | lookup3 | 1 | 89 | 1.17 |" in table
    assert "| all | lookup_cost | 2 |" in table
    assert "| kind | lookup3 | lookup_cost |" in table and "\n| chat | " in table


def test_unknown_config_key_names_key_and_file(tmp_path):
    path = tmp_path / "kinds.yaml"
    path.write_text("model: m\nkinds_file: k.jsonl\nmax_prompt: 4\nmethods: [{name: a, method: prompt_lookup}]\n")
    with pytest.raises(ValueError, match=r"--config .*kinds.yaml: unknown key\(s\) \['max_prompt'\]"):
        kinds.main(["--config", str(path)], run_kind=lambda p: pytest.fail("ran"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        kinds.main(["--config", str(tmp_path / "missing.yaml")])
    # bench.drafters' per_category samples MT-Bench categories; kind files have none, so a kinds config refuses it
    path.write_text("model: m\nkinds_file: k.jsonl\nper_category: 1\nmethods: [{name: a, method: prompt_lookup}]\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['per_category'\]"):
        kinds.main(["--config", str(path)], run_kind=lambda p: pytest.fail("ran"))


def test_committed_config_parses():
    config = kinds.read_config("configs/bench_kinds_smollm2.yaml")
    specs = drafters.parse_methods(config["methods"], "configs/bench_kinds_smollm2.yaml")
    assert [s.method for s in specs] == ["prompt_lookup", "heads", "hybrid"]
    assert config["max_new_tokens"] == 128 and config["max_prompts"] == 4 and config["exact"] is True
    assert set(config["kinds"]) == set(kinds.KINDS)


def write_kinds_file(path: Path) -> None:
    rows = [{"kind": kind, "prompt": f"{kind} prompt {i}: once upon a time", "source": "x", "index": i}
            for kind in ("math", "chat") for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_main_runs_each_kind_and_writes_the_summary(tmp_path, capsys):
    write_kinds_file(tmp_path / "k.jsonl")
    config = tmp_path / "kinds.yaml"
    config.write_text(f"model: {STORIES}\nkinds_file: {tmp_path / 'k.jsonl'}\nkinds: math,chat\nmax_prompts: 2\n"
                      f"max_new_tokens: 8\noutput_dir: {tmp_path / 'out'}\nmethods:\n"
                      "  - {name: lookup3, method: prompt_lookup, num_speculative_tokens: 3}\n"
                      "  - {name: lookup_cost, method: prompt_lookup, num_speculative_tokens: cost}\n"
                      "  - {name: hybrid, method: hybrid, heads: outputs/heads/none}\n")
    ran = []

    def run_kind(path: Path) -> None:
        run_config, specs = drafters.read_config(path)  # a config bench.drafters itself accepts
        assert [s.name for s in specs] == ["lookup3", "lookup_cost"]  # --methods picked two
        assert run_config["max_prompts"] == 2 and run_config["max_new_tokens"] == 8 and run_config["repeats"] == 3
        assert read_prompts(run_config["prompts"], 10) == [f"{path.parent.name} prompt {i}: once upon a time"
                                                           for i in range(2)]
        ran.append(path.parent.name)
        fake_kind(Path(run_config["output_dir"]))

    summary = kinds.main(["--config", str(config), "--methods", "lookup3,lookup_cost", "--repeats", "3"],
                         run_kind=run_kind)
    assert ran == ["math", "chat"]
    assert json.loads((tmp_path / "out" / "kinds_summary.json").read_text()) == json.loads(json.dumps(summary))
    assert [(r["kind"], r["method"]) for r in summary["overall"]] == [("all", "lookup3"), ("all", "lookup_cost")]
    assert "| math | lookup3 | 1 | 89 |" in capsys.readouterr().out
    again = kinds.main(["--config", str(config), "--aggregate_only", "--methods", "lookup3"],
                       run_kind=lambda p: pytest.fail("ran"))
    assert again["rows"] == [r for r in summary["rows"] if r["method"] == "lookup3"]
    with pytest.raises(ValueError, match="--repeats: expected >= 1, got 0"):
        kinds.main(["--config", str(config), "--repeats", "0"], run_kind=run_kind)
    with pytest.raises(ValueError, match=r"--methods: \['nope'\] not in"):
        kinds.main(["--config", str(config), "--methods", "nope"], run_kind=run_kind)
    with pytest.raises(ValueError, match="kind 'qa' has no prompt in kinds_file"):
        kinds.main(["--config", str(config), "--kinds", "qa", "--methods", "lookup3"], run_kind=run_kind)


def test_missing_results_are_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"chat: no .*summary.json"):
        kinds.aggregate({"chat": tmp_path / "chat"})


def test_all_row_fastest_plain_over_kinds():
    records = json.loads((FIXTURE / "lookup3.json").read_text())["prompts"]
    row = kinds.method_row("x", "m", copy.deepcopy(records) * 2, 1000.0)
    assert row["speedup_vs_fastest_plain"] == pytest.approx(records[0]["method"]["tokens_per_second"] / 1000.0)


@pytest.mark.skipif(not STORIES.is_dir(), reason="needs ../shared/models/stories260K")
def test_end_to_end_on_stories260k(tmp_path, capsys):
    """The real bench.drafters, two kinds x 1 prompt x 4 new tokens on stories260K (a few seconds)."""
    write_kinds_file(tmp_path / "k.jsonl")
    config = tmp_path / "kinds.yaml"
    config.write_text(f"model: {STORIES}\nkinds_file: {tmp_path / 'k.jsonl'}\nmax_prompts: 1\nmax_new_tokens: 4\n"
                      f"warmup_tokens: 2\nexact: true\noutput_dir: {tmp_path / 'out'}\n"
                      "methods: [{name: lookup3, method: prompt_lookup, num_speculative_tokens: 3}]\n")
    summary = kinds.main(["--config", str(config)])
    assert summary["kinds"] == ["math", "chat"]  # the file's kinds, in KINDS order
    assert [r["kind"] for r in summary["rows"]] == ["math", "chat"]
    for row in summary["rows"] + summary["overall"]:
        assert row["identical_to_plain"] == row["prompts"] and row["speedup"] > 0 and row["new_tokens"] > 0
    assert "| all | lookup3 | 2 |" in capsys.readouterr().out
