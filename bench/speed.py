"""Benchmark a speculative method against plain decoding on the same prompts, in the same process.

    python -m bench.speed --model ../shared/models/smollm2-135m-instruct --method prompt_lookup \
        --prompts ../shared/data/mt_bench_question.jsonl --max_prompts 10 --max_new_tokens 128 \
        --compare_hf --output_json outputs/bench/smollm2_prompt_lookup.json

For every prompt (the first user turn of each conversation, through the chat template when the tokenizer has
one), interleaved and after one warm-up pass of every runner:
  1. plain: our decode loop with no drafter (`Autoregressive`), the reference for speed-up;
  2. hf: transformers' `model.generate` with the same sampling settings, the reference for greedy identity;
  3. method: our decode loop with the chosen proposer;
  4. hf_assisted (`--compare_hf`): transformers' own assisted generation on the same prompt
     (`assistant_model=` for draft_model, `prompt_lookup_num_tokens=` for prompt_lookup).
The JSON (written atomically) holds per-prompt and overall tau (mean accepted length per step, bonus
included), tokens/s of every runner, speed-ups (median over prompts and total tokens / total time),
acceptance per draft depth, draft / verify / prefill time shares, `identical_to_plain` (the method's tokens equal
our plain loop's, in any dtype: the promise) and `greedy_identical` (they equal `model.generate(do_sample=False)`,
a float32 property: in bfloat16 transformers' kernels round differently from ours); null when sampling. Timings are wall clock on a
possibly shared machine: compare ratios measured in the same run, not absolute numbers across runs
(`--repeats R` runs every runner R times per prompt, interleaved, and keeps the fastest run of each).
`--config bench.yaml` gives defaults (keys = flag names), flags override it.

Efficiency (JSON `overall`, printed): every step of our loop is split into draft time (the proposer), verify time
(the target forward, tree mask included) and overhead (everything else: checks, acceptance, KV compaction,
bookkeeping); `draft_share` / `verify_share` / `overhead_share` / `prefill_share` are shares of the calls' wall
time. `predicted_speedup` is the cost model's speed-up of whole calls from the measured numbers: (prefill + (n - 1)
plain steps) / (prefill + (n - 1) / tau x (verify + draft per step)), n new tokens per call;
`realised_over_predicted` the measured speed-up over it (what loop overhead and noise cost). `--oracle_sizes 1,2,4,8,16` adds the ceiling
table: a drafter that drafts plain decoding's own continuation (every token accepted) per chain length.
`verify_cost` is the verify cost curve measured from the run's own steps. `--plot out.png` draws speed-ups,
acceptance per depth and that curve; `--answers_jsonl` writes Spec-Bench answer files (method and
`-plain` baseline) for its evaluation/speed.py; `--turns 2` also runs second turns (MT-Bench), with plain
decoding's first answer in context.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.batch import parse_batch_sizes, plot_batches, print_batch_table, run_batch_bench
from bench.common import (
    Question,
    Run,
    fastest_of,
    hf_generation_config,
    read_questions,
    run_hf,
    run_ours,
    warm_up,
)
from bench.common import environment as environment_record
from bench.report import (
    PLOT_SUFFIXES,
    check_writable,
    efficiency,
    fmt,
    overall_record,
    prompt_record,
    pyplot,
    ratio,
    ratio_or_none,
    save_figure,
    verify_cost_from_steps,
    write_json,
    write_jsonl,
)
from heads.cli import parse_flag_groups, run_cli
from heads.loading import dtype_name
from runtime.api import SpeculativeModel
from runtime.build import encode_prompt
from runtime.config import DecodeConfig, GenerateArguments, SpeculationConfig
from runtime.layout import check_layout, layout_of, set_layout
from runtime.loop import GenerationStats
from runtime.proposers import Autoregressive, Proposer
from runtime.proposers.oracle import OracleProposer
from runtime.target import SUPPORTED_ATTENTION


@dataclass
class BenchArguments:
    """Flags of `python -m bench.speed` besides the model / method / sampling flags of runtime.generate."""

    prompts: str = field(default="../shared/data/mt_bench_question.jsonl", metadata={
        "help": "prompt file or dataset: JSONL/JSON with prompt, turns (MT-Bench), instruction (Alpaca), "
                "ShareGPT conversations or OpenAI messages; the first user turn of each is used"})
    max_prompts: int = field(default=10, metadata={"help": "use at most this many prompts"})
    per_category: int = field(default=0, metadata={
        "help": "N > 0: the first N prompts of each category (MT-Bench's 'category' field; --max_prompts caps the "
                "total) instead of the file's first --max_prompts: MT-Bench's first 10 are all 'writing'"})
    output_json: str = field(default="outputs/bench/bench.json", metadata={"help": "results file (JSON)"})
    compare_hf: bool = field(default=False, metadata={
        "help": "also run transformers' own assisted generation (assistant_model= / prompt_lookup_num_tokens=)"})
    warmup_tokens: int = field(default=16, metadata={"help": "new tokens of the untimed warm-up run of each runner"})
    repeats: int = field(default=1, metadata={
        "help": "run every runner this many times per prompt (interleaved) and keep the fastest run of each: "
                "robust to a noisy shared machine"})
    turns: int = field(default=1, metadata={
        "help": "user turns per conversation: 2 runs MT-Bench second turns too, with the first answer (plain greedy "
                "decoding's) in context"})
    oracle_sizes: str = field(default="", metadata={
        "help": "comma-separated chain lengths (e.g. 1,2,4,8,16) for the oracle ceiling: a drafter that drafts plain "
                "decoding's own continuation, so every draft is accepted; empty = off"})
    plot: str = field(default="", metadata={
        "help": "PNG with speed-up per method (and oracle size), acceptance per depth and the verify cost curve"})
    answers_jsonl: str = field(default="", metadata={
        "help": "answers in the Spec-Bench format (question_id, model_id, choices: turns, new_tokens, wall_time, "
                "accept_lengths); plain decoding's answers go to the same name with '-plain' before the suffix"})
    batch_sizes: str = field(default="", metadata={
        "help": "comma-separated batch sizes (e.g. 1,2,4,8,16): the batch bench instead (bench/batch.py): "
                "throughput and latency with speculation auto / on / off and transformers' batched generate"})
    batch_drafter: str = field(default="method", metadata={
        "help": "batch bench drafter: 'method' (the --method/--heads drafter) or 'oracle' (plain decoding's own "
                "continuation: a perfect zero-cost drafter)"})
    batch_on_size: int = field(default=4, metadata={
        "help": "batch bench: draft size of mode 'on' (heads: their --tree_size; oracle: its chain length)"})
    plain_layouts: str = field(default="", metadata={
        "help": "comma-separated forced weight layouts (e.g. rows,rows+packed,rows+panels,transposed+panels) on which "
                "plain decoding also runs, per prompt, interleaved: overall.baseline then says whether the plain loop "
                "on the layout in use is within 10%% of the fastest of them (a speed-up counts only against the "
                "fastest plain decoding); the layout in use, if listed, is the plain runner's runs; empty = off"})
    config: str | None = field(default=None, metadata={
        "help": "YAML file of defaults (keys = flag names of this command); flags given on the command line win"})

    def forced_plain_layouts(self) -> list[str]:
        """--plain_layouts 'rows,rows+panels' -> ['rows', 'rows+panels'] (each a forced layout, checked)."""
        layouts = [v.strip() for v in self.plain_layouts.split(",") if v.strip()]
        for layout in layouts:
            if layout == "auto":
                raise ValueError("--plain_layouts: forced layouts only (auto is the run's own --weight_layout)")
            check_layout(layout, "--plain_layouts")
        return layouts

    def oracle_chain_lengths(self) -> list[int]:
        """--oracle_sizes '1,2,4' -> [1, 2, 4]."""
        try:
            sizes = [int(v) for v in self.oracle_sizes.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--oracle_sizes: expected comma-separated ints, got {self.oracle_sizes!r}") from None
        if any(k < 1 for k in sizes):
            raise ValueError(f"--oracle_sizes: chain lengths must be >= 1, got {sizes}")
        return sorted(set(sizes))


# ---------------------------------------------------------------- arguments


def parse_arguments(argv: list[str] | None = None) -> tuple[GenerateArguments, BenchArguments]:
    """Flags (over `--config` YAML defaults) -> (generate arguments, bench arguments). Unknown YAML keys raise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    gen_args, bench_args = parse_flag_groups((GenerateArguments, BenchArguments), argv)
    if "--prompt" in argv or any(a.startswith("--prompt=") for a in argv):
        raise ValueError("--prompt is a flag of runtime.generate; bench.speed reads --prompts FILE")
    if bench_args.max_prompts < 1:
        raise ValueError(f"--max_prompts must be >= 1, got {bench_args.max_prompts}")
    if bench_args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {bench_args.repeats}")
    if bench_args.warmup_tokens < 0:
        raise ValueError(f"--warmup_tokens must be >= 0, got {bench_args.warmup_tokens}")
    if bench_args.batch_sizes:
        parse_batch_sizes(bench_args.batch_sizes)
        if bench_args.batch_on_size < 1:
            raise ValueError(f"--batch_on_size must be >= 1, got {bench_args.batch_on_size}")
    if bench_args.turns not in (1, 2):
        raise ValueError(f"--turns must be 1 or 2, got {bench_args.turns}")
    if bench_args.oracle_chain_lengths() and not gen_args.decode_config().sampling.is_greedy:
        raise ValueError("--oracle_sizes: the oracle ceiling needs greedy decoding (--temperature 0)")
    if bench_args.plot and Path(bench_args.plot).suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"--plot {bench_args.plot}: expected a file name ending in one of {PLOT_SUFFIXES}")
    for flag, path in (("--output_json", bench_args.output_json), ("--plot", bench_args.plot),
                       ("--answers_jsonl", bench_args.answers_jsonl)):
        if path:  # fail now, not after an hour of generation
            check_writable(path, flag)
    if gen_args.attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"--attn_implementation {gen_args.attn_implementation}: an attention backend that "
                         f"ignores custom masks cannot verify candidate trees; use one of {SUPPORTED_ATTENTION}")
    gen_args.resolved_method()
    gen_args.decode_config()  # validates --max_new_tokens, sampling and speculation flags before any loading
    return gen_args, bench_args


# ---------------------------------------------------------------- runners


def hf_assisted_settings(gen_args: GenerateArguments, proposer: Proposer) -> tuple[dict[str, Any], dict[str, Any]]:
    """transformers' own assisted generation equivalent to our method (same k): (generation config updates,
    extra `generate` arguments)."""
    speculation = gen_args.speculation()
    k = speculation.num_speculative_tokens
    method = gen_args.resolved_method()
    if method == "prompt_lookup":
        return {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": gen_args.max_ngram}, {}
    if method == "draft_model":
        assistant = proposer.draft.model  # transformers reads k and its schedule from the assistant's config
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = (
            "heuristic_transient" if speculation.adaptive else "constant")
        return {}, {"assistant_model": assistant}
    raise ValueError(f"--compare_hf: transformers has no assisted generation for --method {method}")


# ---------------------------------------------------------------- summaries


def baseline_record(layout: str, plain_runs: list[Run], forced: dict[str, list[Run]]) -> dict[str, Any]:
    """Plain decoding on the layout in use against plain decoding on each forced layout (same prompts, same run):
    tokens/s of each, the fastest forced one, the ratio in use / fastest and whether it is within 10%, and whether
    each forced layout gave the same tokens."""
    def tps(runs: list[Run]) -> float:
        return ratio(sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs)) or 0.0

    by_layout = {name: {"tokens_per_second": tps(runs),
                        "identical_to_plain": all(r.tokens == p.tokens for r, p in zip(runs, plain_runs, strict=True))}
                 for name, runs in forced.items()}
    best = max(by_layout, key=lambda name: by_layout[name]["tokens_per_second"])
    in_use = tps(plain_runs)
    over = ratio(in_use, by_layout[best]["tokens_per_second"])
    return {"layout": layout, "tokens_per_second": in_use, "forced": by_layout, "fastest_forced": best,
            "over_fastest_forced": over, "within_10_percent": over is not None and over >= 0.9}


def oracle_rows(oracle_runs: dict[int, list[Run]], plain_runs: list[Run]) -> list[dict[str, Any]]:
    """The ceiling table: per oracle chain length, tau, tokens/s, speed-up over plain decoding (total tokens /
    total time, same prompts), the cost model's prediction and the time shares."""
    plain_tps = ratio(sum(len(r.tokens) for r in plain_runs), sum(r.seconds for r in plain_runs)) or 0.0
    plain_stats = [r.stats for r in plain_runs]
    rows = []
    for size, runs in oracle_runs.items():
        stats = [r.stats for r in runs]
        tokens_per_second = ratio(sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs)) or 0.0
        steps = sum(len(s.steps) for s in stats)
        row = {"size": size, "tau": sum(st.accepted_length for s in stats for st in s.steps) / steps if steps else 1.0,
               "tokens_per_second": tokens_per_second, "speedup": ratio(tokens_per_second, plain_tps),
               **efficiency(stats, plain_stats),
               "identical_to_plain": all(r.tokens == p.tokens for r, p in zip(runs, plain_runs, strict=True))}
        row["realised_over_predicted"] = ratio_or_none(row["speedup"], row["predicted_speedup"])
        row["perfect_speedup"] = perfect_speedup(size, stats, plain_stats)
        rows.append(row)
    return rows


def perfect_speedup(size: int, stats: list[GenerationStats], plain_stats: list[GenerationStats]) -> float | None:
    """(size + 1) x a plain step / a step verifying size + 1 tokens (medians of the run's own steps): the ceiling
    when every draft is accepted. It stands where the oracle's tau cannot: outside float32 a near-tie flipped by the
    verify forward leaves plain decoding's continuation, and the oracle's later drafts stop matching."""
    verify, plain = verify_cost_from_steps(stats), verify_cost_from_steps(plain_stats)
    if size + 1 not in verify["tokens"] or 1 not in plain["tokens"]:
        return None
    step = plain["median_seconds"][plain["tokens"].index(1)]
    return (size + 1) * step / verify["median_seconds"][verify["tokens"].index(size + 1)]


def spec_bench_answers(transcripts: list[tuple[Question, list[dict[str, Run]]]], runner: str, model_id: str,
                       decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """One Spec-Bench answer row per question (the format of its evaluation/speed.py): choices[0] holds per
    turn the answer text, new tokens, wall time and decoding steps, and the accepted length of every step."""
    rows = []
    for question, turn_runs in transcripts:
        runs = [runs[runner] for runs in turn_runs]
        accept_lengths = [step.accepted_length for run in runs for step in run.stats.steps]
        choice = {"index": 0, "turns": [decode(run.tokens) for run in runs],
                  "new_tokens": [len(run.tokens) for run in runs], "wall_time": [run.seconds for run in runs],
                  "decoding_steps": [len(run.stats.steps) + 1 for run in runs],  # + the prefill's token
                  "accept_lengths": accept_lengths}
        rows.append({"question_id": question.question_id, "category": question.category or "overall",
                     "answer_id": uuid.uuid4().hex, "model_id": model_id, "choices": [choice],
                     "tstamp": time.time()})
    return rows


def plain_answers_path(path: str | Path) -> Path:
    """answers.jsonl -> answers-plain.jsonl (plain decoding's answers, Spec-Bench's baseline file)."""
    path = Path(path)
    return path.with_name(f"{path.stem}-plain{path.suffix}")


def print_table(result: dict[str, Any]) -> None:
    """Per-prompt rows and the overall row, readable in a terminal."""
    has_hf_assisted = "hf_assisted" in result["overall"]
    head = f"{'prompt':>6} {'p_tok':>5} {'new':>4} {'tau':>5} {'plain/s':>8} {'hf/s':>8} {'method/s':>9} " \
           f"{'speedup':>7} {'vs_hf':>6} {'=plain':>6} {'=gen':>5}"
    if has_hf_assisted:
        head += f" {'hf_asst/s':>9} {'hf_asst_x':>9}"
    print(head)

    def row(label: str, prompt_tokens: str, r: dict[str, Any], speedup: float | None, vs_hf: float | None,
            assisted_speedup: float | None) -> str:
        same = {True: "yes", False: "NO", None: "-"}
        ident = f"{same[r['identical_to_plain']]:>6} {same[r['greedy_identical']]:>5}"
        line = (f"{label:>6} {prompt_tokens:>5} {r['method']['new_tokens']:>4} {r['tau']:>5.2f} "
                f"{fmt(r['plain']['tokens_per_second'], '8.1f')} {fmt(r['hf']['tokens_per_second'], '8.1f')} "
                f"{fmt(r['method']['tokens_per_second'], '9.1f')} {fmt(speedup, '7.2f')} "
                f"{fmt(vs_hf, '6.2f')} {ident}")
        if has_hf_assisted:
            line += f" {fmt(r['hf_assisted']['tokens_per_second'], '9.1f')} {fmt(assisted_speedup, '9.2f')}"
        return line

    for r in result["prompts"]:
        print(row(str(r["index"]), str(r["prompt_tokens"]), r, r["speedup"], r["speedup_vs_hf"],
                  r["hf_assisted"]["speedup_vs_hf"] if has_hf_assisted else None))
    o = result["overall"]
    print(row("total", "", o, o["speedup_total"], o["speedup_vs_hf_total"],
              o["hf_assisted"]["speedup_vs_hf_total"] if has_hf_assisted else None))
    print(row("median", "", o, o["speedup_median"], o["speedup_vs_hf_median"],
              o["hf_assisted"]["speedup_vs_hf_median"] if has_hf_assisted else None))
    if "baseline" in o:
        b = o["baseline"]
        forced = ", ".join(f"{name} {v['tokens_per_second']:.1f}" for name, v in b["forced"].items())
        print(f"baseline: plain decoding on {b['layout']} {b['tokens_per_second']:.1f} tok/s; forced layouts: {forced} "
              f"tok/s; in use / fastest forced ({b['fastest_forced']}) {fmt(b['over_fastest_forced'], '.2f')}")
    rates = ", ".join(f"{a:.2f}" for a in o["acceptance_per_depth"])
    print(f"method {result['config']['method']} ({o['dtype']}): tau {o['tau']:.2f}, acceptance per depth [{rates}], "
          f"identical to our plain loop: {o['identical_to_plain']}, to transformers' generate (greedy_identical): "
          f"{o['greedy_identical']}")
    print(f"efficiency: speed-up {fmt(o['speedup_total'], '.2f')}, predicted {fmt(o['predicted_speedup'], '.2f')}"
          f" (cost model: whole calls from the measured prefill, tau and verify / draft / plain step times), realised/predicted "
          f"{fmt(o['realised_over_predicted'], '.2f')}; time shares draft {o['draft_share']:.3f} / verify "
          f"{o['verify_share']:.3f} / overhead {o['overhead_share']:.3f} / prefill {o['prefill_share']:.3f}")
    cost = result.get("verify_cost", {})
    if cost.get("relative"):
        curve = ", ".join(f"{q}: x{r:.2f}" for q, r in zip(cost["tokens"], cost["relative"], strict=True))
        print(f"verify cost per forwarded tokens (median step, relative to 1 token): {curve}")
    if "oracle" in result:
        print_oracle(result["oracle"])


def print_oracle(oracle: dict[str, Any]) -> None:
    """The ceiling table: what a drafter that is always right and costs nothing gives per chain length."""
    print(f"oracle ceiling ({Path(oracle['model']).name}, {oracle['dtype']}, {oracle['device']}, "
          f"{oracle['num_threads']} threads): every draft token accepted")
    print(f"{'chain':>5} {'tau':>6} {'tok/s':>7} {'speedup':>7} {'predicted':>9} {'real/pred':>9} {'perfect':>7} "
          f"{'draft':>6} {'overhead':>8}")
    for r in oracle["rows"]:
        print(f"{r['size']:>5} {r['tau']:>6.2f} {r['tokens_per_second']:>7.2f} {fmt(r['speedup'], '7.2f')} "
              f"{fmt(r['predicted_speedup'], '9.2f')} {fmt(r['realised_over_predicted'], '9.2f')} "
              f"{fmt(r.get('perfect_speedup'), '7.2f')} {r['draft_share']:>6.3f} {r['overhead_share']:>8.3f}")
    if not all(r["identical_to_plain"] for r in oracle["rows"]):
        print(f"  the output left plain decoding's (a near-tie flipped in {oracle['dtype']}), so the oracle's later "
              "drafts missed and tau < chain + 1; 'perfect' = (chain + 1) x plain step / verify step is the ceiling")


def plot_bench(result: dict[str, Any], path: str | Path) -> None:
    """PNG (Agg): speed-up of the method and of each oracle chain length (realised bars, predicted markers),
    the method's acceptance per depth, and the verify cost curve measured in the run."""
    plt = pyplot()
    o = result["overall"]
    labels = [result["config"]["method"]] + [f"oracle {r['size']}" for r in result.get("oracle", {}).get("rows", [])]
    realised = [o["speedup_total"]] + [r["speedup"] for r in result.get("oracle", {}).get("rows", [])]
    predicted = [o["predicted_speedup"]] + [r["predicted_speedup"] for r in result.get("oracle", {}).get("rows", [])]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    xs = range(len(labels))
    ax[0].bar(xs, [v or 0.0 for v in realised], label="realised")
    ax[0].plot(xs, [float("nan") if v is None else v for v in predicted], "o", color="black", label="predicted")
    ax[0].axhline(1.0, color="grey", linewidth=0.8)
    ax[0].set_xticks(list(xs), labels, rotation=30, ha="right")
    ax[0].set(ylabel="speed-up over plain decoding", title=f"{Path(result['config']['model']).name} ({o['dtype']})")
    ax[0].legend()
    depths = range(1, len(o["acceptance_per_depth"]) + 1)
    ax[1].plot(list(depths), o["acceptance_per_depth"], marker="o")
    ax[1].set_xticks(list(depths))
    ax[1].set(xlabel="draft depth", ylabel="acceptance rate", ylim=(0, 1.05),
              title=f"{result['config']['method']}: tau {o['tau']:.2f}")
    cost = result["verify_cost"]
    ax[2].plot(cost["tokens"], [m * 1000 for m in cost["median_seconds"]], marker="o")
    ax[2].set(xlabel="tokens per verify forward (root + drafted)", ylabel="median ms per forward",
              title="verify cost (steps of this run)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


# ---------------------------------------------------------------- main


def run_bench(gen_args: GenerateArguments, bench_args: BenchArguments) -> dict[str, Any]:
    """Load the model(s), run every runner on every prompt (interleaved), return the JSON-ready result."""
    method = gen_args.resolved_method()
    config = gen_args.decode_config()
    questions = read_questions(bench_args.prompts, bench_args.max_prompts, bench_args.per_category)
    spec = SpeculativeModel.from_args(gen_args)  # plain decoding and the method share this model (and dtype)
    tokenizer, target, proposer, model = spec.tokenizer, spec.target, spec.proposer, spec.target.model
    dtype = dtype_name(model.dtype)
    plain = Autoregressive()
    assisted = hf_assisted_settings(gen_args, proposer) if bench_args.compare_hf else None
    greedy = config.sampling.is_greedy
    oracle_sizes = bench_args.oracle_chain_lengths()
    plain_layouts = bench_args.forced_plain_layouts()
    layout_in_use = layout_of(model)
    forced_plain: dict[str, list[Run]] = {layout: [] for layout in plain_layouts}

    def plain_on_layouts(ids: torch.Tensor, decode: DecodeConfig) -> dict[str, Run]:
        """Plain decoding with the target's weights in each forced layout (fastest of --repeats runs), the weights
        put back in the layout in use once at the end. The layout in use is not run again: its runs are the plain
        runner's (a second run of the same forward only gave the fastest-plain maximum one more draw of the
        machine's noise: the main job's transposed+panels measured 22.1 tok/s in use and 23.5 forced, in one run)."""
        runs = {}
        try:
            for layout in (name for name in plain_layouts if name != layout_in_use):
                set_layout(model, layout)
                runs[layout] = fastest_of(bench_args.repeats, lambda: {"plain": run_ours(target, plain, ids, decode)}
                                          )["plain"]
        finally:
            if plain_layouts:
                set_layout(model, layout_in_use)
        return runs

    def encode(messages: list[dict[str, str]], index: int) -> torch.Tensor:
        ids = encode_prompt(tokenizer, messages)
        if ids.numel() == 0:
            raise ValueError(f"--prompts {bench_args.prompts}: prompt {index} encodes to 0 tokens")
        return ids

    def run_all(ids: torch.Tensor, decode: DecodeConfig) -> dict[str, Run]:
        gen_config = hf_generation_config(model, decode)
        runs = {"plain": run_ours(target, plain, ids, decode),
                "hf": run_hf(model, ids, gen_config, decode.seed),
                "method": run_ours(target, proposer, ids, decode)}
        if assisted is not None:
            assisted_config = copy.deepcopy(gen_config)
            assisted_config.update(**assisted[0])
            runs["hf_assisted"] = run_hf(model, ids, assisted_config, decode.seed, **assisted[1])
        return runs

    first = encode([{"role": "user", "content": questions[0].turns[0]}], 0)
    warm_up(config, bench_args.warmup_tokens, lambda short: run_all(first, short),
            lambda short: plain_on_layouts(first, short))
    records, method_runs, plain_runs = [], [], []
    oracle_runs: dict[int, list[Run]] = {k: [] for k in oracle_sizes}
    transcripts: list[tuple[Question, list[dict[str, Run]]]] = []  # per question, the runs of each turn

    def results() -> dict[str, Any]:
        """The JSON-ready result over the questions done so far (answers files written too)."""
        config_record = {**dataclasses.asdict(gen_args), **dataclasses.asdict(bench_args), "method": method}
        config_record.pop("prompt")
        all_stats = [run.stats for run in plain_runs + method_runs + [r for runs in oracle_runs.values() for r in runs]]
        result = {
            "config": config_record,
            "environment": environment_record(target),
            "overall": overall_record(records, [run.stats for run in method_runs], [run.stats for run in plain_runs],
                                      dtype),
            "verify_cost": verify_cost_from_steps(all_stats),
            "prompts": records,
        }
        if plain_layouts:
            result["overall"]["baseline"] = baseline_record(layout_in_use, plain_runs, forced_plain)
        if oracle_sizes:
            result["oracle"] = {"model": gen_args.model, "dtype": dtype, "device": str(target.device),
                                "num_threads": torch.get_num_threads(), "rows": oracle_rows(oracle_runs, plain_runs)}
        if bench_args.answers_jsonl:
            model_id = f"{Path(gen_args.model).name}-{method}-{dtype}"
            decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
            write_jsonl(bench_args.answers_jsonl, spec_bench_answers(transcripts, "method", model_id, decode))
            write_jsonl(plain_answers_path(bench_args.answers_jsonl),
                               spec_bench_answers(transcripts, "plain", f"{Path(gen_args.model).name}-plain-{dtype}",
                                                  decode))
        return result

    for i, question in enumerate(questions):
        history: list[dict[str, str]] = []
        turn_runs: list[dict[str, Run]] = []
        for turn, text in enumerate(question.turns[:bench_args.turns]):
            history.append({"role": "user", "content": text})
            ids = encode(history, i)
            # every runner --repeats times, interleaved; each one's fastest run (its tokens and stats with it)
            runs = fastest_of(bench_args.repeats, lambda ids=ids: run_all(ids, config))
            forced = plain_on_layouts(ids, config)
            for layout in plain_layouts:
                forced_plain[layout].append(forced.get(layout, runs["plain"]))
            for k in oracle_sizes:  # drafts plain decoding's own continuation: every draft token is accepted
                chain = dataclasses.replace(config, speculation=SpeculationConfig(num_speculative_tokens=k,
                                                                                  max_speculative_tokens=k))
                oracle_runs[k].append(run_ours(target, OracleProposer(runs["plain"].tokens), ids, chain))
            record = prompt_record(len(records), ids.numel(), runs, greedy)
            records.append({"question_id": question.question_id, "turn": turn + 1, **record})
            method_runs.append(runs["method"])
            plain_runs.append(runs["plain"])
            turn_runs.append(runs)
            # the next turn sees plain greedy decoding's answer, so every runner gets the same prompt
            history.append({"role": "assistant",
                            "content": tokenizer.decode(runs["plain"].tokens, skip_special_tokens=True)})
            print(f"[bench] prompt {i + 1}/{len(questions)} turn {turn + 1}: {ids.numel()} prompt tokens, tau "
                  f"{record['tau']:.2f}, speed-up {fmt(record['speedup'], '.2f')}, identical "
                  f"{record['identical_to_plain']} (to generate {record['greedy_identical']})", file=sys.stderr)
        transcripts.append((question, turn_runs))
        write_json(bench_args.output_json, results())  # partial results survive an interrupted run
    return results()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    gen_args, bench_args = parse_arguments(argv)
    torch.set_num_threads(gen_args.num_threads)
    if bench_args.batch_sizes:  # the batch bench: same outputs, its own table and plot
        run, show, plot = run_batch_bench, print_batch_table, plot_batches
    else:
        run, show, plot = run_bench, print_table, plot_bench
    result = run(gen_args, bench_args)
    write_json(bench_args.output_json, result)
    show(result)
    print(f"[bench] wrote {bench_args.output_json}")
    if bench_args.plot:
        plot(result, bench_args.plot)
        print(f"[bench] wrote {bench_args.plot}")
    if bench_args.answers_jsonl and not bench_args.batch_sizes:  # the per-prompt bench writes the answers
        print(f"[bench] wrote {bench_args.answers_jsonl} and {plain_answers_path(bench_args.answers_jsonl)} "
              "(Spec-Bench answer format)")
    return result


if __name__ == "__main__":
    run_cli(main)
