"""Simulate the guard on seeded answers, without a model: what it keeps of a paying head, what it loses on a bad one.

    python -m bench.guard_sim [--answers 300] [--output_json results/guard_sim.json]

Each case is a drafter whose drafted steps commit 1..5 tokens with fixed probabilities (independent steps), a
drafted step's cost in plain steps, the planner's prior tau and an answer length in steps. For every seeded answer
the same accepted lengths are played through `runtime.proposers.guard.PayingGuard` as the decode loop calls it
(propose, then on_accept with what was accepted; a resting step commits one token at cost 1), once with the
ledger's loss cap and once without it, and priced by the same costs: speed-up = tokens / cost. Printed per case: the
forced speed-up (drafting every step), and the mean and worst answer of each guard.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.report import markdown_table, write_json
from heads.cli import parse_flags, run_cli
from runtime.proposers.base import Draft
from runtime.proposers.guard import PayingGuard
from runtime.tree import Tree

# (weights of committing 1..5 tokens on a drafted step, step cost, prior tau, steps)
CASES = (
    ((80, 15, 5, 0, 0), 1.37, 1.4, 110),  # just under break-even, a long answer
    ((87, 3, 5, 3, 2), 1.37, 1.6, 110),  # bursty, under break-even
    ((50, 30, 15, 5, 0), 1.37, 1.6, 110),  # a head that pays well
    ((60, 25, 10, 5, 0), 1.37, 1.6, 110),  # a head that pays a little
    ((100, 0, 0, 0, 0), 1.1, 1.5, 35),  # never accepts, cheap steps, a short answer
    ((100, 0, 0, 0, 0), 1.3, 1.5, 35),  # never accepts, dear steps, a short answer
    ((70, 20, 10, 0, 0), 1.2, 1.5, 35),  # pays, a short answer
)


@dataclass
class GuardSimConfig:
    """Flags of `python -m bench.guard_sim`."""

    answers: int = field(default=300, metadata={"help": "Seeded answers per case."})
    output_json: str = field(default="", metadata={"help": "Write the cases' results here (JSON)."})

    def __post_init__(self) -> None:
        if self.answers < 1:
            raise ValueError(f"--answers: expected >= 1, got {self.answers}")


class _FixedChain:
    """A drafter that always offers the same 2-token chain; what it commits is the simulation's draw."""

    hidden_state_indices = ()
    tree_size = 2

    def __init__(self) -> None:
        committed = torch.arange(1, 8)
        self.committed, self.draft = committed, Draft(tokens=committed[-3:], tree=Tree.chain(2))

    def reset(self, prompt_ids, prefill_hidden) -> None:
        pass

    def propose(self, committed_ids, max_tokens) -> Draft:
        return self.draft

    def on_accept(self, committed_ids, draft, accepted_nodes, tree_hidden) -> None:
        pass


def play(guard: PayingGuard, drafter: _FixedChain, cost: float, lengths: list[int], steps: int) -> float:
    """Speed-up of one answer: tokens over cost in plain steps."""
    tokens, priced = 0, 0.0
    for step in range(steps):
        draft = guard.propose(drafter.committed, 3)
        drafted = draft.tree.num_nodes > 1
        length = lengths[step] if drafted else 1
        guard.on_accept(drafter.committed, draft, list(range(length)), None)
        tokens, priced = tokens + length, priced + (cost if drafted else 1.0)
    return tokens / priced


def simulate(weights: tuple[int, ...], cost: float, prior: float, steps: int, answers: int) -> dict[str, Any]:
    forced, capped, uncapped = [], [], []
    for seed in range(answers):
        rng = random.Random(seed)
        lengths = [rng.choices(range(1, len(weights) + 1), weights=weights)[0] for _ in range(steps)]
        forced.append(sum(lengths) / (steps * cost))
        for results, budget in ((capped, None), (uncapped, float("inf"))):
            drafter = _FixedChain()
            guard = PayingGuard(drafter, step_cost=cost, expected_tau=prior)
            if budget is not None:
                guard.ledger.budget = budget
            results.append(play(guard, drafter, cost, lengths, steps))
    tau = sum(w * n for n, w in enumerate(weights, 1)) / sum(weights)
    return {"tau": round(tau, 3), "step_cost": cost, "prior_tau": prior, "steps": steps, "answers": answers,
            "forced_mean": round(statistics.mean(forced), 4),
            "capped_mean": round(statistics.mean(capped), 4), "capped_worst": round(min(capped), 4),
            "uncapped_mean": round(statistics.mean(uncapped), 4), "uncapped_worst": round(min(uncapped), 4)}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    config = parse_flags(GuardSimConfig, argv)
    rows = [simulate(*case, config.answers) for case in CASES]
    print(markdown_table(["tau", "step cost", "prior", "steps", "forced", "guard mean", "guard worst",
                          "no cap mean", "no cap worst"],
                         [[r["tau"], r["step_cost"], r["prior_tau"], r["steps"], r["forced_mean"], r["capped_mean"],
                           r["capped_worst"], r["uncapped_mean"], r["uncapped_worst"]] for r in rows]), flush=True)
    if config.output_json:
        write_json(config.output_json, {"config": vars(config), "cases": rows})
    return rows


if __name__ == "__main__":
    run_cli(main)
