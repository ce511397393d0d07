"""Prompt lookup: draft the continuation of an earlier occurrence of the last n tokens (no model, no training).

For n from max_ngram down to min_ngram, find the earlier occurrences of the last n committed tokens, take the one
whose preceding tokens agree longest with the tokens before them (up to CONTEXT_CAP; the latest among equals), and
propose the tokens that followed it, as a chain. Deterministic: Draft.probs is None.

Which occurrence: a 1- to 3-token n-gram often occurs many times (a summary's names, an answer's own phrases), and
the continuations differ. transformers' prompt_lookup_num_tokens takes the earliest (the prompt is searched first),
as this proposer did until session 66. The occurrence that matches the most context is the one the text is most
likely copying. Replayed with the cost-aware length on the target's own greedy answers (float32, the KV-256 curve of
the AVX2-only VM; `results/lookup_occurrence_replay_avx2_s66.json`), predicted speed-up earliest -> longest context:
80 MT-Bench first turns 1.260 -> 1.280, and on the 7 prompt kinds of bench.kinds (4 answers each) summarise
1.377 -> 1.467, translate 2.116 -> 2.141, qa 2.207 -> 2.671, rag 1.857 -> 2.041, math 1.348 -> 1.356, code
1.914 -> 1.892, chat 1.454 -> 1.482. The latest occurrence alone was worse than the earliest on translate (2.018)
and code (1.837).

Cost-aware length (`step_costs`, CLI `--num_speculative_tokens cost`): a match is not worth verifying when the
text is not being copied, and on hardware where verifying k + 1 tokens costs more than a plain step (a CPU) such
drafts make decoding slower. With the device's verify cost curve the proposer drafts, per step, the prefix length
k of the match that maximises expected tokens per unit of cost, (1 + sum_j prod_{i<=j} a_i) / cost(k + 1), k = 0
being a plain step. a_i (the chance the i-th drafted token is accepted once the ones before it were) is learned
per sequence and per matched n-gram length as an exponential average. The curve is read at the KV length the sequence has
reached (runtime.cost_model.VerifyTable over the step costs measured at KV 256, 1,024 and 2,048, as the guard and
the hybrid read theirs; issue 29): a plain step at KV 2,000 costs more than at 256, and a verify of k + 1 tokens does
not grow in the same proportion. It is the table the hybrid's lookup part reads, so where the hybrid's head rests
the hybrid drafts what prompt lookup alone drafts (tests/runtime/test_hybrid.py). A fixed list of costs (one KV
length) is still accepted, for replays (bench.lookup_replay) and tests. The first token is learned on every step
with a match, drafted or not: the token the target commits next says whether the candidate's first token would
have been accepted (the draft is free to compute, so declining to verify it loses no information).

A draft must promise REQUIRED_GAIN times a plain step's rate: the a_i are short noisy averages and a draft is
chosen exactly when they are high, so an even bet loses on average (replayed on the target's 80 MT-Bench answers
and on 148 held-out human answers with this CPU's measured curves, `python -m bench.lookup_replay`: without the
margin and with the old prior 0.5 the lookup broke even or lost up to 1% on text that does not copy; with them it
predicts 1.01-1.02x there, 1.14-1.18x on MT-Bench in float32, 1.04x in bf16).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from runtime.proposers.base import Draft, chain_draft, root_only

if TYPE_CHECKING:
    from runtime.cost_model import VerifyTable

CONTEXT_CAP = 16  # tokens before an occurrence compared with the tokens before the suffix, at most (the replays
# below gave the same speed-ups at 16 as at 32 and 64, and within .001 at 8)
PRIOR_ACCEPTANCE = (0.3, 0.7)  # a_1 and a_2.. before anything was learned (MT-Bench measured .30 then .6-.85)
LEARNING_RATE = 0.25  # weight of the newest outcome in the running averages
REQUIRED_GAIN = 1.2  # expected tokens per unit cost a draft must promise, relative to a plain step


def longest_context(ids: torch.Tensor, hits: torch.Tensor, n: int, cap: int = CONTEXT_CAP) -> int:
    """Of the occurrences ids[h:h+n] (h in `hits`, increasing) of the last n tokens of ids [T], the one whose
    preceding tokens agree longest with the tokens before the suffix (up to `cap`), the latest among equals."""
    if hits.numel() == 1:
        return int(hits[0])
    back = torch.arange(1, cap + 1, device=ids.device)
    before_hit = hits[:, None] - back[None, :]  # [H, cap] positions j = 1..cap tokens before each occurrence
    before_suffix = ids.numel() - n - back  # [cap] the same distances before the suffix
    valid = (before_hit >= 0) & (before_suffix >= 0)[None, :]
    same = valid & (ids[before_hit.clamp(min=0)] == ids[before_suffix.clamp(min=0)][None, :])
    agree = same.to(torch.int32).cumprod(dim=1).sum(dim=1)  # [H] tokens agreeing before each occurrence
    return int(hits[(agree == agree.max()).nonzero().flatten()[-1]])


OCCURRENCES = ("longest_context", "earliest", "latest")  # which earlier occurrence a match drafts from


def check_occurrence(occurrence: str) -> None:
    if occurrence not in OCCURRENCES:
        raise ValueError(f"prompt lookup occurrence: expected one of {', '.join(OCCURRENCES)}, got {occurrence!r}")


def lookup_match(ids: torch.Tensor, max_ngram: int, min_ngram: int, max_tokens: int,
                 occurrence: str = "longest_context") -> tuple[int, torch.Tensor]:
    """ids [T] -> (n, up to `max_tokens` tokens [m] that followed an earlier occurrence of the longest suffix n-gram,
    n in max_ngram..min_ngram: the one with the longest agreeing context before it (`longest_context`), or the
    earliest or the latest (`occurrence`, for comparisons: bench.lookup_replay --occurrence)); (0, empty [0]) if none
    matches."""
    length = ids.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = ids[:-1].unfold(0, n, 1)  # [T - n, n]; window i = ids[i:i+n], followed by ids[i+n] (i+n < T)
        hits = (windows == ids[-n:]).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = n + (longest_context(ids, hits, n) if occurrence == "longest_context"
                         else int(hits[0] if occurrence == "earliest" else hits[-1]))
            return n, ids[start:start + max_tokens]
    return 0, ids[:0]


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Tokens a step emits on average when it verifies a chain of k drafts: 1 + sum_j prod_{i<=j} a_i."""
    total, reach = 1.0, 1.0
    for a in acceptance[:k]:
        reach *= a
        total += reach
    return total


def best_draft_length(acceptance: Sequence[float], step_costs: Sequence[float], limit: int,
                      required_gain: float = 1.0) -> int:
    """k in 1..limit maximising expected_tokens(k) / step_costs[k] (step_costs[n - 1]: verifying n tokens relative
    to a plain step, so step_costs[0] = 1) if that rate is at least `required_gain` x a plain step's, else 0;
    ties go to the shorter draft."""
    limit = min(limit, len(acceptance), len(step_costs) - 1)
    rates = [expected_tokens(acceptance, k) / step_costs[k] for k in range(limit + 1)]
    best = max(range(1, limit + 1), key=lambda k: (rates[k], -k), default=0)
    return best if best and rates[best] >= required_gain * rates[0] else 0


def learn(acceptance: list[float], candidate: Sequence[int], committed: Sequence[int], rate: float) -> None:
    """Update the conditional acceptances in place from what was committed after `candidate` was proposed: depth j
    is observed when the j - 1 before it matched and the target has committed a j-th token."""
    for j, (drafted, actual) in enumerate(zip(candidate, committed, strict=False)):
        if j >= len(acceptance):
            return
        hit = float(drafted == actual)
        acceptance[j] += rate * (hit - acceptance[j])
        if not hit:
            return


def check_ngram_range(min_ngram: int, max_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"--min_ngram/--max_ngram: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


class LookupAcceptance:
    """This sequence's conditional acceptances of lookup drafts, per matched n-gram length, learned from what the
    target commits after each match was offered (drafted or not): `offered` at propose, `learn` at the next one."""

    def __init__(self, prior: tuple[float, float] = PRIOR_ACCEPTANCE):
        self.prior = prior
        self.reset()

    def reset(self) -> None:
        self.by_ngram: dict[int, list[float]] = {}  # matched n-gram length -> [a_1, a_2, ...] of this sequence
        self._pending: tuple[int, list[int], int] | None = None  # (n, candidate, committed length) to learn from

    def of(self, n: int, max_tokens: int) -> list[float]:
        """[a_1, ..., a_max_tokens] for matches of n tokens (the prior where nothing was learned)."""
        acceptance = self.by_ngram.setdefault(n, [self.prior[0]])
        acceptance.extend([self.prior[1]] * (max_tokens - len(acceptance)))
        return acceptance

    def offered(self, n: int, candidate: torch.Tensor, committed_length: int) -> None:
        self._pending = (n, candidate.tolist(), committed_length)

    def learn(self, committed_ids: torch.Tensor) -> None:
        if self._pending is None:
            return
        n, candidate, length = self._pending
        self._pending = None
        learn(self.by_ngram[n], candidate, committed_ids[length:].tolist(), LEARNING_RATE)


class PromptLookupProposer:
    """n-gram matching in the context (prompt + generated tokens); with `step_costs`, a cost-aware draft length."""

    hidden_state_indices: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, step_costs: Sequence[float] | VerifyTable | None = None,
                 required_gain: float = REQUIRED_GAIN, prior: tuple[float, float] = PRIOR_ACCEPTANCE,
                 occurrence: str = "longest_context"):
        """step_costs: relative verify costs for 1, 2, ... tokens at one KV length, or a VerifyTable read at each
        step's KV length; None drafts every match whole. occurrence: which earlier occurrence of a match to draft
        from (`lookup_match`)."""
        check_ngram_range(min_ngram, max_ngram)
        check_occurrence(occurrence)
        self.occurrence = occurrence
        table = hasattr(step_costs, "at")
        if step_costs is not None and not table and (len(step_costs) < 2 or step_costs[0] <= 0):
            raise ValueError(f"step_costs: expected relative verify costs for 1, 2, ... tokens, got {step_costs}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.step_costs = step_costs if table or step_costs is None else list(step_costs)
        # costs at a step's KV length for `tokens` tokens: the table's bucket, or the fixed list whatever the length
        self._costs_at = None if step_costs is None else step_costs.at if table else \
            (lambda kv_length, tokens, fixed=self.step_costs: fixed)
        self.required_gain = required_gain
        self.prior = prior
        self.learned = LookupAcceptance(prior)

    @property
    def acceptance(self) -> dict[int, list[float]]:
        """Matched n-gram length -> this sequence's [a_1, a_2, ...]."""
        return self.learned.by_ngram

    def reset(self, prompt_ids: torch.Tensor | None, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        self.learned.reset()

    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return root_only(committed_ids)
        n, candidate = lookup_match(committed_ids, self.max_ngram, self.min_ngram, max_tokens, self.occurrence)  # [m]
        k = candidate.numel()
        if self._costs_at is not None:
            self.learned.learn(committed_ids)
            if n:
                k = best_draft_length(self.learned.of(n, max_tokens), self._costs_at(committed_ids.numel(), k + 1), k,
                                      self.required_gain)
                self.learned.offered(n, candidate, committed_ids.numel())
        return chain_draft(committed_ids, candidate[:k])

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        pass
