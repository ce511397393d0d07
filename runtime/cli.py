"""`python -m runtime.generate`: flags (or `--config file.yaml`) -> SpeculativeModel -> streamed text and a stats line.

    python -m runtime.generate --model ../shared/models/smollm2-135m-instruct --method prompt_lookup \
        --prompt "Repeat after me: the quick brown fox jumps over the lazy dog." --max_new_tokens 64
"""

from __future__ import annotations

import sys

import torch

from heads.cli import parse_flags, run_cli
from runtime.api import SpeculativeModel
from runtime.config import GenerateArguments
from runtime.loop import GenerationStats


def main(argv: list[str] | None = None) -> GenerationStats:
    args = parse_flags(GenerateArguments, argv)  # `--config file.yaml` gives defaults, flags override
    if not args.prompt.strip():  # before loading anything or measuring costs
        raise ValueError("--prompt: empty text; a prompt needs at least one token")
    torch.set_num_threads(args.num_threads)
    model = SpeculativeModel.from_args(args)
    stats = GenerationStats()
    for piece in model.stream(args.prompt, stats=stats):
        sys.stdout.write(piece)
        sys.stdout.flush()
    print()
    rates = ", ".join(f"{r:.2f}" for r in stats.acceptance_per_depth)
    print(f"[{args.resolved_method()}] new tokens {stats.new_tokens} in {len(stats.steps) + 1} forwards, "
          f"tau {stats.tau:.2f}, {stats.tokens_per_second:.1f} tokens/s, stop: {stats.stop_reason}, "
          f"acceptance per depth [{rates}]")
    return stats


if __name__ == "__main__":
    run_cli(main)
