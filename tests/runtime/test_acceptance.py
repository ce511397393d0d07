"""Acceptance rules on fake bigram "models": fixed logits tables on a 6-token vocabulary.

The target is p(. | prev) = logits_to_probs(TARGET[prev]), the drafter q(. | prev) = logits_to_probs(DRAFT[prev])
with q != p. Statistical tests run many independent speculative steps from a fixed root and compare the
empirical distribution of the first committed token, and of the first two committed tokens jointly, with
the exact target distribution by a chi-square goodness-of-fit test. THRESHOLD: the rule passes when the
p-value is > 1e-3 (a correct rule fails with probability 1e-3 per check; seeds are fixed, so the outcome is
deterministic). Each wrong rule (a rejection-sampling step changed in one place) must give a p-value < 1e-6.
"""

from __future__ import annotations

import pytest
import torch

import runtime.acceptance as acceptance
from runtime.acceptance import Acceptance, accept, accept_greedy, accept_rejection, accept_typical
from runtime.proposers.base import Draft
from runtime.sampling import SamplingConfig, logits_to_probs
from runtime.tree import Tree

V = 6
ROOT = 0
SAMPLING = SamplingConfig(temperature=1.0)
_g = torch.Generator().manual_seed(1234)
TARGET = torch.randn(V, V, generator=_g) * 1.5  # [V, V] logits of the token after `prev`
DRAFT = torch.randn(V, V, generator=_g) * 1.5
P = logits_to_probs(TARGET, SAMPLING)  # [V, V]
Q = logits_to_probs(DRAFT, SAMPLING)

CHAIN3 = Tree.chain(3)
TREE_3x2 = Tree.from_parents([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3])  # 3 children at depth 1, 2 under each


def sampled_draft(root: int, tree: Tree, gen: torch.Generator) -> Draft:
    """Children of each node drawn without replacement from q(. | node token), in child order."""
    tokens = [root] + [0] * (tree.num_nodes - 1)
    for node in range(tree.num_nodes):
        children = tree.children(node)
        if children:
            drawn = torch.multinomial(Q[tokens[node]], len(children), replacement=False, generator=gen)
            for child, token in zip(children, drawn.tolist(), strict=True):
                tokens[child] = token
    tokens_t = torch.tensor(tokens)
    return Draft(tokens=tokens_t, tree=tree, probs=Q[tokens_t])


def point_mass_draft(root: int, tree: Tree, gen: torch.Generator) -> Draft:
    """Deterministic children: the most likely tokens under q, most likely first (probs None)."""
    tokens = [root] + [0] * (tree.num_nodes - 1)
    for node in range(tree.num_nodes):
        children = tree.children(node)
        if children:
            for child, token in zip(children, Q[tokens[node]].argsort(descending=True)[: len(children)].tolist(), strict=True):
                tokens[child] = token
    return Draft(tokens=torch.tensor(tokens), tree=tree, probs=None)


def committed(draft: Draft, result: Acceptance) -> list[int]:
    return draft.tokens[result.accepted_nodes[1:]].tolist() + [result.bonus_token]


def first_two_tokens(make_draft, tree: Tree, trials: int, seed: int) -> torch.Tensor:
    """Run speculative steps from ROOT until 2 tokens are committed; returns [trials, 2]."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(trials, 2, dtype=torch.long)
    for t in range(trials):
        tokens: list[int] = []
        while len(tokens) < 2:
            draft = make_draft(tokens[-1] if tokens else ROOT, tree, gen)
            result = accept_rejection(draft, TARGET[draft.tokens], SAMPLING, generator=gen)
            tokens += committed(draft, result)
        out[t] = torch.tensor(tokens[:2])
    return out


def chi_square_p_value(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit of integer samples (cells 0..C-1) to the distribution `expected` [C]."""
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    n = counts.sum()
    support = expected > 0
    if bool((counts[~support] > 0).any()):
        return 0.0
    exp = expected.double()[support] * n
    stat = ((counts[support] - exp) ** 2 / exp).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def p_values(samples: torch.Tensor) -> tuple[float, float]:
    """(first token vs p(.|ROOT), first two tokens jointly vs p(a|ROOT) p(b|a))."""
    first = chi_square_p_value(samples[:, 0], P[ROOT])
    joint = chi_square_p_value(samples[:, 0] * V + samples[:, 1], (P[ROOT][:, None] * P).flatten())
    return first, joint


TRIALS = 2500


@pytest.mark.parametrize("make_draft,tree", [(sampled_draft, Tree.chain(2)), (sampled_draft, CHAIN3),
                                             (sampled_draft, TREE_3x2), (point_mass_draft, TREE_3x2)],
                         ids=["chain2", "chain3", "tree3x2", "tree3x2-point-mass"])
def test_rejection_sampling_reproduces_target_distribution(make_draft, tree):
    assert (P - Q).abs().sum(-1).min() > 0.3  # the drafter really differs from the target
    first, joint = p_values(first_two_tokens(make_draft, tree, TRIALS, seed=7))
    assert first > 1e-3 and joint > 1e-3, (first, joint)


def _bonus_from_p(p, q):  # wrong: resample from p instead of the residual norm(max(0, p - q))
    return p


def _keep_token(q, token):  # wrong: forget to remove a rejected candidate before the next one
    return q


@pytest.mark.parametrize("make_draft,tree,name,wrong", [
    (sampled_draft, CHAIN3, "_residual", _bonus_from_p),
    (sampled_draft, TREE_3x2, "_residual", _bonus_from_p),
    (sampled_draft, TREE_3x2, "_without", _keep_token),
    (point_mass_draft, TREE_3x2, "_without", _keep_token),
], ids=["chain3-bonus-from-p", "tree-bonus-from-p", "tree-q-not-zeroed", "point-mass-p-not-zeroed"])
def test_wrong_rule_fails_the_same_test(monkeypatch, make_draft, tree, name, wrong):
    monkeypatch.setattr(acceptance, name, wrong)
    first, joint = p_values(first_two_tokens(make_draft, tree, TRIALS, seed=7))
    assert min(first, joint) < 1e-6, (first, joint)


def _logits_with_argmax(argmax: list[int]) -> torch.Tensor:
    logits = torch.randn(len(argmax), V, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


def test_greedy_chain_accepts_longest_matching_prefix_and_bonus_is_argmax():
    draft = Draft(tokens=torch.tensor([0, 3, 4, 5]), tree=CHAIN3)
    result = accept_greedy(draft, _logits_with_argmax([3, 4, 1, 2]))
    assert result.accepted_nodes == [0, 1, 2] and result.bonus_token == 1 and result.accepted_length == 3
    result = accept_greedy(draft, _logits_with_argmax([2, 4, 5, 1]))
    assert result.accepted_nodes == [0] and result.bonus_token == 2
    result = accept_greedy(draft, _logits_with_argmax([3, 4, 5, 1]))
    assert result.accepted_nodes == [0, 1, 2, 3] and result.bonus_token == 1


def test_greedy_tree_follows_the_matching_child():
    #            0(root)
    #       1:a   2:b   3:c        children of the root
    #     4   5  6   7  8   9
    tokens = torch.tensor([0, 1, 2, 3, 4, 5, 4, 5, 4, 5])
    draft = Draft(tokens=tokens, tree=TREE_3x2)
    result = accept_greedy(draft, _logits_with_argmax([2, 0, 5, 0, 0, 0, 0, 3, 0, 0]))
    assert result.accepted_nodes == [0, 2, 7] and result.bonus_token == 3


def test_any_rule_with_greedy_settings_is_greedy():
    gen = torch.Generator().manual_seed(3)
    greedy = SamplingConfig()
    for _ in range(50):
        draft = sampled_draft(ROOT, TREE_3x2, gen)
        logits = torch.randn(TREE_3x2.num_nodes, V, generator=gen)
        expected = accept_greedy(draft, logits)
        for rule in ("greedy", "typical", "rejection"):
            assert accept(draft, logits, greedy, rule=rule) == expected
        assert accept_rejection(draft, logits, greedy, generator=gen) == expected  # p is the argmax point mass
        point = Draft(tokens=draft.tokens, tree=draft.tree, probs=None)
        assert accept_rejection(point, logits, greedy, generator=gen) == expected


def test_typical_acceptance_follows_the_formula():
    sampling = SamplingConfig(temperature=1.0)
    logits = torch.randn(TREE_3x2.num_nodes, V, generator=torch.Generator().manual_seed(5))
    p = logits_to_probs(logits, sampling)
    entropy = -(p * p.log()).sum(-1)
    threshold, alpha = 0.2, 0.5
    cutoff = torch.clamp(alpha * torch.exp(-entropy), max=threshold)
    tokens = torch.tensor([0, 1, 2, 3, 4, 5, 4, 5, 4, 5])
    result = accept_typical(Draft(tokens=tokens, tree=TREE_3x2), logits, sampling, threshold, alpha,
                            generator=torch.Generator().manual_seed(0))
    passes = [True] + [bool(p[TREE_3x2.parents[i], tokens[i]] > cutoff[TREE_3x2.parents[i]])
                       for i in range(1, TREE_3x2.num_nodes)]
    good = [i for i in range(TREE_3x2.num_nodes) if all(passes[j] for j in TREE_3x2.path_to(i))]
    deepest = max(int(TREE_3x2.depth[i]) for i in good)
    assert result.accepted_nodes == TREE_3x2.path_to(min(i for i in good if int(TREE_3x2.depth[i]) == deepest))
    assert p[result.accepted_nodes[-1], result.bonus_token] > 0


def test_typical_acceptance_accepts_plausible_and_rejects_implausible_tokens():
    sampling = SamplingConfig(temperature=1.0)
    logits = torch.full((4, V), -5.0)
    logits[0, 1] = 5.0  # confident target: only token 1 is typical
    logits[1] = 0.0  # flat target: cutoff = min(0.09, 0.3 / 6) = 0.05 < 1/6, every token passes
    logits[2, 3] = 5.0
    draft = Draft(tokens=torch.tensor([0, 1, 2, 4]), tree=CHAIN3)
    result = accept_typical(draft, logits, sampling, generator=torch.Generator().manual_seed(0))
    assert result.accepted_nodes == [0, 1, 2]  # token 4 has p ~ 3e-5 after node 2
    draft = Draft(tokens=torch.tensor([0, 2, 2, 4]), tree=CHAIN3)
    assert accept_typical(draft, logits, sampling).accepted_nodes == [0]


def test_bad_inputs_raise_clear_errors():
    draft = sampled_draft(ROOT, CHAIN3, torch.Generator().manual_seed(0))
    logits = TARGET[draft.tokens]
    with pytest.raises(ValueError, match="target_logits must have shape"):
        accept_rejection(draft, logits[:3], SAMPLING)
    with pytest.raises(ValueError, match="draft.tokens must have shape"):
        accept_greedy(Draft(tokens=draft.tokens[:3], tree=CHAIN3), logits)
    with pytest.raises(ValueError, match="same vocabulary"):
        accept_rejection(Draft(draft.tokens, CHAIN3, torch.cat([draft.probs, draft.probs], 1) / 2), logits,
                         SAMPLING)
    with pytest.raises(ValueError, match="must be distributions"):
        accept_rejection(Draft(draft.tokens, CHAIN3, draft.probs * 2), logits, SAMPLING)
    with pytest.raises(ValueError, match="token ids in"):
        accept_greedy(Draft(tokens=torch.tensor([0, 1, 9, 2]), tree=CHAIN3), logits)
    zero_q = draft.probs.clone()
    zero_q[0] = 0.0
    zero_q[0, (int(draft.tokens[1]) + 1) % V] = 1.0
    with pytest.raises(ValueError, match="has q = 0"):
        accept_rejection(Draft(draft.tokens, CHAIN3, zero_q), logits, SAMPLING)
    with pytest.raises(ValueError, match="acceptance rule must be one of"):
        accept(draft, logits, SAMPLING, rule="medusa")
    with pytest.raises(ValueError, match="posterior_threshold"):
        accept_typical(draft, logits, SAMPLING, posterior_threshold=0.0)
