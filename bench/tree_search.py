"""Measure Medusa heads' per-head, per-rank accuracy and write the sparse tree grown from it (runtime.tree_search).

    python -m bench.tree_search --model M --heads H --prompts FILE --num_nodes N --output configs/trees/x.yaml
    python -m bench.tree_search --accuracy '[[0.6, 0.18, ...], [0.42, ...]]' --num_nodes 32 --output tree.yaml

The accuracy table comes from the target's own greedy continuations of the prompts (`measure_accuracy_table`) or
from --accuracy; the tree is the greedy search of runtime.tree_search over it, written as a tree file (the command
that produced it in its header comment) that runtime.tree_search.load_tree_file reads.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import load_target, read_prompts
from heads.base import target_modules
from heads.checkpoint import load_heads
from heads.cli import parse_flags, run_cli
from heads.files import atomic_write_text
from heads.medusa import MedusaHeads, shared_lm_head_rows
from runtime.build import encode_prompt
from runtime.tree_search import expected_accepted_length, grow_tree, validate_paths


@dataclass
class TreeSearchArgs:
    """Flags of `python -m bench.tree_search`."""

    output: str = field(metadata={"help": "tree YAML to write (e.g. configs/trees/medusa_smollm2_32.yaml)"})
    num_nodes: int = field(default=32, metadata={"help": "non-root nodes in the tree"})
    model: str = field(default="", metadata={"help": "target model (Hub id, directory or GGUF); with --heads"})
    heads: str = field(default="", metadata={"help": "Medusa heads directory or Hub id to measure"})
    prompts: str = field(default="", metadata={"help": "calibration prompts (any format data.prompts reads: "
                                                        "JSONL/JSON with turns/conversations/prompt)"})
    max_prompts: int = field(default=16, metadata={"help": "calibration prompts to use"})
    max_new_tokens: int = field(default=64, metadata={"help": "greedy continuation length per prompt"})
    top_k: int = field(default=8, metadata={"help": "ranks measured per head"})
    accuracy: str = field(default="", metadata={"help": "instead of measuring: a JSON table "
                                                         "'[[head0 rank0, rank1, ...], [head1 ...], ...]'"})
    note: str = field(default="", metadata={"help": "extra line for the file's header comment"})
    dtype: str = field(default="auto", metadata={"help": "target dtype: auto (bfloat16 where fast, float32 "
                                                "elsewhere) / float32 / bfloat16"})
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads"})


def write_tree_file(path: str | Path, paths: Sequence[Sequence[int]], header: str,
                    accuracy: Sequence[Sequence[float]] | None = None) -> None:
    """Write rank paths (BFS order) atomically, with `header` as leading comment lines (and the table they were
    grown from, with its E[tau], when given)."""
    ordered = validate_paths(paths, str(path))
    lines = [f"# {line}" if line else "#" for line in header.strip().splitlines()]
    lines.append("paths: [" + ", ".join("[" + ", ".join(map(str, p)) + "]" for p in ordered) + "]")
    if accuracy is not None:
        expected = expected_accepted_length(ordered, accuracy)  # checks the table: ValueError naming the entry
        lines.append(f"expected_accepted_length: {expected:.4f}")
        lines.append("accuracy:")
        lines.extend("  - [" + ", ".join(f"{float(a):.4f}" for a in row) + "]" for row in accuracy)
    atomic_write_text(path, "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_flags(TreeSearchArgs, argv)
    torch.set_num_threads(args.num_threads)
    if args.accuracy:
        try:
            table = json.loads(args.accuracy)
        except json.JSONDecodeError as err:
            raise ValueError(f"--accuracy: expected a JSON list of lists, got {args.accuracy!r}") from err
        source = "the --accuracy table"
    else:
        if not (args.model and args.heads and args.prompts):
            raise ValueError("pass --model, --heads and --prompts to measure the accuracy table, or --accuracy")
        table = measure_accuracy_table_cli(args)
        source = f"accuracy measured for {args.heads} on {args.prompts} ({args.max_prompts} prompts, "\
                 f"{args.max_new_tokens} greedy tokens each)"
    paths = grow_tree(table, args.num_nodes)  # checks the table (ValueError naming the entry)
    command = "python -m bench.tree_search " + " ".join(shlex.quote(a) for a in argv)
    header = f"{command}\nMedusa sparse tree, {len(paths)} nodes, grown greedily from {source}.\n" \
             f"accuracy[h][r] = P(head h's rank-r token is the target's token)." + \
             (f"\n{args.note}" if args.note else "")
    write_tree_file(args.output, paths, header, accuracy=table)
    print(f"wrote {args.output}: {len(paths)} nodes, depth {max(len(p) for p in paths)}, "
          f"E[tau] = {expected_accepted_length(paths, table):.3f}")


@torch.inference_mode()
def measure_accuracy_table(model, heads, sequences: Sequence[tuple[torch.Tensor, int]], top_k: int
                           ) -> list[list[float]]:
    """Per-head, per-rank accuracy of Medusa `heads` on the target's own greedy continuations.

    sequences: (ids [T] = prompt + the target's greedy continuation, prompt length). For every position t of
    the continuation (t >= prompt length - 1) and head h with t+2+h < T, the rank of token t+2+h in head h's
    logits at t is counted. Returns accuracy[h][r] = P(rank == r), r < top_k (one row per head).
    """
    lm_head_rows = shared_lm_head_rows(target_modules(model).lm_head) if heads.config.medusa_shared_lm_head else None
    layer = heads.config.target_layers[0]
    hits = torch.zeros(heads.num_heads, top_k, dtype=torch.float64)
    counts = torch.zeros(heads.num_heads, dtype=torch.float64)
    device = next(model.parameters()).device
    for ids, prompt_length in sequences:
        ids = ids.to(device)
        hidden = model(ids[None], output_hidden_states=[layer]).hidden_states[layer]  # [1, T, H]
        logits = heads.compute_logits(hidden.to(heads.dtype), lm_head_rows)[:, 0].float()  # [K, T, V]
        length = ids.numel()
        for h in range(heads.num_heads):
            positions = torch.arange(max(prompt_length - 1, 0), length - 2 - h, device=device)
            if positions.numel() == 0:
                continue
            truth = ids[positions + 2 + h]  # [P]
            rows = logits[h, positions]  # [P, V]
            rank = (rows > rows.gather(1, truth[:, None])).sum(1)  # [P] rank of the true token (ties: best)
            hits[h] += torch.bincount(rank[rank < top_k].cpu(), minlength=top_k)[:top_k].double()
            counts[h] += positions.numel()
    if bool((counts == 0).any()):
        raise ValueError("measure_accuracy_table: no positions to measure (continuations too short)")
    return (hits / counts[:, None]).tolist()


def measure_accuracy_table_cli(args: TreeSearchArgs) -> list[list[float]]:
    """Load target, heads and prompts per the CLI flags; greedy continuations; the accuracy table."""
    # the weights as loaded (rows): transformers' generate and forward run on them as a user runs them
    target, tokenizer = load_target(model=args.model, dtype=args.dtype, weight_layout="rows")
    model = target.model
    heads = load_heads(args.heads, target=model, target_name=args.model, dtype=model.dtype)
    if not isinstance(heads, MedusaHeads):
        raise ValueError(f"--heads {args.heads}: the sparse-tree search needs Medusa heads, got kind "
                         f"{heads.config.kind!r} (EAGLE trees are dynamic: --eagle_tree dynamic)")
    if args.top_k > heads.config.vocab_size:
        raise ValueError(f"--top_k {args.top_k} is larger than the vocabulary ({heads.config.vocab_size})")
    sequences = []
    for text in read_prompts(args.prompts, args.max_prompts):
        ids = encode_prompt(tokenizer, text)
        out = model.generate(ids[None], max_new_tokens=args.max_new_tokens, do_sample=False)[0]
        sequences.append((out, ids.numel()))
    return measure_accuracy_table(model, heads, sequences, args.top_k)


if __name__ == "__main__":
    run_cli(main)
