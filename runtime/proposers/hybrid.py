"""The hybrid drafter: prompt-lookup candidates and a trained head's candidates in ONE tree, verified in one forward.

Prompt lookup wins where the answer copies the prompt (summaries, translations that keep names, answers quoting
retrieved passages); a head wins where it does not (chat, math). Neither knows in advance which text it is in, and
within one answer the two alternate. So each step the hybrid asks both what they offer, at the KV length the
sequence has reached (runtime.cost_model.StepCosts: verify over q tokens and the head's draft time, relative to a
plain step), and takes the best of:

    plain          1                                   / 1
    lookup k       E_l(k) = 1 + sum_{j<=k} prod a_i    / verify(1 + k)
    head m         tau_h                               / (verify(1 + m) + draft + feed)      / HEAD_MARGIN
    both           E_l(k) + (1 - a_1) (tau_h - 1)      / (verify(1 + k + m) + draft + feed)  / HEAD_MARGIN

feed is what the head pays before it can draft: the committed entries it missed while it rested (its state keeps
the target's features of every committed token, and an EAGLE or MTP layer runs them through in one call at its next
propose; runtime.proposers.base.pending_entries), at the per-entry time measured when the costs were
(runtime.cost_model.StepCosts.feed). After 40 lookup steps of a copied answer a head has ~400 entries to feed: 14 ms,
0.4 of a plain step of SmolLM2-135M, measured on this project's CPU, where its own draft costs 4 ms (50 ms before the
feed computed only the keys and values of all but the newest entry); priced at the draft alone, the "both" option
looked cheap and the first head step after a copied stretch cost more than it promised.
k is what prompt lookup alone would draft (runtime.proposers.prompt_lookup: the prefix length of the match that
pays most per unit cost, by this sequence's learned conditional acceptances a_i, with its REQUIRED_GAIN margin over a
plain step), m is the head's planned size, tau_h this sequence's accepted length per head draft (a RunningTau whose
prior is the planner's expected tau, read optimistically like the guard's; a head-only step, which the head's
confidence gate may decline, is valued by the share of such asks it drafted: runtime.proposers.guard.ask_value, a
declined one at the root's verify plus the head's draft and feed for one token). "Both" counts the head's gain only where
the lookup's first token is rejected (where it is accepted the lookup's chain is followed). So the draft budget of a
step goes to the sources by what each is measured to return in this sequence: all to the lookup while text is
copied, all to the head while it is not, both when both promise. A head that is not chosen rests and is probed on
the guard's schedule (runtime.proposers.guard.ProbeSchedule), so its estimate can recover; a probe only takes the
place of a plain step (while the lookup drafts, the head waits).

The tree: the head's draft as it is, then the lookup chain merged in from the root (a lookup token equal to a head
child follows that child; the first one that is not becomes a new node, the rest of the chain below it). Lookup
nodes are point masses (Draft.point_mass), so rejection sampling stays lossless also under a head whose children
were sampled from q; under greedy, the loop follows the target's argmax as for any tree. What the head accepted is
measured on its own nodes only (its tree is closed under ancestors, so that is what it alone would have accepted);
the head is fed the accepted path whichever source drafted it (its on_accept sees that path as a chain).

The head's loss is capped as the guard's is (runtime.proposers.guard.Ledger), against the hybrid's own alternative:
a step with the head is charged what the best step without it would have committed in the same time (its modelled
verify plus the head's measured propose and on_accept time, times that option's rate), and while the head's steps
have lost more than the guard's budget, the head drafts only probes.
"""

from __future__ import annotations

import copy
import time

import torch

from runtime.cost_model import StepCosts, VerifyTable
from runtime.proposers.base import Draft, Proposer, chain_draft, pending_entries, root_only
from runtime.proposers.guard import (
    DraftShare,
    GateCalibration,
    Ledger,
    ProbeSchedule,
    RatioMean,
    RunningTau,
    ask_value,
    set_gate,
)
from runtime.proposers.prompt_lookup import (
    PRIOR_ACCEPTANCE,
    REQUIRED_GAIN,
    LookupAcceptance,
    best_draft_length,
    check_ngram_range,
    expected_tokens,
    lookup_match,
)
from runtime.tree import Tree

# A head's step must promise this much more than the best step without it: its draft time is measured on a warm
# context, while a step also pays what the model leaves out (feeding the head the tokens it missed while resting,
# its on_accept, the bigger tree's acceptance walk). Measured on 4 translation prompts of bench/prompt_kinds, where
# the text copies and the main job's head is near break-even, without the margin the hybrid ran 0.86-0.94x of
# prompt lookup alone at the same tau (2.70): its head-only steps cost 2.5 ms of drafting for nothing.
HEAD_MARGIN = 1.05


def best_option(options: dict[tuple[int, int], float]) -> tuple[int, int]:
    """The (k, m) with the highest rate; ties go to the smaller step."""
    return max(options, key=lambda key: (options[key], -key[0] - key[1]))


def merge_chain(head: Draft, chain: list[int]) -> tuple[Draft, int]:
    """`head` with the token chain merged in from its root: returns (draft, nodes added). Added nodes come after the
    head's (parents before children), are point masses, and get zero rows of probs (their children are point masses
    too, so acceptance never reads those rows)."""
    tokens, parents = head.tokens.tolist(), head.tree.parents.tolist()
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(tokens)):
        children.setdefault(parents[node], {}).setdefault(tokens[node], node)
    node, added = 0, 0
    for token in chain:
        nxt = children.get(node, {}).get(token)
        if nxt is None:
            tokens.append(token)
            parents.append(node)
            nxt = len(tokens) - 1
            children.setdefault(node, {})[token] = nxt
            added += 1
        node = nxt
    if not added:
        return head, 0
    n = len(tokens)
    point_mass = torch.zeros(n, dtype=torch.bool)
    point_mass[n - added:] = True
    if head.point_mass is not None:
        point_mass[: n - added] = head.point_mass
    probs = None
    if head.probs is not None:
        probs = torch.cat([head.probs, head.probs.new_zeros(added, head.probs.shape[1])])
    return Draft(tokens=torch.tensor(tokens, dtype=head.tokens.dtype, device=head.tokens.device),
                 tree=Tree.from_parents(parents), probs=probs,
                 point_mass=point_mass.to(head.tokens.device) if probs is not None else None), added


def path_view(draft: Draft, accepted_nodes: list[int], tree_hidden: dict[int, torch.Tensor] | None
              ) -> tuple[Draft, list[int], dict[int, torch.Tensor] | None]:
    """The accepted path of a tree as a chain draft with its hidden rows: what a head's on_accept needs to feed its
    state, whatever tree (or source) the path came from."""
    rows = torch.tensor(accepted_nodes, device=draft.tokens.device)
    chain = Draft(tokens=draft.tokens.index_select(0, rows), tree=Tree.chain(len(accepted_nodes) - 1))
    hidden = None if tree_hidden is None else {i: h.index_select(0, rows.to(h.device)) for i, h in tree_hidden.items()}
    return chain, list(range(len(accepted_nodes))), hidden


class HybridProposer:
    """Prompt lookup and `head` (an unguarded heads proposer drafting `head_size` tokens, expected to accept
    `expected_tau` per step by its plan) in one tree per step, sized by `costs` at the sequence's KV length."""

    def __init__(self, head: Proposer, head_size: int, expected_tau: float, costs: StepCosts, max_lookup: int = 8,
                 max_ngram: int = 3, min_ngram: int = 1, required_gain: float = REQUIRED_GAIN, trees: bool = True,
                 gate: bool = True):
        if head_size < 1 or max_lookup < 1:
            raise ValueError(f"hybrid: need a head size >= 1 and --max_speculative_tokens >= 1, got {head_size}, "
                             f"{max_lookup}")
        check_ngram_range(min_ngram, max_ngram)
        self.head, self.head_size, self.expected_tau, self.costs = head, head_size, expected_tau, costs
        self.max_lookup, self.max_ngram, self.min_ngram, self.required_gain = max_lookup, max_ngram, min_ngram, \
            required_gain
        self.trees = trees  # False for a target that verifies chains only: one source per step, never both
        self.gate = gate  # a head-only step tells the head its break-even, for its confidence gate (guard.set_gate)
        self.hidden_state_indices = head.hidden_state_indices
        self.tau = RunningTau(expected_tau)
        self.probes = ProbeSchedule()
        self.ledger = Ledger()
        self.calibration = GateCalibration()  # this sequence's expected over accepted head tokens: scales its gate
        self.asks = DraftShare()  # the share of gated asks (head-only steps) the head drafted; its gate declined the rest
        self.verify = VerifyTable(costs)  # the verify costs prompt lookup alone reads too, and the head's draft
        self.lookup = LookupAcceptance()
        self.reset(None, None)

    def __copy__(self) -> HybridProposer:  # runtime.proposers.base.per_row
        return HybridProposer(copy.copy(self.head), self.head_size, self.expected_tau, self.costs, self.max_lookup,
                              self.max_ngram, self.min_ngram, self.required_gain, self.trees, self.gate)

    @property
    def tree_size(self) -> int:
        return self.head_size + self.max_lookup

    def reset(self, prompt_ids: torch.Tensor | None, prefill_hidden: dict[int, torch.Tensor] | None) -> None:
        if prompt_ids is not None:
            self.head.reset(prompt_ids, prefill_hidden)
        self.lookup.reset()  # this sequence's acceptances of lookup drafts
        self._head_nodes = 0  # nodes of the last draft that came from the head (root included), 0 = it did not draft
        self.tau.reset()
        self.probes.paid()
        self.ledger.reset()
        self.calibration.reset()
        self.asks.reset()
        self._gated = False  # the last step asked the head alone, with its confidence gate
        self._expected: float | None = None  # what the head's last draft expected to get accepted (Draft.expected)
        # the last step's: best rate without the head, tokens, KV length, the head's measured seconds in it
        self._rate_without, self._step_tokens, self._kv_length, self._head_seconds = 0.0, 1, 0, 0.0
        self._draft_ratio, self._head_drafted_before = RatioMean(), False  # the head's measured / modelled draft
        self._pending = 0  # entries the head had to feed at the last propose (what it missed while resting)
        self.last_choice = ""

    def _table(self, kv_length: int) -> tuple[list[float], float]:
        """At the KV length rounded down to a multiple of KV_BUCKET (runtime.cost_model.VerifyTable, the table prompt
        lookup alone reads): [relative verify cost of q tokens, q = 1..the largest step] and the head's modelled draft
        time over a plain step."""
        return self.verify.at(kv_length, self.tree_size + 1), self.verify.draft_at(kv_length)

    def _cost(self, tokens: int, kv_length: int, drafting: bool, pending: int = 0) -> float:
        """costs.relative at the step's KV bucket (`_table`), the head's draft time (drafting) scaled by what it
        measured in this sequence, plus feeding the `pending` entries it missed while resting."""
        verify, draft = self._table(kv_length)
        if not drafting:
            return verify[tokens - 1]
        feed = self.costs.feed(pending, kv_length) / self.costs.plain_seconds(kv_length)
        return verify[tokens - 1] + self.draft_ratio * (draft + feed)

    @property
    def draft_ratio(self) -> float:
        """The head's measured time per head step over its modelled draft time: a decayed mean (weight DECAY per
        step) over this sequence's head steps but its first (which fed the head the prompt), from a prior of 1
        worth CLOCK_PRIOR_STEPS steps. Head steps after lookup or plain steps are in it: they feed the head the
        tokens it missed, a cost of every such step."""
        return self._draft_ratio.mean()

    def _time_head(self, kv_length: int) -> None:
        modelled = self.costs.draft(kv_length) + self.costs.feed(self._pending, kv_length)
        if self._head_drafted_before:  # (RatioMean skips a model of 0 s)
            self._draft_ratio.observe(self._head_seconds, modelled)
        self._head_drafted_before = True

    def plan(self, kv_length: int, acceptance: list[float], match_length: int, head_tokens: int,
             head_tau: float, probe: bool, pending: int = 0, drafted_share: float = 1.0) -> tuple[int, int]:
        """(lookup tokens k, head tokens m) for this step (see the module docstring). probe: the head must draft."""
        options = self.options(kv_length, acceptance, match_length, head_tokens, head_tau, pending, drafted_share)
        return best_option({key: rate for key, rate in options.items() if key[1]} if probe else options)

    def options(self, kv_length: int, acceptance: list[float], match_length: int, head_tokens: int,
                head_tau: float, pending: int = 0, drafted_share: float = 1.0) -> dict[tuple[int, int], float]:
        """{(k, m): expected tokens per plain step's time} of the step's choices (the module docstring's table);
        `pending`: entries the head must feed before it drafts (what it missed while resting); `drafted_share`: the
        share of head-only asks its confidence gate lets draft (guard.ask_value: a declined ask commits one token
        for the root's verify plus the head's time)."""
        plain_costs = self._table(kv_length)[0][:match_length + 1]
        k = best_draft_length(acceptance, plain_costs, match_length, self.required_gain) if match_length else 0
        lookup_tokens = expected_tokens(acceptance, k)
        options = {(k, 0): lookup_tokens / plain_costs[k]}
        if head_tokens:
            tokens, cost = ask_value(head_tau, self._cost(1 + head_tokens, kv_length, True, pending),
                                     self._cost(1, kv_length, True, pending), drafted_share)
            options[(0, head_tokens)] = tokens / cost / HEAD_MARGIN
            if k and self.trees:
                both = lookup_tokens + (1 - acceptance[0]) * (head_tau - 1)
                options[(k, head_tokens)] = both / self._cost(1 + k + head_tokens, kv_length, True, pending) / \
                    HEAD_MARGIN
        return options

    def propose(self, committed_ids: torch.Tensor, max_tokens: int) -> Draft:
        self.lookup.learn(committed_ids)
        self._head_nodes, self._kv_length, self._gated = 0, committed_ids.numel(), False
        if max_tokens <= 0:
            return root_only(committed_ids)
        n, candidate = lookup_match(committed_ids, self.max_ngram, self.min_ngram, min(max_tokens, self.max_lookup))
        acceptance = self.lookup.of(n, self.max_lookup) if n else [PRIOR_ACCEPTANCE[0]]
        if n:
            self.lookup.offered(n, candidate, committed_ids.numel())
        head_tokens = min(self.head_size, max_tokens)
        self._pending = pending_entries(self.head)
        options = self.options(committed_ids.numel(), acceptance, candidate.numel(), head_tokens, self.tau.optimistic,
                               self._pending, self.asks.share if self.gate else 1.0)
        without = {key: rate for key, rate in options.items() if not key[1]}
        k, m = best_option(without if self.ledger.losing else options)  # over its loss budget the head rests
        if m:
            self.probes.paid()
        elif head_tokens and not k and self.probes.due():  # a probe replaces a plain step, never a lookup draft
            k, m = best_option({key: rate for key, rate in options.items() if key[1]})
        k = min(k, max_tokens - m)
        self.last_choice = f"lookup {k} + head {m}"
        self._gated = bool(self.gate and m and not k)
        self._rate_without, self._step_tokens = max(without.values()), 1 + k + m
        if not m:  # the lookup's chain (or the root alone), as prompt lookup drafts it
            return chain_draft(committed_ids, candidate[:k])
        started = time.perf_counter()
        if self.gate:  # a head-only step pays where it expects what the best step without it commits in its time
            self.calibration.ask()  # (the threshold scaled by how this sequence's drafts met their expectations)
            set_gate(self.head, (self._rate_without * self._cost(1 + m, self._kv_length, True) - 1.0) *
                     self.calibration.scale if not k else 0.0)
        draft = self.head.propose(committed_ids, m)
        self._expected = draft.expected
        self._head_seconds = time.perf_counter() - started
        self._head_nodes = draft.tree.num_nodes  # 1: the head was asked and declined (its confidence gate)
        if k:
            draft, _ = merge_chain(draft, candidate[:k].tolist())
        return draft

    def on_accept(self, committed_ids: torch.Tensor, draft: Draft, accepted_nodes: list[int],
                  tree_hidden: dict[int, torch.Tensor] | None) -> None:
        started = time.perf_counter()
        if self._head_nodes:
            self.head.on_accept(committed_ids, *path_view(draft, accepted_nodes, tree_hidden))
        else:  # a chain already: its accepted nodes are a prefix, the path as it is
            self.head.on_accept(committed_ids, draft, accepted_nodes, tree_hidden)
        self._head_seconds += time.perf_counter() - started
        committed = len(accepted_nodes)
        if self._gated:
            self.asks.observe_ask(self._head_nodes > 1)
        if self._head_nodes == 1:  # asked and declined: charged what the best step without the head commits in
            # this step's time (its first ask as a plain step of that kind: it fed the head the prompt), neither
            # timed as a head draft nor observed as one (the gate chose it, not the text)
            seconds = self._head_seconds if self._head_drafted_before else 0.0
            self.ledger.add(committed, self._rate_without * self.costs.measured(draft.tree.num_nodes, self._kv_length,
                                                                                seconds))
            self._head_drafted_before = True
            return
        if self._head_nodes > 1:  # charged what the best step without the head commits in this step's real time
            # (the sequence's first head step at the head's modelled time: it also fed the head the prompt, the
            # one-off price of trying it, which resting would not win back)
            seconds = self._head_seconds if self._head_drafted_before else self.costs.draft(self._kv_length)
            self.ledger.add(committed, self._rate_without * self.costs.measured(self._step_tokens, self._kv_length,
                                                                                seconds))
        else:
            self.ledger.add(committed, committed)
        if self._head_nodes > 1:
            self._time_head(self._kv_length)
            accepted = sum(1 for node in accepted_nodes if node < self._head_nodes)
            self.tau.observe(accepted)
            self.calibration.observe(self._expected, accepted - 1)
