"""Draft confidence vs acceptance of EAGLE heads, and what drafting only when the head is sure would give.

    python -m bench.calibration --model ../shared/models/smollm2-135m-instruct \
        --heads outputs/scaling/smollm2/eagle_240000/heads --prompts ../shared/data/mt_bench_question.jsonl \
        --max_prompts 20 --output_json results/calibration_eagle_smollm2.json

Decodes greedily with the heads (EAGLE-1/2/3) drafting one token per step, and records per step the draft's
confidence p (the top-1 probability of the root's children, softmax over the draft vocabulary) and whether the
target accepted that token. Prints the share of steps and their acceptance per confidence bin (EAGLE-2's
observation: a head's confidence predicts acceptance), then, for thresholds t, the speed-up over plain
decoding the cost model predicts when only steps with p >= t verify the drafted token and the others are plain
steps: per step, cost = draft + (verify of 2 tokens if drafted, else 1) in plain-step units (the verify cost
curve of this device, cached; the draft time measured in the run), tokens = 1 + accepted if drafted, else 1.
The draft runs on every step (it is what decides), so below the break-even a head cannot pay by gating either.

`--eagle_tree dynamic` checks what the confidence gate (runtime.proposers.eagle: min_expected) reads instead: EAGLE-2
trees of the planner's shape and size, never guarded or gated, and per step the draft's own expected accepted tokens
(`Draft.expected`, the sum of its nodes' path probabilities) against the draft tokens the target accepted, per bin
of the expected (mean expected and mean accepted in each: equal means calibrated).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import load_target, read_prompts, run_ours
from bench.report import write_json
from heads.cli import parse_flags, run_cli
from heads.loading import dtype_name
from runtime.build import encode_prompt
from runtime.config import DecodeConfig, SpeculationConfig
from runtime.cost_model import verify_cost_curve
from runtime.layout import LAYOUT_HELP
from runtime.proposers.base import Draft
from runtime.proposers.eagle import EagleProposer
from runtime.proposers.factory import HeadsOptions, proposer_from_heads

BIN_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)
THRESHOLDS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
EXPECTED_EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0, 1.5, 3.0)


@dataclass
class CalibrationArgs:
    model: str = field(default="../shared/models/smollm2-135m-instruct", metadata={"help": "Target model."})
    heads: str = field(default="", metadata={"help": "EAGLE-1/2/3 heads directory (or Hub id)."})
    prompts: str = field(default="../shared/data/mt_bench_question.jsonl", metadata={
        "help": "Prompt file (MT-Bench/Spec-Bench JSONL with turns, or JSONL/text: one prompt per row)."})
    max_prompts: int = field(default=20, metadata={"help": "Prompts decoded (first turns)."})
    max_new_tokens: int = field(default=128, metadata={"help": "Greedy tokens per prompt."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 where fast, else fp32), float32, bfloat16."})
    num_threads: int = field(default=1, metadata={"help": "torch threads."})
    weight_layout: str = field(default="auto", metadata={"help": LAYOUT_HELP})
    eagle_tree: str = field(default="static", metadata={
        "help": "static: a chain of 1, the root's top-1 confidence; dynamic: EAGLE-2 trees of the planner's shape and "
                "size, the draft's expected accepted tokens (Draft.expected) against those accepted"})
    tree_size: str = field(default="auto", metadata={"help": "--eagle_tree dynamic: draft tokens per step or auto "
                                                           "(the planner's, from the heads' held-out accuracy)"})
    tree_depth: str = field(default="auto", metadata={"help": "--eagle_tree dynamic: EAGLE-2 depth or auto"})
    tree_top_k: str = field(default="auto", metadata={"help": "--eagle_tree dynamic: EAGLE-2 top_k or auto"})
    output_json: str = field(default="", metadata={"help": "Write the tables here (JSON)."})


class ConfidenceRecorder:
    """A proposer wrapper: proposes one token with the EAGLE proposer and records its confidence; after the
    step, whether it was accepted. `records` = [(confidence, accepted)] in step order."""

    def __init__(self, proposer: EagleProposer):
        if not isinstance(proposer, EagleProposer):
            raise ValueError(f"--heads: confidence calibration needs EAGLE-1/2/3 heads, got a "
                             f"{type(proposer).__name__}")
        self.proposer = proposer
        self.hidden_state_indices = proposer.hidden_state_indices
        self.records: list[tuple[float, bool]] = []
        self.measuring_seconds = 0.0  # inside the loop's draft time, not the draft's: subtracted
        self._confidence: float | None = None

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        self.proposer.reset(prompt_ids, prefill_hidden)

    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        draft = self.proposer.propose(committed_ids, min(max_tokens, 1))
        start = time.perf_counter()
        logits = self.proposer.root_logits()  # the draft computed these; recomputing them is not its cost
        self._confidence = None if logits is None or draft.tokens.numel() < 2 else \
            float(torch.softmax(logits, dim=-1).max())
        self.measuring_seconds += time.perf_counter() - start
        return draft

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        if self._confidence is not None:
            self.records.append((self._confidence, len(accepted_nodes) > 1))
        self.proposer.on_accept(committed_ids, draft, accepted_nodes, tree_hidden)


class ExpectedRecorder:
    """A proposer wrapper: drafts the EAGLE-2 tree it is asked for and records, per drafted step, the draft's
    expected accepted tokens and the draft tokens the target accepted: `records` = [(expected, accepted)]."""

    def __init__(self, proposer: EagleProposer):
        if not isinstance(proposer, EagleProposer) or proposer.dynamic is None:
            raise ValueError(f"--heads: --eagle_tree dynamic needs EAGLE-1/2/3 heads drafting EAGLE-2 trees, got a "
                             f"{type(proposer).__name__}")
        proposer.min_expected = 0.0  # every tree drafted as it is, never gated
        self.proposer = proposer
        self.hidden_state_indices = proposer.hidden_state_indices
        self.tree_size = proposer.tree_size
        self.records: list[tuple[float, int]] = []
        self._expected: float | None = None

    def reset(self, prompt_ids: torch.Tensor, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        self.proposer.reset(prompt_ids, prefill_hidden)

    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        draft = self.proposer.propose(committed_ids, max_tokens)
        self._expected = draft.expected if draft.tree.num_nodes > 1 else None
        return draft

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        if self._expected is not None:
            self.records.append((self._expected, len(accepted_nodes) - 1))
        self.proposer.on_accept(committed_ids, draft, accepted_nodes, tree_hidden)


def binned(records: Sequence[tuple[float, Any]], edges: Sequence[float]) -> Iterator[tuple[float, float, list]]:
    """(lo, hi, the records whose first value lies in [lo, hi)) per bin of `edges`, the last bin closed."""
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        last = i == len(edges) - 2
        yield lo, hi, [r for r in records if lo <= r[0] and (r[0] < hi or (last and r[0] <= hi))]


def expected_bins(records: Sequence[tuple[float, int]], edges: Sequence[float] = EXPECTED_EDGES
                  ) -> list[dict[str, Any]]:
    """Per bin [lo, hi) of the expected (the last one closed): steps, mean expected, mean accepted (None if empty)."""
    return [{"low": lo, "high": hi, "steps": len(inside),
             "expected": sum(e for e, _ in inside) / len(inside) if inside else None,
             "accepted": sum(a for _, a in inside) / len(inside) if inside else None}
            for lo, hi, inside in binned(records, edges)]


def confidence_bins(records: Sequence[tuple[float, bool]], edges: Sequence[float] = BIN_EDGES) -> list[dict[str, Any]]:
    """Per bin [lo, hi) (the last one closed): steps, share of all steps, acceptance rate (None if empty)."""
    return [{"low": lo, "high": hi, "steps": len(inside), "share": len(inside) / max(len(records), 1),
             "acceptance": sum(a for _, a in inside) / len(inside) if inside else None}
            for lo, hi, inside in binned(records, edges)]


def gated_speedup(records: Sequence[tuple[float, bool]], threshold: float, verify_two: float,
                  draft: float) -> dict[str, float | None]:
    """Predicted speed-up over plain decoding when only steps with confidence >= threshold verify their token.

    verify_two: cost of verifying 2 tokens in plain steps; draft: the draft's cost per step in plain steps."""
    drafted = [a for p, a in records if p >= threshold]
    steps = len(records)
    if not steps:
        return {"threshold": threshold, "drafted_share": None, "acceptance": None, "predicted_speedup": None}
    tokens = steps + sum(drafted)
    cost = steps * draft + len(drafted) * verify_two + (steps - len(drafted))
    return {"threshold": threshold, "drafted_share": len(drafted) / steps,
            "acceptance": sum(drafted) / len(drafted) if drafted else None, "predicted_speedup": tokens / cost}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_flags(CalibrationArgs, argv)
    if not args.heads:
        raise ValueError("--heads is required (EAGLE-1/2/3 heads directory)")
    if args.eagle_tree not in ("static", "dynamic"):
        raise ValueError(f"--eagle_tree must be static or dynamic, got {args.eagle_tree!r}")
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target(model=args.model, dtype=args.dtype, weight_layout=args.weight_layout)
    if args.eagle_tree == "dynamic":
        return expected_calibration(args, target, tokenizer)
    built = proposer_from_heads(args.heads, target, HeadsOptions(tree_size="1", eagle_tree="static"),
                                target_name=args.model)
    recorder = ConfidenceRecorder(built.proposer)
    curve = verify_cost_curve(target, kv_length=256, max_tokens=2)
    plain_seconds, verify_two = curve.seconds_at(1), curve.relative_to_plain(2)[1]
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, speculation=SpeculationConfig(num_speculative_tokens=1))
    draft_seconds = steps = 0
    for prompt in read_prompts(args.prompts, args.max_prompts):
        run = run_ours(target, recorder, encode_prompt(tokenizer, [{"role": "user", "content": prompt}]), config)
        draft_seconds += run.stats.draft_time
        steps += len(run.stats.steps)
    draft = (draft_seconds - recorder.measuring_seconds) / max(steps, 1) / plain_seconds
    records = recorder.records
    result = {"model": args.model, "heads": args.heads, "dtype": dtype_name(target.dtype),
              "prompts": args.max_prompts, "max_new_tokens": args.max_new_tokens, "steps": len(records),
              "acceptance": sum(a for _, a in records) / max(len(records), 1),
              "verify_two_tokens_cost": verify_two, "draft_cost": draft,
              "bins": confidence_bins(records),
              "gated": [gated_speedup(records, t, verify_two, draft) for t in THRESHOLDS]}
    print(f"{len(records)} steps, acceptance {result['acceptance']:.3f}; verify of 2 tokens x{verify_two:.2f} a plain "
          f"step, draft {draft:.3f} of one")
    print(f"{'confidence':>12} {'share':>6} {'accepted':>8}")
    for row in result["bins"]:
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.3f}"
        print(f"{row['low']:>5.1f}-{row['high']:<5.1f} {row['share']:6.3f} {acc:>8}")
    print(f"{'draft if p >=':>13} {'drafted':>7} {'accepted':>8} {'predicted speed-up':>18}")
    for row in result["gated"]:
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.3f}"
        print(f"{row['threshold']:>13.2f} {row['drafted_share']:7.3f} {acc:>8} {row['predicted_speedup']:18.3f}")
    if args.output_json:
        write_json(args.output_json, result)
    return result


def expected_calibration(args: CalibrationArgs, target, tokenizer) -> dict[str, Any]:
    """--eagle_tree dynamic: the draft's expected accepted tokens against the accepted, per bin."""
    options = HeadsOptions(tree_size=args.tree_size, tree_depth=args.tree_depth, tree_top_k=args.tree_top_k,
                           allow_off=False)
    built = proposer_from_heads(args.heads, target, options, target_name=args.model)
    recorder = ExpectedRecorder(built.proposer)
    config = DecodeConfig(max_new_tokens=args.max_new_tokens,
                          speculation=SpeculationConfig(num_speculative_tokens=recorder.tree_size))
    for prompt in read_prompts(args.prompts, args.max_prompts):
        run_ours(target, recorder, encode_prompt(tokenizer, [{"role": "user", "content": prompt}]), config)
    records = recorder.records
    steps = max(len(records), 1)
    result = {"model": args.model, "heads": args.heads, "dtype": dtype_name(target.dtype), "eagle_tree": "dynamic",
              "drafter": built.description, "prompts": args.max_prompts, "max_new_tokens": args.max_new_tokens,
              "steps": len(records), "mean_expected": sum(e for e, _ in records) / steps,
              "mean_accepted": sum(a for _, a in records) / steps, "expected_bins": expected_bins(records)}
    print(f"{built.description}: {len(records)} drafted steps, expected {result['mean_expected']:.3f} accepted "
          f"draft tokens per step, accepted {result['mean_accepted']:.3f}")
    print(f"{'expected':>11} {'steps':>6} {'mean expected':>13} {'accepted':>8}")
    for row in result["expected_bins"]:
        if row["steps"]:
            print(f"{row['low']:>4.1f}-{row['high']:<5.1f} {row['steps']:6d} {row['expected']:13.3f} "
                  f"{row['accepted']:8.3f}")
    if args.output_json:
        write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    run_cli(main)
