"""Acceptance rules: which path of a candidate tree the target keeps, and the target's own bonus token.

Notation, as in the papers (Leviathan et al. 2023; Chen et al. 2023; SpecInfer, Miao et al. 2024;
Recursive Speculative Decoding, Jeon et al. 2024): p = the TARGET distribution, q = the DRAFT distribution,
both after the same `runtime.sampling.logits_to_probs` processing. x is a draft token, u ~ U[0, 1).

Inputs shared by every rule:
    draft.tokens [N] int64: node tokens in BFS order; node 0 is the root (the last committed token).
    draft.probs  [N, V] float32 or None: probs[i] is the q the children of node i were drawn from WITHOUT
                 replacement, in child order; None means deterministic children (point masses).
    draft.point_mass [N] bool or None: nodes that are deterministic guesses whatever probs says (a hybrid tree).
    target_logits [N, V]: target_logits[i] are the target's logits for the token FOLLOWING node i.
Committed tokens after a step = draft.tokens[accepted_nodes[1:]] followed by bonus_token.

Rules:
- greedy (lossless at temperature 0): follow the child equal to argmax p; bonus = argmax p.
- rejection (lossless for any sampling settings; chains and trees with several candidates per node):
  recursive rejection sampling. At the current node, for each child x in order: accept with probability
  min(1, p(x) / q(x)); on rejection p <- norm(max(0, p - q)), q(x) <- 0, q <- norm(q) and try the next
  child. With point-mass children (probs None) this is: accept x with probability p(x), else p(x) <- 0,
  p <- norm(p). When no child is accepted the bonus token is sampled from the current (residual) p. The
  committed tokens are then distributed exactly as if sampled from the target alone.
- typical (Medusa, Cai et al. 2024; LOSSY: the output distribution is NOT the target's): accept x if
  p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))), H the entropy of p; keep the deepest
  node whose whole path is accepted (first in BFS order on ties); bonus sampled from p at that node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.proposers.base import Draft
from runtime.sampling import SamplingConfig, logits_to_probs, sample_token

RULES = ("greedy", "typical", "rejection")
_ROW_SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Acceptance:
    """Result of one verification step."""

    accepted_nodes: list[int]  # node ids root..last accepted along ONE path; always starts with 0 (root)
    bonus_token: int  # the target's own token after the last accepted node (sampled from p or residual)

    @property
    def accepted_length(self) -> int:
        """New tokens committed this step: accepted draft tokens + the bonus token (tau counts the bonus)."""
        return len(self.accepted_nodes)


def _check_inputs(draft: Draft, target_logits: Tensor) -> int:
    """Validate shapes and token ids; returns V."""
    n = draft.tree.num_nodes
    if draft.tokens.ndim != 1 or draft.tokens.numel() != n:
        raise ValueError(f"draft.tokens must have shape [N] with N = {n} tree nodes, got {tuple(draft.tokens.shape)}")
    if target_logits.ndim != 2 or target_logits.shape[0] != n:
        raise ValueError(f"target_logits must have shape [N, V] with N = {n} tree nodes, "
                         f"got {tuple(target_logits.shape)}")
    vocab = target_logits.shape[1]
    if n > 1 and not bool(((draft.tokens[1:] >= 0) & (draft.tokens[1:] < vocab)).all()):
        raise ValueError(f"draft.tokens must be token ids in [0, {vocab}), got {draft.tokens.tolist()}")
    if draft.point_mass is not None and tuple(draft.point_mass.shape) != (n,):
        raise ValueError(f"draft.point_mass must have shape [N] = [{n}], got {tuple(draft.point_mass.shape)}")
    if draft.probs is not None:
        if tuple(draft.probs.shape) != (n, vocab):
            raise ValueError(f"draft.probs must have shape [N, V] = [{n}, {vocab}] (same vocabulary as the "
                             f"target), got {tuple(draft.probs.shape)}")
        sampled = draft.tree.parents[1:] if draft.point_mass is None else draft.tree.parents[1:][~draft.point_mass[1:]]
        parents = sampled.unique()
        rows = draft.probs[parents].float()  # [P, V] rows children were drawn from
        sums = rows.sum(dim=-1)
        if bool((rows < 0).any()) or not bool(((sums - 1).abs() <= _ROW_SUM_TOLERANCE).all()):
            raise ValueError(f"draft.probs rows of nodes with children must be distributions (>= 0, sum 1); "
                             f"row sums {sums.tolist()} for nodes {parents.tolist()}")
    return vocab


def accept_greedy(draft: Draft, target_logits: Tensor) -> Acceptance:
    """Longest path whose every token equals the target's argmax at its parent; bonus = argmax at its end.

    target_logits: [N, V]. Ties in argmax go to the lowest token id (as torch.argmax and HF generate).
    """
    _check_inputs(draft, target_logits)
    best = target_logits.argmax(dim=-1).tolist()  # [N]
    tokens = draft.tokens.tolist()
    nodes = [0]
    while True:
        node = nodes[-1]
        match = [c for c in draft.tree.children(node) if tokens[c] == best[node]]
        if not match:
            return Acceptance(accepted_nodes=nodes, bonus_token=best[node])
        nodes.append(match[0])


def accept_typical(draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
                   posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
                   generator: torch.Generator | None = None) -> Acceptance:
    """Medusa's typical acceptance (LOSSY): accept x if p(x) > min(threshold, alpha * exp(-H(p))).

    target_logits: [N, V]. p = logits_to_probs(target_logits, sampling). Keeps the deepest node whose whole
    path is accepted (lowest node id on ties); the bonus token is sampled from p at that node.
    """
    _check_inputs(draft, target_logits)
    if posterior_threshold <= 0 or posterior_alpha <= 0:
        raise ValueError(f"posterior_threshold and posterior_alpha must be > 0, "
                         f"got {posterior_threshold} and {posterior_alpha}")
    p = logits_to_probs(target_logits, sampling)  # [N, V]
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)  # [N]
    cutoff = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)  # [N]
    parents = draft.tree.parents
    n = draft.tree.num_nodes
    ok = torch.ones(n, dtype=torch.bool)  # node's token passes the test under its parent's p
    if n > 1:
        ok[1:] = p[parents[1:], draft.tokens[1:]] > cutoff[parents[1:]]
    path_ok = (~draft.tree.ancestors | ok[None, :]).all(dim=-1)  # [N] every node on the root path passes
    depth = torch.where(path_ok, draft.tree.depth, torch.full_like(draft.tree.depth, -1))
    last = int(depth.argmax())  # first (lowest id) among the deepest accepted nodes
    bonus = int(sample_token(p[last], generator))
    return Acceptance(accepted_nodes=draft.tree.path_to(last), bonus_token=bonus)


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)): what is left of p after a rejection. [V] -> [V].

    The residual is all zeros only when p == q, in which case a rejection has probability 0 and can come
    only from float rounding; p is then returned unchanged.
    """
    left = torch.clamp(p - q, min=0.0)
    total = left.sum()
    return left / total if total > 0 else p


def _without(q: Tensor, token: int) -> Tensor:
    """q with `token` removed and renormalised: the next child is drawn without replacement. [V] -> [V]."""
    q = q.clone()
    q[token] = 0.0
    total = q.sum()
    return q / total if total > 0 else q


def accept_rejection(draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
                     generator: torch.Generator | None = None) -> Acceptance:
    """Lossless recursive rejection sampling over a chain or a multi-candidate tree (see module docstring).

    target_logits: [N, V]; p = logits_to_probs(target_logits, sampling); q = draft.probs rows (or point
    masses when draft.probs is None).
    """
    _check_inputs(draft, target_logits)
    tokens = draft.tokens.tolist()
    nodes = [0]
    while True:
        node = nodes[-1]
        p = logits_to_probs(target_logits[node], sampling)  # [V]
        q = draft.probs[node].float() if draft.probs is not None else None  # [V]
        accepted = None
        for child in draft.tree.children(node):
            x = tokens[child]
            if q is None or (draft.point_mass is not None and bool(draft.point_mass[child])):
                # point mass at x: accept with p(x); residual = p without x (the sampled siblings' q unchanged)
                if float(torch.rand((), generator=generator)) < float(p[x]):
                    accepted = child
                    break
                p = _without(p, x)
                continue
            qx = float(q[x])
            if qx <= 0.0:
                raise ValueError(f"draft token {x} at node {child} has q = 0 in draft.probs[{node}]: children must "
                                 f"be drawn without replacement from that row")
            if float(torch.rand((), generator=generator)) < float(p[x]) / qx:
                accepted = child
                break
            p = _residual(p, q)
            q = _without(q, x)
        if accepted is None:
            return Acceptance(accepted_nodes=nodes, bonus_token=int(sample_token(p, generator)))
        nodes.append(accepted)


def accept(draft: Draft, target_logits: Tensor, sampling: SamplingConfig, rule: str = "rejection",
           generator: torch.Generator | None = None) -> Acceptance:
    """Dispatch to a rule in RULES. Greedy sampling settings always use accept_greedy (all rules agree)."""
    if rule not in RULES:
        raise ValueError(f"acceptance rule must be one of {RULES}, got {rule!r}")
    if rule == "greedy" or sampling.is_greedy:
        return accept_greedy(draft, target_logits)
    if rule == "typical":
        return accept_typical(draft, target_logits, sampling, generator=generator)
    return accept_rejection(draft, target_logits, sampling, generator=generator)
