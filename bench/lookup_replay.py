"""Replay cost-aware prompt lookup on fixed answers, without running a model: its predicted decode speed-up.

    python -m bench.lookup_replay --curve ~/.cache/specheads/cost_curves/<model>__cpu-1threads__float32__kv256.json \
        --answers outputs/distill/smollm2-mtbench-eval,outputs/data/smollm2-long/eval --required_gain 1.0,1.2

Each answer is the last assistant turn of a row of a `data.distill` dataset (its last run of loss-mask 1, at most
`--max_new_tokens` tokens), with everything before it as the prompt. The proposer runs as in the decode loop under
greedy verification: it drafts from the committed tokens, the longest prefix of its draft that equals the answer is
accepted plus one token, and the step costs the curve's verify cost of 1 + k tokens relative to a plain step (the
same `CostCurve.relative_to_plain` the runtime gives the proposer). Predicted decode speed-up = answer tokens /
total cost (prefill excluded: the same for both). On the target's own greedy answers this is what the lookup
would accept when run (`bench.speed` measures the rest: realised / predicted); on human answers it shows how the
policy behaves on text the target does not copy. Deterministic, seconds per hundred answers, so the lookup's
constants can be checked on any answers and any measured curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch

from bench.report import write_json
from heads.cli import parse_flags, run_cli
from runtime.cost_model import describe_relative_costs, load_curve
from runtime.proposers.prompt_lookup import (
    OCCURRENCES,
    PRIOR_ACCEPTANCE,
    REQUIRED_GAIN,
    PromptLookupProposer,
    check_occurrence,
)


@dataclass
class ReplayArguments:
    """Flags of `python -m bench.lookup_replay`."""

    curve: str = field(default="", metadata={"help": "a verify cost curve JSON (python -m bench.cost_curve "
                                                     "--output, or the runtime's cache under cost_curves/)"})
    answers: str = field(default="", metadata={"help": "comma-separated data.distill dataset directories"})
    required_gain: str = field(default=str(REQUIRED_GAIN), metadata={
        "help": "comma-separated margins to compare (1.0 = draft on any expected gain)"})
    prior: str = field(default=",".join(map(str, PRIOR_ACCEPTANCE)), metadata={
        "help": "a_1,a_2: the acceptance the lookup assumes before it has learned any"})
    occurrence: str = field(default=OCCURRENCES[0], metadata={
        "help": f"comma-separated occurrence rules to compare ({', '.join(OCCURRENCES)}): which earlier occurrence "
                "of a match the lookup drafts from"})
    max_new_tokens: int = field(default=128, metadata={"help": "answer tokens replayed per row"})
    max_speculative_tokens: int = field(default=16, metadata={"help": "longest draft, as the runtime's flag"})
    max_ngram: int = field(default=3, metadata={"help": "prompt lookup: longest n-gram to match"})
    min_ngram: int = field(default=1, metadata={"help": "prompt lookup: shortest n-gram to match"})
    output: str | None = field(default=None, metadata={"help": "write the results as JSON here"})

    def __post_init__(self) -> None:
        if not self.curve:
            raise ValueError("--curve is required (a cost curve JSON)")
        if not Path(self.curve).is_file():
            raise FileNotFoundError(f"--curve {self.curve}: no such file")
        if not self.answer_dirs():
            raise ValueError("--answers is required (data.distill dataset directories)")
        if self.max_new_tokens < 1 or self.max_speculative_tokens < 1:
            raise ValueError("--max_new_tokens and --max_speculative_tokens: expected >= 1")
        self.gains()
        self.prior_pair()
        self.occurrences()

    def occurrences(self) -> list[str]:
        rules = [o.strip() for o in self.occurrence.split(",") if o.strip()]
        if not rules:
            raise ValueError(f"--occurrence: expected one or more of {', '.join(OCCURRENCES)}, got {self.occurrence!r}")
        for rule in rules:
            try:
                check_occurrence(rule)
            except ValueError as error:
                raise ValueError(f"--occurrence: {error}") from None
        return rules

    def prior_pair(self) -> tuple[float, float]:
        try:
            first, rest = (float(x) for x in self.prior.split(","))
        except ValueError:
            raise ValueError(f"--prior: expected two numbers A1,A2, got {self.prior!r}") from None
        if not (0 <= first <= 1 and 0 <= rest <= 1):
            raise ValueError(f"--prior: expected probabilities in [0, 1], got {self.prior!r}")
        return first, rest

    def answer_dirs(self) -> list[str]:
        return [d.strip() for d in self.answers.split(",") if d.strip()]

    def gains(self) -> list[float]:
        try:
            gains = [float(g) for g in self.required_gain.split(",") if g.strip()]
        except ValueError:
            raise ValueError(f"--required_gain: expected comma-separated numbers, got {self.required_gain!r}") from None
        if not gains or any(g <= 0 for g in gains):
            raise ValueError(f"--required_gain: expected positive numbers, got {self.required_gain!r}")
        return gains


def last_answer(input_ids: Sequence[int], loss_mask: Sequence[int], max_new_tokens: int
                ) -> tuple[list[int], list[int]] | None:
    """(prompt ids, answer ids): the last run of loss-mask 1 (at most max_new_tokens of it) and what precedes it;
    None when the row has no loss-mask token or nothing before its answer."""
    end = len(loss_mask)
    while end and not loss_mask[end - 1]:
        end -= 1
    start = end
    while start and loss_mask[start - 1]:
        start -= 1
    if start == end or start == 0:
        return None
    return list(input_ids[:start]), list(input_ids[start:min(end, start + max_new_tokens)])


def load_answers(directory: str, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"--answers {directory}: no such dataset directory")
    rows = datasets.load_from_disk(directory)
    missing = {"input_ids", "loss_mask"} - set(rows.column_names)
    if missing:
        raise ValueError(f"--answers {directory}: expected a data.distill dataset with input_ids and loss_mask, "
                         f"missing {sorted(missing)}")
    pairs = [last_answer(ids, mask, max_new_tokens) for ids, mask in zip(rows["input_ids"], rows["loss_mask"],
                                                                         strict=True)]
    pairs = [p for p in pairs if p is not None and len(p[1]) >= 2]
    if not pairs:
        raise ValueError(f"--answers {directory}: no row has an answer of 2 or more tokens after a prompt")
    return pairs


def replay(proposer: PromptLookupProposer, prompt: list[int], answer: list[int], step_costs: Sequence[float],
           max_tokens: int) -> dict[str, Any]:
    """One answer through the lookup under greedy verification. The first answer token comes from the prefill;
    each step drafts k tokens, commits the matching prefix + 1 and costs step_costs[k]."""
    proposer.reset(torch.tensor(prompt), None)
    committed = torch.tensor(prompt + answer[:1])  # [T]
    position, cost, steps, drafted = 1, 0.0, 0, 0
    while position < len(answer):
        draft = proposer.propose(committed, min(max_tokens, len(answer) - position - 1)).tokens[1:].tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == answer[position + accepted]:
            accepted += 1
        new = answer[position:position + accepted + 1]
        committed = torch.cat([committed, torch.tensor(new)])
        position += len(new)
        cost += step_costs[len(draft)]
        steps += 1
        drafted += bool(draft)
    return {"tokens": len(answer) - 1, "cost": cost, "steps": steps, "drafted_steps": drafted,
            "committed": committed[len(prompt):].tolist()}


def replay_set(pairs: list[tuple[list[int], list[int]]], step_costs: Sequence[float], required_gain: float,
               args: ReplayArguments, occurrence: str = OCCURRENCES[0]) -> dict[str, Any]:
    proposer = PromptLookupProposer(args.max_ngram, args.min_ngram, step_costs, required_gain=required_gain,
                                    prior=args.prior_pair(), occurrence=occurrence)
    results = [replay(proposer, prompt, answer, step_costs, args.max_speculative_tokens) for prompt, answer in pairs]
    tokens, cost = sum(r["tokens"] for r in results), sum(r["cost"] for r in results)
    steps = sum(r["steps"] for r in results)
    per_answer = sorted(r["tokens"] / r["cost"] for r in results)
    return {"answers": len(results), "required_gain": required_gain, "occurrence": occurrence,
            "prior": list(args.prior_pair()),
            "tau": tokens / steps,
            "drafted_share": sum(r["drafted_steps"] for r in results) / steps,
            "predicted_speedup": tokens / cost, "median_speedup": per_answer[len(per_answer) // 2],
            "answers_slower": sum(s < 1 for s in per_answer)}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_flags(ReplayArguments, argv)
    curve = load_curve(args.curve)
    step_costs = curve.relative_to_plain(args.max_speculative_tokens + 1)
    print(f"curve {Path(args.curve).name}: verify cost vs a plain step {describe_relative_costs(step_costs)}")
    rows = []
    for directory in args.answer_dirs():
        pairs = load_answers(directory, args.max_new_tokens)
        for gain in args.gains():
            for occurrence in args.occurrences():
                row = {"answers_from": directory, **replay_set(pairs, step_costs, gain, args, occurrence)}
                rows.append(row)
                print(f"{directory}: {row['answers']} answers, prior {args.prior}, required gain {gain:g}, occurrence "
                      f"{occurrence}: tau {row['tau']:.3f}, drafted {row['drafted_share']:.1%} of steps, predicted "
                      f"decode speed-up {row['predicted_speedup']:.4f} (median {row['median_speedup']:.3f}, "
                      f"{row['answers_slower']} answers slower)")
    if args.output:
        write_json(Path(args.output), {"curve": args.curve, "curve_dtype": curve.dtype,
                                              "step_costs": step_costs, "config": vars(args), "results": rows})
    return rows


if __name__ == "__main__":
    run_cli(main)
