"""Sparse candidate trees for Medusa heads: the greedy search of the Medusa paper, tree files, and the CLI.

A static tree node is a *rank path* `(r_1, ..., r_d)`: the node at depth d holds head (d-1)'s rank-r_d
token, below the node `(r_1, ..., r_{d-1})`. The root (depth 0, the last committed token) is the empty
path and is implicit in tree files.

Accuracy table: `accuracy[h][r]` = probability that head h's rank-r token (0 = its argmax) is the token the
target emits, measured on calibration prompts. Under the paper's independence assumption a node is
accepted with probability `prod_d accuracy[d-1][r_d]`, so the expected accepted length of a tree is
`1 + sum over its nodes of that product` (the 1 is the bonus token). The greedy search adds, one node at a
time, the addable node (its parent already in the tree) with the largest product; since every factor is
<= 1 a child never beats its parent, so the result is the best tree of each size under that model.

Tree files (YAML), written by this module and read by the Medusa proposer:

    # <command that produced it>
    paths: [[0], [1], [0, 0], ...]     # rank paths, BFS order (shorter first, then lexicographic)
    expected_accepted_length: 2.31     # optional, informational
    accuracy: [[...], ...]             # optional, the table the tree was grown from

CLI (needs Medusa heads for the target):

    python -m runtime.tree_search --model M --heads H --prompts FILE --num_nodes N --output configs/trees/x.yaml
"""

from __future__ import annotations

import heapq
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from heads.files import atomic_write_text
from runtime.tree import Tree

RankPath = tuple[int, ...]
_TREE_FILE_KEYS = {"paths", "expected_accepted_length", "accuracy"}


def _check_table(accuracy: Sequence[Sequence[float]]) -> list[list[float]]:
    table = [[float(a) for a in row] for row in accuracy]
    if not table or any(len(row) == 0 for row in table):
        raise ValueError("accuracy table must have at least one head and one rank per head")
    for h, row in enumerate(table):
        for r, a in enumerate(row):
            if not (0.0 <= a <= 1.0) or math.isnan(a):
                raise ValueError(f"accuracy[{h}][{r}] = {a} is not a probability in [0, 1]")
    return table


def path_value(path: RankPath, accuracy: Sequence[Sequence[float]]) -> float:
    """Probability that the node `path` is accepted: prod_d accuracy[d][path[d]]."""
    value = 1.0
    for depth, rank in enumerate(path):
        value *= float(accuracy[depth][rank])
    return value


def grow_tree(accuracy: Sequence[Sequence[float]], num_nodes: int) -> list[RankPath]:
    """Greedy sparse-tree search: the `num_nodes` non-root nodes with the largest expected contribution.

    accuracy: [num_heads][top_k] per-head, per-rank accuracies. Returns the rank paths in the order they
    were added (descending value; ties broken by shorter, then lexicographically smaller path). At most
    every node of the full top_k-ary tree of depth num_heads can be added.
    """
    table = _check_table(accuracy)
    if num_nodes < 0:
        raise ValueError(f"--num_nodes must be >= 0, got {num_nodes}")
    # Max-heap of addable nodes keyed by (-value, depth, path) -> deterministic tie breaking.
    frontier: list[tuple[float, int, RankPath]] = [(-table[0][r], 1, (r,)) for r in range(len(table[0]))]
    heapq.heapify(frontier)
    chosen: list[RankPath] = []
    while frontier and len(chosen) < num_nodes:
        neg_value, depth, path = heapq.heappop(frontier)
        chosen.append(path)
        if depth < len(table):
            for r in range(len(table[depth])):
                heapq.heappush(frontier, (neg_value * table[depth][r], depth + 1, path + (r,)))
    return chosen


def expected_accepted_length(paths: Sequence[RankPath], accuracy: Sequence[Sequence[float]]) -> float:
    """1 (bonus token) + sum of node acceptance probabilities: the model's E[tau] for this tree."""
    table = _check_table(accuracy)
    return 1.0 + sum(path_value(tuple(p), table) for p in paths)


def expected_accepted_lengths(accuracy: Sequence[Sequence[float]], max_nodes: int) -> list[float]:
    """E[tau] of the best greedy tree of every size 0..max_nodes (index = number of non-root nodes)."""
    table = _check_table(accuracy)
    taus = [1.0]
    for path in grow_tree(table, max_nodes):
        taus.append(taus[-1] + path_value(path, table))
    return taus


def bfs_order(paths: Sequence[Sequence[int]]) -> list[RankPath]:
    """Rank paths sorted shorter-first, then lexicographically: every parent precedes its children."""
    return sorted((tuple(int(r) for r in p) for p in paths), key=lambda p: (len(p), p))


@dataclass(frozen=True)
class StaticTree:
    """A static tree ready for the runtime: topology plus, per node, which head and rank fills it.

    Node 0 is the root (rank -1, depth 0). Node i > 0 at depth d holds head (d-1)'s rank `ranks[i]` token
    among the children of its parent's token.
    """

    tree: Tree
    ranks: torch.Tensor  # [N] int64, ranks[0] == -1
    paths: tuple[RankPath, ...] = field(default=())  # the non-root rank paths, BFS order

    @property
    def depth(self) -> torch.Tensor:  # [N] int64
        return self.tree.depth

    @property
    def max_rank(self) -> int:
        return int(self.ranks.max()) if self.ranks.numel() > 1 else -1


def validate_paths(paths: Sequence[Sequence[int]], source: str = "tree",
                   num_heads: int | None = None, vocab_size: int | None = None) -> list[RankPath]:
    """Check rank paths and return them in BFS order; ValueError naming `source` for any problem.

    Problems: empty or non-integer paths, negative or duplicate paths, a path whose parent is missing (not
    prefix-closed), depth > num_heads (deeper than the heads), rank >= vocab_size (top_k larger than the
    vocabulary the heads draft from).
    """
    if not isinstance(paths, (list, tuple)):
        raise ValueError(f"{source}: 'paths' must be a list of rank lists, got {type(paths).__name__}")
    clean: list[RankPath] = []
    for p in paths:
        if not isinstance(p, (list, tuple)) or len(p) == 0 or not all(isinstance(r, int) and not
                                                                     isinstance(r, bool) for r in p):
            raise ValueError(f"{source}: every path must be a non-empty list of integer ranks, got {p!r}")
        if any(r < 0 for r in p):
            raise ValueError(f"{source}: ranks must be >= 0, got path {list(p)}")
        clean.append(tuple(p))
    seen = set(clean)
    if len(seen) != len(clean):
        dup = next(p for p in clean if clean.count(p) > 1)
        raise ValueError(f"{source}: duplicate path {list(dup)}")
    for p in clean:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"{source}: tree is not prefix-closed: path {list(p)} has no parent {list(p[:-1])}")
    if num_heads is not None:
        deepest = max((len(p) for p in clean), default=0)
        if deepest > num_heads:
            raise ValueError(f"{source}: tree depth {deepest} is deeper than the {num_heads} heads "
                             f"(depth d uses head d-1)")
    if vocab_size is not None:
        top = max((max(p) for p in clean), default=-1)
        if top >= vocab_size:
            raise ValueError(f"{source}: rank {top} needs top_k = {top + 1} candidates, larger than the "
                             f"draft vocabulary ({vocab_size} tokens)")
    return bfs_order(clean)


def static_tree(paths: Sequence[Sequence[int]], source: str = "tree", num_heads: int | None = None,
                vocab_size: int | None = None) -> StaticTree:
    """Rank paths -> StaticTree (validated; BFS order; node 0 = root)."""
    ordered = validate_paths(paths, source, num_heads, vocab_size)
    index: dict[RankPath, int] = {(): 0}
    parents = [-1]
    ranks = [-1]
    for p in ordered:
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    return StaticTree(tree=Tree.from_parents(parents), ranks=torch.tensor(ranks, dtype=torch.long),
                      paths=tuple(ordered))


def load_tree_file(path: str | Path, num_heads: int | None = None, vocab_size: int | None = None) -> StaticTree:
    """Read a tree YAML file (see module docstring); every error names the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tree file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"tree file {path}: not valid YAML ({err})") from err
    if not isinstance(data, dict) or "paths" not in data:
        raise ValueError(f"tree file {path}: expected a mapping with a 'paths' key (list of rank lists)")
    unknown = sorted(set(data) - _TREE_FILE_KEYS)
    if unknown:
        raise ValueError(f"tree file {path}: unknown key(s) {unknown}; allowed {sorted(_TREE_FILE_KEYS)}")
    return static_tree(data["paths"], f"tree file {path}", num_heads, vocab_size)


def write_tree_file(path: str | Path, paths: Sequence[Sequence[int]], header: str,
                    accuracy: Sequence[Sequence[float]] | None = None) -> None:
    """Write rank paths (BFS order) atomically, with `header` as leading comment lines."""
    ordered = validate_paths(paths, str(path))
    lines = [f"# {line}" if line else "#" for line in header.strip().splitlines()]
    lines.append("paths: [" + ", ".join("[" + ", ".join(map(str, p)) + "]" for p in ordered) + "]")
    if accuracy is not None:
        table = _check_table(accuracy)
        lines.append(f"expected_accepted_length: {expected_accepted_length(ordered, table):.4f}")
        lines.append("accuracy:")
        lines.extend("  - [" + ", ".join(f"{a:.4f}" for a in row) + "]" for row in table)
    atomic_write_text(path, "\n".join(lines) + "\n")


@dataclass
class TreeSearchArgs:
    """Flags of `python -m runtime.tree_search`."""

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


def main(argv: list[str] | None = None) -> None:
    import json
    import shlex

    from heads.cli import parse_flags

    argv = sys.argv[1:] if argv is None else argv
    args = parse_flags(TreeSearchArgs, argv)
    torch.set_num_threads(args.num_threads)
    if args.accuracy:
        try:
            table = json.loads(args.accuracy)
        except json.JSONDecodeError as err:
            raise ValueError(f"--accuracy: expected a JSON list of lists, got {args.accuracy!r}") from err
        table = _check_table(table)
        source = "the --accuracy table"
    else:
        if not (args.model and args.heads and args.prompts):
            raise ValueError("pass --model, --heads and --prompts to measure the accuracy table, or --accuracy")
        table = measure_accuracy_table_cli(args)
        source = f"accuracy measured for {args.heads} on {args.prompts} ({args.max_prompts} prompts, "\
                 f"{args.max_new_tokens} greedy tokens each)"
    paths = grow_tree(table, args.num_nodes)
    command = "python -m runtime.tree_search " + " ".join(shlex.quote(a) for a in argv)
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
    from heads.base import target_modules
    from heads.medusa import shared_lm_head_rows

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
    from heads.checkpoint import load_heads
    from heads.loading import describe_dtype, load_model, load_tokenizer
    from heads.medusa import MedusaHeads
    from runtime.bench import read_prompts
    from runtime.generate import encode_prompt

    model = load_model(args.model, dtype=args.dtype)
    print(describe_dtype(model.dtype, args.dtype), file=sys.stderr)
    tokenizer = load_tokenizer(args.model)
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
    from heads.cli import run_cli

    run_cli(main)
