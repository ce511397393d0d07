"""Greedy exactness in a reduced dtype: does speculative greedy output equal plain greedy decoding, and where not, why?

    python -m bench.exactness --model ../shared/models/smollm2-135m-instruct --dtype bfloat16 \\
        --method prompt_lookup --max_prompts 8 --max_new_tokens 64 --output_json outputs/bench/exactness_bf16.json

In float32 the two are token-identical (tested). In bfloat16 the verify forward (several tokens, tree mask) and a
plain decoding step (one token) run different kernel shapes, whose roundings differ, so where the target's two best
logits are nearly tied the argmax can flip and the outputs part from there on (both are then valid greedy decodings
of the bf16 model, neither is "the" answer). Per prompt this prints and writes: identical or not, the first
position where the method's tokens leave plain decoding's, and the top-2 logit gap of the plain logits there (the
logits recomputed by one forward over prompt + plain tokens in the same dtype) with the share of all positions
whose gap is at most that large (a near-tie is a gap in the lowest few percent).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import load_target, read_prompts, run_ours
from bench.report import write_json
from heads.cli import parse_flag_groups, run_cli
from heads.loading import dtype_name
from runtime.build import build_proposer, encode_prompt
from runtime.config import GenerateArguments
from runtime.loop import GenerationStats
from runtime.proposers import Autoregressive


@dataclass
class ExactnessArguments:
    """Flags of `python -m bench.exactness` besides the model / method / dtype flags of runtime.generate."""

    prompts: str = field(default="../shared/data/mt_bench_question.jsonl", metadata={
        "help": "prompt file (first user turn of each row is used)"})
    max_prompts: int = field(default=8, metadata={"help": "use at most this many prompts"})
    output_json: str = field(default="outputs/bench/exactness.json", metadata={"help": "results file (JSON)"})


@torch.inference_mode()
def top2_gaps(model, input_ids: torch.Tensor, new_tokens: list[int]) -> torch.Tensor:
    """Gap between the two largest logits predicting each new token: [len(new_tokens)] float32.

    One forward over prompt + new tokens (input_ids [T]) in the model's dtype; position p of the result is the
    logit gap before new token p was chosen.
    """
    ids = torch.cat([input_ids, torch.tensor(new_tokens[:-1], dtype=torch.long)]).to(model.device)
    logits = model(ids[None]).logits[0, input_ids.numel() - 1:].float()  # [len(new_tokens), V]
    top = logits.topk(2, dim=-1).values  # [N, 2]
    return (top[:, 0] - top[:, 1]).cpu()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where a and b differ (the shorter one's length when one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def prompt_result(index: int, plain: list[int], method: list[int], gaps: torch.Tensor, tau: float = 1.0
                  ) -> dict[str, Any]:
    """One prompt's record: identical, first divergence, gap there and its rank among all positions' gaps, and the
    method's tau (tokens per verify: above 1 means multi-token verifies were compared, not just plain steps)."""
    position = first_divergence(plain, method)
    record: dict[str, Any] = {"index": index, "new_tokens": len(plain), "identical": position is None, "tau": tau,
                              "first_divergence": position, "median_top2_gap": float(gaps.median())}
    if position is not None and position < gaps.numel():
        gap = float(gaps[position])
        record.update(gap_at_divergence=gap, gap_share_at_most=float((gaps <= gap).float().mean()),
                      plain_token=plain[position], method_token=method[position] if position < len(method) else None)
    return record


def summarize(records: list[dict[str, Any]], tau: float = 1.0) -> dict[str, Any]:
    diverged = [r for r in records if not r["identical"]]
    gaps = [r["gap_at_divergence"] for r in diverged if "gap_at_divergence" in r]
    return {"prompts": len(records), "identical": len(records) - len(diverged), "tau": tau,
            "identical_share": (len(records) - len(diverged)) / len(records),
            "first_divergence_positions": [r["first_divergence"] for r in diverged],
            "gaps_at_divergence": gaps,
            "gap_share_at_most": [r["gap_share_at_most"] for r in diverged if "gap_share_at_most" in r],
            "median_top2_gap_all_positions": statistics.median(r["median_top2_gap"] for r in records)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    gen_args, args = parse_flag_groups((GenerateArguments, ExactnessArguments), argv)
    if args.max_prompts < 1:
        raise ValueError(f"--max_prompts must be >= 1, got {args.max_prompts}")
    torch.set_num_threads(gen_args.num_threads)
    config = gen_args.decode_config()
    if not config.sampling.is_greedy:
        raise ValueError(f"--temperature {gen_args.temperature}: exactness is about greedy decoding; use 0")
    prompts = read_prompts(args.prompts, args.max_prompts)
    target, tokenizer = load_target(gen_args)  # the load-time verify check too
    model = target.model
    proposer = build_proposer(gen_args, target, tokenizer)
    records, method_stats = [], []
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt)
        plain = run_ours(target, Autoregressive(), ids, config).tokens
        run = run_ours(target, proposer, ids, config)
        method_stats.append(run.stats)
        records.append(prompt_result(i, plain, run.tokens, top2_gaps(model, ids, plain), run.stats.tau))
        r = records[-1]
        where = "" if r["identical"] else (f", first divergence at token {r['first_divergence']}, plain top-2 gap "
                                           f"{r.get('gap_at_divergence', float('nan')):.4f} (<= it: "
                                           f"{r.get('gap_share_at_most', float('nan')):.1%} of positions)")
        print(f"[exactness] prompt {i + 1}/{len(prompts)}: identical {r['identical']}{where}, tau {r['tau']:.2f}",
              file=sys.stderr)
    result = {"config": {**dataclasses.asdict(gen_args), **dataclasses.asdict(args),
                         "method": gen_args.resolved_method(), "dtype_used": dtype_name(model.dtype)},
              "overall": summarize(records, GenerationStats.merged(method_stats).tau), "prompts": records}
    result["config"].pop("prompt")
    write_json(args.output_json, result)
    o = result["overall"]
    print(f"{result['config']['dtype_used']}, {result['config']['method']} (tau {o['tau']:.2f}): "
          f"{o['identical']}/{o['prompts']} prompts "
          f"identical to plain greedy decoding; first divergences at {o['first_divergence_positions']}, plain top-2 "
          f"gaps there {[round(g, 4) for g in o['gaps_at_divergence']]} (median gap over all positions "
          f"{o['median_top2_gap_all_positions']:.3f}); wrote {args.output_json}")
    return result


if __name__ == "__main__":
    run_cli(main)
