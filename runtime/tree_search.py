"""Sparse candidate trees for Medusa heads: the greedy search of the Medusa paper and tree files.

A static tree node is a *rank path* `(r_1, ..., r_d)`: the node at depth d holds head (d-1)'s rank-r_d
token, below the node `(r_1, ..., r_{d-1})`. The root (depth 0, the last committed token) is the empty
path and is implicit in tree files.

Accuracy table: `accuracy[h][r]` = probability that head h's rank-r token (0 = its argmax) is the token the
target emits, measured on calibration prompts. Under the paper's independence assumption a node is
accepted with probability `prod_d accuracy[d-1][r_d]`, so the expected accepted length of a tree is
`1 + sum over its nodes of that product` (the 1 is the bonus token). The greedy search adds, one node at a
time, the addable node (its parent already in the tree) with the largest product; since every factor is
<= 1 a child never beats its parent, so the result is the best tree of each size under that model.

Tree files (YAML), written by `python -m bench.tree_search` and read here for the Medusa proposer:

    # <command that produced it>
    paths: [[0], [1], [0, 0], ...]     # rank paths, BFS order (shorter first, then lexicographic)
    expected_accepted_length: 2.31     # optional, informational
    accuracy: [[...], ...]             # optional, the table the tree was grown from

The accuracy measurement and the tree-file writer are bench/tree_search.py (`python -m bench.tree_search`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

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
