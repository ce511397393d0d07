"""Building candidate trees from draft logits: the pieces every head proposer (Medusa, EAGLE-1/2/3, MTP) shares.

Two ways to grow a tree, both rooted at the last committed token (node 0):

- static (`draft_static_tree`): the shape is fixed data (a `StaticTree` of rank paths: Medusa trees, EAGLE-1
  trees, chains). Depth by depth, the proposer supplies one logits row per node that has children; the
  children are filled from that row.
- dynamic (`select_nodes`, EAGLE-2): the proposer expands a candidate set by cumulative log-probability and
  keeps the best `total_tokens` nodes; `ordered_draft` turns the kept nodes into a BFS-ordered Draft.

Losslessness with sampling (temperature > 0). Children are filled in one of two ways:
- greedy settings, or a dynamic tree: deterministic top-k children (rank r = r-th most likely token) and
  `Draft.probs = None`; the acceptance module then treats them as point masses (accept x with p(x)), which is
  lossless for any candidate set chosen without looking at the target.
- sampling on a static tree: node i's children are drawn WITHOUT replacement from q_i = logits_to_probs(row_i)
  (the same processing as the target), in child order, and `Draft.probs[i] = q_i`; recursive rejection
  sampling is lossless for that. A node gets fewer children when q_i has fewer non-zero tokens than the
  shape asks for; their subtrees are dropped (this depends on q_i only, never on the draws). Dynamic trees
  cannot do this: which sampled children survive pruning would depend on the draws themselves.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.proposers.base import Draft
from runtime.sampling import SamplingConfig, logits_to_probs
from runtime.tree import Tree
from runtime.tree_search import StaticTree


def check_top_k(top_k: int, vocab_size: int, flag: str = "--top_k") -> None:
    """ValueError unless 1 <= top_k <= the vocabulary the drafter picks from."""
    if not 1 <= top_k <= vocab_size:
        raise ValueError(f"{flag} {top_k}: must be in [1, {vocab_size}] (the draft vocabulary has {vocab_size} "
                         f"tokens)")


def sample_children(logits: Tensor, count: int, sampling: SamplingConfig, generator: torch.Generator | None
                    ) -> tuple[Tensor, Tensor]:
    """Draw up to `count` distinct tokens from q = logits_to_probs(logits) in draw order.

    logits: [V] (-inf allowed). Returns (tokens [c] int64 with c = min(count, #tokens with q > 0), q [V]).
    """
    q = logits_to_probs(logits, sampling)  # [V] float32
    count = min(count, int((q > 0).sum()))
    return torch.multinomial(q, count, replacement=False, generator=generator), q


RowsFor = Callable[[int, list[int], list[int], list[int]], Tensor]


def draft_static_tree(shape: StaticTree, root_token: int, rows_for: RowsFor,
                      sampling: SamplingConfig, generator: torch.Generator | None, max_tokens: int,
                      vocab_size: int, to_target: Callable[[Tensor], Tensor] | None = None,
                      to_target_logits: Callable[[Tensor], Tensor] | None = None) -> Draft:
    """Fill a static tree shape with tokens, depth by depth, keeping at most `max_tokens` non-root nodes.

    rows_for(depth, node_ids, node_tokens, parents) -> logits [F, Vd]: the rows from which the children of
    the given nodes (ids in the draft being built, all at `depth`, in order) are chosen; `parents` is the
    draft's parent list so far. Called once per depth that has children. Vd may be a reduced draft vocabulary: `to_target` maps draft ids to target ids and
    `to_target_logits` maps [.., Vd] logits to [.., vocab_size] (EAGLE-3); both default to the identity.
    Deterministic top-k children with probs None when greedy, sampled children with q rows otherwise.
    """
    to_target = to_target or (lambda ids: ids)
    to_target_logits = to_target_logits or (lambda logits: logits)
    shape_children = [shape.tree.children(i) for i in range(shape.tree.num_nodes)]
    ranks = shape.ranks.tolist()
    parents, tokens, origin = [-1], [root_token], [0]  # origin: node id in `shape`
    q_rows: dict[int, Tensor] = {}
    level = [0]  # draft node ids at the current depth
    depth = 0
    while level and len(tokens) - 1 < max_tokens:
        # Rows only for nodes that can still get a child within the budget (nodes are filled in order).
        expanding = [n for n in level if shape_children[origin[n]]][: max_tokens - (len(tokens) - 1)]
        if not expanding:
            break
        rows = rows_for(depth, expanding, [tokens[n] for n in expanding], parents)  # [F, Vd]
        next_level = []
        for node, row in zip(expanding, rows, strict=True):
            wanted = shape_children[origin[node]]  # shape ids of the children, in rank order
            if sampling.is_greedy:
                need = max(ranks[c] for c in wanted) + 1
                top = to_target(row.topk(min(need, row.shape[-1])).indices)
                picked = [(c, int(top[ranks[c]])) for c in wanted if ranks[c] < top.numel()]
            else:
                drawn, q = sample_children(to_target_logits(row), len(wanted), sampling, generator)
                q_rows[node] = q
                picked = list(zip(wanted, drawn.tolist(), strict=False))
            for shape_id, token in picked:
                if len(tokens) - 1 >= max_tokens:
                    break
                next_level.append(len(tokens))
                parents.append(node)
                tokens.append(token)
                origin.append(shape_id)
        level, depth = next_level, depth + 1
    tree = Tree.from_parents(parents)
    probs = None
    if not sampling.is_greedy:
        probs = torch.zeros(tree.num_nodes, vocab_size)
        for node, q in q_rows.items():
            if node < tree.num_nodes:
                probs[node] = q.to(probs.device)
    return Draft(tokens=torch.tensor(tokens, dtype=torch.long), tree=tree, probs=probs)


@dataclass
class Candidates:
    """A growing candidate tree (before selection): node 0 is the root; parents[i] < i."""

    parents: list[int]
    tokens: list[int]
    depth: list[int]
    score: list[float]  # cumulative draft log-probability along the path (root 0)

    @staticmethod
    def rooted(token: int) -> Candidates:
        return Candidates(parents=[-1], tokens=[token], depth=[0], score=[0.0])

    def add(self, parent: int, token: int, log_prob: float) -> int:
        self.parents.append(parent)
        self.tokens.append(token)
        self.depth.append(self.depth[parent] + 1)
        self.score.append(self.score[parent] + log_prob)
        return len(self.tokens) - 1

    def is_ancestor(self, a: int, b: int) -> bool:
        """True if a is b or an ancestor of b."""
        while b > a:
            b = self.parents[b]
        return a == b


def deeper_can_enter(candidates: Candidates, layer: list[int], total_tokens: int) -> bool:
    """Whether expanding the newest `layer` could change `select_nodes(candidates, total_tokens)`.

    select_nodes keeps the first `total_tokens` candidates in the order (score descending, id ascending): a parent
    comes before its children there (a child's score is its parent's plus a log-probability <= 0, its id larger),
    so that order's prefix is the kept set. Every deeper node descends from `layer`, so its score is at most the
    layer's best, and its id is larger than any candidate's so far: it can enter only with a score above the
    `total_tokens`-th best score. When the layer's best is not above it, the tree is final: expanding further
    would forward the draft layer for nodes that are then dropped (a budget of 8 with top_k 8 kept 8 nodes of
    depth <= 2 while 5 levels were forwarded, 13.4 ms of drafting)."""
    if not layer or len(candidates.score) - 1 < total_tokens:
        return bool(layer)
    threshold = heapq.nlargest(total_tokens, candidates.score[1:])[-1]
    return max(candidates.score[n] for n in layer) > threshold


def expected_bound(candidates: Candidates, children: list[int], total_tokens: int, depth: int) -> float:
    """The most accepted tokens any tree of `total_tokens` nodes below the root's `children` (their scores known), at
    most `depth` levels deep, can expect (the sum of its nodes' path probabilities). Each level of a child's subtree
    adds at most the child's probability p (its children's probabilities sum to at most p, and so on down), and takes
    at least one node: so the bound is the sum of the `total_tokens` largest of every child's p, `depth` times each."""
    probs = sorted((math.exp(candidates.score[n]) for n in children), reverse=True)
    return sum([p for p in probs for _ in range(depth)][:total_tokens])


def select_nodes(candidates: Candidates, total_tokens: int) -> list[int]:
    """The best `total_tokens` non-root candidates by cumulative score, a node only after its parent.

    Returns the kept node ids (root included) sorted by (depth, id): a valid BFS order.
    """
    children: dict[int, list[int]] = {}
    for i, p in enumerate(candidates.parents[1:], start=1):
        children.setdefault(p, []).append(i)
    heap = [(-candidates.score[c], c) for c in children.get(0, [])]
    heapq.heapify(heap)
    kept = [0]
    while heap and len(kept) - 1 < total_tokens:
        _, node = heapq.heappop(heap)
        kept.append(node)
        for c in children.get(node, []):
            heapq.heappush(heap, (-candidates.score[c], c))
    return sorted(kept, key=lambda i: (candidates.depth[i], i))


def ordered_draft(candidates: Candidates, kept: list[int]) -> Draft:
    """Kept candidate ids (BFS order, root first) -> Draft with deterministic children (probs None) and, as
    `expected`, the sum of the kept nodes' path probabilities (exp of their cumulative scores)."""
    index = {node: i for i, node in enumerate(kept)}
    parents = [-1] + [index[candidates.parents[n]] for n in kept[1:]]
    tokens = torch.tensor([candidates.tokens[n] for n in kept], dtype=torch.long)
    expected = sum(math.exp(candidates.score[n]) for n in kept[1:])
    return Draft(tokens=tokens, tree=Tree.from_parents(parents), expected=expected)
