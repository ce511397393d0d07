"""`python -m bench.speed` end to end on stories260K (2 prompts x 20 new tokens)."""

from __future__ import annotations

import json

import pytest
import torch

import bench.speed as bench
from bench.common import run_ours
from bench.speed import main, parse_arguments, perfect_speedup
from heads.loading import load_model
from runtime.config import DecodeConfig, SpeculationConfig
from runtime.cost_model import predicted_speedup
from runtime.loop import GenerationStats, StepStats
from runtime.proposers import Autoregressive
from runtime.proposers.oracle import OracleProposer
from runtime.target import TargetModel
from tests.tiny_models import DATA, SMOLLM2, STORIES260K

PROMPTS = str(DATA / "tinystories_sample.jsonl")


def _bench(tmp_path, *flags: str, dtype: str = "float32") -> tuple[dict, dict]:
    """float32 unless asked: identity with transformers' generate is a float32 property (in bfloat16 our kernels
    and its BLAS round differently; there the reference is our own plain loop)."""
    out = tmp_path / "bench.json"
    result = main(["--model", str(STORIES260K), "--prompts", PROMPTS, "--max_prompts", "2", "--dtype", dtype,
                   "--max_new_tokens", "20", "--warmup_tokens", "4", "--output_json", str(out), *flags])
    return result, json.loads(out.read_text())


def test_prompt_lookup_bench_writes_json_and_is_greedy_identical(tmp_path, capsys):
    result, written = _bench(tmp_path, "--method", "prompt_lookup", "--compare_hf")
    assert written == json.loads(json.dumps(result))
    overall = written["overall"]
    assert overall["prompts"] == 2 and len(written["prompts"]) == 2
    assert overall["greedy_identical"] is True and overall["plain_identical"] is True
    assert overall["hf_assisted"]["greedy_identical"] is True
    for record in written["prompts"]:
        assert record["greedy_identical"] is True
        assert record["method"]["new_tokens"] == record["hf"]["new_tokens"] <= 20
        assert record["tau"] >= 1.0 and record["speedup"] > 0
        assert 0.0 <= record["draft_share"] + record["verify_share"] + record["prefill_share"] <= 1.0 + 1e-6
        assert all(0.0 <= a <= 1.0 for a in record["acceptance_per_depth"])
    for runner in ("plain", "hf", "method", "hf_assisted"):
        assert overall[runner]["new_tokens"] == sum(r[runner]["new_tokens"] for r in written["prompts"])
        assert overall[runner]["tokens_per_second"] > 0
    assert overall["speedup_total"] == pytest.approx(
        overall["method"]["tokens_per_second"] / overall["plain"]["tokens_per_second"])
    assert written["config"]["method"] == "prompt_lookup" and "prompt" not in written["config"]
    assert "median" in capsys.readouterr().out


def test_bf16_bench_is_identical_to_plain_bf16(tmp_path):
    """In bfloat16 the bench reports identity with our plain bf16 loop (batch-invariant kernels: runtime.kernels)."""
    _, written = _bench(tmp_path, "--method", "draft_model", "--draft_model", str(STORIES260K),
                        "--num_speculative_tokens", "3", dtype="bfloat16")
    overall = written["overall"]
    assert overall["dtype"] == "bfloat16" and overall["identical_to_plain"] is True
    assert overall["identical_to_plain_count"] == 2 and overall["tau"] > 2


def test_draft_model_bench_with_the_target_as_its_own_draft(tmp_path):
    """Self-drafting accepts every greedy draft token: tau = k + 1 except where max_new_tokens cuts the draft."""
    _, written = _bench(tmp_path, "--method", "draft_model", "--draft_model", str(STORIES260K),
                        "--num_speculative_tokens", "3", "--compare_hf", "--repeats", "2")
    overall = written["overall"]
    assert overall["greedy_identical"] is True and overall["hf_assisted"]["greedy_identical"] is True
    assert overall["acceptance_per_depth"] == [1.0, 1.0, 1.0]
    assert overall["tau"] > 3.0


def test_draft_model_with_another_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--draft_model"):
        _bench(tmp_path, "--method", "draft_model", "--draft_model", str(SMOLLM2))


def test_config_yaml_gives_defaults_and_rejects_unknown_keys(tmp_path):
    config = tmp_path / "bench.yaml"
    config.write_text("method: autoregressive\nmax_prompts: 3\nmax_new_tokens: 7\n")
    gen_args, bench_args = parse_arguments(["--config", str(config), "--max_prompts", "5"])
    assert (gen_args.method, gen_args.max_new_tokens, bench_args.max_prompts) == ("autoregressive", 7, 5)
    config.write_text("method: autoregressive\nmax_promts: 3\n")
    with pytest.raises(ValueError, match="unknown key.*max_promts"):
        parse_arguments(["--config", str(config)])
    with pytest.raises(FileNotFoundError, match="--config"):
        parse_arguments(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ValueError, match="--prompts FILE"):
        parse_arguments(["--prompt", "hello"])
    with pytest.raises(ValueError, match="--repeats"):
        parse_arguments(["--repeats", "0"])
    with pytest.raises(ValueError, match="--max_new_tokens"):
        parse_arguments(["--max_new_tokens", "0"])
    with pytest.raises(ValueError, match="--method"):
        parse_arguments(["--method", "medusa"])


def _two_turn_prompts(tmp_path) -> str:
    path = tmp_path / "mt_bench_like.jsonl"
    rows = [{"question_id": 81, "category": "writing", "turns": ["Once upon a time", "Then the cat"]},
            {"question_id": 82, "category": "math", "turns": ["Lily had a dog", "The end"]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_oracle_drafter_accepts_every_token_and_reproduces_plain_decoding():
    """Drafting plain greedy decoding's own continuation: every step accepts the whole chain (tau = k + 1) except
    the last, which max_new_tokens cuts."""
    target = TargetModel(load_model(str(STORIES260K), dtype="float32"))
    prompt = torch.tensor([1, 403, 407, 261, 378], dtype=torch.long)
    plain = run_ours(target, Autoregressive(), prompt, DecodeConfig(max_new_tokens=24, eos_token_ids=()))
    chain = DecodeConfig(max_new_tokens=24, eos_token_ids=(),
                         speculation=SpeculationConfig(num_speculative_tokens=4, max_speculative_tokens=4))
    oracle = run_ours(target, OracleProposer(plain.tokens), prompt, chain)
    assert oracle.tokens == plain.tokens
    lengths = [step.accepted_length for step in oracle.stats.steps]
    assert lengths[:-1] == [5] * (len(lengths) - 1) and 1 <= lengths[-1] <= 5
    assert all(step.accepted_length == step.drafted_depth + 1 for step in oracle.stats.steps)
    assert all(step.overhead_time >= 0 and step.verify_time > 0 for step in oracle.stats.steps)


def test_bench_efficiency_oracle_turns_answers_and_plot(tmp_path, capsys):
    plot, answers = tmp_path / "plots" / "bench.png", tmp_path / "answers.jsonl"
    out = tmp_path / "bench.json"
    main(["--model", str(STORIES260K), "--prompts", _two_turn_prompts(tmp_path), "--max_prompts", "2",
          "--max_new_tokens", "12", "--warmup_tokens", "4", "--output_json", str(out), "--method", "prompt_lookup",
          "--dtype", "float32", "--turns", "2", "--oracle_sizes", "1,2", "--plot", str(plot), "--answers_jsonl", str(answers)])
    written = json.loads(out.read_text())
    overall = written["overall"]
    for key in ("draft_share", "overhead_share", "predicted_speedup", "realised_over_predicted"):
        assert isinstance(overall[key], float), key
    assert overall["dtype"] == "float32" and 0 <= overall["overhead_share"] < 1
    assert overall["realised_over_predicted"] == pytest.approx(overall["speedup_total"] / overall["predicted_speedup"])
    assert [(r["question_id"], r["turn"]) for r in written["prompts"]] == [(81, 1), (81, 2), (82, 1), (82, 2)]
    assert written["prompts"][1]["prompt_tokens"] > written["prompts"][0]["prompt_tokens"] + 10  # answer in context
    rows = written["oracle"]["rows"]
    assert [r["size"] for r in rows] == [1, 2] and all(r["identical_to_plain"] for r in rows)
    assert rows[1]["tau"] > rows[0]["tau"] > 1.5 and written["oracle"]["dtype"] == "float32"
    assert all(r["perfect_speedup"] > 0 for r in rows)  # (size + 1) x plain step / verify step, from the run
    assert written["verify_cost"]["tokens"][0] == 1 and written["verify_cost"]["relative"][0] == 1.0
    for path, runner in ((answers, "method"), (tmp_path / "answers-plain.jsonl", "plain")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert [line["question_id"] for line in lines] == [81, 82]
        for line, records in zip(lines, (written["prompts"][:2], written["prompts"][2:]), strict=True):
            assert {"question_id", "category", "answer_id", "model_id", "choices"} <= set(line)
            choice = line["choices"][0]
            assert choice["index"] == 0 and len(choice["turns"]) == 2 and all(isinstance(t, str) for t in choice["turns"])
            assert choice["new_tokens"] == [r[runner]["new_tokens"] for r in records]
            assert choice["wall_time"] == [r[runner]["seconds"] for r in records]
            assert sum(choice["accept_lengths"]) == sum(choice["new_tokens"]) - 2  # the prefill token is no step
    assert plot.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "oracle ceiling" in printed and "realised/predicted" in printed


def test_unwritable_outputs_fail_before_generation(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_bench", lambda *a: pytest.fail("generation started"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--plot .*cannot write"):
        bench.main(["--model", str(STORIES260K), "--plot", str(blocker / "out.png")])
    with pytest.raises(ValueError, match="--answers_jsonl .*cannot write"):
        bench.main(["--model", str(STORIES260K), "--answers_jsonl", str(blocker / "a.jsonl")])
    with pytest.raises(ValueError, match="--plot .*ending in"):
        bench.main(["--model", str(STORIES260K), "--plot", str(tmp_path / "out.txt")])
    with pytest.raises(ValueError, match="--oracle_sizes"):
        bench.main(["--oracle_sizes", "2,x"])
    with pytest.raises(ValueError, match="--turns"):
        bench.main(["--turns", "3"])


def test_predicted_speedup_is_tau_times_plain_step_over_step_time():
    assert predicted_speedup(3.0, verify_seconds=0.02, draft_seconds=0.01, plain_seconds=0.015) == pytest.approx(1.5)
    assert predicted_speedup(1.0, 0.0, 0.0, 0.01) is None
    # Whole calls: a 0.1 s prefill (same for both) and 11 new tokens = the prefill's token + 10 decoded ones:
    # plain 0.1 + 10 x 0.015 = 0.25 s; speculative 0.1 + 10 / 3 x 0.03 = 0.2 s.
    assert predicted_speedup(3.0, 0.02, 0.01, 0.015, prefill_seconds=0.1, plain_prefill_seconds=0.1,
                             new_tokens=11) == pytest.approx(1.25)
    # A prefill pulls the prediction towards 1 from either side.
    assert predicted_speedup(1.0, 0.02, 0.01, 0.015) == pytest.approx(0.5)
    assert predicted_speedup(1.0, 0.02, 0.01, 0.015, 0.1, 0.1, 11) == pytest.approx(0.25 / 0.4)


def test_batch_bench_modes_identity_and_summary(tmp_path, monkeypatch):
    """--batch_sizes: every (batch size, mode) row measured, our rows greedy-identical to each prompt alone,
    the oracle's planner drafts at batch 1, the summary and the plot written."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    out, plot = tmp_path / "batch.json", tmp_path / "batch.png"
    result = main(["--model", str(STORIES260K), "--prompts", PROMPTS, "--max_prompts", "3", "--max_new_tokens", "12",
                   "--batch_sizes", "1,2", "--batch_drafter", "oracle", "--batch_on_size", "3",
                   "--output_json", str(out), "--plot", str(plot)])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result)) and plot.stat().st_size > 0
    rows = {(r["batch_size"], r["mode"]): r for r in written["batches"]}
    assert set(rows) == {(b, m) for b in (1, 2) for m in ("off", "on", "auto", "hf")}
    assert all(r["greedy_identical"] for r in written["batches"] if r["mode"] != "hf")
    assert all(r["tokens_per_second"] > 0 and r["latency_median"] > 0 for r in written["batches"])
    assert rows[(1, "on")]["size"] == 3 and [p["batch_size"] for p in written["planner"]] == [1, 2]
    assert set(written["summary"]) >= {"crossover_batch_size", "auto_over_best_of_on_off", "auto_within_5_percent"}


@pytest.mark.parametrize("value", ["0", "2,-1", "two"])
def test_batch_sizes_flag_is_checked(value):
    with pytest.raises(ValueError, match="--batch_sizes"):
        parse_arguments(["--model", str(STORIES260K), "--batch_sizes", value])


def test_perfect_speedup_is_the_size_over_the_measured_verify_cost():
    def stats(verify_by_tokens):
        return [GenerationStats(steps=[StepStats(accepted_length=1, drafted_depth=n - 1, drafted_nodes=n - 1,
                                                 draft_time=0.0, verify_time=t) for n, t in verify_by_tokens])]

    plain = stats([(1, 0.10), (1, 0.12), (1, 0.10)])
    oracle = stats([(3, 0.15), (3, 0.15), (2, 0.12)])  # a short last step of 2 tokens does not count
    assert perfect_speedup(2, oracle, plain) == pytest.approx(3 * 0.10 / 0.15)
    assert perfect_speedup(4, oracle, plain) is None  # no step verified 5 tokens


def test_bench_runs_plain_decoding_on_forced_layouts_as_the_baseline_check(tmp_path):
    out = tmp_path / "bench.json"
    main(["--model", str(STORIES260K), "--prompts", _two_turn_prompts(tmp_path), "--max_prompts", "1",
          "--max_new_tokens", "8", "--warmup_tokens", "2", "--output_json", str(out), "--method", "prompt_lookup",
          "--dtype", "float32", "--plain_layouts", "rows,transposed"])
    result = json.loads(out.read_text())
    baseline = result["overall"]["baseline"]
    assert baseline["layout"] == result["environment"]["weight_layout"] == "rows"  # stories260K: under 10M params
    assert set(baseline["forced"]) == {"rows", "transposed"} and baseline["fastest_forced"] in baseline["forced"]
    assert all(v["identical_to_plain"] and v["tokens_per_second"] > 0 for v in baseline["forced"].values())
    # the layout in use is not run twice: its forced entry is the plain runner's runs (one draw of the noise, not two)
    assert baseline["forced"]["rows"]["tokens_per_second"] == baseline["tokens_per_second"]
    assert baseline["over_fastest_forced"] == pytest.approx(
        baseline["tokens_per_second"] / baseline["forced"][baseline["fastest_forced"]]["tokens_per_second"])
    assert "bf16" in result["environment"]["cpu"]
    with pytest.raises(ValueError, match="--plain_layouts"):
        main(["--model", str(STORIES260K), "--plain_layouts", "auto", "--output_json", str(out)])


def test_per_category_takes_the_first_prompts_of_each_category(tmp_path):
    """MT-Bench's first rows are all 'writing': --per_category samples every category, in order of first appearance,
    capped by --max_prompts; a file without categories is refused naming the flag."""
    from bench.common import read_questions

    rows = [{"question_id": i, "category": cat, "turns": [f"q{i}"]}
            for i, cat in enumerate(["a", "a", "a", "b", "c", "b", "c", "a"])]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [q.question_id for q in read_questions(str(path), 10, 1)] == [0, 3, 4]
    assert [q.question_id for q in read_questions(str(path), 10, 2)] == [0, 1, 3, 5, 4, 6]
    assert [q.question_id for q in read_questions(str(path), 4, 2)] == [0, 1, 3, 5]
    assert [q.question_id for q in read_questions(str(path), 2, 0)] == [0, 1]
    with pytest.raises(ValueError, match="--per_category"):
        read_questions(PROMPTS, 2, 1)
    _, written = _bench(tmp_path, "--method", "prompt_lookup", "--prompts", str(path), "--per_category", "1")
    assert [r["question_id"] for r in written["prompts"]] == [0, 3]  # _bench's --max_prompts 2 caps it
