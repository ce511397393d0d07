"""`python -m bench.speed --batch_sizes 1,2,4,8,16`: batched decoding, speculation auto / on / off, next to
transformers' own batched `generate` (hf).

The prompts are decoded in consecutive batches of each size, every mode on a batch before the next batch
(interleaved, the mode that goes first rotating, so a drifting machine load and order effects hit the modes
alike). Per (batch size, mode): total new tokens per
second of wall time over all batches, the median per-sequence latency (a row's time from the start of its
batch to its last token), and whether every row equals its prompt decoded alone with plain greedy decoding.
Modes:
- off: plain decoding through our loop (batched);
- on: the drafter at a fixed size (`--tree_size N` for heads, `--num_speculative_tokens` otherwise);
- auto: the planner (runtime/planner.py) picks the size per batch size from the drafter's profile and the
  verify cost over rows x tokens measured here, down to plain decoding;
- hf: `model.generate` on the left-padded batch.
The drafter is the method of the generate flags, or `--batch_drafter oracle`: it drafts plain decoding's own
continuation (every draft accepted), so on/auto show what a perfect zero-cost drafter gives per batch size,
i.e. where speculation stops paying on this machine whatever the drafter. Profiles: heads with `--tree_size
auto` use their measured accuracy; the oracle tau(n) = n + 1; other drafters the acceptance per depth and draft
time measured in their batch-1 "on" run.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import environment, read_questions, warm_up
from bench.report import pyplot, save_figure
from runtime.api import SpeculativeModel
from runtime.build import encode_prompt
from runtime.config import GenerateArguments, SpeculationConfig
from runtime.cost_model import batch_cost_curve
from runtime.loop import GenerationStats, generate_batch
from runtime.planner import BatchPlanner, DraftProfile
from runtime.proposers.base import Autoregressive, per_row
from runtime.proposers.factory import proposer_from_heads
from runtime.proposers.oracle import OracleProposer

MODES = ("off", "on", "auto", "hf")


def parse_batch_sizes(value: str) -> list[int]:
    """--batch_sizes '1,2,4' -> [1, 2, 4] (ValueError naming the flag for 0, negatives or non-ints)."""
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--batch_sizes: expected comma-separated ints, got {value!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"--batch_sizes: every batch size must be >= 1, got {value!r}")
    return sorted(set(sizes))


def profile_from_stats(stats: list[GenerationStats], max_size: int, source: str) -> DraftProfile:
    """The planner's profile measured from runs: tau(n) = 1 + sum_{d <= n} P(depth-d token accepted), draft time
    per row = mean draft time per step (at the run's size, used for every size: an upper bound for smaller ones)."""
    measured = GenerationStats.merged(stats).acceptance_per_depth[:max_size]  # depths never drafted: 0
    rates = measured + [0.0] * (max_size - len(measured))
    steps = sum(len(s.steps) for s in stats)
    draft = sum(s.draft_time for s in stats) / steps if steps else 0.0
    sizes = list(range(1, max_size + 1))
    return DraftProfile(sizes, [1.0 + sum(rates[:n]) for n in sizes], [draft] * max_size, source)


def _hf_batch(model, prompts: list[torch.Tensor], max_new_tokens: int, pad_id: int) -> tuple[list[list[int]], float]:
    """transformers' batched greedy generate on left-padded prompts: new tokens per row (cut after EOS) and seconds."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():], mask[i, width - p.numel():] = p, 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=pad_id)
    seconds = time.perf_counter() - start
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    rows = []
    for row in out[:, width:].tolist():
        hits = [i for i, t in enumerate(row) if t in eos]
        rows.append(row[:hits[0] + 1] if hits else row)
    return rows, seconds


def run_batch_bench(gen_args: GenerateArguments, bench_args) -> dict[str, Any]:
    """The batch bench of `python -m bench.speed --batch_sizes` (bench_args: its BenchArguments)."""
    batch_sizes = parse_batch_sizes(bench_args.batch_sizes)
    config = gen_args.decode_config()
    if not config.sampling.is_greedy:
        raise ValueError("--batch_sizes: the batch bench compares against plain greedy decoding (--temperature 0)")
    if bench_args.batch_drafter not in ("method", "oracle"):
        raise ValueError(f"--batch_drafter must be 'method' or 'oracle', got {bench_args.batch_drafter!r}")
    spec = SpeculativeModel.from_args(gen_args)
    target, tokenizer, hf_model = spec.target, spec.tokenizer, spec.target.model
    questions = read_questions(bench_args.prompts, bench_args.max_prompts, bench_args.per_category)
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    oracle = bench_args.batch_drafter == "oracle"
    on_size = config.speculation.num_speculative_tokens if not gen_args.heads else None
    method = gen_args.resolved_method()
    if oracle:
        on_size = bench_args.batch_on_size
    elif method == "heads":
        forced = proposer_from_heads(gen_args.heads, target, dataclasses.replace(
            gen_args.heads_options(), tree_size=str(bench_args.batch_on_size)), seed=gen_args.seed,
            target_name=gen_args.model)
        on_proposer, on_size = forced.proposer, forced.size
    else:
        on_proposer = spec.proposer
    if method == "autoregressive" and not oracle:
        raise ValueError("--batch_sizes: --method autoregressive has no drafter to turn on; pick a drafter or "
                         "--batch_drafter oracle")

    def decode(proposers, chunk, size_for_batch=None, speculation=None):
        stats = [GenerationStats() for _ in chunk]
        decode_config = config if speculation is None else dataclasses.replace(config, speculation=speculation)
        rows: list[list[int]] = [[] for _ in chunk]
        for step in generate_batch(target, proposers, chunk, decode_config, stats, size_for_batch):
            for row, new in zip(rows, step, strict=True):
                row.extend(new.tolist())
        return rows, stats

    warm = [p[:32] for p in prompts[:2]]  # untimed: allocation and lazy initialisation
    warm_up(config, config.max_new_tokens, lambda _: decode(per_row(Autoregressive(), len(warm)), warm))
    print(f"[bench] plain greedy reference: {len(prompts)} prompts, each alone", file=sys.stderr)
    reference = [decode([Autoregressive()], [p])[0][0] for p in prompts]
    oracle_speculation = SpeculationConfig(num_speculative_tokens=on_size, max_speculative_tokens=on_size)

    def on_proposers(indices: list[int]):
        if oracle:
            return [OracleProposer(reference[i]) for i in indices]
        return per_row(on_proposer, len(indices))

    def auto_proposers(indices: list[int]):
        return on_proposers(indices) if oracle else per_row(spec.proposer, len(indices))

    # the planner's profile of the drafter
    if oracle:
        profile = DraftProfile(list(range(1, on_size + 1)), [n + 1.0 for n in range(1, on_size + 1)], [0.0] * on_size,
                               "oracle: every draft accepted, zero draft time")
    elif spec.profile is not None:
        profile = spec.profile
    elif method == "heads":
        raise ValueError("--batch_sizes: auto needs the heads' measured profile: pass --tree_size auto")
    else:
        calibration = [decode(on_proposers([i]), [prompts[i]])[1][0] for i in range(min(4, len(prompts)))]
        profile = profile_from_stats(calibration, on_size, f"{method}: acceptance measured on {len(calibration)} prompts")
    cost = batch_cost_curve(target, batch_sizes, kv_length=gen_args.heads_options().cost_kv_length,
                            max_tokens=max(profile.sizes, default=0) + 1)
    planner = BatchPlanner(profile, cost.seconds)
    plan = planner.table(batch_sizes)
    print(f"[planner] {profile.source}: {planner.describe(batch_sizes)}", file=sys.stderr)

    def run_mode(mode: str, chunk: list[int]) -> tuple[list[list[int]], float, list[float], dict[str, float]]:
        """One batch of prompts in one mode: rows, wall seconds, per-row latencies, step-time parts."""
        chunk_prompts = [prompts[i] for i in chunk]
        if mode == "hf":
            rows, seconds = _hf_batch(hf_model, chunk_prompts, config.max_new_tokens, pad_id)
            return rows, seconds, [seconds] * len(chunk), {}
        start = time.perf_counter()
        if mode == "off":
            rows, stats = decode(per_row(Autoregressive(), len(chunk)), chunk_prompts)
        elif mode == "on":
            rows, stats = decode(on_proposers(chunk), chunk_prompts, speculation=oracle_speculation if oracle else None)
        else:
            rows, stats = decode(auto_proposers(chunk), chunk_prompts, planner,
                                 speculation=oracle_speculation if oracle else None)
        seconds = time.perf_counter() - start
        longest = max(stats, key=lambda s: len(s.steps))  # the row that saw every step of the batch
        parts = {part: getattr(longest, f"{part}_time") for part in ("draft", "verify", "overhead")}
        return rows, seconds, [s.total_time for s in stats], parts

    records = []
    for batch in batch_sizes:
        chunks = [list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)]
        tokens: dict[str, dict[int, list[int]]] = {mode: {} for mode in MODES}
        latencies: dict[str, list[float]] = {mode: [] for mode in MODES}
        wall = dict.fromkeys(MODES, 0.0)
        parts = {mode: {"draft": 0.0, "verify": 0.0, "overhead": 0.0} for mode in MODES}
        for index, chunk in enumerate(chunks):  # modes interleaved per batch of prompts, the first one rotating:
            for mode in MODES[index % len(MODES):] + MODES[:index % len(MODES)]:  # drift and order hit them alike
                rows, seconds, row_latencies, step_parts = run_mode(mode, chunk)
                wall[mode] += seconds
                latencies[mode] += row_latencies
                tokens[mode].update(zip(chunk, rows, strict=True))
                for part, value in step_parts.items():
                    parts[mode][part] += value
        for mode in MODES:
            total_new = sum(len(r) for r in tokens[mode].values())
            identical = all(tokens[mode][i] == reference[i] for i in range(len(prompts)))
            record = dict(batch_size=batch, mode=mode, tokens_per_second=total_new / wall[mode],
                          latency_median=statistics.median(latencies[mode]), greedy_identical=identical,
                          new_tokens=total_new, seconds=wall[mode],
                          **{f"{part}_share": (None if mode == "hf" else value / wall[mode])
                             for part, value in parts[mode].items()},
                          size=(planner(batch)[0] if mode == "auto" else on_size if mode == "on" else 0))
            records.append(record)
            print(f"[bench] batch {batch:3d} {mode:4s}: {record['tokens_per_second']:8.1f} tokens/s, latency median "
                  f"{record['latency_median']:.2f} s, identical {identical}", file=sys.stderr)
    return {"config": {**dataclasses.asdict(gen_args), **dataclasses.asdict(bench_args), "method": method},
            "environment": environment(target),
            "drafter": "oracle" if oracle else method, "on_size": on_size, "planner": plan,
            "batches": records, "summary": summarise(records, batch_sizes)}


def summarise(records: list[dict[str, Any]], batch_sizes: list[int]) -> dict[str, Any]:
    """Crossover (the smallest batch size where forced speculation no longer beats plain decoding) and auto's
    ratio to the better of on/off per batch size."""
    rate = {(r["batch_size"], r["mode"]): r["tokens_per_second"] for r in records}
    crossover = next((b for b in batch_sizes if rate[(b, "on")] <= rate[(b, "off")]), None)
    auto_vs_best = {b: rate[(b, "auto")] / max(rate[(b, "on")], rate[(b, "off")]) for b in batch_sizes}
    return {"crossover_batch_size": crossover, "auto_over_best_of_on_off": auto_vs_best,
            "auto_within_5_percent": all(v >= 0.95 for v in auto_vs_best.values()),
            "on_speedup": {b: rate[(b, "on")] / rate[(b, "off")] for b in batch_sizes},
            "all_greedy_identical": all(r["greedy_identical"] for r in records if r["mode"] != "hf"),
            "hf_greedy_identical": all(r["greedy_identical"] for r in records if r["mode"] == "hf")}


def print_batch_table(result: dict[str, Any]) -> None:
    print(f"{'batch':>5} {'mode':>5} {'tokens/s':>9} {'latency':>8} {'size':>4} {'draft':>6} {'overhead':>8} identical")
    for r in result["batches"]:
        shares = ("", "") if r["draft_share"] is None else (f"{r['draft_share']:.1%}", f"{r['overhead_share']:.1%}")
        print(f"{r['batch_size']:5d} {r['mode']:>5} {r['tokens_per_second']:9.1f} {r['latency_median']:7.2f}s "
              f"{r['size']:4d} {shares[0]:>6} {shares[1]:>8} {r['greedy_identical']}")
    s = result["summary"]
    print(f"crossover (forced speculation no faster than plain): batch {s['crossover_batch_size']}; auto / best of "
          f"on,off: " + ", ".join(f"{b}: {v:.2f}" for b, v in s["auto_over_best_of_on_off"].items()))


def plot_batches(result: dict[str, Any], path: str | Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        rows = [r for r in result["batches"] if r["mode"] == mode]
        ax.plot([r["batch_size"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o", label=mode)
    crossover = result["summary"]["crossover_batch_size"]
    if crossover is not None:
        ax.axvline(crossover, color="grey", linestyle="--", label=f"crossover (batch {crossover})")
    ax.set(xscale="log", xlabel="batch size", ylabel="total new tokens / s",
           title=f"drafter: {result['drafter']}, {result['environment']['dtype']}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
