"""Benchmark a speculative method against plain decoding on the same prompts, in the same process.

    python -m runtime.bench --model ../shared/models/smollm2-135m-instruct --method prompt_lookup \
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
acceptance per draft depth, draft / verify / prefill time shares and `greedy_identical` (the method's tokens
equal `model.generate(do_sample=False)` token for token; null when sampling). Timings are wall clock on a
possibly shared machine: compare ratios measured in the same run, not absolute numbers across runs
(`--repeats R` runs every runner R times per prompt, interleaved, and keeps the fastest run of each).
`--config bench.yaml` gives defaults (keys = flag names), flags override it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from heads.cli import parse_flag_groups
from runtime.config import DecodeConfig, GenerateArguments
from runtime.generate import GenerationStats, build_proposer, encode_prompt, generate
from runtime.proposers import Autoregressive, Proposer
from runtime.target import SUPPORTED_ATTENTION, TargetModel


@dataclass
class BenchArguments:
    """Flags of `python -m runtime.bench` besides the model / method / sampling flags of runtime.generate."""

    prompts: str = field(default="../shared/data/mt_bench_question.jsonl", metadata={
        "help": "prompt file or dataset: JSONL/JSON with prompt, turns (MT-Bench), instruction (Alpaca), "
                "ShareGPT conversations or OpenAI messages; the first user turn of each is used"})
    max_prompts: int = field(default=10, metadata={"help": "use at most this many prompts"})
    output_json: str = field(default="outputs/bench/bench.json", metadata={"help": "results file (JSON)"})
    compare_hf: bool = field(default=False, metadata={
        "help": "also run transformers' own assisted generation (assistant_model= / prompt_lookup_num_tokens=)"})
    warmup_tokens: int = field(default=16, metadata={"help": "new tokens of the untimed warm-up run of each runner"})
    repeats: int = field(default=1, metadata={
        "help": "run every runner this many times per prompt (interleaved) and keep the fastest run of each: "
                "robust to a noisy shared machine"})
    config: str | None = field(default=None, metadata={
        "help": "YAML file of defaults (keys = flag names of this command); flags given on the command line win"})


# ---------------------------------------------------------------- arguments


def parse_arguments(argv: list[str] | None = None) -> tuple[GenerateArguments, BenchArguments]:
    """Flags (over `--config` YAML defaults) -> (generate arguments, bench arguments). Unknown YAML keys raise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    gen_args, bench_args = parse_flag_groups((GenerateArguments, BenchArguments), argv)
    if "--prompt" in argv or any(a.startswith("--prompt=") for a in argv):
        raise ValueError("--prompt is a flag of runtime.generate; runtime.bench reads --prompts FILE")
    if bench_args.max_prompts < 1:
        raise ValueError(f"--max_prompts must be >= 1, got {bench_args.max_prompts}")
    if bench_args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {bench_args.repeats}")
    if bench_args.warmup_tokens < 0:
        raise ValueError(f"--warmup_tokens must be >= 0, got {bench_args.warmup_tokens}")
    if gen_args.attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"--attn_implementation {gen_args.attn_implementation}: an attention backend that "
                         f"ignores custom masks cannot verify candidate trees; use one of {SUPPORTED_ATTENTION}")
    gen_args.resolved_method()
    gen_args.decode_config()  # validates --max_new_tokens, sampling and speculation flags before any loading
    return gen_args, bench_args


def read_prompts(source: str, max_prompts: int) -> list[str]:
    """The first user turn of each of the first `max_prompts` conversations in `source`."""
    from data.prompts import read_conversations  # the CLI edge may read prompt files; runtime core may not

    conversations, skipped = read_conversations(source, max_rows=max_prompts)
    for row in skipped[:5]:
        print(f"[bench] --prompts {source}: skipped row {row.line}: {row.reason}", file=sys.stderr)
    prompts = [next(m["content"] for m in conversation if m["role"] == "user") for conversation in conversations]
    if not prompts:
        raise ValueError(f"--prompts {source}: no usable prompt ({len(skipped)} rows skipped)")
    return prompts


# ---------------------------------------------------------------- runners


@dataclass(frozen=True)
class Run:
    """One generation of one runner on one prompt."""

    tokens: list[int]  # new tokens
    seconds: float  # wall time of the whole call (prefill included)
    stats: GenerationStats | None = None  # our loop only

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def run_ours(target: TargetModel, proposer: Proposer, input_ids: torch.Tensor, config: DecodeConfig) -> Run:
    """Our decode loop; input_ids [T]."""
    stats = GenerationStats()
    tokens: list[int] = []
    for step in generate(target, proposer, input_ids, config, stats):
        tokens.extend(step.tolist())
    return Run(tokens=tokens, seconds=stats.total_time, stats=stats)


def hf_generation_config(model, config: DecodeConfig) -> transformers.GenerationConfig:
    """The model's own generation config with our max_new_tokens, EOS and sampling settings."""
    gen = copy.deepcopy(model.generation_config)
    sampling = config.sampling
    if sampling.is_greedy:
        gen.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        gen.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                   top_p=sampling.top_p)
    gen.update(max_new_tokens=config.max_new_tokens, min_new_tokens=None, max_length=None)
    if config.eos_token_ids is not None:
        gen.update(eos_token_id=list(config.eos_token_ids) or None)
    if gen.pad_token_id is None:
        eos = gen.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return gen


@torch.inference_mode()
def run_hf(model, input_ids: torch.Tensor, gen_config: transformers.GenerationConfig, seed: int | None,
           **assisted: Any) -> Run:
    """transformers' `model.generate` (plain, or assisted with `assistant_model=` / `prompt_lookup_num_tokens=`)."""
    ids = input_ids[None].to(model.device)  # [1, T]
    if seed is not None:
        torch.manual_seed(seed)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config, **assisted)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - start
    return Run(tokens=out[0, ids.shape[1]:].tolist(), seconds=seconds)


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


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def prompt_record(index: int, prompt_length: int, runs: dict[str, Run], greedy: bool) -> dict[str, Any]:
    """Per-prompt JSON record from the runs of every runner on that prompt."""
    method = runs["method"]
    stats = method.stats
    record: dict[str, Any] = {
        "index": index, "prompt_tokens": prompt_length,
        "tau": stats.tau, "steps": len(stats.steps), "stop_reason": stats.stop_reason,
        "acceptance_per_depth": stats.acceptance_per_depth,
        "draft_share": _share(stats.draft_time, stats.total_time),
        "verify_share": _share(stats.verify_time, stats.total_time),
        "prefill_share": _share(stats.prefill_time, stats.total_time),
    }
    for name, run in runs.items():
        record[name] = {"new_tokens": len(run.tokens), "seconds": run.seconds,
                        "tokens_per_second": run.tokens_per_second}
    record["speedup"] = _ratio(method.tokens_per_second, runs["plain"].tokens_per_second)
    record["speedup_vs_hf"] = _ratio(method.tokens_per_second, runs["hf"].tokens_per_second)
    reference = runs["hf"].tokens
    record["greedy_identical"] = method.tokens == reference if greedy else None
    record["plain_identical"] = runs["plain"].tokens == reference if greedy else None
    if "hf_assisted" in runs:
        assisted = runs["hf_assisted"]
        record["hf_assisted"]["speedup_vs_hf"] = _ratio(assisted.tokens_per_second, runs["hf"].tokens_per_second)
        record["hf_assisted"]["greedy_identical"] = assisted.tokens == reference if greedy else None
    return record


def overall_record(records: list[dict[str, Any]], method_stats: list[GenerationStats]) -> dict[str, Any]:
    """Totals over prompts: tau over all steps, total tokens / total time, medians of per-prompt ratios."""
    steps = sum(len(s.steps) for s in method_stats)
    accepted = [0] * max((len(s.drafted_per_depth) for s in method_stats), default=0)
    drafted = list(accepted)
    for s in method_stats:
        for d, (a, n) in enumerate(zip(s.accepted_per_depth + [0] * (len(s.drafted_per_depth) -
                                                                    len(s.accepted_per_depth)),
                                       s.drafted_per_depth, strict=True)):
            accepted[d] += a
            drafted[d] += n
    total_time = sum(s.total_time for s in method_stats)
    overall: dict[str, Any] = {
        "prompts": len(records),
        "tau": sum(sum(step.accepted_length for step in s.steps) for s in method_stats) / steps if steps else 1.0,
        "acceptance_per_depth": [a / n for a, n in zip(accepted, drafted, strict=True)],
        "draft_share": _share(sum(s.draft_time for s in method_stats), total_time),
        "verify_share": _share(sum(s.verify_time for s in method_stats), total_time),
        "prefill_share": _share(sum(s.prefill_time for s in method_stats), total_time),
    }
    runners = [name for name in ("plain", "hf", "method", "hf_assisted") if name in records[0]]
    for name in runners:
        tokens = sum(r[name]["new_tokens"] for r in records)
        seconds = sum(r[name]["seconds"] for r in records)
        overall[name] = {"new_tokens": tokens, "seconds": seconds, "tokens_per_second": _ratio(tokens, seconds)}
    tps = {name: overall[name]["tokens_per_second"] or 0.0 for name in runners}
    overall["speedup_median"] = _median([r["speedup"] for r in records])
    overall["speedup_total"] = _ratio(tps["method"], tps["plain"])
    overall["speedup_vs_hf_median"] = _median([r["speedup_vs_hf"] for r in records])
    overall["speedup_vs_hf_total"] = _ratio(tps["method"], tps["hf"])
    if "hf_assisted" in overall:
        overall["hf_assisted"]["speedup_vs_hf_median"] = _median(
            [r["hf_assisted"]["speedup_vs_hf"] for r in records])
        overall["hf_assisted"]["speedup_vs_hf_total"] = _ratio(tps["hf_assisted"], tps["hf"])
        flags = [r["hf_assisted"]["greedy_identical"] for r in records]
        overall["hf_assisted"]["greedy_identical"] = None if None in flags else all(flags)
    for key in ("greedy_identical", "plain_identical"):
        flags = [r[key] for r in records]
        overall[key] = None if None in flags else all(flags)
    return overall


def write_json_atomic(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(result: dict[str, Any]) -> None:
    """Per-prompt rows and the overall row, readable in a terminal."""
    has_hf_assisted = "hf_assisted" in result["overall"]
    head = f"{'prompt':>6} {'p_tok':>5} {'new':>4} {'tau':>5} {'plain/s':>8} {'hf/s':>8} {'method/s':>9} " \
           f"{'speedup':>7} {'vs_hf':>6} {'ident':>5}"
    if has_hf_assisted:
        head += f" {'hf_asst/s':>9} {'hf_asst_x':>9}"
    print(head)

    def row(label: str, prompt_tokens: str, r: dict[str, Any], speedup: float | None, vs_hf: float | None,
            assisted_speedup: float | None) -> str:
        ident = {True: "yes", False: "NO", None: "-"}[r["greedy_identical"]]
        line = (f"{label:>6} {prompt_tokens:>5} {r['method']['new_tokens']:>4} {r['tau']:>5.2f} "
                f"{_fmt(r['plain']['tokens_per_second'], '8.1f')} {_fmt(r['hf']['tokens_per_second'], '8.1f')} "
                f"{_fmt(r['method']['tokens_per_second'], '9.1f')} {_fmt(speedup, '7.2f')} "
                f"{_fmt(vs_hf, '6.2f')} {ident:>5}")
        if has_hf_assisted:
            line += f" {_fmt(r['hf_assisted']['tokens_per_second'], '9.1f')} {_fmt(assisted_speedup, '9.2f')}"
        return line

    for r in result["prompts"]:
        print(row(str(r["index"]), str(r["prompt_tokens"]), r, r["speedup"], r["speedup_vs_hf"],
                  r["hf_assisted"]["speedup_vs_hf"] if has_hf_assisted else None))
    o = result["overall"]
    print(row("total", "", o, o["speedup_total"], o["speedup_vs_hf_total"],
              o["hf_assisted"]["speedup_vs_hf_total"] if has_hf_assisted else None))
    print(row("median", "", o, o["speedup_median"], o["speedup_vs_hf_median"],
              o["hf_assisted"]["speedup_vs_hf_median"] if has_hf_assisted else None))
    rates = ", ".join(f"{a:.2f}" for a in o["acceptance_per_depth"])
    print(f"method {result['config']['method']}: tau {o['tau']:.2f}, acceptance per depth [{rates}], "
          f"time shares draft {o['draft_share']:.2f} / verify {o['verify_share']:.2f} / prefill "
          f"{o['prefill_share']:.2f}; greedy_identical: {o['greedy_identical']}")


# ---------------------------------------------------------------- main


def run_bench(gen_args: GenerateArguments, bench_args: BenchArguments) -> dict[str, Any]:
    """Load the model(s), run every runner on every prompt (interleaved), return the JSON-ready result."""
    from heads.loading import load_model, load_tokenizer

    method = gen_args.resolved_method()
    config = gen_args.decode_config()
    prompts = read_prompts(bench_args.prompts, bench_args.max_prompts)
    tokenizer = load_tokenizer(gen_args.model)
    model = load_model(gen_args.model, dtype=gen_args.model_dtype(), attn_implementation=gen_args.attn_implementation,
                       device=gen_args.device)
    print(gen_args.dtype_line(model.dtype), file=sys.stderr)  # plain decoding and the method share this model
    target = TargetModel(model)
    proposer = build_proposer(gen_args, target, tokenizer)
    plain = Autoregressive()
    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    for i, ids in enumerate(encoded):
        if ids.numel() == 0:
            raise ValueError(f"--prompts {bench_args.prompts}: prompt {i} encodes to 0 tokens")
    assisted = hf_assisted_settings(gen_args, proposer) if bench_args.compare_hf else None
    greedy = config.sampling.is_greedy

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

    if bench_args.warmup_tokens > 0:  # untimed: first calls pay for allocation and lazy initialisation
        run_all(encoded[0], dataclasses.replace(config, max_new_tokens=min(bench_args.warmup_tokens,
                                                                          config.max_new_tokens)))
    records, method_stats = [], []
    for i, ids in enumerate(encoded):
        runs = run_all(ids, config)
        for _ in range(bench_args.repeats - 1):  # keep each runner's fastest run (and its tokens and stats)
            again = run_all(ids, config)
            runs = {name: min(runs[name], again[name], key=lambda run: run.seconds) for name in runs}
        records.append(prompt_record(i, ids.numel(), runs, greedy))
        method_stats.append(runs["method"].stats)
        r = records[-1]
        print(f"[bench] prompt {i + 1}/{len(encoded)}: {ids.numel()} prompt tokens, tau {r['tau']:.2f}, "
              f"speed-up {_fmt(r['speedup'], '.2f')}, identical {r['greedy_identical']}", file=sys.stderr)
    config_record = {**dataclasses.asdict(gen_args), **dataclasses.asdict(bench_args), "method": method}
    config_record.pop("prompt")
    return {
        "config": config_record,
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(), "num_threads": torch.get_num_threads(),
                        "device": str(target.device), "machine": platform.machine(),
                        "dtype": str(model.dtype).removeprefix("torch.")},
        "overall": overall_record(records, method_stats),
        "prompts": records,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    gen_args, bench_args = parse_arguments(argv)
    torch.set_num_threads(gen_args.num_threads)
    result = run_bench(gen_args, bench_args)
    write_json_atomic(bench_args.output_json, result)
    print_table(result)
    print(f"[bench] wrote {bench_args.output_json}")
    return result


if __name__ == "__main__":
    from heads.cli import run_cli

    run_cli(main)
