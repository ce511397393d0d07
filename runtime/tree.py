"""Candidate-tree topology: nodes in BFS order, node 0 = root = the last committed token.

A chain of k draft tokens is the tree with parents [-1, 0, 1, ..., k-1]. Static trees (Medusa) are data
loaded from YAML; dynamic trees (EAGLE-2, top-k draft trees) are built per step with `Tree.from_parents`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    """Candidate tree in BFS order. Node 0 is the root (the last committed token)."""

    parents: torch.Tensor  # [N] int64, parents[0] == -1, parents[i] < i
    depth: torch.Tensor  # [N] int64, depth[0] == 0
    ancestors: torch.Tensor  # [N, N] bool, ancestors[i, j] = j is i or an ancestor of i

    @staticmethod
    def from_parents(parents: list[int] | torch.Tensor) -> Tree:
        """Build a tree from a parent list; raises ValueError unless parents[0] == -1 and parents[i] < i."""
        parents = torch.as_tensor(parents, dtype=torch.long).flatten()
        n = parents.numel()
        if n == 0 or int(parents[0]) != -1:
            raise ValueError(f"tree parents must start with -1 (the root), got {parents.tolist()[:8]}")
        if n > 1:
            rest = parents[1:]
            if bool(((rest < 0) | (rest >= torch.arange(1, n))).any()):
                raise ValueError(f"tree parents must satisfy 0 <= parents[i] < i, got {parents.tolist()}")
        depth = torch.zeros(n, dtype=torch.long)
        ancestors = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            p = int(parents[i])
            depth[i] = depth[p] + 1
            ancestors[i] |= ancestors[p]
        return Tree(parents=parents, depth=depth, ancestors=ancestors)

    @staticmethod
    def chain(length: int) -> Tree:
        """Root plus `length` draft tokens in a line (built directly: prefill uses chains of prompt length)."""
        if length < 0:
            raise ValueError(f"chain length must be >= 0, got {length}")
        n = length + 1
        return Tree(parents=torch.arange(-1, length), depth=torch.arange(n),
                    ancestors=torch.ones(n, n, dtype=torch.bool).tril_())

    @property
    def num_nodes(self) -> int:
        return self.parents.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def children(self, node: int) -> list[int]:
        """Child node ids of `node`, in BFS (= candidate) order."""
        return (self.parents == node).nonzero().flatten().tolist()

    def leaves(self) -> list[int]:
        has_child = torch.zeros(self.num_nodes, dtype=torch.bool)
        has_child[self.parents[1:]] = True
        return (~has_child).nonzero().flatten().tolist()

    def path_to(self, node: int) -> list[int]:
        """Node ids from the root to `node`, both included."""
        return self.ancestors[node].nonzero().flatten().tolist()

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path as a list of node ids."""
        return [self.path_to(leaf) for leaf in self.leaves()]
